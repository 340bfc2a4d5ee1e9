"""Example downstream library: a linear layer on a vendored copy of portable_gemm."""

import torch

from . import _gemm  # the vendored copy (created by `python -m portable_gemm vendor`)


def fused_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """act(x @ weight_t + bias) with SiLU, on the vendored kernels."""
    return _gemm.gemm(x, weight_t, bias=bias, activation="silu")
