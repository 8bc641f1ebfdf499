# Kiln's compiler: recipe (parsed JSON) → plan. Builtins only, so it evaluates offline,
# from `nix-instantiate --eval --strict --json` (tool/nixeval.py), from the flake's `lib`,
# and from the NixOS module, which therefore cannot disagree with `tool materialise`.
#
#   compile { recipe; options ? { }; } → {
#     id; runtime; options (resolved); paths = { state; weights; store; evidence; files; };
#     endpoint (the OpenAI base URL a client on this host uses: the check unit's, tool up's);
#     steps.<fetch|prepare|verify|serve|check> = null | { argv; commands; env; mounts; limits; unit; description; };
#     steps.check.baseline = null | { argv; env; label; timeoutSeconds; } (the speed gate's reference);
#     units.<name> = unit text;  unitSections.<name> = { Unit; Service; Install; };  unitWhy.<name>;
#     files.<absolute host path> = { content; mode; };  tmpfiles = [ rule ];
#   }
# `argv` is a step's first command and `commands` all of them (a native oneshot may run
# several, one ExecStart= each). The recipe is assumed valid (tool validate checks it first).
#
# A fleet recipe (recipe.fleet) compiles one plan per host: options.host names it (default: the head). The head's
# plan is the recipe's plan (its serve step drives the workers); a worker's has id <id>-<host>, a serve step that
# runs fleet.worker (and fetch, for a container worker that reads the weights itself), no checks and no
# endpoint. plan.fleet = null | { host; role; self; head; workers; hosts; allow; timeoutSeconds; }.
let
  util = import ./util.nix;
  units = import ./units.nix { inherit util; };
  hardening = import ./hardening.nix { inherit util; };
  fleet = import ./fleet.nix { inherit util; };
  optionsLib = import ./options.nix { inherit util fleet; };
  docker = import ./docker.nix { inherit util hardening units fleet; };
  native = import ./native.nix { inherit util hardening units fleet; };
  toolSteps = import ./toolsteps.nix { inherit util hardening units; };
  recipes = import ./recipes.nix { inherit util; };

  inherit (util) optional optionals;

  stepOrder = [ "fetch" "prepare" "verify" "serve" "check" ];

  unitName = id: stepName:
    if stepName == "serve" then "kiln-${id}.service" else "kiln-${id}-${stepName}.service";

  # fetch, prepare and verify leave something on disk: they stay "active" once done so
  # the next step's Requires= is satisfied without running them again.
  remainsAfterExit = stepName: builtins.elem stepName [ "fetch" "prepare" "verify" ];

  restartSec = 30;

  # [Unit]: the chain fetch → prepare → verify → serve → check, and the docker daemon for containers.
  unitSection = ctx: stepName: previous:
    let
      # A per-user manager cannot order against the system's docker.service; podman has no daemon.
      usesDocker = ctx.runtime == "container" && ctx.o.containerRuntime == "docker"
        && !(builtins.elem stepName [ "fetch" "check" ]) && !ctx.o.userUnits;
      deps = optional (previous != null) (unitName ctx.unitId previous) ++ optional usesDocker "docker.service";
      # a fleet's processes talk to other hosts: start once the network is up
      online = optional (stepName == "fetch" || stepName == "serve" && ctx.o.fleet != null) "network-online.target";
      timeout = ctx.readyTimeout;
    in
    {
      Description = units.unitString "Description"
        "Kiln ${ctx.id}: ${if ctx.isWorker && stepName == "serve" then "fleet worker ${ctx.o.fleet.host}" else stepName} (${ctx.recipe.title})";
      Requires = if deps == [ ] then null else deps;
      Wants = if online == [ ] then null else online;
      After = if deps ++ online == [ ] then null else deps ++ online;
    } // (if stepName == "serve" then {
      # systemd 252 has no RestartSteps=: the backoff is RestartSec= plus this start limit.
      StartLimitIntervalSec = 3 * (timeout + restartSec);
      StartLimitBurst = 3;
    } else { });

  # [Service] keys every step shares, added to what the runtime built.
  serviceSection = ctx: stepName: step:
    let
      o = ctx.o;
      isServe = stepName == "serve";
      probe = toolSteps.readiness ctx;
      # a worker has no API to probe: it is ready when its process runs
      probed = isServe && !ctx.isWorker;
    in
    step.service
    // (if o.userUnits || (step.runAsRoot or false) then { } else { User = o.user; Group = o.group; })
    // (if o.environmentFile == null then { } else { EnvironmentFile = "-${o.environmentFile}"; })
    // (if remainsAfterExit stepName then { RemainAfterExit = true; } else { })
    // {
      # Loads take up to an hour; a oneshot's own work has no natural limit.
      TimeoutStartSec = if isServe then ctx.readyTimeout else "infinity";
    }
    // (if probed then {
      # Ready means a real completion answered, not an open port.
      ExecStartPost = probe.execLine;
      Environment = util.orDefault (step.service.Environment or null) [ ] ++ probe.environment;
      ReadWritePaths = util.orDefault (step.service.ReadWritePaths or null) [ ] ++ [ ctx.paths.evidence ];
    } else { })
    // (if isServe then {
      Restart = "on-failure";
      RestartSec = restartSec;
      TimeoutStopSec = 90;
    } else { });

  installSection = ctx: stepName:
    if stepName == "serve"
    then { WantedBy = [ (if ctx.o.userUnits then "default.target" else "multi-user.target") ]; }
    else { };

  # tmpfiles.d rules for the directories the units expect to exist (ReadWritePaths= must exist).
  tmpfilesRules = ctx:
    let
      owner = if ctx.o.userUnits then "- -" else "${ctx.o.user} ${ctx.o.group}";
      dir = path: mode: "d ${path} ${mode} ${owner} -";
    in
    [ (dir ctx.o.stateDir "0750") (dir ctx.o.modelsDir "0750") (dir ctx.paths.evidence "0750") ]
    ++ optionals (ctx.paths.store != null) [ (dir ctx.o.storeDir "0750") (dir ctx.paths.store "0750") ]
    ++ optionals (ctx.recipe.files or { } != { }) [ "d ${ctx.o.filesDir} 0755 ${if ctx.o.userUnits then "- -" else "root root"} -" ];
