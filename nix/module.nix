# NixOS module: services.kiln.recipes.<id>.enable = true; gives that recipe's units, produced
# by nix/lib (the same compiler `tool materialise` uses), overridable with the usual
# systemd.services.<name> options. Shape after nixpkgs' services.ollama.
{ config, lib, pkgs, ... }:
let
  inherit (lib) mkEnableOption mkIf mkOption types literalExpression;

  cfg = config.services.kiln;
  kiln = import ./lib;
  bundled = kiln.recipesIn ../recipes;
  kilnPackages = pkgs.callPackage ./packages.nix { };

  enabled = lib.filterAttrs (_: r: r.enable) cfg.recipes;

  recipeOf = id: r:
    if r.recipe == null then bundled.${id} or (throw "services.kiln.recipes.${id}: no bundled recipe with this id (bundled: ${lib.concatStringsSep ", " (builtins.attrNames bundled)}); set services.kiln.recipes.${id}.recipe")
    else if builtins.isAttrs r.recipe then r.recipe
    else builtins.fromJSON (builtins.readFile r.recipe);

  planOf = id: r: kiln.compile {
    recipe = recipeOf id r;
    options = {
      inherit (cfg) stateDir user group uid gid;
      inherit (r) modelsDir storeDir port bindAddress memoryBytes memorySwapBytes cpus extraEnv environmentFile;
      toolBin = lib.getExe' cfg.package "tool";
      engineBin = lib.getExe' cfg.enginePackage "engine";
      dockerBin = lib.getExe' config.virtualisation.docker.package "docker";
    };
  };
  plans = lib.mapAttrs planOf enabled;

  # nix/lib's structured unit → systemd.services.<name>: dependencies and WantedBy through the
  # dedicated options (so users extend them as usual), every other key as unitConfig/serviceConfig.
  toService = sections: {
    description = sections.Unit.Description;
    requires = sections.Unit.Requires or [ ];
    wants = sections.Unit.Wants or [ ];
    after = sections.Unit.After or [ ];
    wantedBy = sections.Install.WantedBy or [ ];
    unitConfig = builtins.removeAttrs sections.Unit [ "Description" "Requires" "Wants" "After" ];
    serviceConfig = sections.Service;
  };

  services = lib.concatMapAttrs
    (_: plan: lib.mapAttrs' (name: sections: lib.nameValuePair (lib.removeSuffix ".service" name) (toService sections)) plan.unitSections)
    plans;

  # Files a recipe mounts (the 4-GPU entrypoint script) are store files linked into filesDir.
  fileRules = lib.concatMap
    (plan: lib.mapAttrsToList
      (hostPath: f: "L+ ${hostPath} - - - - ${pkgs.writeTextFile {
        name = baseNameOf hostPath; text = f.content; executable = f.mode == "0555" || f.mode == "0755"; }}")
      plan.files)
    (builtins.attrValues plans);

  recipeOptions = { name, ... }: {
    options = {
      enable = mkEnableOption "the Kiln recipe ${name}: fetch, prepare, verify, serve and check units";
      recipe = mkOption {
        type = types.nullOr (types.either types.path types.attrs);
        default = null;
        example = literalExpression "./my-recipe.json";
        description = "The recipe (a JSON file or its parsed attrset); null takes the bundled recipe whose id is the attribute name.";
      };
      modelsDir = mkOption {
        type = types.nullOr types.str;
        default = null;
        example = "/nvme/models";
        description = "Where the weights are downloaded; null means `stateDir`/models.";
      };
      storeDir = mkOption {
        type = types.nullOr types.str;
        default = null;
        example = "/nvme/kiln-stores";
        description = "Where the prepared expert store lives (an O_DIRECT-capable filesystem: xfs or ext4); null means `stateDir`/stores.";
      };
      port = mkOption {
        type = types.nullOr types.port;
        default = null;
        example = 8080;
        description = "Host port the server publishes; null takes the recipe's serve.port.";
      };
      bindAddress = mkOption {
        type = types.str;
        default = "127.0.0.1";
        example = "0.0.0.0";
        description = "Host address the server binds. Loopback by default: Kiln's servers have no authentication.";
      };
      openFirewall = mkOption {
        type = types.bool;
        default = false;
        description = "Open the server's port in the firewall (only meaningful with a non-loopback bindAddress).";
      };
      memoryBytes = mkOption {
        type = types.nullOr types.ints.positive;
        default = null;
        example = 59055800320;
        description = "Memory cap in bytes (docker --memory for containers, MemoryMax= for native); null takes the recipe's.";
      };
      memorySwapBytes = mkOption {
        type = types.nullOr types.ints.positive;
        default = null;
        example = 59055800320;
        description = "Memory + swap cap in bytes (docker's sense; equal to memoryBytes means no swap); null takes the recipe's.";
      };
      cpus = mkOption {
        type = types.nullOr types.str;
        default = null;
        example = "2-39";
        description = "CPUs the server may use (docker --cpuset-cpus, or AllowedCPUs=/CPUAffinity=); null means all.";
      };
      environmentFile = mkOption {
        type = types.nullOr types.str;
        default = null;
        example = "/run/secrets/kiln.env";
        description = "A file of KEY=VALUE lines for secrets (KILN_API_KEY, HF_TOKEN): given to every unit with EnvironmentFile= and to containers with docker --env-file, so no secret lands in a unit file, the Nix store or a command line. Use it instead of extraEnv for secrets.";
      };
      extraEnv = mkOption {
        type = types.attrsOf types.str;
        default = { };
        example = { GLM53_MODE = "nvme-exact"; };
        description = "Environment added to (or replacing) the recipe's, for prepare, verify and serve.";
      };
    };
  };
