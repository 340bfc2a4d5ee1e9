#!/usr/bin/env bash
# The A/B of avx512_fma_prefetch.patch (bench/CPU_NOTES.md 52) in two steps, for a session
# that has an AVX-512 CPU with AMX (the 2-core Xeon VM kind, or the device tool's H200 host
# CPU-only).
#
#   bash bench/probes/avx512_fma_prefetch_ab.sh build        # here: build/pfab/{libpf0..3.so,ab}
#   bash bench/probes/avx512_fma_prefetch_ab.sh run [ROT_MB]  # there (carry build/pfab)
#
# `build` applies the patch to a scratch copy of the kernel sources (the tree is left as it
# is) and builds one library per PGX_PF_MODE plus the one-process A/B driver. `run` needs
# no compiler. ROT_MB: the weight rotation in MiB, at least twice the last-level cache
# (default 640, for the H200 host's 300 MB of L3; 960 on the Xeon VM kind's 480 MB).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=build/pfab
case "${1:-}" in
  build)
    src=$(mktemp -d)
    trap 'rm -rf "$src"' EXIT
    cp -r src include "$src/"
    (cd "$src" && git apply "$OLDPWD/bench/probes/avx512_fma_prefetch.patch")
    mkdir -p "$OUT"
    for mode in 0 1 2 3; do
      g++ -O3 -std=c++17 -fPIC -shared -I"$src/include" -I"$src/src/kernels" -DPG_VERSION='"ab"' \
        -DPG_CXX_COMPILER='"g++"' -DPGX_PF_MODE=$mode "$src"/src/kernels/common/*.cpp \
        "$src"/src/kernels/cpu/*.cpp "$src"/src/kernels/cuda/unavailable.cpp -lpthread -o "$OUT/libpf$mode.so" &
    done
    wait
    g++ -O2 -std=c++17 -Iinclude -Ibench/probes bench/probes/kernel_mixed_linear_ab.cpp -ldl -lpthread -o "$OUT/ab"
    ls -l "$OUT"
    ;;
  run)
    export PGX_ROT_MB=${2:-640}
    grep -m1 "model name" /proc/cpuinfo || true
    L=$OUT
    # M bits group N K: int4 g128 at M = 4 is the row that motivates it (8.4 GB/s at K = 4096
    # against 13.2 at K = 8192 on the Xeon VM, 76e2888's table); int8 at M = 2 and 4 takes
    # the same blocks on AMX CPUs; M = 1 compares mode 3 with the shipped 512 bytes ahead.
    for c in "4 4 128 4096 4096" "4 4 128 12288 4096" "4 4 128 8192 8192" \
             "4 8 0 4096 4096" "2 8 0 12288 4096" "4 8 0 8192 8192"; do
      set -- $c
      "$L/ab" "$1" "$4" "$5" "$3" "$2" 2 8 40 "$L/libpf0.so" "$L/libpf1.so" "$L/libpf2.so" | tail -4
    done
    for c in "1 8 0 4096 4096" "1 4 128 4096 4096"; do
      set -- $c
      "$L/ab" "$1" "$4" "$5" "$3" "$2" 2 8 60 "$L/libpf0.so" "$L/libpf3.so" | tail -3
    done
    ;;
  *) sed -n 2,12p "$0"; exit 2 ;;
esac
