#!/usr/bin/env bash
# ASan + UBSan run of the CPU test suite.
#
#   bash ci/sanitize.sh                 build, install privately, run the CPU tests
#   bash ci/sanitize.sh -k fuzz -x      extra arguments go to pytest (replacing the default
#                                       selection of test files, see PYTEST_DEFAULT below)
#
# What it does:
#   1. builds the kernel library, the five CPU bindings and the DLPack module with
#      -fsanitize=address,undefined -fno-omit-frame-pointer (CUDA off) into build/asan/
#      (scikit-build-core build dir build/asan/cmake, wheel in build/asan/dist). The flags
#      go in through CMAKE_CXX_FLAGS / CMAKE_{SHARED,MODULE}_LINKER_FLAGS: CMakeLists.txt
#      needs no sanitizer option;
#   2. unpacks that wheel into build/asan/site (put first on PYTHONPATH, so the tests and
#      every subprocess they start import the instrumented copy, not the venv's wheel);
#   3. runs pytest from tests/ with libasan (+ libstdc++) preloaded (python itself is not
#      instrumented)
#      and every ASan / UBSan report written to build/asan/reports/;
#   4. fails (exit 1) when pytest fails OR any sanitizer report was written, by any process
#      (subprocess tests included), and prints the reports.
#
# Environment: PG_VENV (default .venv: a python with torch==2.13.0, scikit-build-core,
# nanobind, ninja, pytest, numpy, hypothesis; created/filled like ci/dev.sh when missing),
# PG_PYTHON (default python3.11 or python3), PG_SANITIZE_SKIP_BUILD=1 reuses build/asan/site,
# PG_SANITIZE_HALT=0 lets UBSan report and continue (the run still fails at the end).
#
# Deselected by default: test_symbol_audit.py (compiles and audits throw-away bindings with
# the system compiler: a toolchain test, no portable_gemm code runs), test_sdist.py (builds
# the sdist and a wheel from it: pip, CMake and the compiler would run under the preloaded
# ASan) and gpu tests.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${PG_VENV:-$ROOT/.venv}
PY_BOOT=${PG_PYTHON:-$(command -v python3.11 || command -v python3)}
OUT=$ROOT/build/asan
SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -g"

