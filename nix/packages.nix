# The tool and the engine as Python applications for nixpkgs (python3Packages), from this
# repository's one Python project. `tool plan`/`materialise` evaluate nix/lib, so the tool is
# wrapped with Nix on its PATH and KILN_NIX_LIB / KILN_RECIPES pointing at the copies in $src.
# Each package builds only its own Python package and console script (postPatch drops the
# other's), so both install side by side in one profile: no file is in both. The engine imports
# nothing of the tool's. Dependencies are pyproject.toml's, whose ranges admit nixpkgs' versions
# (tests/test_flake.py applies pythonRuntimeDepsCheck's rule to tests/fixtures/nixpkgs-python-versions.json).
# gcc: the engine builds its CPU kernels (engine/kernels/native_cpu.cpp) with it once per machine, at first use
# (-march=native: a build-time binary would fit the builder's CPU, not the user's); without it, torch's kernels.
{ lib, python3Packages, nix, gcc ? null }:
let
  src = lib.fileset.toSource {
    root = ../.;
    fileset = lib.fileset.unions [ ../pyproject.toml ../tool ../engine ../recipes ./lib ];
  };

  # pyproject.toml's [project.dependencies] and its `engine` extra, by nixpkgs attribute name.
  toolDeps = with python3Packages; [ click jsonschema rich requests huggingface-hub docker nvidia-ml-py prometheus-client ];
  engineDeps = with python3Packages; [
    torch safetensors transformers accelerate gguf tokenizers jinja2 numpy fastapi uvicorn
  ];

  # Keep one of the project's two Python packages and its console script.
  only = keep: drop: ''
    rm -r ${drop}
    sed -i '/^${drop} = "${drop}.cli:entry"$/d' pyproject.toml
  '';

  kilnApp = { pname, dependencies, mainProgram, imports, postPatch, path ? [ ] }:
    python3Packages.buildPythonApplication {
      inherit pname src dependencies postPatch;
      version = "0.1.0";
      pyproject = true;
      build-system = [ python3Packages.setuptools ];
      makeWrapperArgs = [
        "--prefix" "PATH" ":" (lib.makeBinPath ([ nix ] ++ path))
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
  tool = kilnApp {
    pname = "kiln-tool"; dependencies = toolDeps; mainProgram = "tool"; imports = [ "tool" ];
    postPatch = only "tool" "engine";
  };
  # The wheel's Requires-Dist holds the project's base dependencies too; pythonRuntimeDepsCheck wants them.
  engine = kilnApp {
    pname = "kiln-engine"; dependencies = toolDeps ++ engineDeps; mainProgram = "engine"; imports = [ "engine" ];
    postPatch = only "engine" "tool"; path = lib.optional (gcc != null) gcc;
  };
}
