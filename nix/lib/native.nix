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
      cmds = commands ctx recipeStep;
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
      };
      why = sandbox.why // (if l.memlock != null then {
        LimitMEMLOCK = "the engine page-locks its RAM expert tier so NVMe reads and GPU copies can use it directly";
      } else { });
    };
}
