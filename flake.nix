{
  description = "Kiln: a recipe (one JSON file) → a pinned, verified local LLM deployment";

  # A stable release branch: the toolchain under every pinned recipe moves only with its security
  # fixes. flake.lock pins the commit; it is made where the network reaches GitHub (`nix flake lock`,
  # then commit it) and moved on purpose (`nix flake update nixpkgs`). This repository's CI has no
  # network, so it has no lock yet and evaluates with --override-input nixpkgs (see README, With Nix).
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-26.05";

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
          kilnPackages = pkgs.callPackage ./nix/packages.nix { };
          inherit (kilnPackages) tool engine;
          # llama.cpp with RPC, for llama-cpp recipes (absent where the package set has no stdenv: CI's stand-in)
          llamaCpp = kilnPackages.llama-cpp or null;

          lib = pkgs.lib;

          # What `nix run .#<id>` runs: `tool up <id>` with the programs its steps need from nixpkgs
          # (the container CLI for container recipes, Kiln's engine for native ones), so nothing
          # is looked up at /usr/bin. Either may be replaced from the environment.
          upScript = id: pkgs.writeShellScript "kiln-up-${id}" (
            (if recipes.${id}.runtime.kind == "native" then ''
              export KILN_ENGINE_BIN=''${KILN_ENGINE_BIN:-${engine}/bin/engine}
            '' else if recipes.${id}.runtime.kind == "llama-cpp" then (if llamaCpp == null then "" else ''
              export KILN_LLAMA_SERVER_BIN=''${KILN_LLAMA_SERVER_BIN:-${llamaCpp}/bin/llama-server}
              export KILN_RPC_SERVER_BIN=''${KILN_RPC_SERVER_BIN:-${llamaCpp}/bin/rpc-server}
            '') else ''
              export KILN_DOCKER_BIN=''${KILN_DOCKER_BIN:-${pkgs.docker}/bin/docker}
            '') + ''exec ${tool}/bin/tool up ${id} "$@"
          '');

          # A recipe as a derivation: its runnable (bin/kiln-<id>, meta.mainProgram) beside its plan,
          # units and mounted files, compiled for the Nix-built programs.
          recipePackage = id: recipe:
            let
              plan = kiln.compile {
                inherit recipe;
                options = {
                  toolBin = "${tool}/bin/tool";
                  engineBin = "${engine}/bin/engine";
                  dockerBin = "${pkgs.docker}/bin/docker";
                } // (if llamaCpp == null then { } else {
                  llamaServerBin = "${llamaCpp}/bin/llama-server";
                  rpcServerBin = "${llamaCpp}/bin/rpc-server";
                });
              };
            in
            # meta by `//` (linkFarm takes no meta): nix run reads meta.mainProgram off the value.
            withMeta { mainProgram = "kiln-${id}"; description = "Kiln: ${recipe.title}"; } (pkgs.linkFarm "kiln-${id}" (
              [
                { name = "bin/kiln-${id}"; path = upScript id; }
                { name = "plan.json"; path = pkgs.writeText "kiln-${id}-plan.json" (builtins.toJSON plan); }
                { name = "tmpfiles.d/kiln-${id}.conf"; path = pkgs.writeText "kiln-${id}.conf" (builtins.concatStringsSep "\n" plan.tmpfiles + "\n"); }
              ]
              ++ map (name: { name = "units/${name}"; path = pkgs.writeText name plan.units.${name}; }) (builtins.attrNames plan.units)
              ++ map
                (hostPath: let f = plan.files.${hostPath}; name = baseNameOf hostPath; in {
                  name = "files/${name}";
                  path = pkgs.writeTextFile { inherit name; text = f.content; executable = f.mode == "0555" || f.mode == "0755"; };
                })
                (builtins.attrNames plan.files)));

          withMeta = meta: drv: drv // { meta = (drv.meta or { }) // meta; };
          recipePackages = builtins.mapAttrs recipePackage recipes;

          upApp = id: { type = "app"; program = "${upScript id}"; };

          # Nix splits an installable's attribute path on dots: `nix run .#glm-5.3-flash` looks up
          # apps/packages/legacyPackages.<system>."glm-5"."3-flash". packages and apps must stay
          # flat for `nix flake check`; legacyPackages may nest, so each id is also there under its
          # dot-split path, and the id reads as typed.
          byTypedPath = nest (map (id: { inherit id; path = builtins.filter builtins.isString (builtins.split "[.]" id); })
            (builtins.attrNames recipes));
          # [{ id; path; }] → nested attrsets by path (builtins only: `lib` must evaluate without nixpkgs).
          nest = entries:
            let heads = builtins.attrNames (builtins.listToAttrs (map (e: { name = builtins.head e.path; value = null; }) entries)); in
            builtins.listToAttrs (map
              (h:
                let
                  mine = builtins.filter (e: builtins.head e.path == h) entries;
                  leaf = builtins.filter (e: builtins.length e.path == 1) mine;
                in
                {
                  name = h;
                  value =
                    if leaf == [ ] then nest (map (e: e // { path = builtins.tail e.path; }) mine)
                    else if builtins.length mine == 1 then recipePackages.${(builtins.head leaf).id}
                    else throw "kiln: recipe ids ${builtins.concatStringsSep ", " (map (e: e.id) mine)} collide once split on dots (Nix's installable syntax); rename one";
                })
              heads);

          libTests =
            let
              cases = import ./nix/lib/tests.nix;
              failed = builtins.filter (name: cases.${name}.expr != cases.${name}.expected) (builtins.attrNames cases);
            in
            if failed == [ ] then pkgs.runCommand "kiln-nix-lib-tests" { } "touch $out"
            else throw "nix/lib tests failed: ${builtins.concatStringsSep ", " failed}";
        in
        {
          # llama.cpp itself is reached through the llama-cpp recipes' runnables (and the NixOS module's
          # llamaCppPackage): its presence depends on pkgs, and this set's names must not.
          packages = { inherit tool engine; default = tool; } // recipePackages;
          legacyPackages = byTypedPath;
          apps = builtins.mapAttrs (id: _: upApp id) recipes // { default = upApp "smollm2-135m"; };
          checks = {
            nix-lib = libTests;
            validate-recipes = pkgs.runCommand "kiln-validate-recipes" { nativeBuildInputs = [ tool ]; } ''
              tool validate $(find ${./recipes} -name '*.json' ! -name schema.json)
              touch $out
            '';
          } // recipePackages;
        };
      bySystem = forAllSystems perSystem;
    in
    {
      # kiln.compile, toUnitText, recipesIn, …; plus every bundled recipe's plan with default options.
      # `lib` is the community's name for a flake's functions; `nix flake check` knows it since Nix
      # 2.13 (NixOS/nix#7606) and warns only on older Nix, such as this CI's 2.8 (tests/test_flake.py).
      lib = kiln // {
        inherit recipes;
        plans = builtins.mapAttrs (_: recipe: kiln.compile { inherit recipe; }) recipes;
        # A recipe that spans hosts: one fleet description → each host's NixOS module (nix/fleet-modules.nix).
        fleet = import ./nix/fleet-modules.nix { module = ./nix/module.nix; recipeFiles = kiln.recipeFilesIn ./recipes; };
      };
      packages = builtins.mapAttrs (_: s: s.packages) bySystem;
      apps = builtins.mapAttrs (_: s: s.apps) bySystem;
      legacyPackages = builtins.mapAttrs (_: s: s.legacyPackages) bySystem;
      checks = builtins.mapAttrs (_: s: s.checks) bySystem;
      # An attribute-set module (not the bare path): `nix flake check` wants a function or an attrset,
      # and `imports` keeps the file's name in NixOS' error messages.
      nixosModules.default = { imports = [ ./nix/module.nix ]; };
    };
}
