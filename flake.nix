{
  description = "Kiln: a recipe (one JSON file) → a pinned, verified local LLM deployment";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";

  outputs = { self, nixpkgs }:
    let
      # The compiler: builtins only, so `lib` evaluates without nixpkgs (CI overrides nixpkgs
      # with an empty flake and evaluates lib.plans; see tests/test_flake.py).
      kiln = import ./nix/lib;
      recipes = kiln.recipesIn ./recipes;

      systems = [ "x86_64-linux" "aarch64-linux" ];
      forAllSystems = f: builtins.listToAttrs (map (system: { name = system; value = f system; }) systems);

      perSystem = system:
        let
          pkgs = nixpkgs.legacyPackages.${system};
          inherit (pkgs.callPackage ./nix/packages.nix { }) tool engine;

          # A recipe as a derivation: its plan, units and mounted files, compiled for Nix-built programs.
          recipePackage = id: recipe:
            let
              plan = kiln.compile {
                inherit recipe;
                options = {
                  toolBin = "${tool}/bin/tool";
                  engineBin = "${engine}/bin/engine";
                  dockerBin = "${pkgs.docker}/bin/docker";
                };
              };
            in
            pkgs.linkFarm "kiln-${id}" (
              [
                { name = "plan.json"; path = pkgs.writeText "kiln-${id}-plan.json" (builtins.toJSON plan); }
                { name = "tmpfiles.d/kiln-${id}.conf"; path = pkgs.writeText "kiln-${id}.conf" (builtins.concatStringsSep "\n" plan.tmpfiles + "\n"); }
              ]
              ++ map (name: { name = "units/${name}"; path = pkgs.writeText name plan.units.${name}; }) (builtins.attrNames plan.units)
              ++ map
                (hostPath: let f = plan.files.${hostPath}; name = baseNameOf hostPath; in {
                  name = "files/${name}";
                  path = pkgs.writeTextFile { inherit name; text = f.content; executable = f.mode == "0555" || f.mode == "0755"; };
                })
                (builtins.attrNames plan.files));

          # A native recipe's steps run Kiln's engine: the app names it (KILN_ENGINE_BIN), so the
          # tool's Python need not hold torch. Container recipes do not pull the engine in.
          upApp = id: {
            type = "app";
            program = "${pkgs.writeShellScript "kiln-up-${id}" (
              pkgs.lib.optionalString (recipes.${id}.runtime.kind == "native") ''
                export KILN_ENGINE_BIN=''${KILN_ENGINE_BIN:-${engine}/bin/engine}
              '' + ''exec ${tool}/bin/tool up ${id} "$@"'')}";
          };

          libTests =
            let
              cases = import ./nix/lib/tests.nix;
              failed = builtins.filter (name: cases.${name}.expr != cases.${name}.expected) (builtins.attrNames cases);
            in
            if failed == [ ] then pkgs.runCommand "kiln-nix-lib-tests" { } "touch $out"
            else throw "nix/lib tests failed: ${builtins.concatStringsSep ", " failed}";
        in
        {
          packages = { inherit tool engine; default = tool; } // builtins.mapAttrs recipePackage recipes;
          apps = builtins.mapAttrs (id: _: upApp id) recipes // { default = upApp "smollm2-135m"; };
          checks = {
            nix-lib = libTests;
            validate-recipes = pkgs.runCommand "kiln-validate-recipes" { nativeBuildInputs = [ tool ]; } ''
              tool validate $(find ${./recipes} -name '*.json' ! -name schema.json)
              touch $out
            '';
          } // builtins.mapAttrs (id: _: self.packages.${system}.${id}) recipes;
        };
      bySystem = forAllSystems perSystem;
    in
    {
      # kiln.compile, toUnitText, recipesIn, …; plus every bundled recipe's plan with default options.
      lib = kiln // {
        inherit recipes;
        plans = builtins.mapAttrs (_: recipe: kiln.compile { inherit recipe; }) recipes;
      };
      packages = builtins.mapAttrs (_: s: s.packages) bySystem;
      apps = builtins.mapAttrs (_: s: s.apps) bySystem;
      checks = builtins.mapAttrs (_: s: s.checks) bySystem;
      nixosModules.default = ./nix/module.nix;
    };
}
