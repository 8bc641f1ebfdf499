# The sandbox every Kiln unit starts from (systemd.exec(5)), and the few relaxations a step
# needs, each with the one-line reason that toUnitText writes beside it.
#   network: the step talks TCP (downloads, serves, or probes a server)
#   jit:     the process generates machine code at run time (torch's CPU kernels)
#   gpu:     a native process opens /dev/nvidia*
#   writes:  host paths the process itself writes (everything else stays read-only)
{ util }:
let
  inherit (util) optionals;
in
{
  sandbox = { network ? false, jit ? false, gpu ? false, writes ? [ ], userUnits ? false }:
    let
      # Per-user managers cannot drop capabilities or police devices; those keys would fail there.
      systemOnly = attrs: if userUnits then { } else attrs;
    in
    {
      service = {
        NoNewPrivileges = true;
        ProtectSystem = "strict";
        ProtectHome = true;
        PrivateTmp = true;
        PrivateDevices = !gpu;
        PrivateNetwork = !network;
        ProtectKernelTunables = true;
        ProtectKernelModules = true;
        ProtectKernelLogs = true;
        ProtectControlGroups = true;
        ProtectClock = true;
        ProtectHostname = true;
        RestrictNamespaces = true;
        RestrictRealtime = true;
        RestrictSUIDSGID = true;
        LockPersonality = true;
        MemoryDenyWriteExecute = !jit;
        SystemCallArchitectures = "native";
        SystemCallFilter = "@system-service";
        SystemCallErrorNumber = "EPERM";
        RestrictAddressFamilies = builtins.concatStringsSep " " ([ "AF_UNIX" ] ++ optionals network [ "AF_INET" "AF_INET6" ]);
        UMask = "0027";
        ReadWritePaths = if writes == [ ] then null else writes;
      } // systemOnly ({
        CapabilityBoundingSet = "";
        AmbientCapabilities = "";
      } // (if gpu then {
        # PrivateDevices=no opens /dev; these put the device cgroup back to "GPU only".
        DevicePolicy = "closed";
        DeviceAllow = [ "char-nvidiactl rw" "char-nvidia-frontend rw" "char-nvidia-uvm rw" "char-nvidia-caps rw" ];
      } else { }));

      why = { }
        // (if network then { RestrictAddressFamilies = "this step talks TCP (download, serve, or probe the server)"; PrivateNetwork = "this step needs the host's network (at least loopback to the server)"; } else { })
        // (if jit then { MemoryDenyWriteExecute = "torch generates CPU kernels at run time into writable+executable memory"; } else { })
        // (if gpu then { PrivateDevices = "the engine opens /dev/nvidia*; DevicePolicy/DeviceAllow below allow exactly those"; } else { })
        // (if writes != [ ] then { ReadWritePaths = "the only paths this step writes; the rest of the system stays read-only"; } else { });
    };
}
