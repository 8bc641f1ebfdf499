# The native runtimes: Kiln's own engine (kind native) or llama.cpp's llama-server (kind llama-cpp; a fleet's
# workers run its rpc-server) run directly as systemd services. Their limits are systemd directives (the process
# lives in the unit's cgroup), their sandbox is the usual hardening, and their writable paths are exactly the
# ones the recipe says the step writes.
{ util, hardening, units, fleet }:
let
  inherit (util) optional optionals hasInfix;
  inherit (units) commandLine environmentLine;
  sources = [ "weights" "store" ];
in
rec {
  # Where the server listens and how it authenticates are the operator's options: a recipe names the
  # bind address and port only as @host@/@port@, and never an API key (tool/validate.py says the same,
  # with the located message; this is for recipes that never met it, e.g. through the NixOS module).
  placeholderFlags = { "--host" = "@host@"; "--port" = "@port@"; };
  operatorFlags = [ "--bind" "--api-key" "--api-key-file" ];
  checkArgs = ctx: stepName: words:
    let
      n = builtins.length words;
      fail = msg: throw "kiln: ${ctx.id}: step ${stepName}: ${msg}";
      ok = i:
        let
          word = builtins.elemAt words i;
          parts = builtins.match "(--[^=]*)(=(.*))?" word;
          flag = if parts == null then null else builtins.head parts;
          value = if parts == null then null
            else if builtins.elemAt parts 1 != null then builtins.elemAt parts 2
            else if i + 1 < n then builtins.elemAt words (i + 1) else null;
        in
        if flag == null then true
        else if builtins.elem flag operatorFlags
        then fail "${flag} is the operator's option, not the recipe's (secrets go in the environment file)"
        else if placeholderFlags ? ${flag} && value != placeholderFlags.${flag}
        then fail "${flag} ${builtins.toJSON value}: the bind address and port are the operator's options; write ${flag} ${placeholderFlags.${flag}}"
        else true;
    in
    builtins.all ok (builtins.genList (i: i) n);

  # pack-store learns the store's record scheme from the recipe's store.quant (one place says it;
  # gguf: the file's own expert blocks, store.gguf_file naming the file).
  quantArgs = ctx: args:
    let s = ctx.recipe.store or { }; in
    if args != [ ] && builtins.head args == "pack-store" && s ? quant
    then [ "--quant" s.quant ] ++ (if s.quant == "gguf" then [ "--gguf" s.gguf_file ] else [ ])
    else [ ];

  # A recipe step has either `args` (one command) or `commands` (several, run in order).
  stepCommands = ctx: step: map (args: args ++ quantArgs ctx args) (step.commands or [ step.args ]);

  isEngine = ctx: ctx.runtime == "native";
  # The program every step runs, and the runtime object that holds its limits.
  program = ctx: if isEngine ctx then ctx.o.engineBin else ctx.o.llamaServerBin;
  runtimeObject = ctx: if isEngine ctx then ctx.recipe.runtime.native else ctx.recipe.runtime.llama_cpp;

  commands = ctx: step:
    map (args: [ (program ctx) ] ++ map ctx.substitute args) (stepCommands ctx step);

  # The engine's batch and prefill chunk come from the recipe's `serve` fields (the schema's contract),
  # appended last so they win over the same flags in args (click takes the last). A fleet's llama-server head
  # gets its workers from the operator's fleet addresses (--rpc) and its host's thread count.
  serveFlags = ctx:
    let
      s = ctx.recipe.serve;
      f = ctx.o.fleet;
      threads = if f == null then null else f.spec.cpu.threads or null;
    in
    if isEngine ctx then
      [ "--max-batch" (toString s.max_batch_size) ]
      ++ optional (s ? chunk_size) "--chunk-size" ++ optional (s ? chunk_size) (toString s.chunk_size)
    else
      optionals (threads != null) [ "--threads" (toString threads) ]
      ++ optionals (f != null && f.workers != [ ]) [ "--rpc" (builtins.concatStringsSep "," (map fleet.endpoint f.workers)) ];

  # What a step touches follows from the placeholders it uses; `writes` marks the writable ones.
  mounts = ctx: step:
    let
      words = builtins.concatLists (stepCommands ctx step);
      uses = src: builtins.any (hasInfix "@${src}@") words;
    in
    builtins.concatMap
      (src: optional (uses src) {
        source = src;
        host = ctx.paths.${src};
        target = ctx.paths.${src};
        readOnly = !(builtins.elem "@${src}@" (step.writes or [ ]));
      })
      sources;

  isGpu = ctx: ((runtimeObject ctx).device or "cpu") != "cpu";

  limits = ctx: {
    enforcedBy = "systemd";
    memoryBytes = ctx.o.memoryBytes;
    memorySwapBytes = ctx.o.memorySwapBytes;
    memlock = (runtimeObject ctx).memlock or null;
    cpus = ctx.o.cpus;
    gpus = if isGpu ctx then "all" else null;
  };

  # systemd's MemorySwapMax is swap alone; Kiln's memorySwapBytes is memory + swap (docker's sense).
  limitDirectives = l: util.compact {
    MemoryMax = l.memoryBytes;
    MemorySwapMax = if l.memoryBytes == null then null else l.memorySwapBytes - l.memoryBytes;
    LimitMEMLOCK = l.memlock;
    AllowedCPUs = l.cpus;
    CPUAffinity = l.cpus;
  };

  step = ctx: stepName: recipeStep:
    let
      o = ctx.o;
      isServe = stepName == "serve";
      # checked before the placeholders are filled in: @host@ is what the recipe must have written
      cmds0 = assert builtins.all (checkArgs ctx stepName) (recipeStep.commands or [ recipeStep.args ]); commands ctx recipeStep;
      cmds = if isServe then map (c: c ++ serveFlags ctx) cmds0 else cmds0;
      ms = mounts ctx recipeStep;
      l = limits ctx;
      env = (ctx.recipe.env or { }) // (recipeStep.env or { }) // o.extraEnv;
      f = ctx.o.fleet;
      # systemd cannot order units on two machines: the head's unit waits for its workers' ports itself.
      waitForWorkers = isServe && f != null && f.workers != [ ];
      sandbox = hardening.sandbox {
        network = isServe;
        jit = isEngine ctx;
        gpu = isGpu ctx;
        writes = map (m: m.host) (builtins.filter (m: !m.readOnly) ms);
        userUnits = o.userUnits;
      };
    in
    {
      argv = builtins.head cmds;
      commands = cmds;
      inherit env;
      mounts = ms;
      limits = l;
      description = recipeStep.description or null;
      service = sandbox.service // limitDirectives l // {
        Type = if isServe then "exec" else "oneshot";
        ExecStart = map commandLine cmds;
        Environment = util.mapAttrsToList environmentLine env;
      } // (if isServe && isEngine ctx then { CacheDirectory = "kiln-${ctx.id}"; } else { })
        // (if waitForWorkers then { ExecStartPre = commandLine (waitArgv ctx); } else { });
      why = sandbox.why // (if l.memlock != null then {
        LimitMEMLOCK = if isEngine ctx then "the engine page-locks its RAM expert tier so NVMe reads and GPU copies can use it directly"
          else "llama.cpp's --mlock keeps the model resident";
      } else { }) // (if isServe && isEngine ctx then {
        CacheDirectory = "the engine builds its CPU kernels for this machine once (g++) and keeps them here ($CACHE_DIRECTORY)";
      } else { });
    };

  # `tool fleet-wait`: every worker's port answers within the recipe's timeout, or one line names the first
  # that did not (the unit fails, Restart= tries again).
  waitArgv = ctx:
    let f = ctx.o.fleet; in
    [ ctx.o.toolBin "fleet-wait" "--timeout" (toString f.timeoutSeconds) ] ++ fleet.workerList f;

  # A fleet worker: llama.cpp's rpc-server on the operator's fleet address, its threads and CPUs from the
  # recipe's host. It authenticates nobody, so its unit admits only the fleet's hosts (IPAddressAllow=, enforced
  # by the kernel through the unit's cgroup). Where there is no systemd, `gate` says how the foreground runner
  # enforces the same: rpc-server on a private loopback port behind Kiln's allow-list gate on the fleet address.
  worker = ctx:
    let
      f = ctx.o.fleet;
      w = ctx.recipe.fleet.worker;
      threads = optionals (f.spec.cpu ? threads) [ "--threads" (toString f.spec.cpu.threads) ];
      rpc = address: port: [ ctx.o.rpcServerBin "--host" address "--port" port ] ++ threads ++ map ctx.substitute w.args;
      argv = rpc f.self.address (toString f.self.port);
      env = (ctx.recipe.env or { }) // (w.env or { }) // ctx.o.extraEnv;
      l = limits ctx;
      sandbox = hardening.sandbox { network = true; gpu = isGpu ctx; userUnits = ctx.o.userUnits; };
    in
    {
      inherit argv env;
      commands = [ argv ];
      mounts = [ ];
      limits = l;
      description = w.description or null;
      gate = { listen = fleet.endpoint f.self; inherit (f) allow; argv = rpc "127.0.0.1" "@gate_port@"; };
      service = sandbox.service // limitDirectives l // {
        Type = "exec";
        ExecStart = commandLine argv;
        Environment = util.mapAttrsToList environmentLine env;
        IPAddressAllow = f.allow;
        IPAddressDeny = "any";
      };
      why = sandbox.why // {
        IPAddressDeny = "rpc-server authenticates no caller: the kernel drops every packet but the fleet's hosts' (IPAddressAllow=)";
      };
    };
}
