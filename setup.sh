#!/usr/bin/env bash
# Installs what rlflow needs from Debian's packages (only what is missing) and builds it in
# ./build. Usage: bash setup.sh [extra cmake options]. Re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")"
# python3-zmq and python3-protobuf: the Python reward-program client (reward/clients/python) and
# its tests; iproute2: the test that simulates two machines (tests/test_split_machines.c, network
# namespaces); rlflow itself does not need them.
pkgs="build-essential cmake pkg-config libopenblas-openmp-dev libdnnl-dev libcjson-dev libpcre2-dev libunistring-dev\
      libzmq3-dev protobuf-c-compiler libprotobuf-c-dev openmpi-bin libopenmpi-dev\
      python3-zmq python3-protobuf iproute2"
missing=""
for p in $pkgs; do
  dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing$missing" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build build -j"$(nproc)"
