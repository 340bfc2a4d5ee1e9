"""Drop-in modules built on the ops."""

from __future__ import annotations

import torch

from .ops import _group_code, mixed_linear, quantize_weight

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class QuantizedLinear(torch.nn.Module):
    """nn.Linear with an int8 / int4 weight (symmetric, per channel or per group) and
    activations in fp16 / bf16 / fp32. The quantised weight and scales are buffers, so the
    state_dict round-trips and `.to(device)` moves them.

    The constructor makes an empty layer (zero weight) to load a state_dict into; `dtype`,
    bf16 unless given, is the scales' and bias' dtype. `from_linear` quantises an existing
    `nn.Linear` and keeps its dtype unless given one. `group_size` (128 unless given; None:
    one scale per output channel) must divide in_features, and int4 needs an even
    in_features: `from_linear(nn.Linear(1000, n))` fails with the default group size, so
    pass a divisor of 1000 or None."""

    def __init__(self, in_features: int, out_features: int, *, bits: int = 4,
                 group_size: int | None = 128, bias: bool = True,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits!r}")
        group_size = _group_code(group_size) or None
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16 (the "
                             f"activations' dtype), got {dtype!r}")
        if group_size is not None and in_features % group_size:
            raise ValueError(f"group_size {group_size} must divide in_features {in_features}")
        if bits == 4 and in_features % 2:
            raise ValueError(f"int4 packs two values per byte: in_features ({in_features}) must be even")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        packed = in_features if bits == 8 else in_features // 2
        qdtype = torch.int8 if bits == 8 else torch.uint8
        self.register_buffer("qweight", torch.zeros(out_features, packed, dtype=qdtype, device=device))
        shape = (out_features, in_features // group_size) if group_size else (out_features,)
        self.register_buffer("scales", torch.zeros(shape, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, *, bits: int = 4, group_size: int | None = 128,
                    dtype: torch.dtype | None = None) -> "QuantizedLinear":
        """A QuantizedLinear holding `linear`'s weight quantised with `quantize_weight(bits,
        group_size)` and its bias, on its device, with scales and bias in `dtype` (the
        Linear's own unless given: fp32 for a default nn.Linear)."""
        dtype = dtype or linear.weight.dtype
        m = cls(linear.in_features, linear.out_features, bits=bits, group_size=group_size,
                bias=linear.bias is not None, dtype=dtype, device=linear.weight.device)
        with torch.no_grad():
            q, s = quantize_weight(linear.weight.detach().to(dtype), bits=bits, group_size=group_size)
            m.qweight.copy_(q)
            m.scales.copy_(s)
            if linear.bias is not None:
                m.bias.copy_(linear.bias.to(dtype))
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`mixed_linear(x, qweight, scales, ...) + bias`: x is [..., in_features] of a float
        dtype on the layer's device; the result has x's dtype (the bias is cast to it)."""
        if self.scales.dtype not in _DTYPES:  # e.g. after .double(): the ops would refuse them
            raise TypeError(f"QuantizedLinear: its scales are {self.scales.dtype} (after .double() or .to()?), "
                            "but the kernels take float32, float16 or bfloat16 scales; convert the module "
                            "with .float(), .half() or .to(torch.bfloat16)")
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return mixed_linear(x, self.qweight, self.scales, bits=self.bits, group_size=self.group_size, bias=bias)

    def extra_repr(self) -> str:
        g = f"group_size={self.group_size}" if self.group_size else "per-channel"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, {g}, bias={self.bias is not None}")
