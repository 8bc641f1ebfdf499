# Read every recipe file under a directory: { <id> = recipe; }. Used by the flake
# (lib.plans, packages, apps) and the NixOS module to find a recipe by its id.
{ util }:
let
  isRecipeFile = name: util.hasSuffix ".json" name && name != "schema.json";

  filesUnder = dir:
    let entries = builtins.readDir dir; in
    builtins.concatLists (util.mapAttrsToList
      (name: kind:
        if kind == "directory" then filesUnder (dir + "/${name}")
        else if kind == "regular" && isRecipeFile name then [ (dir + "/${name}") ]
        else [ ])
      entries);
in
rec {
  # { <id> = the file; } (the NixOS module hands a recipe's own file to the tool).
  recipeFilesIn = dir: builtins.listToAttrs (map
    (file: { name = (builtins.fromJSON (builtins.readFile file)).id; value = file; })
    (filesUnder dir));

  recipesIn = dir: builtins.mapAttrs (_: file: builtins.fromJSON (builtins.readFile file)) (recipeFilesIn dir);
}
