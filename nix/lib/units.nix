# systemd units as data, and their text. Each unit is
#   { sections = { Unit = {...}; Service = {...}; Install = {...}; }; why = { Service.Key = "reason"; }; }
# The NixOS module maps `sections` onto systemd.services.<name>; `tool materialise` writes
# `toUnitText` of the same value, so the two cannot disagree.
{ util }:
let
  inherit (util) optional compact indexOf;

  # Keys in the order a reader expects them; anything else follows alphabetically.
  keyRank = indexOf [
    "Description" "Documentation" "Requires" "Wants" "After" "Before"
    "StartLimitIntervalSec" "StartLimitBurst"
    "Type" "RemainAfterExit" "User" "Group" "SupplementaryGroups" "Environment" "EnvironmentFile"
    "ExecStartPre" "ExecStart" "ExecStartPost" "ExecStop"
    "TimeoutStartSec" "TimeoutStopSec" "Restart" "RestartSec"
    "MemoryMax" "MemorySwapMax" "LimitMEMLOCK" "AllowedCPUs" "CPUAffinity" "DevicePolicy" "DeviceAllow"
    "ReadWritePaths"
    "WantedBy"
  ];
  rank = key: keyRank.${key} or 1000;
  sortKeys = builtins.sort (a: b: if rank a == rank b then a < b else rank a < rank b);

  sectionOrder = [ "Unit" "Service" "Install" ];
in
rec {
  # systemd expands %-specifiers in most values; a literal % is written %%.
  escapePercent = builtins.replaceStrings [ "%" ] [ "%%" ];

  # One argument of an Exec*= line. systemd splits on whitespace and honours C-style
  # double quotes; it also expands $VAR and %-specifiers, so $ and % are doubled.
  # Plain words stay bare so the unit reads like the shell command it came from.
  escapeArg = arg:
    let
      plain = builtins.match "[A-Za-z0-9_./:@=,+-]+" arg != null;
      quoted = builtins.replaceStrings
        [ "\\" "\"" "%" "$" "\n" "\t" ]
        [ "\\\\" "\\\"" "%%" "$$" "\\n" "\\t" ]
        arg;
    in
    if plain then arg else "\"${quoted}\"";

  commandLine = argv: builtins.concatStringsSep " " (map escapeArg argv);

  # Environment= values are not $-expanded, but %-specifiers are.
  environmentLine = name: value:
    "\"" + builtins.replaceStrings [ "\\" "\"" "%" ] [ "\\\\" "\\\"" "%%" ] "${name}=${value}" + "\"";

  renderValue = v:
    if v == true then "yes"
    else if v == false then "no"
    else toString v;

  # One key: a `# why:` line when the key relaxes something, then one line per value.
  renderKey = why: key: value:
    optional (why ? ${key}) "# why: ${why.${key}}"
    ++ map (v: "${key}=${renderValue v}") (if builtins.isList value then value else [ value ]);

  renderSection = why: name: attrs:
    let set = compact attrs; in
    if set == { } then [ ]
    else [ "[${name}]" ]
      ++ builtins.concatMap (key: renderKey (why.${name} or { }) key set.${key}) (sortKeys (builtins.attrNames set))
      ++ [ "" ];

  # The unit file's text: sections in the usual order, a blank line after each.
  toUnitText = { sections, why ? { } }:
    let lines = builtins.concatMap (name: renderSection why name (sections.${name} or { })) sectionOrder;
    in builtins.concatStringsSep "\n" lines;
}
