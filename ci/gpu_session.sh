#!/usr/bin/env bash
# The whole GPU session in one device call (README, "Developer commands"): install the
# carried wheel with --no-deps into the machine's python (torch 2.11 cu130 there), then the
# GPU test suite under the default target (2.11) and forced 2.10 and 2.9, compute-sanitizer
# (memcheck, racecheck, initcheck) over tests/gpu/sanitize_ops.py, the README's main job
# (`python -m portable_gemm demo`, CPU and CUDA), and optionally the GPU benchmark. Logs go
# to $OUT (the device tool brings them back); a summary is printed last.
#   usage: bash ci/gpu_session.sh WHEEL [demo|tests|sanitize|bench|all]...
#   env: PG_PYTEST_EXTRA (extra pytest args, split on spaces), PG_PYTEST_K (a -k expression,
#        kept whole: "a or b"), PG_TARGETS (the test runs, default "default 2.10 2.9": one
#        device call may not hold all three), PG_BENCH_ARGS (e.g. --quick), PG_GPU_PYTHON
set -uo pipefail
# shellcheck source=ci/gpu_common.sh
. "$(dirname "$0")/gpu_common.sh"
WHEEL=$1; shift
STEPS=${*:-all}
OUT=${OUT:-/tmp/pg_out}
mkdir -p "$OUT"
summary=()
note() { summary+=("$*"); echo "== $*"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
$PY -m pip install -q --no-deps --force-reinstall "$WHEEL" 2>&1 | tail -2
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
(cd /tmp && $PY -m portable_gemm info) | tee "$OUT/info.txt"

want() { [[ " $STEPS " == *" $1 "* || " $STEPS " == *" all "* ]]; }

if want demo; then
  (cd /tmp && timeout 120 $PY -m portable_gemm demo > "$OUT/demo.txt" 2>&1)
  note "demo: exit $?; $(tail -1 "$OUT/demo.txt")"
  tail -9 "$OUT/demo.txt"
fi

if want tests; then
  for target in ${PG_TARGETS:-default 2.10 2.9}; do
    env=()
    [ "$target" != default ] && env=("PORTABLE_GEMM_TARGET=$target")
    log="$OUT/pytest_${target}.log"
    # full suite under the machine's own target; the GPU-relevant files under forced targets
    files=(.)
    # (the AOTInductor test compiles two packages, ~80 s: once, under the machine's own target;
    # --deselect takes node ids from the rootdir, the repository root)
    [ "$target" != default ] && files=(test_cuda.py test_gemm.py test_mixed_linear.py test_torch_integration.py test_bad_input.py
                                        --deselect tests/test_torch_integration.py::test_aot_inductor_package_calls_the_ops)
    kexpr=()
    [ -n "${PG_PYTEST_K:-}" ] && kexpr=(-k "$PG_PYTEST_K")
    # (the default run has the AOTInductor tests too: ~190 s of suite and ~150 s of packages, run 105)
    # shellcheck disable=SC2086  # PG_PYTEST_EXTRA: extra pytest arguments, word-split on purpose
    (cd tests && env "${env[@]}" timeout "$([ "$target" = default ] && echo 540 || echo 300)" $PY -m pytest -q -p no:cacheprovider "${files[@]}" "${kexpr[@]}" ${PG_PYTEST_EXTRA:-} > "$log" 2>&1)
    note "pytest target=$target: $(tail -1 "$log")"
  done
fi

if want sanitize; then
  for tool in memcheck racecheck initcheck; do
    log="$OUT/sanitizer_${tool}.log"
    # initcheck does not see TMA stores (cp.async.bulk): every read of an output written only
    # by an sm_90 CUTLASS or cuBLAS kernel is reported. It checks the portable kernels: sm_90
    # ones off, no dequantise + cuBLAS calls; memcheck and racecheck cover every path
    # (bench/GPU_NOTES.md, run 21).
    env=() args=()
    [ $tool = initcheck ] && env=(PORTABLE_GEMM_DISABLE_SM90=1) args=(--initcheck)
    (cd tests && env "${env[@]}" timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 $PY gpu/sanitize_ops.py "${args[@]}" > "$log" 2>&1)
    rc=$?
    note "compute-sanitizer $tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize_ops:' "$log" | tr '\n' ' ')"
  done
fi

if want bench; then
  (timeout 560 $PY bench/gpu_bench.py ${PG_BENCH_ARGS:-} --out "$OUT" > "$OUT/bench.log" 2>&1)
  note "gpu bench: exit $?; table in bench.log"
  tail -60 "$OUT/bench.log"
fi

echo; echo "==== summary"; printf '%s\n' "${summary[@]}"
