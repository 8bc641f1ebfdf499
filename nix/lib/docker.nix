# The container runtime: a recipe step → the full `docker run` argv and its systemd service.
# The argv reproduces the seed commands option for option (same image, same args after it);
# Kiln changes only what it must: host sides of mounts are its state directories, --user is
# the service user's uid:gid, the published port binds bindAddress, and the container is named
# so the unit can stop it. Limits are docker flags: the container is not in the unit's cgroup.
# The same argv drives podman (o.containerRuntime = "podman": its CLI takes these flags), and GPUs
# are either docker's --gpus (the seeds' flag, the default) or CDI devices (o.gpuMode = "cdi", what
# NixOS' hardware.nvidia-container-toolkit generates specs for).
#
# A fleet (recipe.fleet, vLLM on Ray): the head's and the workers' containers share their host's network
# (--network host, as vLLM's multi-node guide runs them): Ray and NCCL open ports of their own between the
# hosts, which docker's -p cannot publish. They learn their place from KILN_FLEET_* variables.
{ util, hardening, units, fleet }:
let
  inherit (util) optional optionals mapAttrsToList;
  inherit (units) commandLine;
in
rec {
  containerName = ctx: stepName:
    if stepName == "serve" then "kiln-${ctx.unitId}" else "kiln-${ctx.unitId}-${stepName}";

  # Recipe mount sources name Kiln's own directories.
  hostPath = ctx: source:
    if source == "weights" then ctx.paths.weights
    else if source == "store" then ctx.paths.store
    else if util.hasPrefix "file:" source then ctx.paths.files.${util.removePrefix "file:" source}
    else throw "kiln: ${ctx.id}: unknown mount source '${source}' (weights, store or file:<name>)";

  mounts = ctx: step: map
    (m: {
      inherit (m) source target;
      host = hostPath ctx m.source;
      readOnly = m.read_only or false;
    })
    (step.mounts or [ ]);

  volumeArgs = ms: builtins.concatMap
    (m: [ "-v" "${m.host}:${m.target}${if m.readOnly then ":ro" else ""}" ]) ms;

  envArgs = env: keys: builtins.concatMap (k: [ "-e" "${k}=${env.${k}}" ]) keys;

  # docker/podman -p takes an IP literal: IPv6 in brackets; `localhost` is loopback (127.0.0.1).
  publishHost = bind:
    if bind == "localhost" then "127.0.0.1"
    else if util.hasInfix ":" bind then "[${bind}]"
    else bind;

  # The first published port is the serve port, so the `port` option moves it.
  portArgs = ctx: step:
    let ports = if ctx.o.fleet != null then [ ] else step.ports or [ ]; in
    builtins.concatLists (builtins.genList
      (i:
        let p = builtins.elemAt ports i;
            hostPort = if i == 0 then ctx.o.port else p.host;
        in [ "-p" "${publishHost ctx.o.bindAddress}:${toString hostPort}:${toString p.container}" ])
      (builtins.length ports));

  limits = ctx: step:
    let c = ctx.recipe.runtime.container; in
    {
      enforcedBy = "docker";
      memoryBytes = ctx.o.memoryBytes;
      memorySwapBytes = ctx.o.memorySwapBytes;
      memlock = (c.ulimits or { }).memlock or null;
      ulimits = c.ulimits or { };
      shmSize = c.shm_size or null;
      cpus = ctx.o.cpus;
      gpus = step.gpus or null;
    };

  # --gpus all | N | device=0,1 as CDI device names (nvidia.com/gpu=<index>|all).
  cdiDevices = gpus:
    if gpus == "all" then [ "all" ]
    else if builtins.isInt gpus then builtins.genList toString gpus
    else builtins.filter builtins.isString (builtins.split "," (util.removePrefix "device=" gpus));

  gpuArgs = o: gpus:
    if gpus == null then [ ]
    else if o.gpuMode == "cdi" then builtins.concatMap (d: [ "--device" "nvidia.com/gpu=${d}" ]) (cdiDevices gpus)
    else [ "--gpus" (toString gpus) ];

  limitArgs = l:
    optionals (l.memoryBytes != null) [ "--memory" (toString l.memoryBytes) ]
    ++ optionals (l.memorySwapBytes != null) [ "--memory-swap" (toString l.memorySwapBytes) ]
    ++ builtins.concatLists (mapAttrsToList (k: v: [ "--ulimit" "${k}=${v}" ]) l.ulimits)
    ++ optionals (l.shmSize != null) [ "--shm-size" l.shmSize ]
    ++ optionals (l.cpus != null) [ "--cpuset-cpus" l.cpus ];

  # What a fleet's container is told about its place (Kiln's names: a recipe cannot set KILN_*).
  fleetEnv = ctx:
    let f = ctx.o.fleet; in
    if f == null then { } else {
      KILN_FLEET_HOST = f.self.address;
      KILN_FLEET_PORT = toString f.self.port;
      KILN_FLEET_HEAD = fleet.endpoint f.head;
      KILN_FLEET_WORKERS = builtins.concatStringsSep "," (fleet.workerList f);
      KILN_FLEET_TIMEOUT_S = toString f.timeoutSeconds;
      # vLLM and NCCL pick this host's interface by its address
      VLLM_HOST_IP = f.self.address;
    };

  # A fleet's worker: the recipe's image running fleet.worker's args (a Ray worker joining the head).
  worker = ctx: step ctx "serve" (ctx.recipe.fleet.worker // { ports = [ ]; });

  argv = ctx: stepName: step:
    let
      c = ctx.recipe.runtime.container;
      o = ctx.o;
      stepEnv = step.env or { };
      env = (ctx.recipe.env or { }) // stepEnv // o.extraEnv;
      # The step's own env (HOME=/tmp) comes first, as in the seeds; then the recipe's.
      restKeys = builtins.filter (k: !(stepEnv ? ${k})) (builtins.attrNames env);
      l = limits ctx step;
    in
    [ o.dockerBin "run" "--rm" "--name" (containerName ctx stepName) ]
    ++ optionals ((step.user or null) == "service") [ "--user" "${toString o.uid}:${toString o.gid}" ]
    ++ envArgs env (builtins.attrNames stepEnv)
    # Narrowing only: no setuid escalation inside; no network for steps that only read and write disks.
    ++ [ "--security-opt" "no-new-privileges" ]
    ++ optionals (stepName != "serve") [ "--network" "none" ]
    ++ optionals (stepName == "serve" && ctx.o.fleet != null) [ "--network" "host" ]
    ++ gpuArgs o (step.gpus or null)
    ++ portArgs ctx step
    ++ optionals ((c.ipc or null) != null) [ "--ipc" c.ipc ]
    ++ limitArgs l
    ++ envArgs env restKeys
    ++ optionals (stepName == "serve") (envArgs (fleetEnv ctx) (builtins.attrNames (fleetEnv ctx)))
    ++ optionals (o.environmentFile != null) [ "--env-file" o.environmentFile ]
    ++ optionals ((c.entrypoint or null) != null) [ "--entrypoint" c.entrypoint ]
    ++ volumeArgs (mounts ctx step)
    ++ [ c.image ]
    ++ map ctx.substitute (step.args or [ ]);

  step = ctx: stepName: recipeStep:
    let
      o = ctx.o;
      name = containerName ctx stepName;
      docker = args: [ o.dockerBin ] ++ args;
      isServe = stepName == "serve";
      command = argv ctx stepName recipeStep;
      podman = o.containerRuntime == "podman";
      sandbox = hardening.sandbox { network = isServe; userUnits = o.userUnits; };
      # Podman has no daemon: the unit's own process creates the container's namespaces, mounts and
      # cgroups, which the docker-client sandbox forbids, and a system user would need rootless
      # set-up (subuids, a home). As virtualisation.oci-containers does, podman runs as root,
      # unsandboxed; the workload inside still gets --user, --security-opt no-new-privileges and
      # every limit flag. No docker group: nothing root-equivalent is handed to the service user.
      runAsRoot = podman && !o.userUnits;
    in
    {
      argv = command;
      commands = [ command ];
      env = (ctx.recipe.env or { }) // (recipeStep.env or { }) // o.extraEnv;
      mounts = mounts ctx recipeStep;
      limits = limits ctx recipeStep;
      description = recipeStep.description or null;
      inherit runAsRoot;
      service = (if podman then { } else sandbox.service) // {
        Type = if isServe then "exec" else "oneshot";
        # A container left over from a crash would make `docker run --name` refuse to start.
        ExecStartPre = "-" + commandLine (docker [ "rm" "--force" name ]);
        ExecStart = commandLine command;
        ExecStop = "-" + commandLine (docker [ "stop" "--time" "60" name ]);
      } // (if o.userUnits || podman then { } else { SupplementaryGroups = "docker"; });
      why = (if podman then { } else sandbox.why) // (if isServe && o.fleet != null then {
        PrivateNetwork = "a fleet's container runs on the host's network (--network host; Ray and NCCL talk between the hosts); the unit's own network sandbox would not reach it: a container is not in this unit's cgroup, so the fleet network's firewall, not IPAddressAllow=, keeps others out of Ray's ports";
      } else { }) // (if o.userUnits || podman then { } else {
        SupplementaryGroups = "the docker client needs the daemon's socket; the workload's own user is docker's --user";
      }) // {
        ExecStart = (if runAsRoot then "podman runs as root without a sandbox (it builds the container itself; see nix/lib/docker.nix); " else "") + "the limits are docker flags (--memory, --memory-swap, --ulimit, --shm-size): the container is not in this unit's cgroup";
      };
      containerName = name;
    };
}
