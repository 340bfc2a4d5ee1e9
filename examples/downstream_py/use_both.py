"""Import the real package and the vendored copy in one process; both work, each in its own
torch.ops namespace."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mylib  # noqa: E402
import portable_gemm as pg  # noqa: E402

x, w, b = torch.randn(4, 64), torch.randn(64, 32), torch.randn(32)
ours = mylib.fused_linear(x, w, b)
theirs = pg.gemm(x, w, bias=b, activation="silu")
assert torch.equal(ours, theirs)
print("vendored namespace:", mylib._gemm.info()["namespace"], "| real:", pg.info()["namespace"])
print("torch.ops.mylib_gemm.gemm and torch.ops.portable_gemm.gemm agree bit for bit")