in
rec {
  inherit (units) toUnitText escapeArg commandLine;
  inherit (recipes) recipesIn recipeFilesIn;
  inherit stepOrder unitName;
  defaultOptions = optionsLib.defaults;

  # Every recipe is checked for hostile text first (units.plainRecipe), validated or not.
  compile = { recipe, options ? { } }: compileChecked { recipe = units.plainRecipe recipe; inherit options; };
  compileChecked = { recipe, options ? { } }:
    let
      o0 = optionsLib.resolve recipe options;
      o = optionsLib.check recipe o0;
      paths = optionsLib.paths recipe o;
      runtime = recipe.runtime.kind;
      host = o.bindAddress;
      isWorker = o.fleet != null && o.fleet.role == "worker";
      fleetWords = fleet.placeholders o.fleet;
      ctx = {
        inherit recipe o paths runtime isWorker;
        id = recipe.id;
        unitId = fleet.unitId recipe o.fleet;
        readyTimeout = recipe.steps.serve.ready_timeout_s or (recipe.checks.load_timeout_s or 3600);
        # Placeholders a recipe's args may use (native recipes name Kiln's paths this way; a fleet's args the
        # fleet's addresses).
        substitute = builtins.replaceStrings
          ([ "@weights@" "@store@" "@host@" "@port@" ] ++ builtins.attrNames fleetWords)
          ([ paths.weights (if paths.store == null then "" else paths.store) host (toString o.port) ] ++ builtins.attrValues fleetWords);
      };
      rt = if runtime == "container" then docker else native;
      workload = stepName:
        let s = recipe.steps.${stepName} or null; in
        if s == null then null else rt.step ctx stepName s;

      built = if isWorker then {
        # a container worker (a Ray node) loads the weights from its own disk; rpc-server gets them from the head
        fetch = if runtime == "container" then toolSteps.fetch ctx else null;
        prepare = null;
        verify = null;
        serve = rt.worker ctx;
        check = null;
      } else {
        fetch = toolSteps.fetch ctx;
        prepare = workload "prepare";
        verify = workload "verify";
        serve = workload "serve";
        check = toolSteps.check ctx;
      };
      chain = builtins.filter (n: built.${n} != null) stepOrder;
      previousOf = builtins.listToAttrs (builtins.genList
        (i: { name = builtins.elemAt chain i; value = if i == 0 then null else builtins.elemAt chain (i - 1); })
        (builtins.length chain));

      unitOf = stepName: {
        sections = {
          Unit = util.compact (unitSection ctx stepName previousOf.${stepName});
          Service = util.compact (serviceSection ctx stepName built.${stepName});
          Install = installSection ctx stepName;
        };
        why = { Service = built.${stepName}.why // (if stepName == "serve" && !isWorker then {
          ReadWritePaths = "what this step writes, and the evidence directory the readiness probe (ExecStartPost) records into";
        } else { }); };
      };
      unitsByName = builtins.listToAttrs (map (n: { name = unitName ctx.unitId n; value = unitOf n; }) chain);

      # A fleet worker carries only the files its own container mounts (the head's entrypoint is the head's).
      carried = if isWorker
        then util.filterAttrs (name: _: builtins.elem "file:${name}" (map (m: m.source) (recipe.fleet.worker.mounts or [ ]))) (recipe.files or { })
        else recipe.files or { };
      publicStep = stepName: s:
        if s == null then null
        else { inherit (s) argv commands env mounts limits description; unit = unitName ctx.unitId stepName; }
          // (if s ? baseline then { inherit (s) baseline; } else { })
          // (if s ? gate then { inherit (s) gate; } else { });
    in
    {
      id = ctx.unitId;
      recipe = recipe.id;
      inherit runtime paths;
      inherit (o) fleet;
      endpoint = if isWorker then null else toolSteps.endpoint ctx;
      options = builtins.removeAttrs o [ "fleet" ];
      steps = builtins.mapAttrs publicStep built;
      units = builtins.mapAttrs (_: units.toUnitText) unitsByName;
      unitSections = builtins.mapAttrs (_: u: u.sections) unitsByName;
      unitWhy = builtins.mapAttrs (_: u: u.why) unitsByName;
      files = builtins.listToAttrs (util.mapAttrsToList
        (name: f: { name = paths.files.${name}; value = { inherit (f) content; mode = f.mode or "0444"; }; })
        carried);
      tmpfiles = tmpfilesRules ctx;
    };

  # Every recipe under a directory compiled with the same options: { <id> = plan; }.
  plansIn = dir: opts: builtins.mapAttrs (_: recipe: compile { inherit recipe; options = opts; }) (recipesIn dir);

}