log() { printf '\n==> %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PY_BOOT" -m venv "$VENV"
fi
PY=$VENV/bin/python
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  "$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
# (pipefail keeps pip's status; its stderr, less this machine's "WARNING: Location" lines, stays on stderr)
"$PY" -c "import scikit_build_core, nanobind, pytest, numpy, hypothesis" 2>/dev/null ||
  { "$PY" -m pip install -q --disable-pip-version-check "scikit-build-core>=0.11" "nanobind>=2.4" \
      "cmake>=3.24" ninja pytest numpy hypothesis expecttest 2>&1 1>&3 |
      { grep -v "^WARNING: Location" || true; } >&2; } 3>&1

LIBASAN=$(gcc -print-file-name=libasan.so)
LIBSTDCXX=$(gcc -print-file-name=libstdc++.so.6)
if [ ! -e "$LIBASAN" ] || [ "$LIBASAN" = libasan.so ]; then
  echo "sanitize: libasan.so not found (gcc -print-file-name=libasan.so); install gcc's libasan" >&2
  exit 2
fi

if [ "${PG_SANITIZE_SKIP_BUILD:-0}" != 1 ] || [ ! -d "$OUT/site/portable_gemm" ]; then
  log "building with $SAN (log: $OUT/build.log)"
  mkdir -p "$OUT"
  rm -rf "$OUT/dist"
  t0=$SECONDS
  set +e
  CMAKE_ARGS="-DPORTABLE_GEMM_CUDA=OFF" "$PY" -m pip wheel . --no-build-isolation --no-deps -w "$OUT/dist" -v \
    -Cbuild-dir="$OUT/cmake" \
    -Ccmake.build-type=RelWithDebInfo \
    -Ccmake.define.CMAKE_C_FLAGS="$SAN" \
    -Ccmake.define.CMAKE_CXX_FLAGS="$SAN" \
    -Ccmake.define.CMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" \
    -Ccmake.define.CMAKE_MODULE_LINKER_FLAGS="-fsanitize=address,undefined" \
    -Ccmake.define.CMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
    >"$OUT/build.log" 2>&1
  rc=$?
  set -e
  if [ $rc != 0 ]; then tail -40 "$OUT/build.log"; echo "sanitize: build failed (log: $OUT/build.log)" >&2; exit 1; fi
  rm -rf "$OUT/site"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$OUT/site" "$OUT"/dist/portable_gemm-*.whl
  log "built in $((SECONDS - t0)) s"
fi
# The instrumented copy really is instrumented (a plain build would make this run vacuous).
for so in "$OUT"/site/portable_gemm/lib/*.so "$OUT"/site/portable_gemm/_dlpack*.so; do
  syms=$(nm -D "$so")  # (not piped into grep -q: with pipefail, nm's SIGPIPE would fail the check)
  case "$syms" in
    *__asan_init*) ;;
    *) echo "sanitize: $so has no ASan instrumentation" >&2; exit 1 ;;
  esac
done

REPORTS=$OUT/reports
HALT=${PG_SANITIZE_HALT:-1}   # 0: keep going after a UBSan report (to see them all); still fails
rm -rf "$REPORTS"
mkdir -p "$REPORTS"
if [ $# -gt 0 ]; then
  PYTEST_ARGS=("$@")
else
  PYTEST_DEFAULT=(-m "not gpu" --ignore=test_symbol_audit.py --ignore=test_sdist.py)
  PYTEST_ARGS=("${PYTEST_DEFAULT[@]}")
fi

log "pytest under ASan+UBSan: ${PYTEST_ARGS[*]}"
set +e
(
  cd tests
  export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
  # libstdc++ preloaded too: python does not link it, so without it ASan's __cxa_throw
  # interceptor finds no real __cxa_throw at start-up and the first C++ exception aborts
  # ("CHECK failed: asan_interceptors.cpp ... real___cxa_throw").
  export LD_PRELOAD="$LIBASAN $LIBSTDCXX"
  # detect_leaks=0: CPython and torch keep allocations until exit on purpose.
  # halt_on_error / exitcode: the first report ends that process with status 86.
  # handle_sigbus=0: tests/test_faults.py dlopens a truncated binding on purpose (SIGBUS in
  # the dynamic loader, checked by that test as a crash); a SIGBUS elsewhere still kills
  # the process and fails its test.
  export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:exitcode=86:abort_on_error=0:strict_init_order=1:check_initialization_order=1:detect_stack_use_after_return=0:handle_sigbus=0:log_path=$REPORTS/asan"
  # UBSan ignores log_path when its runtime sits beside a preloaded libasan: its reports go
  # to stderr, so the run's output is kept and searched too (below).
  export UBSAN_OPTIONS="halt_on_error=$HALT:print_stacktrace=1:exitcode=87:log_path=$REPORTS/ubsan"
  # --capture=sys: pytest captures Python's own streams only, so a report the runtime writes
  # to fd 2 reaches this output even when halt_on_error ends the process inside a test (with
  # fd capture it died in pytest's buffer, unseen: "exit 87, 0 reports").
  "$PY" -m pytest -q -p no:cacheprovider --capture=sys "${PYTEST_ARGS[@]}" 2>&1 | tee "$REPORTS/pytest.out"
  exit "${PIPESTATUS[0]}"
)
rc=$?
set -e

# reports written to files by any process, plus any that reached the run's own output
inline=$(grep -cE "runtime error:|ERROR: AddressSanitizer|AddressSanitizer: CHECK failed|UndefinedBehaviorSanitizer" \
  "$REPORTS/pytest.out" || true)
mv "$REPORTS/pytest.out" "$OUT/pytest.out"
if [ "$inline" -gt 0 ]; then
  log "$inline sanitizer report line(s) in the pytest output ($OUT/pytest.out):"
  grep -nE -A12 "runtime error:|ERROR: AddressSanitizer|AddressSanitizer: CHECK failed" "$OUT/pytest.out" | head -80
fi
nreports=$(( $(find "$REPORTS" -type f | wc -l) + inline ))
if [ "$(find "$REPORTS" -type f | wc -l)" -gt 0 ]; then
  log "sanitizer report file(s):"
  for f in "$REPORTS"/*; do echo "--- $f"; head -60 "$f"; done
fi
if [ $rc != 0 ] || [ "$nreports" -gt 0 ]; then
  echo "sanitize: FAILED (pytest exit $rc, $nreports sanitizer report(s) in $REPORTS)" >&2
  exit 1
fi
echo "sanitize: OK (pytest passed, no ASan/UBSan report)"
