# The tool and the engine as Python applications for nixpkgs (python3Packages), from this
# repository's one Python project. `tool plan`/`materialise` evaluate nix/lib, so the tool is
# wrapped with Nix on its PATH and KILN_NIX_LIB / KILN_RECIPES pointing at the copies in $src.
{ lib, python3Packages, nix }:
let
  src = lib.fileset.toSource {
    root = ../.;
    fileset = lib.fileset.unions [ ../pyproject.toml ../tool ../engine ../recipes ./lib ];
  };

  # pyproject.toml's [project.dependencies] and its `engine` extra, by nixpkgs attribute name.
  toolDeps = with python3Packages; [ click jsonschema rich httpx requests huggingface-hub docker nvidia-ml-py prometheus-client ];
  engineDeps = with python3Packages; [
    torch safetensors transformers accelerate gguf tokenizers jinja2 numpy fastapi uvicorn
  ];

  kilnApp = { pname, dependencies, mainProgram, imports }:
    python3Packages.buildPythonApplication {
      inherit pname src dependencies;
      version = "0.1.0";
      pyproject = true;
      build-system = [ python3Packages.setuptools ];
      makeWrapperArgs = [
        "--prefix" "PATH" ":" (lib.makeBinPath [ nix ])
        "--set-default" "KILN_NIX_LIB" "${src}/nix/lib"
        "--set-default" "KILN_RECIPES" "${src}/recipes"
      ];
      pythonImportsCheck = imports;
      # The test suite needs Docker, systemd-analyze and the network-free model fixtures: run it from the repo.
      doCheck = false;
      meta = {
        description = "Kiln: recipes to pinned, verified local LLM deployments";
        platforms = lib.platforms.linux;
        inherit mainProgram;
      };
    };
in
{
  tool = kilnApp { pname = "kiln-tool"; dependencies = toolDeps; mainProgram = "tool"; imports = [ "tool" ]; };
  engine = kilnApp { pname = "kiln-engine"; dependencies = toolDeps ++ engineDeps; mainProgram = "engine"; imports = [ "engine" ]; };
}
