#!/usr/bin/env bash
# Target 2.13 (Stream::nativeHandle) on the GPU machine, whose own torch is 2.11: the last
# call of the chunked procedure (bench/GPU_NOTES.md, run 50c; last used in run 97). Earlier
# calls appended the chunks of both.bin (the torch 2.13.0 cp312 wheel, then a tar.gz of
# NCCL's nvidia/nccl folder and dist-info) to $CHUNKS/both.bin. This reassembles and checks them, installs torch, NCCL and
# the project's wheel into /tmp/t213 (the image's torch stays), runs the GPU-relevant tests
# under target 2.13, and times target 2.11 (the aoti_torch_get_current_cuda_stream shim)
# against 2.13 under that torch (bench/gpu_bench.py --targets-only). Logs go to $OUT.
#   usage: bash ci/gpu_torch213.sh WHEEL SHA256_OF_BOTH TORCH_WHEEL_BYTES [ROUNDS]
set -uo pipefail
# shellcheck source=ci/gpu_common.sh
. "$(dirname "$0")/gpu_common.sh"
WHEEL=$1 SHA=$2 TORCH_BYTES=$3 ROUNDS=${4:-11}
CHUNKS=${CHUNKS:-/tmp/t213c}
OUT=${OUT:-/tmp/pg_out}
T=/tmp/t213
mkdir -p "$OUT" "$T"
fail() { echo "gpu_torch213: $*" | tee -a "$OUT/summary.txt"; exit 1; }

got=$(sha256sum "$CHUNKS/both.bin" | cut -d' ' -f1)
[ "$got" = "$SHA" ] || fail "both.bin sha256 $got, expected $SHA ($(stat -c %s "$CHUNKS/both.bin") bytes)"
head -c "$TORCH_BYTES" "$CHUNKS/both.bin" > "$CHUNKS/torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl"
tail -c +"$((TORCH_BYTES + 1))" "$CHUNKS/both.bin" | tar xzf - -C "$T" || fail "NCCL archive did not unpack"
$PY -m pip install -q --no-deps --target "$T" "$CHUNKS"/torch-2.13.0-*.whl "$WHEEL" 2>&1 | tail -2
# torch's CUDA libraries find their NVIDIA dependencies through RUNPATHs ($ORIGIN/../../nvidia/...),
# i.e. in $T/nvidia, which has only NCCL: the image's other packages (cu13, cudnn, cusparselt,
# nvshmem) are linked in. Python finds them on sys.path anyway; a C++ program linked
# against libtorch_cuda (test_cpp_consumer.py) does not (run 108).
SITE=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
for d in "$SITE"/nvidia/*; do [ -e "$T/nvidia/$(basename "$d")" ] || ln -s "$d" "$T/nvidia/"; done
export PYTHONPATH=$T
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" \
  | tee "$OUT/torch.txt"
(cd /tmp && $PY -m portable_gemm info) | tee "$OUT/info_t213.txt"
grep -q "Stream::nativeHandle" "$OUT/info_t213.txt" || fail "target 2.13 did not load (see info_t213.txt)"

(cd tests && timeout 420 $PY -m pytest -q -rs -p no:cacheprovider test_cuda.py test_gemm.py test_mixed_linear.py \
  test_torch_integration.py test_bad_input.py test_cpp_consumer.py > "$OUT/pytest_t213.log" 2>&1)
echo "pytest target=2.13 (torch 2.13): exit $?; $(tail -1 "$OUT/pytest_t213.log")" | tee -a "$OUT/summary.txt"

timeout 300 $PY bench/gpu_bench.py --targets-only "$OUT/gpu_stream_branch_torch213.json" --compare-target 2.11 \
  --target-rounds "$ROUNDS" > "$OUT/stream_branch.log" 2>&1
echo "stream branch (2.11 / 2.13, $ROUNDS rounds): exit $?; $(tail -3 "$OUT/stream_branch.log" | tr '\n' ' ')" \
  | tee -a "$OUT/summary.txt"
