# The native runtime: Kiln's own engine run directly as a systemd service. Its limits are
# systemd directives (it lives in the unit's cgroup), its sandbox is the usual hardening,
# and its writable paths are exactly the ones the recipe says the step writes.
{ util, hardening, units }:
let
  inherit (util) optional hasInfix;
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

  commands = ctx: step:
    map (args: [ ctx.o.engineBin ] ++ map ctx.substitute args) (stepCommands ctx step);

  # The serve step's batch and prefill chunk come from the recipe's `serve` fields (the schema's contract),
  # appended last so they win over the same flags in args (click takes the last).
  serveFlags = ctx:
    let s = ctx.recipe.serve; in
    [ "--max-batch" (toString s.max_batch_size) ]
    ++ optional (s ? chunk_size) "--chunk-size" ++ optional (s ? chunk_size) (toString s.chunk_size);

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

  isGpu = ctx: (ctx.recipe.runtime.native.device or "cpu") != "cpu";

  limits = ctx: {
    enforcedBy = "systemd";
    memoryBytes = ctx.o.memoryBytes;
    memorySwapBytes = ctx.o.memorySwapBytes;
    memlock = ctx.recipe.runtime.native.memlock or null;
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
      sandbox = hardening.sandbox {
        network = isServe;
        jit = true;
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
      } // (if isServe then { CacheDirectory = "kiln-${ctx.id}"; } else { });
      why = sandbox.why // (if l.memlock != null then {
        LimitMEMLOCK = "the engine page-locks its RAM expert tier so NVMe reads and GPU copies can use it directly";
      } else { }) // (if isServe then {
        CacheDirectory = "the engine builds its CPU kernels for this machine once (g++) and keeps them here ($CACHE_DIRECTORY)";
      } else { });
    };
}
