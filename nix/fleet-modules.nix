# lib.fleet: one fleet description → each host's NixOS module (for colmena, deploy-rs, nixosSystem).
#
#   kiln.lib.fleet {
#     recipe = "smollm2-135m-rpc";                # a bundled recipe's id, or a recipe file (or its attrset)
#     addresses = { head = "10.0.0.1:50052"; worker-a = "10.0.0.2:50052"; worker-b = "10.0.0.3:50052"; };
#     settings = { openFirewall = true; };        # more of services.kiln.recipes.<id>'s options, every host
#   }
#   → { head = <module>; worker-a = <module>; worker-b = <module>; }
#
# Each module imports Kiln's NixOS module and enables the recipe as that host (services.kiln.recipes.<id>.host),
# with every host's address: a machine gets only its own units, as `tool materialise --host` writes them.
# Builtins only: it evaluates wherever the flake's lib does.
{ module, recipeFiles }:
{ recipe, addresses ? { }, settings ? { } }:
let
  bundled = builtins.isString recipe && recipeFiles ? ${recipe};
  data =
    if bundled then builtins.fromJSON (builtins.readFile recipeFiles.${recipe})
    else if builtins.isAttrs recipe then recipe
    else builtins.fromJSON (builtins.readFile recipe);
  id = data.id;
  hosts = data.fleet.hosts or (throw "kiln.lib.fleet: recipe ${id} is one host (it has no fleet): enable it with services.kiln.recipes.${builtins.toJSON id}.enable = true");
  unknown = builtins.filter (n: !(hosts ? ${n})) (builtins.attrNames addresses);
in
if unknown != [ ]
then throw "kiln.lib.fleet: addresses name ${builtins.concatStringsSep ", " unknown}, not a host of ${id} (hosts: ${builtins.concatStringsSep ", " (builtins.attrNames hosts)})"
else builtins.mapAttrs
  (host: _: {
    imports = [ module ];
    services.kiln.recipes.${id} = settings // {
      enable = true;
      inherit host;
      fleetAddresses = addresses;
    } // (if bundled then { } else { inherit recipe; });
  })
  hosts
