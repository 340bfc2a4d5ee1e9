"""Drop-in modules built on the ops: `QuantizedLinear`, and `quantize_linears`, which puts
it in place of a model's `nn.Linear` layers."""

from __future__ import annotations

from typing import Callable

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


def _outcome(bits: int, group_size: int | None) -> str:
    return f"int{bits} " + (f"g{group_size}" if group_size else "per channel")


def _kept_because(linear: torch.nn.Linear, bits: int, group_size: int | None,
                  dtype: torch.dtype | None) -> str | None:
    """Why `linear` cannot become a QuantizedLinear with these settings, or None."""
    if type(linear) is not torch.nn.Linear:
        return (f"a subclass of nn.Linear ({type(linear).__qualname__}): the code around it may read "
                "its .weight (nn.MultiheadAttention does), so only plain nn.Linear is replaced")
    w = linear.weight
    if isinstance(w, torch.nn.parameter.UninitializedParameter) or w.is_meta:
        return "its weight is not materialised (meta device or lazy): load the weights first"
    if w.device.type not in ("cpu", "cuda"):
        return f"its weight is on {w.device.type}; the kernels run on cpu and cuda"
    target = dtype or w.dtype
    if target not in _DTYPES:
        return (f"its weight is {w.dtype}; the kernels take float32, float16 or bfloat16 "
                "(pass dtype= to quantise it from one of those)")
    if group_size and linear.in_features % group_size:
        return f"in_features {linear.in_features} is not a multiple of group_size {group_size}"
    if bits == 4 and linear.in_features % 2:
        return f"int4 packs two values per byte: in_features {linear.in_features} is odd"
    return None


def quantize_linears(model: torch.nn.Module, *, bits: int = 4, group_size: int | None = 128,
                     dtype: torch.dtype | None = None,
                     filter_fn: Callable[[str, torch.nn.Linear], bool] | None = None) -> dict[str, str]:
    """Replace, in place, every `nn.Linear` inside `model` by `QuantizedLinear.from_linear(
    linear, bits=bits, group_size=group_size, dtype=dtype)`, and say what happened to each.

    Returns {qualified name: outcome} for every nn.Linear found, in `named_modules` order:
    "int4 g128" (or "int8 per channel", ...) where it was replaced, "kept: <reason>" where
    not. A layer is kept when `filter_fn(name, linear)` returns False (e.g. to keep an
    `lm_head` in full precision), when it is a subclass of nn.Linear (its owner may read
    `.weight`, as nn.MultiheadAttention does with its `out_proj`), when its weight is not
    materialised or not on cpu / cuda, when its dtype is not one the kernels take, or when
    `group_size` does not divide its in_features (int4 also needs it even). A module that
    appears at several places is replaced by one QuantizedLinear at all of them; a weight
    that is also a parameter elsewhere (tied embeddings) is noted, since that float copy stays.
    Forward hooks and other attributes of a replaced layer are not carried over. `bits` and
    `group_size` are checked before anything is replaced."""
    from .ops import _bits_code

    if isinstance(model, torch.nn.Linear):
        raise TypeError("quantize_linears replaces the nn.Linear layers inside a module; for a single "
                        "layer use QuantizedLinear.from_linear(linear, ...)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"quantize_linears takes a torch.nn.Module, got {type(model).__name__}")
    if _bits_code(bits) not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    bits = int(bits)
    group_size = _group_code(group_size) or None
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be None (each layer's own), torch.float32, torch.float16 or "
                         f"torch.bfloat16, got {dtype!r}")

    # Every name each parameter is reachable under, to spot weights held elsewhere too.
    holders: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), []).append(pname)

    # (parent, attribute, qualified name, linear), collected before anything changes
    found: list[tuple[torch.nn.Module, str, str, torch.nn.Linear]] = []
    for name, child in model.named_modules(remove_duplicate=False):  # (named_children drops repeats)
        if isinstance(child, torch.nn.Linear):
            parent_name, _, attr = name.rpartition(".")
            found.append((model.get_submodule(parent_name), attr, name, child))

    paths: dict[int, list[str]] = {}  # id(linear) -> every name it has
    for _, _, name, linear in found:
        paths.setdefault(id(linear), []).append(name + ".")

    report: dict[str, str] = {}
    made: dict[int, tuple[str, QuantizedLinear | None, str]] = {}  # id(linear) -> first name, module, outcome
    for parent, attr, name, linear in found:
        if id(linear) in made:
            first, new, outcome = made[id(linear)]
            if new is not None:
                setattr(parent, attr, new)
            report[name] = f"{outcome} (the same module as {first})"
            continue
        why = "filter_fn returned False" if filter_fn is not None and not filter_fn(name, linear) else \
            _kept_because(linear, bits, group_size, dtype)
        if why is not None:
            made[id(linear)] = (name, None, f"kept: {why}")
            report[name] = f"kept: {why}"
            continue
        new = QuantizedLinear.from_linear(linear, bits=bits, group_size=group_size, dtype=dtype)
        new.train(linear.training)
        outcome = _outcome(bits, group_size)
        own = tuple(paths[id(linear)])
        elsewhere = [n for n in holders.get(id(linear.weight), []) if not n.startswith(own)]
        if elsewhere:
            outcome += f"; its weight is also {elsewhere[0]}, which keeps the float copy"
        made[id(linear)] = (name, new, outcome)
        setattr(parent, attr, new)
        report[name] = outcome
    return report
