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
#        device call may not hold all three), PG_TEST_FILES (the default target's test files,
#        default "." = all; the whole suite no longer fits one call: "part1" ... "part4"
#        split it over four, part1 being every test_*.py the others do not name),
#        PG_PYTEST_TIMEOUT (default 540 s, 300 under forced targets), PG_BENCH_ARGS (e.g.
#        --quick), PG_GPU_PYTHON, PG_TREE_COMMIT (the working tree's commit, for the check
#        below where the device's copy has no .git)
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

# The tests are the working tree's, the binaries the wheel's: a test newer than the wheel
# fails by design (run 132). Say so up front when the two differ ("-dirty": uncommitted
# changes, as `portable_gemm info` writes it; "unknown": no manifest, or a build outside git).
wheel_src=$($PY - "$WHEEL" <<'PYEOF'
import json, sys, zipfile
try:
    with zipfile.ZipFile(sys.argv[1]) as z:
        src = json.loads(z.read("portable_gemm/lib/manifest.json")).get("source") or {}
except (OSError, KeyError, ValueError, zipfile.BadZipFile):
    src = {}
print((src.get("commit") or "unknown") + ("-dirty" if src.get("dirty") else ""))
PYEOF
)
wheel_src=${wheel_src:-unknown}
if [ -n "${PG_TREE_COMMIT:-}" ]; then
  tree_src=$PG_TREE_COMMIT
elif tree_src=$(git rev-parse --short HEAD 2>/dev/null); then
  [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && tree_src+=-dirty
else
  tree_src=unknown
fi
if [[ "$tree_src" == unknown* || "$wheel_src" == unknown* ]]; then
  note "source: wheel $wheel_src, tree $tree_src (set PG_TREE_COMMIT to compare)"
elif n=$(( ${#tree_src} < ${#wheel_src} ? ${#tree_src} : ${#wheel_src} ));
     [[ $n -lt 7 || "$wheel_src$tree_src" == *-dirty* || "${tree_src:0:n}" != "${wheel_src:0:n}" ]]; then
  note "WARNING source: wheel $wheel_src, tests from tree $tree_src: tests newer than the wheel may fail by design"
else
  note "source: wheel and tree at $wheel_src"
fi
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
(cd /tmp && $PY -m portable_gemm info) | tee "$OUT/info.txt"

want() { [[ " $STEPS " == *" $1 "* || " $STEPS " == *" all "* ]]; }

if want demo; then
  (cd /tmp && timeout 120 $PY -m portable_gemm demo > "$OUT/demo.txt" 2>&1)
  note "demo: exit $?; $(tail -1 "$OUT/demo.txt")"
  tail -9 "$OUT/demo.txt"
fi

if want tests; then
  # The default target's test files: the full suite, or a part of it (PG_TEST_FILES);
  # forced targets run the GPU-relevant files (below).
  # Measured under target 2.11 (bench/GPU_NOTES.md): part1 215 s, part2 under 216 s, part4
  # 291 s (runs 137-140, an H100); part3 230 s (run 135, an H200).
  parts=([2]="test_targets.py test_select_variant.py test_symbol_audit.py test_ci_config.py test_repo.py"
         [3]="test_torch_integration.py test_vendor.py"
         [4]="test_cpp_consumer.py test_sdist.py")
  case ${PG_TEST_FILES:-.} in
    part1) default_files=(); for f in tests/test_*.py; do
             f=${f#tests/}; [[ " ${parts[*]} " == *" $f "* ]] || default_files+=("$f"); done ;;
    part[234]) read -ra default_files <<< "${parts[${PG_TEST_FILES#part}]}" ;;
    *) # shellcheck disable=SC2206  # a list of files, word-split on purpose
       default_files=(${PG_TEST_FILES:-.}) ;;
  esac
  for target in ${PG_TARGETS:-default 2.10 2.9}; do
    env=()
    [ "$target" != default ] && env=("PORTABLE_GEMM_TARGET=$target")
    log="$OUT/pytest_${target}.log"
    files=("${default_files[@]}")
    # (the AOTInductor test compiles two packages, ~80 s: once, under the machine's own target;
    # --deselect takes node ids from the rootdir, the repository root)
    [ "$target" != default ] && files=(test_cuda.py test_gemm.py test_mixed_linear.py test_torch_integration.py test_bad_input.py
                                        --deselect tests/test_torch_integration.py::test_aot_inductor_package_calls_the_ops)
    kexpr=()
    [ -n "${PG_PYTEST_K:-}" ] && kexpr=(-k "$PG_PYTEST_K")
    # (the default run has the AOTInductor tests too: ~190 s of suite and ~150 s of packages, run 105)
    # shellcheck disable=SC2086  # PG_PYTEST_EXTRA: extra pytest arguments, word-split on purpose
    (cd tests && env "${env[@]}" timeout "${PG_PYTEST_TIMEOUT:-$([ "$target" = default ] && echo 540 || echo 300)}" $PY -m pytest -q -p no:cacheprovider "${files[@]}" "${kexpr[@]}" ${PG_PYTEST_EXTRA:-} > "$log" 2>&1)
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
