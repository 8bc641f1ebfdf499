# NixOS module: services.kiln.recipes.<id>.enable = true; gives that recipe's units, produced
# by nix/lib (the same compiler `tool materialise` uses), overridable with the usual
# systemd.services.<name> options. Shape after nixpkgs' services.ollama.
#
# Design choices (each one a difference from the units `tool materialise` writes, named in
# tests/test_module.py):
#
# * Starting without blocking a switch. `nixos-rebuild switch` waits for every start job it
#   queues, and the chain (fetch: a 125 GB download; prepare: the pack; serve: a load of up to an
#   hour) would hold it for hours. So no chain unit is wanted by multi-user.target; a one-line
#   starter, kiln-<id>-start.service, is, and it only queues the chain (`systemctl restart
#   --no-block …`) and returns. Boot and switch wait for the starter alone; the chain runs on.
#   (A timer would do the same, but the starter is a plain service that every NixOS evaluates.)
#
# * Not restarted by a switch, while a real change still takes effect. Every chain unit has
#   restartIfChanged = false: a new Kiln or nixpkgs changes their store paths, and that alone
#   must not re-run prepare and reload the model. The starter's [Unit] X-Kiln-Chain= is a hash
#   of the recipe and of the chain's rendered units with every /nix/store path masked; it changes
#   when the recipe or an option or override of these units changes, and then the switch (which
#   restarts a unit whose file changed) restarts the starter, which re-queues the chain (each step
#   skips what is already published and verified). The starter's text carries no store path at
#   all, which restartTriggers would not give (its file is a derivation built with nixpkgs'
#   stdenv, so a nixpkgs bump moves it): no default PATH, and systemctl by /run/current-system.
#
# * Ids. docker's and podman's --user need the numbers at evaluation time, so the kiln user has
#   static ids, 2960: outside NixOS' static table (0-399, ids.nix) and outside the range NixOS
#   allocates system users from (400-999), where a fixed id could meet an allocated one; the
#   allocator skips ids a configuration declares. (DynamicUser, as services.ollama uses, cannot
#   give a container its number before the unit starts.) Point services.kiln.user at an existing
#   user and the module creates nothing: that user's uid, home and flags stay its own.
#
# * Containers the NixOS way. The runtime follows what the host enables (docker or podman; both:
#   virtualisation.oci-containers.backend). Podman has no daemon, so its units run podman as root
#   without the docker group, as oci-containers does (nix/lib/docker.nix says why). GPUs go
#   through CDI (--device nvidia.com/gpu=…) when hardware.nvidia-container-toolkit generates the
#   specs; docker's --gpus needs the deprecated virtualisation.docker.enableNvidia.
#
# * Published container ports are NAT rules of docker/podman, which the NixOS firewall does not
#   filter: a non-loopback bindAddress of a container recipe is an assertion unless
#   allowUnfirewalledBind says the operator means it.
#
# * A fleet recipe (one that spans hosts) is enabled on each of its hosts with that host's name
#   (services.kiln.recipes.<id>.host) and the operator's fleet addresses: each machine gets only its own
#   units, exactly as `tool materialise --host` writes them. The flake's lib.fleet writes these settings for
#   every host from one fleet description.
#
# * Every compiled [Unit]/[Service] value is a default (mkDefault): a plain
#   systemd.services.<unit>.serviceConfig.MemoryMax = "8G" replaces it, no mkForce.
{ config, lib, pkgs, options, ... }:
let
  inherit (lib) mkEnableOption mkIf mkOption types literalExpression;

  cfg = config.services.kiln;
  kiln = import ./lib;
  bundledFiles = kiln.recipeFilesIn ../recipes;
  kilnPackages = pkgs.callPackage ./packages.nix { };

  enabled = lib.filterAttrs (_: r: r.enable) cfg.recipes;

  # --- the recipe of each attribute: its file, parsed, and what is wrong with it ----------------
  recipeFile = name: r:
    if r.recipe == null then bundledFiles.${name} or null
    else if builtins.isAttrs r.recipe then pkgs.writeText "${name}.json" (builtins.toJSON r.recipe)
    else r.recipe;
  recipeData = name: r:
    if builtins.isAttrs r.recipe then r.recipe
    else builtins.fromJSON (builtins.readFile (recipeFile name r));

  where = name: r: "services.kiln.recipes.${builtins.toJSON name}"
    + lib.optionalString (r.recipe != null && !builtins.isAttrs r.recipe) " (recipe = ${toString r.recipe})";

  # What the compiler reads, checked before it runs, so a bad file is named here and not deep in
  # nix/lib. The whole schema is `tool validate`'s, run by the system's build (see validation).
  shapeProblems = recipe:
    let
      isStr = v: builtins.isString v && v != "";
      rt = recipe.runtime or { };
      port = (recipe.serve or { }).port or null;
      check = cond: msg: lib.optional (!cond) msg;
    in
    if !builtins.isAttrs recipe then [ "the recipe is not a JSON object" ] else
    check (isStr (recipe.id or null) && builtins.match "[a-z0-9][a-z0-9._-]*" recipe.id != null)
      "$.id: missing or not [a-z0-9][a-z0-9._-]*"
    ++ check (isStr (recipe.title or null)) "$.title: missing"
    ++ check (builtins.elem (rt.kind or null) [ "container" "native" "llama-cpp" ]) "$.runtime.kind: must be container, native or llama-cpp"
    ++ check ((rt.kind or null) != "container" || lib.hasInfix "@sha256:" (rt.container.image or ""))
      "$.runtime.container.image: must be pinned by @sha256: digest"
    ++ check (builtins.isInt port && port >= 1 && port <= 65535) "$.serve.port: must be a TCP port (1-65535)"
    ++ check (isStr ((recipe.weights or { }).dirname or null)) "$.weights.dirname: missing"
    ++ check (builtins.isAttrs ((recipe.steps or { }).serve or null)) "$.steps.serve: missing";

  info = lib.mapAttrs
    (name: r:
      let
        file = recipeFile name r;
        recipe = if file == null then null else recipeData name r;
        problems =
          if file == null then [
            "no bundled recipe has id ${builtins.toJSON name} (bundled: ${lib.concatStringsSep ", " (builtins.attrNames bundledFiles)}); set ${where name r}.recipe to a recipe file"
          ] else
            let shape = shapeProblems recipe; in
            if shape != [ ] then map (p: "${where name r}: ${p}; `tool validate` reports every error") shape
            else lib.optional (recipe.id != name)
              "${where name r}: the attribute name must equal the recipe's id, and the file says ${builtins.toJSON recipe.id}; rename the attribute to ${builtins.toJSON recipe.id}";
      in
      { inherit file recipe problems; ok = problems == [ ]; })
    enabled;
  good = lib.filterAttrs (name: _: info.${name}.ok) enabled;

  # The units hand the tool the recipe's own store path, so they run exactly that file; the
  # system's build validates it against the full schema (system.checks), so nixos-rebuild refuses
  # an invalid recipe with every error `tool validate` finds.
  recipeStorePath = name: "${info.${name}.file}";
  validation = name: pkgs.runCommand "kiln-validate-${name}" { nativeBuildInputs = [ cfg.package ]; } ''
    tool validate ${recipeStorePath name}
    touch $out
  '';

  # --- the container runtime ---------------------------------------------------------------------
  dockerOn = config.virtualisation.docker.enable;
  podmanOn = config.virtualisation.podman.enable or false;
  backendDefault =
    if dockerOn && !podmanOn then "docker"
    else if podmanOn && !dockerOn then "podman"
    else config.virtualisation.oci-containers.backend or "docker";
  containerBin =
    if cfg.containerRuntime == "podman"
    then lib.getExe' (config.virtualisation.podman.package or pkgs.podman) "podman"
    else lib.getExe' config.virtualisation.docker.package "docker";
  cdi = config.hardware.nvidia-container-toolkit.enable;

  isLoopback = a: a == "localhost" || a == "::1" || lib.hasPrefix "127." a;
  isWildcard = a: a == "0.0.0.0" || a == "::" || a == "";

  hostPort = name: r: if r.port != null then r.port else info.${name}.recipe.serve.port;

  compileWith = name: r: programs: kiln.compile {
    recipe = info.${name}.recipe;
    options = {
      inherit (cfg) stateDir user group uid gid containerRuntime;
      inherit (r) modelsDir storeDir port bindAddress memoryBytes memorySwapBytes cpus extraEnv environmentFile
        host fleetAddresses unauthenticatedPortOnAllAddresses;
      gpuMode = if cdi then "cdi" else "gpus";
    } // programs;
  };
  planOf = name: r: compileWith name r ({
    toolBin = lib.getExe' cfg.package "tool";
    engineBin = lib.getExe' cfg.enginePackage "engine";
    dockerBin = containerBin;
    recipeRef = recipeStorePath name;
  } // lib.optionalAttrs (cfg.llamaCppPackage != null) {
    llamaServerBin = lib.getExe' cfg.llamaCppPackage "llama-server";
    rpcServerBin = lib.getExe' cfg.llamaCppPackage "rpc-server";
  });
  plans = lib.mapAttrs planOf good;

  # nix/lib's structured unit → systemd.services.<name>: dependencies through the dedicated options
  # (so users extend them as usual), every other key as unitConfig/serviceConfig, all at mkDefault.
  # No [Install]: the starter below is what multi-user.target wants.
  toService = sections: {
    description = lib.mkDefault sections.Unit.Description;
    requires = sections.Unit.Requires or [ ];
    wants = sections.Unit.Wants or [ ];
    after = sections.Unit.After or [ ];
    unitConfig = lib.mapAttrs (_: lib.mkDefault) (builtins.removeAttrs sections.Unit [ "Description" "Requires" "Wants" "After" ]);
    serviceConfig = lib.mapAttrs (_: lib.mkDefault) sections.Service;
    # A new store path of Kiln or nixpkgs must not re-run the chain; see the starter.
    restartIfChanged = false;
    # Units name their programs by absolute path; NixOS' default PATH stays as it is.
  };

  chainUnits = name: builtins.attrNames plans.${name}.unitSections;
  startUnit = name: "kiln-${name}-start";

  maskStorePaths = text:
    lib.concatStrings (map (x: if builtins.isList x then "/nix/store/…" else x)
      (builtins.split "/nix/store/[0-9a-z]{32}-[^/ \"\n]*" text));

  starter = name: {
    description = "Kiln ${name}: queue the chain (fetch, prepare, verify, serve, check) without waiting for it";
    wantedBy = [ "multi-user.target" ];
    unitConfig.X-Kiln-Chain = builtins.hashString "sha256" (builtins.toJSON {
      recipe = info.${name}.recipe;
      units = map (u: maskStorePaths config.systemd.units.${u}.text) (chainUnits name);
    });
    # NixOS' default PATH names store paths; the starter runs one absolute command and needs none.
    enableDefaultPath = false;
    serviceConfig = {
      Type = "oneshot";
      RemainAfterExit = true;
      # restart: a recipe change re-runs each step, which skips what is already published and verified.
      # Every step by name: a RemainAfterExit step stays active, and only a restart re-runs it.
      ExecStart = "/run/current-system/sw/bin/systemctl restart --no-block ${lib.concatStringsSep " " (chainUnits name)}";
    };
  };

  services = lib.concatMapAttrs
    (name: plan:
      lib.mapAttrs' (unit: sections: lib.nameValuePair (lib.removeSuffix ".service" unit) (toService sections)) plan.unitSections
      // { ${startUnit name} = starter name; })
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
        description = ''
          The recipe (a JSON file or its parsed attrset); null takes the bundled recipe whose id is the
          attribute name. Its id must equal the attribute name. The units run exactly this file
          (validated at build time by `tool validate`), also when it keeps a bundled recipe's id.
        '';
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
        type = types.nullOr (types.ints.between 1 65535);
        default = null;
        example = 8080;
        description = "Host port the server publishes; null takes the recipe's serve.port.";
      };
      bindAddress = mkOption {
        type = types.str;
        default = "127.0.0.1";
        example = "0.0.0.0";
        description = "Host address the server binds (an IP literal, or localhost). Loopback by default: Kiln's servers have no authentication.";
      };
      openFirewall = mkOption {
        type = types.bool;
        default = false;
        description = "Open the server's port in the NixOS firewall (for a native recipe bound to a non-loopback address; container ports bypass the firewall, see allowUnfirewalledBind).";
      };
      allowUnfirewalledBind = mkOption {
        type = types.bool;
        default = false;
        description = ''
          Accept that a container recipe bound to a non-loopback bindAddress is reachable wherever that
          address is: docker and podman publish ports with their own NAT rules, which the NixOS firewall
          (and openFirewall) does not filter.
        '';
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
        type = types.nullOr (types.strMatching "[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*");
        default = null;
        example = "2-39";
        description = "CPUs the server may use (docker --cpuset-cpus, or AllowedCPUs=/CPUAffinity=), as a cpuset list; null means all.";
      };
      environmentFile = mkOption {
        type = types.nullOr types.str;
        default = null;
        example = "/run/secrets/kiln.env";
        description = "A file of KEY=VALUE lines for secrets (KILN_API_KEY, HF_TOKEN): given to every unit with EnvironmentFile= and to containers with docker --env-file, so no secret lands in a unit file, the Nix store or a command line. Use it instead of extraEnv for secrets.";
      };
      host = mkOption {
        type = types.nullOr types.str;
        default = null;
        example = "worker-a";
        description = "For a recipe that spans hosts (its `fleet`): which of its hosts this machine is; it gets that host's units only (the head's when null). lib.fleet sets it.";
      };
      fleetAddresses = mkOption {
        type = types.attrsOf types.str;
        default = { };
        example = { head = "10.0.0.1:50052"; worker-a = "10.0.0.2:50052"; };
        description = "For a fleet recipe: each host's ADDRESS:PORT on the fleet network (IPv6 in brackets). A worker listens only there and its unit admits only these addresses (IPAddressAllow=); the head reaches its workers there. Hosts left out get 127.0.0.1 and consecutive ports.";
      };
      unauthenticatedPortOnAllAddresses = mkOption {
        type = types.bool;
        default = false;
        description = "Let a fleet address be 0.0.0.0 or ::, though rpc-server and Ray workers take commands from anyone who reaches their port (they authenticate nobody).";
      };
      extraEnv = mkOption {
        type = types.attrsOf types.str;
        default = { };
        example = { GLM53_MODE = "nvme-exact"; };
        description = "Environment added to (or replacing) the recipe's, for prepare, verify and serve.";
      };
    };
  };

  defaultUser = cfg.user == kiln.defaultOptions.user;
  defaultGroup = cfg.group == kiln.defaultOptions.group;

  # --- assertions: each names the recipe, the option and the limit ---------------------------
  recipeAssertions = name: r:
    let
      i = info.${name};
      at = where name r;
      recipe = i.recipe;
      isContainer = recipe.runtime.kind == "container";
      gpus = recipe.hardware.gpu_count or 0;
      bind = r.bindAddress;
      port = hostPort name r;
      clashes = lib.filter
        (other: other != name && hostPort other good.${other} == port
          && (good.${other}.bindAddress == bind || isWildcard bind || isWildcard good.${other}.bindAddress))
        (builtins.attrNames good);
    in
    map (message: { assertion = false; inherit message; }) i.problems
    ++ lib.optionals i.ok [
      {
        assertion = !isContainer || (if cfg.containerRuntime == "podman" then podmanOn else dockerOn);
        message = "${at}: a container recipe needs its runtime: services.kiln.containerRuntime is ${cfg.containerRuntime}, so set virtualisation.${cfg.containerRuntime}.enable = true";
      }
      {
        assertion = !(isContainer && gpus > 0) || cdi || (config.virtualisation.docker.enableNvidia && cfg.containerRuntime == "docker");
        message = "${at}: needs ${toString gpus} GPU(s) in its container; set hardware.nvidia-container-toolkit.enable = true (CDI: --device nvidia.com/gpu=…)";
      }
      {
        assertion = r.memoryBytes == null || r.memorySwapBytes == null || r.memorySwapBytes >= r.memoryBytes;
        message = "${at}.memorySwapBytes (${toString r.memorySwapBytes}) is below memoryBytes (${toString r.memoryBytes}); it counts memory + swap, so it must be at least the memory cap";
      }
      {
        assertion = !r.openFirewall || !isLoopback bind;
        message = "${at}.openFirewall = true has no effect while bindAddress is ${bind} (loopback); bind a non-loopback address or leave the firewall closed";
      }
      {
        assertion = !isContainer || isLoopback bind || r.allowUnfirewalledBind;
        message = "${at}.bindAddress = ${builtins.toJSON bind} publishes a container port, which the NixOS firewall does not filter (docker/podman NAT rules); bind 127.0.0.1 or ::1, or set ${at}.allowUnfirewalledBind = true";
      }
      {
        assertion = clashes == [ ];
        message = "${at}: port ${toString port} on ${bind} is also taken by services.kiln.recipes.${builtins.toJSON (builtins.head clashes)}; give one of them another port";
      }
    ];
