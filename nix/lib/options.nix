# Resolve the compiler's options: every one has a default, and the NixOS module and
# `tool plan` flags override any of them. The resolved set is part of the plan, so a
# reader sees exactly what the units were made from.
{ util, fleet }:
let
  inherit (util) get;

  # The memory cap a recipe declares, whichever runtime it uses; a fleet host's own cap wins.
  recipeMemory = recipe: hostSpec:
    let rt = recipe.runtime; in
    if hostSpec != null && hostSpec ? memory_max_bytes then hostSpec.memory_max_bytes
    else if rt.kind == "container" then rt.container.memory_bytes or null
    else if rt.kind == "llama-cpp" then rt.llama_cpp.memory_max_bytes or null
    else rt.native.memory_max_bytes or null;

  # Docker's --memory-swap is memory + swap; a recipe without it means "no swap" (= memory).
  recipeMemorySwap = recipe: memory:
    let rt = recipe.runtime; in
    if rt.kind == "container" then rt.container.memory_swap_bytes or memory
    else if rt.kind == "native" then rt.native.memory_swap_bytes or memory
    else memory;
in
rec {
  # The defaults, in one place: the NixOS module's option defaults are these (kiln.defaultOptions).
  defaults = {
    stateDir = "/var/lib/kiln";
    user = "kiln";
    group = "kiln";
    # Fixed ids: docker's --user needs numbers known at evaluation time, and the NixOS module
    # creates the kiln user with exactly these. Outside NixOS' static ids (0-399, ids.nix) and
    # its dynamically allocated system range (400-999), where a fixed id could collide with an
    # allocated one; NixOS' allocator skips ids a configuration declares.
    uid = 2960;
    gid = 2960;
    bindAddress = "127.0.0.1";
    toolBin = "tool";
    engineBin = "engine";
    dockerBin = "/usr/bin/docker";
    # The container CLI dockerBin is: docker (talks to dockerd; the unit joins the docker group)
    # or podman (daemonless; its units run it as root, see docker.nix).
    containerRuntime = "docker";
    # GPUs for containers: docker's --gpus (the seeds' flag; needs the NVIDIA runtime hook) or
    # "cdi": --device nvidia.com/gpu=… (the CDI specs NixOS' nvidia-container-toolkit generates).
    gpuMode = "gpus";
    cpus = null;
    extraEnv = { };
    # A file of KEY=VALUE lines (secrets: KILN_API_KEY, HF_TOKEN) for every unit (EnvironmentFile=)
    # and every container (docker --env-file): secrets stay out of unit files, the store and argv.
    environmentFile = null;
    # true: units for a per-user systemd instance (`tool materialise --user`).
    userUnits = false;
    # llama.cpp's programs (runtime llama-cpp): the server, and the RPC worker a fleet's workers run.
    llamaServerBin = "llama-server";
    rpcServerBin = "rpc-server";
    # A fleet recipe: the host this plan is for (null: the head), each host's "ADDRESS:PORT" on the fleet
    # network (absent: 127.0.0.1 and fleetPortBase + the host's place), and the explicit consent to let an
    # unauthenticated worker port listen on every address (0.0.0.0, ::). See fleet.nix.
    host = null;
    fleetAddresses = { };
    fleetPortBase = null;
    unauthenticatedPortOnAllAddresses = false;
  };

  resolve = recipe: options:
    let
      o = name: get options name defaults.${name};
      stateDir = o "stateDir";
      f = if fleet.isFleet recipe then fleet.resolve recipe options
        else if get options "host" null != null
        then throw "kiln: ${recipe.id}: host ${builtins.toJSON options.host}: this recipe is one host (it has no fleet); leave the host out"
        else null;
      hostSpec = if f == null then null else f.spec;
      memoryBytes = get options "memoryBytes" (recipeMemory recipe hostSpec);
    in
    {
      fleet = f;
      llamaServerBin = o "llamaServerBin";
      rpcServerBin = o "rpcServerBin";
      inherit stateDir memoryBytes;
      modelsDir = get options "modelsDir" "${stateDir}/models";
      storeDir = get options "storeDir" "${stateDir}/stores";
      filesDir = get options "filesDir" "${stateDir}/files/${recipe.id}";
      user = o "user";
      group = o "group";
      uid = o "uid";
      gid = o "gid";
      bindAddress = o "bindAddress";
      port = get options "port" recipe.serve.port;
      toolBin = o "toolBin";
      engineBin = o "engineBin";
      dockerBin = o "dockerBin";
      containerRuntime = o "containerRuntime";
      gpuMode = o "gpuMode";
      # What the tool's own steps name the recipe by: its id, or the file it was compiled from.
      recipeRef = get options "recipeRef" recipe.id;
      memorySwapBytes = get options "memorySwapBytes"
        (if memoryBytes == null then null else recipeMemorySwap recipe memoryBytes);
      # a fleet host's pinning (fleet.hosts.<name>.cpu.cpus) unless the operator says otherwise
      cpus = get options "cpus" (if hostSpec == null then null else hostSpec.cpu.cpus or null);
      extraEnv = o "extraEnv";
      environmentFile = o "environmentFile";
      userUnits = o "userUnits";
    };

  # Where things live on the host. Container mounts and native ReadWritePaths both come from here.
  paths = recipe: o: {
    state = o.stateDir;
    weights = "${o.modelsDir}/${recipe.weights.dirname}";
    store = if recipe ? store then "${o.storeDir}/${recipe.store.dirname}" else null;
    evidence = "${o.stateDir}/evidence";
    files = builtins.mapAttrs (name: _: "${o.filesDir}/${name}") (recipe.files or { });
  };

  # Refuse options that would make a unit lie about its limits (messages name the recipe and the limit).
  check = recipe: o:
    let
      fail = msg: throw "kiln: ${recipe.id}: ${msg}";
    in
    if o.memoryBytes != null && o.memorySwapBytes != null && o.memorySwapBytes < o.memoryBytes
    then fail "memorySwapBytes (${toString o.memorySwapBytes}) is below memoryBytes (${toString o.memoryBytes}); it counts memory + swap, so it must be at least the memory cap"
    else if !(builtins.isInt o.port) || o.port < 1 || o.port > 65535
    then fail "port ${toString o.port} is not a TCP port (1-65535)"
    else if !(builtins.elem o.containerRuntime [ "docker" "podman" ])
    then fail "containerRuntime ${builtins.toJSON o.containerRuntime} is not docker or podman"
    else if !(builtins.elem o.gpuMode [ "gpus" "cdi" ])
    then fail "gpuMode ${builtins.toJSON o.gpuMode} is not gpus (docker --gpus) or cdi (--device nvidia.com/gpu=...)"
    # An IP literal or `localhost` only (the module's option is a free string): it reaches docker's -p and unit files.
    else if !(builtins.isString o.bindAddress) || o.bindAddress != "localhost" && builtins.match "[0-9.]+|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*" o.bindAddress == null
    then fail "bindAddress ${builtins.toJSON o.bindAddress} is not an IP address or localhost (e.g. 127.0.0.1, 0.0.0.0, ::1)"
    else if !(builtins.isInt o.uid) || !(builtins.isInt o.gid)
    then fail "uid and gid must be numbers (docker's --user needs them), got ${builtins.toJSON o.uid}:${builtins.toJSON o.gid}"
    else o;
}
