# Kiln's own steps, the same for every runtime: `tool fetch <id>` before everything and
# `tool check <id>` after the server is up, plus the readiness probe the serve unit runs.
# The tool learns Kiln's directories from KILN_* variables, so its flags stay its own. The recipe is
# named by o.recipeRef: its id (a bundled recipe the tool finds itself) or the file the plan was
# compiled from (the NixOS module passes a recipe's store path), so the tool runs exactly that recipe.
{ util, hardening, units }:
let
  inherit (units) commandLine environmentLine;

  # A server bound to every address is still probed on loopback.
  probeHost = bind:
    if bind == "0.0.0.0" || bind == "" then "127.0.0.1"
    else if bind == "::" then "[::1]"
    else if util.hasInfix ":" bind then "[${bind}]"
    else bind;

  toolEnv = ctx: {
    HOME = "/tmp";
    KILN_STATE_DIR = ctx.o.stateDir;
    KILN_MODELS_DIR = ctx.o.modelsDir;
    KILN_STORE_DIR = ctx.o.storeDir;
    KILN_EVIDENCE_DIR = ctx.paths.evidence;
  };

  oneshot = ctx: { argv, writes, mounts, extraEnv ? { } }:
    let
      env = toolEnv ctx // extraEnv;
      sandbox = hardening.sandbox { network = true; inherit writes; userUnits = ctx.o.userUnits; };
    in
    {
      inherit argv env mounts;
      commands = [ argv ];
      limits = { enforcedBy = "systemd"; };
      service = sandbox.service // {
        Type = "oneshot";
        ExecStart = commandLine argv;
        Environment = util.mapAttrsToList environmentLine env;
      };
      inherit (sandbox) why;
    };
in
rec {
  endpoint = ctx: "http://${probeHost ctx.o.bindAddress}:${toString ctx.o.port}/v1";

  fetch = ctx: oneshot ctx {
    argv = [ ctx.o.toolBin "fetch" ctx.o.recipeRef ];
    # The whole models directory: downloads are staged beside the target and published by rename.
    writes = [ ctx.o.modelsDir ];
    mounts = [{ source = "models"; host = ctx.o.modelsDir; target = ctx.o.modelsDir; readOnly = false; }];
  } // { description = "download the weights at the pinned revision and verify every file"; };

  check = ctx: oneshot ctx {
    argv = [ ctx.o.toolBin "check" ctx.o.recipeRef "--endpoint" (endpoint ctx) ];
    writes = [ ctx.paths.evidence ];
    mounts = [{ source = "evidence"; host = ctx.paths.evidence; target = ctx.paths.evidence; readOnly = false; }];
    # The unit's `tool check` gets the compiled baseline as it is, with no Nix to evaluate at run time.
    extraEnv = if decodeBaseline ctx == null then { } else { KILN_DECODE_BASELINE = builtins.toJSON (decodeBaseline ctx); };
  } // {
    description = "the acceptance gates against the running server; evidence JSON";
    baseline = decodeBaseline ctx;
  };

  # checks.decode_baseline (native recipes): the reference the speed gate times in the same run, as the
  # engine program with the recipe's args, placeholders substituted like any step's.
  decodeBaseline = ctx:
    let b = (ctx.recipe.checks or { }).decode_baseline or null; in
    if b == null then null else {
      argv = [ ctx.o.engineBin ] ++ map ctx.substitute b.args;
      env = ctx.recipe.env or { };
      inherit (b) label;
      timeoutSeconds = b.timeout_s or 600;
    };

  # The serve unit's ExecStartPost: the load gate (/v1/models, then a real 1-token completion).
  readiness = ctx: {
    execLine = commandLine [ ctx.o.toolBin "check" ctx.o.recipeRef "--gates" "load" "--endpoint" (endpoint ctx) ];
    environment = [ (environmentLine "KILN_EVIDENCE_DIR" ctx.paths.evidence) ];
  };
}