in
{
  options.services.kiln = {
    package = mkOption {
      type = types.package;
      default = kilnPackages.tool;
      defaultText = literalExpression "(pkgs.callPackage ./nix/packages.nix { }).tool";
      description = "The Kiln `tool` (fetch, check and the readiness probe run it).";
    };
    enginePackage = mkOption {
      type = types.package;
      default = kilnPackages.engine;
      defaultText = literalExpression "(pkgs.callPackage ./nix/packages.nix { }).engine";
      description = "The Kiln engine, run by native recipes.";
    };
    stateDir = mkOption {
      type = types.str;
      default = "/var/lib/kiln";
      description = "Kiln's state: models, stores, mounted files, evidence.";
    };
    user = mkOption {
      type = types.str;
      default = "kiln";
      description = "User the units (and containers' --user steps) run as.";
    };
    group = mkOption {
      type = types.str;
      default = "kiln";
      description = "Group of `user`.";
    };
    uid = mkOption {
      type = types.int;
      default = kiln.defaultOptions.uid;
      description = "uid of `user`: fixed, because docker's --user needs the number at evaluation time.";
    };
    gid = mkOption {
      type = types.int;
      default = kiln.defaultOptions.gid;
      description = "gid of `group`.";
    };
    recipes = mkOption {
      type = types.attrsOf (types.submodule recipeOptions);
      default = { };
      example = literalExpression ''{ "glm-5.3-flash".enable = true; }'';
      description = "Recipes to deploy, by id.";
    };
  };

  config = mkIf (enabled != { }) {
    assertions = lib.concatLists (lib.mapAttrsToList
      (id: r:
        let recipe = recipeOf id r; isContainer = recipe.runtime.kind == "container"; in [
          {
            assertion = !isContainer || config.virtualisation.docker.enable;
            message = "services.kiln.recipes.${id}: a container recipe needs virtualisation.docker.enable = true";
          }
          {
            assertion = !(isContainer && (recipe.hardware.gpu_count or 0) > 0) || (config.hardware.nvidia-container-toolkit.enable or false);
            message = "services.kiln.recipes.${id}: needs ${toString recipe.hardware.gpu_count} GPU(s) in docker (--gpus); set hardware.nvidia-container-toolkit.enable = true";
          }
          {
            assertion = r.memoryBytes == null || r.memorySwapBytes == null || r.memorySwapBytes >= r.memoryBytes;
            message = "services.kiln.recipes.${id}: memorySwapBytes (${toString r.memorySwapBytes}) is below memoryBytes (${toString r.memoryBytes}); it counts memory + swap";
          }
          {
            assertion = !r.openFirewall || r.bindAddress != "127.0.0.1";
            message = "services.kiln.recipes.${id}: openFirewall = true has no effect while bindAddress is 127.0.0.1";
          }
        ])
      enabled);

    users.users.${cfg.user} = {
      isSystemUser = true;
      inherit (cfg) group uid;
      home = cfg.stateDir;
      description = "Kiln model servers";
    };
    users.groups.${cfg.group}.gid = cfg.gid;

    systemd.tmpfiles.rules = lib.unique (lib.concatMap (plan: plan.tmpfiles) (builtins.attrValues plans)) ++ fileRules;
    systemd.services = services;

    networking.firewall.allowedTCPPorts = lib.mapAttrsToList (id: _: plans.${id}.options.port)
      (lib.filterAttrs (_: r: r.openFirewall) enabled);
  };
}
