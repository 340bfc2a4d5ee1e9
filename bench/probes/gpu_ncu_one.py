"""One small-M case called a few times in a warm process, for Nsight Compute to profile one
launch of it (weights rotated past L2 as in gpu_ab.py):

    ncu --kernel-name regex:gemv_tc --launch-skip 3 --launch-count 1 \
        --section Occupancy --section LaunchStats python bench/probes/gpu_ncu_one.py 8192 8192 4 128 16
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_ab import case_inputs  # noqa: E402


def main() -> int:
    k, n, bits, g, m = (int(a) for a in sys.argv[1:6])
    dtype = torch.float16 if len(sys.argv) > 6 and sys.argv[6] == "f16" else torch.bfloat16
    import portable_gemm as pg

    x, _, _, qs, _ = case_inputs(k, n, bits, g, m, dtype)
    for i in range(6):
        q, s = qs[i % len(qs)]
        pg.mixed_linear(x, q, s, bits=bits, group_size=g or None)
    torch.cuda.synchronize()
    print("ok", k, n, bits, g, m, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
