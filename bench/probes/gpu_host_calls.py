"""Host time per call of one tiny weight-only call on the GPU, by the way it is called (run 79e).

int4 g128 at M = 1 on a 4096^2 weight takes ~6 us on the H200, so loops of these calls are
host-bound: the time per call is the host's. Measured next to bf16 F.linear on the same
weight and a bare torch.empty, 3 rounds of 5000 calls each (300 to warm up), one sync per loop:
    python bench/probes/gpu_host_calls.py [--no-dlpack] [--rounds R]
--no-dlpack leaves out the DLPack door (its nanobind module is built for one Python; run 80
ran two wheels' torch paths, unpacked, side by side without it).
"""

import argparse
import time

import torch

import portable_gemm as pg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-dlpack", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    w = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    q, s = pg.quantize_weight(w, bits=4, group_size=128)
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
    op = torch.ops.portable_gemm.mixed_linear.default
    stream = torch.cuda.current_stream().cuda_stream

    def below_autograd():
        with torch._C._AutoDispatchBelowAutograd():
            return op(x, q, s, 4, 128, None, 0)

    cases = {
        "pg.mixed_linear": lambda: pg.mixed_linear(x, q, s, bits=4, group_size=128),
        "op below autograd": below_autograd,
        "torch.ops op (autograd key)": lambda: op(x, q, s, 4, 128, None, 0),
        "F.linear bf16 4096^2": lambda: torch.nn.functional.linear(x, w),
        "torch.empty": lambda: torch.empty((1, 4096), dtype=torch.bfloat16, device="cuda"),
    }
    if not args.no_dlpack:
        from portable_gemm import dlpack
        cases["dlpack door (fresh output)"] = lambda: dlpack.mixed_linear(x, q, s, 4, group_size=128, stream=stream)
    for rnd in range(args.rounds):
        for name, f in cases.items():
            for _ in range(300):
                f()
            torch.cuda.synchronize()
            n = 5000
            t = time.perf_counter()
            for _ in range(n):
                f()
            torch.cuda.synchronize()
            print(f"round {rnd} {name:28s} {(time.perf_counter() - t) / n * 1e6:6.2f} us/call", flush=True)


if __name__ == "__main__":
    main()
