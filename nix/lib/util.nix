# Small list/attrset helpers. nix/lib uses builtins only (no nixpkgs) so that it
# evaluates offline, on Nix 2.8, from `nix-instantiate` as well as from the flake.
rec {
  optional = cond: x: if cond then [ x ] else [ ];
  optionals = cond: xs: if cond then xs else [ ];

  # Options arrive as JSON, where an absent key and `null` mean the same thing: "use the default".
  orDefault = value: default: if value == null then default else value;
  get = attrs: name: default: orDefault (attrs.${name} or null) default;

  mapAttrsToList = f: set: map (name: f name set.${name}) (builtins.attrNames set);

  filterAttrs = pred: set: builtins.listToAttrs (builtins.concatMap
    (name: optional (pred name set.${name}) { inherit name; value = set.${name}; })
    (builtins.attrNames set));

  # Drop null-valued keys, so "not set" never reaches a unit file or an argv.
  compact = filterAttrs (_: v: v != null);

  hasPrefix = prefix: s: builtins.substring 0 (builtins.stringLength prefix) s == prefix;
  hasSuffix = suffix: s:
    let ls = builtins.stringLength s; lx = builtins.stringLength suffix;
    in lx <= ls && builtins.substring (ls - lx) lx s == suffix;
  removePrefix = prefix: s:
    if hasPrefix prefix s
    then builtins.substring (builtins.stringLength prefix) (builtins.stringLength s) s
    else s;
  hasInfix = infix: s: builtins.length (builtins.split (escapeRegex infix) s) > 1;
  escapeRegex = builtins.replaceStrings
    [ "\\" "[" "]" "{" "}" "(" ")" "." "*" "+" "?" "^" "$" "|" ]
    [ "\\\\" "\\[" "\\]" "\\{" "\\}" "\\(" "\\)" "\\." "\\*" "\\+" "\\?" "\\^" "\\$" "\\|" ];

  # Position of each element, for ordering keys by a fixed list.
  indexOf = list: builtins.listToAttrs
    (builtins.genList (i: { name = builtins.elemAt list i; value = i; }) (builtins.length list));

  unique = list: builtins.foldl' (acc: x: if builtins.elem x acc then acc else acc ++ [ x ]) [ ] list;
}
