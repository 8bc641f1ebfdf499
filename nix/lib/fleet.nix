# A recipe that spans hosts (recipe.fleet): which host this plan is for, and every host's address and port on
# the fleet network. The addresses are the operator's (options.fleetAddresses, `tool plan --fleet-address`, the
# NixOS module), never the recipe's. rpc-server and Ray workers authenticate no caller, so an address that
# listens everywhere (0.0.0.0, ::) is refused unless the operator says, by the option's name, that the port is
# unauthenticated. Builtins only, like the rest of nix/lib.
{ util }:
let
  inherit (util) get unique;

  # Default ports when the operator names none: llama.cpp's rpc-server default, Ray's GCS default; one port per
  # host (base + the host's place in the sorted names), so a whole fleet fits on one loopback for a try-out.
  portBase = recipe: if recipe.runtime.kind == "llama-cpp" then 50052 else 6379;

  # "10.0.0.2:50052" or "[fd00::2]:50052" → { address; port; }; null when it is neither.
  parse = text:
    let
      v6 = builtins.match "[[]([0-9A-Fa-f:.]+)[]]:([0-9]+)" text;
      v4 = builtins.match "([0-9.]+):([0-9]+)" text;
      m = if v6 != null then v6 else v4;
    in
    if !(builtins.isString text) || m == null then null
    else { address = builtins.head m; port = builtins.fromJSON (builtins.elemAt m 1); };

  # host:port as the engines write it (IPv6 in brackets).
  endpoint = a: (if util.hasInfix ":" a.address then "[${a.address}]" else a.address) + ":${toString a.port}";

  anyAddress = a: builtins.elem a [ "0.0.0.0" "::" "0:0:0:0:0:0:0:0" ];
  isIPv4 = a: builtins.match "(([0-9]{1,3})\\.){3}[0-9]{1,3}" a != null;
in
rec {
  inherit endpoint;

  isFleet = recipe: recipe ? fleet;
  hostNames = recipe: builtins.attrNames recipe.fleet.hosts;
  headName = recipe: builtins.head (builtins.filter (n: recipe.fleet.hosts.${n}.role == "head") (hostNames recipe));

  # options → null (not a fleet) or everything the compiler needs about this host and its peers.
  resolve = recipe: options:
    let
      fail = msg: throw "kiln: ${recipe.id}: ${msg}";
      names = hostNames recipe;
      host = get options "host" (headName recipe);
      given = get options "fleetAddresses" { };
      openAll = get options "unauthenticatedPortOnAllAddresses" false;
      base = get options "fleetPortBase" (portBase recipe);
      place = util.indexOf names;
      addressOf = name:
        let
          text = given.${name} or null;
          a = if text == null then { address = "127.0.0.1"; port = base + place.${name}; } else parse text;
        in
        if a == null
        then fail "fleet address of ${name} ${builtins.toJSON text} is not ADDRESS:PORT (e.g. 10.0.0.2:50052, [fd00::2]:50052)"
        else if !(util.hasInfix ":" a.address) && !(isIPv4 a.address)
        then fail "fleet address of ${name} ${builtins.toJSON a.address} is not an IP address"
        else if a.port < 1 || a.port > 65535
        then fail "fleet port of ${name} ${toString a.port} is not a TCP port (1-65535)"
        else if anyAddress a.address && !openAll
        then fail "fleet address of ${name} is ${a.address}, every address of the host: its port takes commands from anyone who reaches it (no authentication); give the fleet network's own address, or set unauthenticatedPortOnAllAddresses (tool: --unauthenticated-port-on-all-addresses)"
        else a // { inherit name; inherit (recipe.fleet.hosts.${name}) role; };
      unknown = builtins.filter (n: !(builtins.elem n names)) (builtins.attrNames given);
      all = map addressOf names;
      byName = builtins.listToAttrs (map (a: { name = a.name; value = a; }) all);
      workers = builtins.filter (a: a.role == "worker") all;
    in
    if !(builtins.elem host names)
    then fail "fleet has no host ${builtins.toJSON host} (hosts: ${builtins.concatStringsSep ", " names})"
    else if unknown != [ ]
    then fail "fleet address given for ${builtins.concatStringsSep ", " unknown}, which is not a host of the fleet (hosts: ${builtins.concatStringsSep ", " names})"
    else {
      inherit host workers;
      role = recipe.fleet.hosts.${host}.role;
      spec = recipe.fleet.hosts.${host};
      self = byName.${host};
      head = byName.${headName recipe};
      hosts = all;
      # Only the fleet's own hosts may reach a worker's port (IPAddressAllow=; the foreground runner's gate).
      allow = unique (map (a: a.address) all);
      timeoutSeconds = recipe.fleet.workers_timeout_s or 300;
      unauthenticatedPortOnAllAddresses = openAll;
    };

  # The plan's id for this host: the head keeps the recipe's (its units are the recipe's units); a worker's is
  # <id>-<host>, so a worker's units, run state and log never collide with the head's or another worker's.
  unitId = recipe: f: if f == null || f.role == "head" then recipe.id else "${recipe.id}-${f.host}";

  # The placeholders a fleet's args may use (container workers: where to find the head, where to listen).
  placeholders = f: if f == null then { } else {
    "@fleet_host@" = f.self.address;
    "@fleet_port@" = toString f.self.port;
    "@head@" = endpoint f.head;
    "@workers@" = builtins.concatStringsSep "," (map endpoint f.workers);
  };

  # name=host:port for each worker, as `tool fleet-wait` and the Ray head's wait take them.
  workerList = f: map (w: "${w.name}=${endpoint w}") f.workers;
}