in
{
  options.services.kiln = {
    package = mkOption {
      type = types.package;
      default = kilnPackages.tool;
      defaultText = literalExpression "(pkgs.callPackage ./nix/packages.nix { }).tool";
      description = "The Kiln `tool` (fetch, check and the readiness probe run it; installed in environment.systemPackages).";
    };
    enginePackage = mkOption {
      type = types.package;
      default = kilnPackages.engine;
      defaultText = literalExpression "(pkgs.callPackage ./nix/packages.nix { }).engine";
      description = "The Kiln engine, run by native recipes.";
    };
    llamaCppPackage = mkOption {
      type = types.nullOr types.package;
      default = kilnPackages.llama-cpp or null;
      defaultText = literalExpression "(pkgs.callPackage ./nix/packages.nix { }).llama-cpp";
      description = "llama.cpp built with its RPC backend (llama-server, rpc-server), run by llama-cpp recipes; null: the names llama-server and rpc-server, found on systemd's PATH.";
    };
    containerRuntime = mkOption {
      type = types.enum [ "docker" "podman" ];
      default = backendDefault;
      defaultText = literalExpression ''
        "docker" or "podman", whichever of virtualisation.{docker,podman}.enable is on; both or neither:
        virtualisation.oci-containers.backend'';
      description = "The container CLI container recipes run (podman runs as root; docker joins the docker group).";
    };
    stateDir = mkOption {
      type = types.str;
      default = kiln.defaultOptions.stateDir;
      description = "Kiln's state: models, stores, mounted files, evidence.";
    };
    user = mkOption {
      type = types.str;
      default = kiln.defaultOptions.user;
      description = "User the units (and containers' --user steps) run as. Only the default `kiln` is created by this module; another name must be an existing user, left as it is.";
    };
    group = mkOption {
      type = types.str;
      default = kiln.defaultOptions.group;
      description = "Group of `user` (only the default `kiln` is created).";
    };
    uid = mkOption {
      type = types.nullOr types.int;
      default = if defaultUser then kiln.defaultOptions.uid else config.users.users.${cfg.user}.uid or null;
      defaultText = literalExpression "2960 for the kiln user, else config.users.users.\${user}.uid";
      description = "uid of `user`: a number, because docker's --user needs it at evaluation time.";
    };
    gid = mkOption {
      type = types.nullOr types.int;
      default = if defaultGroup then kiln.defaultOptions.gid else config.users.groups.${cfg.group}.gid or null;
      defaultText = literalExpression "2960 for the kiln group, else config.users.groups.\${group}.gid";
      description = "gid of `group`.";
    };
    recipes = mkOption {
      type = types.attrsOf (types.submodule recipeOptions);
      default = { };
      example = literalExpression ''{ "glm-5.3-flash".enable = true; }'';
      description = "Recipes to deploy, by id.";
    };
  };

  config = mkIf (enabled != { }) (lib.mkMerge [
    {
      assertions = lib.concatLists (lib.mapAttrsToList recipeAssertions enabled) ++ [
        {
          assertion = cfg.uid != null && cfg.gid != null;
          message = "services.kiln.uid/gid: user ${cfg.user} (group ${cfg.group}) has no static uid/gid in this configuration; set users.users.${cfg.user}.uid and users.groups.${cfg.group}.gid, or services.kiln.uid and services.kiln.gid (containers' --user needs numbers)";
        }
      ];

      users.users = mkIf defaultUser {
        kiln = {
          isSystemUser = true;
          inherit (cfg) group uid;
          home = cfg.stateDir;
          description = "Kiln model servers";
        };
      };
      users.groups = mkIf defaultGroup { kiln.gid = cfg.gid; };

      systemd.tmpfiles.rules = lib.unique (lib.concatMap (plan: plan.tmpfiles) (builtins.attrValues plans)) ++ fileRules;
      systemd.services = services;

      # openFirewall: the API port, and a fleet host's own fleet port where it listens (a worker; a Ray head)
      networking.firewall.allowedTCPPorts = lib.concatLists (lib.mapAttrsToList
        (name: _: let plan = plans.${name}; f = plan.fleet; in
          lib.optional (f == null || f.role == "head") plan.options.port
          ++ lib.optional (f != null && (f.role == "worker" || plan.runtime == "container")) f.self.port)
        (lib.filterAttrs (_: r: r.openFirewall) good));
    }
    # environment.systemPackages and system.checks exist on every NixOS; the guards let the module
    # evaluate in module-system harnesses that declare only systemd and users (../shared/nixpkgs).
    (lib.optionalAttrs (options ? environment.systemPackages) {
      environment.systemPackages = [ cfg.package ];
    })
    (lib.optionalAttrs (options ? system.checks) {
      system.checks = map validation (builtins.attrNames good);
    })
  ]);
}
