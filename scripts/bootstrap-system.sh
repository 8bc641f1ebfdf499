#!/usr/bin/env bash
# Install the system parts Kiln's tests use for real (not doubles): Nix for the compiler,
# systemd-analyze for unit verification, a Docker engine + local registry for container tests, and a
# C++ toolchain for llama.cpp (scripts/build-llama-cpp.sh: the real peer server the check tests run).
# Debian/Ubuntu only, and only as root; elsewhere it says what is missing and goes on.
set -euo pipefail
need=()
command -v nix-instantiate >/dev/null || need+=(nix-bin)
command -v systemd-analyze >/dev/null || need+=(systemd)
command -v dockerd >/dev/null || need+=(docker.io)
command -v docker-registry >/dev/null || need+=(docker-registry)
[ -x /bin/busybox ] || need+=(busybox-static)
command -v cmake >/dev/null || need+=(cmake)
command -v c++ >/dev/null || need+=(g++)
command -v ninja >/dev/null || need+=(ninja-build)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "kiln: not installing ${need[*]} (needs root and apt-get); tests that need them will say so" >&2
  exit 0
fi
echo "kiln: installing ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
