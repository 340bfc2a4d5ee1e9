#!/usr/bin/env bash
# Sourced by ci/gpu_session.sh and ci/gpu_torch213.sh: what every run on the lent GPU machines sets.
export PYTHONUNBUFFERED=1
# shellcheck disable=SC2034  # PY: read by the scripts that source this
PY=${PG_GPU_PYTHON:-python3}
# AOTInductor packages built through these machines' CXX (a wrapper script around g++ 13)
# crash at load, torch's own too; the system g++ builds working ones (bench/GPU_NOTES.md,
# runs 101-103). The AOTInductor tests (tests/aoti_check.py, test_cpp_consumer.py) take it from this.
if [ -z "${PG_TEST_AOTI_CXX:-}" ] && [ -x /usr/bin/g++ ]; then export PG_TEST_AOTI_CXX=/usr/bin/g++; fi
