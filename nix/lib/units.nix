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
  # The control characters (U+0001–U+001F and DEL; a Nix string cannot hold NUL), made with fromJSON
  # because Nix has no \x escape. systemd ends a unit-file line at \n and \r and joins a line that
  # ends in a backslash to the next: no value from a recipe may be written raw with any of these.
  hexDigit = i: builtins.substring i 1 "0123456789abcdef";
  hex2 = i: hexDigit (i / 16) + hexDigit (i - i / 16 * 16);
  controlCodes = builtins.genList (i: i + 1) 31 ++ [ 127 ];
  controls = map (i: builtins.fromJSON "\"\\u00${hex2 i}\"") controlCodes;
  # C escapes, which systemd's unquoting reads in Exec*= and Environment= (systemd.syntax(7)).
  controlEscapes = map (i: { "10" = "\\n"; "13" = "\\r"; "9" = "\\t"; }.${toString i} or "\\x${hex2 i}") controlCodes;
  controlClass = "[${builtins.concatStringsSep "" controls}]";
  hasControl = s: builtins.length (builtins.split controlClass s) > 1;

  # A value is written as one line: no control character, no trailing backslash (a continuation).
  # The message names the key and shows the value JSON-escaped, so the error is one line too.
  refuseUnsafe = key: s:
    if hasControl s
    then throw "kiln: unit key ${key}= cannot hold a control character (a newline or carriage return would start a unit line of its own; systemd has no escape for it in ${key}=): ${builtins.toJSON s}"
    else if util.hasSuffix "\\" s
    then throw "kiln: unit key ${key}= cannot end in a backslash (systemd would join the next line to it): ${builtins.toJSON s}"
    else s;

  # Defence in depth for a recipe that never met `tool validate` (the NixOS module evaluates recipes
  # directly): text with a control character anywhere but a carried file's content, or an id or
  # directory name that is not one path component, is refused before any of it reaches a unit, a
  # tmpfiles rule or an argv. The message locates the value as `tool validate` would ($.a.b[0]).
  plainRecipe = recipe:
    let
      step = p:
        if builtins.isInt p then "[${toString p}]"
        else if builtins.match "[A-Za-z_][A-Za-z0-9_]*" p != null then ".${p}"
        else "[${builtins.toJSON p}]";  # JSON-escaped: the message stays one line whatever the key holds
      where = path: "$" + builtins.concatStringsSep "" (map step path);
      isContent = path: builtins.length path == 3 && builtins.head path == "files" && builtins.elemAt path 2 == "content";
      fail = path: what: throw "kiln: recipe ${where path}: ${what}";
      text = path: s:
        if hasControl s && !(isContent path)
        then fail path "holds a control character, which could start a unit-file line of its own: ${builtins.toJSON s}"
        else true;
      walk = path: v:
        if builtins.isString v then text path v
        else if builtins.isAttrs v then builtins.all (n: text (path ++ [ n ]) n && walk (path ++ [ n ]) v.${n}) (builtins.attrNames v)
        else if builtins.isList v then builtins.all (i: walk (path ++ [ i ]) (builtins.elemAt v i)) (builtins.genList (i: i) (builtins.length v))
        else true;
      component = path: pattern: v:
        if v == null || (builtins.isString v && builtins.match pattern v != null) then true
        else fail path "${builtins.toJSON v} is not one path component (${pattern})";
      dirname = "[A-Za-z0-9][A-Za-z0-9._-]*";
      checked = walk [ ] recipe
        && component [ "id" ] "[a-z0-9][a-z0-9.-]*" (recipe.id or null)
        && component [ "weights" "dirname" ] dirname (recipe.weights.dirname or null)
        && component [ "store" "dirname" ] dirname (recipe.store.dirname or null)
        && builtins.all (n: component [ "files" n ] dirname n) (builtins.attrNames (recipe.files or { }));
    in
    builtins.seq checked recipe;

  # systemd expands %-specifiers in most values; a literal % is written %%.
  escapePercent = builtins.replaceStrings [ "%" ] [ "%%" ];

  # Free text for a key that has no escapes (Description=): refused if unsafe, % doubled.
  unitString = key: s: escapePercent (refuseUnsafe key s);

  # One argument of an Exec*= line. systemd splits on whitespace and honours C-style
  # double quotes and escapes; it also expands $VAR and %-specifiers, so $ and % are doubled,
  # and every control character is written as its C escape (\n, \x1b): the argument stays one
  # word on one line. Plain words stay bare so the unit reads like the shell command it came from.
  escapeArg = arg:
    let
      plain = builtins.match "[A-Za-z0-9_./:@=,+-]+" arg != null;
      quoted = builtins.replaceStrings
        ([ "\\" "\"" "%" "$" ] ++ controls)
        ([ "\\\\" "\\\"" "%%" "$$" ] ++ controlEscapes)
        arg;
    in
    if plain then arg else "\"${quoted}\"";

  commandLine = argv: builtins.concatStringsSep " " (map escapeArg argv);

  # Environment= values are not $-expanded, but %-specifiers and C escapes inside quotes are.
  # A name that is not a shell identifier is refused: systemd would drop or misread it.
  environmentLine = name: value:
    if builtins.match "[A-Za-z_][A-Za-z0-9_]*" name == null
    then throw "kiln: environment variable name ${builtins.toJSON name} is not a name (letters, digits and _, not starting with a digit)"
    else "\"" + builtins.replaceStrings
      ([ "\\" "\"" "%" ] ++ controls)
      ([ "\\\\" "\\\"" "%%" ] ++ controlEscapes)
      "${name}=${value}" + "\"";

  renderValue = v:
    if v == true then "yes"
    else if v == false then "no"
    else toString v;

  # One key: a `# why:` line when the key relaxes something, then one line per value.
  # Every value passes refuseUnsafe here as well, whoever built it: the text cannot gain a line.
  renderKey = why: key: value:
    optional (why ? ${key}) "# why: ${refuseUnsafe "${key} (its why)" why.${key}}"
    ++ map (v: "${key}=${refuseUnsafe key (renderValue v)}") (if builtins.isList value then value else [ value ]);

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
