"""Drop-in modules built on the ops: `QuantizedLinear`, and `quantize_linears`, which puts
it in place of a model's `nn.Linear` layers."""

from __future__ import annotations

from typing import Callable

import torch

from .ops import _bits_code, _group_code, dequantize_weight, mixed_linear, quantize_weight

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_float_dtype(dtype, method: str) -> None:
    if dtype is not None and dtype not in (*_DTYPES, torch.float64):
        raise ValueError(f"QuantizedLinear.{method}: dtype must be None (the scales'), torch.float32, "
                         f"torch.float16, torch.bfloat16 or torch.float64, got {dtype!r}")


class _ScaleRangeError(ValueError):
    """A weight whose scales do not fit the chosen dtype (quantize_linears keeps such layers)."""


def _scale_range_problem(weight: torch.Tensor, scales: torch.Tensor, group_size: int | None,
                         dtype: torch.dtype) -> str | None:
    """Why `scales` (quantize_weight's, in `dtype`) lose part of `weight`, or None: a finite,
    non-zero group whose scale underflowed to 0 (its weights would read as 0) or overflowed to
    inf (fp16 holds at most 65504: its outputs would be NaN)."""
    if weight.numel() == 0 or weight.is_meta:
        return None
    a = weight.detach().abs().float()
    a = a.reshape(a.shape[0], -1, group_size).amax(-1) if group_size else a.amax(-1)
    s = scales.float().reshape(a.shape)
    finite = torch.isfinite(a)
    under = int((finite & (a > 0) & (s == 0)).sum())
    over = int((finite & ~torch.isfinite(s)).sum())
    if not (under or over):
        return None
    unit = "groups" if group_size else "rows"
    lost = [f"{under} of {a.numel()} {unit}' scales underflow to 0 (their weights would read as 0)"] if under else []
    lost += [f"{over} of {a.numel()} {unit}' scales overflow to inf (their outputs would be NaN)"] if over else []
    return (f"in {dtype}, {' and '.join(lost)}; quantise with dtype=torch.float32 or torch.bfloat16 "
            "(float32's range)")


class QuantizedLinear(torch.nn.Module):
    """nn.Linear with an int8 / int4 weight (symmetric, per channel or per group) and
    activations in fp16 / bf16 / fp32. The quantised weight and scales are buffers, so the
    state_dict round-trips and `.to(device)` moves them.

    The constructor makes an empty layer (zero weight) to load a state_dict into; `dtype`,
    bf16 unless given, is the scales' and bias' dtype. `from_linear` quantises an existing
    `nn.Linear` and keeps its dtype unless given one. `group_size` (128 unless given; None:
    one scale per output channel) must divide in_features, and int4 needs an even
    in_features: `from_linear(nn.Linear(1000, n))` fails with the default group size, so
    pass a divisor of 1000 or None.

    The bit width and group size are not part of the state_dict: build the layer with the
    checkpoint's (loading an int8 qweight into an int4 layer is refused)."""

    def __init__(self, in_features: int, out_features: int, *, bits: int = 4,
                 group_size: int | None = 128, bias: bool = True,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        if _bits_code(bits) not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits!r}")
        bits = int(bits)
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
        Linear's own unless given: fp32 for a default nn.Linear), in the Linear's training
        mode and with its bias' requires_grad.

        Raises ValueError where a scale does not fit `dtype` rather than lose those weights:
        in fp16, a group whose largest weight is under 127 * 2^-25 ~ 3.8e-6 (int8; 7 * 2^-25
        for int4) gets scale 0, and one with a weight beyond 65504 scale inf. Quantise those
        with dtype=torch.float32 or torch.bfloat16."""
        if dtype is None and linear.weight.dtype not in _DTYPES:
            raise ValueError(f"QuantizedLinear.from_linear: the Linear's weight is {linear.weight.dtype}, and the "
                             "kernels take float32, float16 or bfloat16: pass dtype= (e.g. dtype=torch.float32) "
                             "to quantise it in one of those")
        dtype = dtype or linear.weight.dtype
        m = cls(linear.in_features, linear.out_features, bits=bits, group_size=group_size,
                bias=linear.bias is not None, dtype=dtype, device=linear.weight.device)
        with torch.no_grad():
            q, s = quantize_weight(linear.weight.detach().to(dtype), bits=bits, group_size=group_size)
            problem = _scale_range_problem(linear.weight, s, m.group_size, dtype)
            if problem:
                raise _ScaleRangeError(f"QuantizedLinear.from_linear: {problem}")
            m.qweight.copy_(q)
            m.scales.copy_(s)
            if linear.bias is not None:
                m.bias.copy_(linear.bias.to(dtype))
        m.train(linear.training)
        if m.bias is not None:
            m.bias.requires_grad_(linear.bias.requires_grad)
        return m

    def _check_scales_dtype(self) -> None:
        if self.scales.dtype not in _DTYPES:  # e.g. after .double(): the ops would refuse them
            raise TypeError(f"QuantizedLinear: its scales are {self.scales.dtype} (after .double() or .to()?), "
                            "but the kernels take float32, float16 or bfloat16 scales; convert the module "
                            "with .float(), .half() or .to(torch.bfloat16)")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # The bit width is not in the state_dict; an int8 qweight copied into an int4 layer's
        # uint8 buffer (same shape when in_features doubles) would garble it without a word.
        q = state_dict.get(prefix + "qweight")
        if isinstance(q, torch.Tensor) and q.dtype != self.qweight.dtype:
            error_msgs.append(f"{prefix}qweight is {q.dtype} in the state_dict, but this layer has bits={self.bits} "
                              f"({self.qweight.dtype}): build it with bits={8 if q.dtype == torch.int8 else 4}")
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`mixed_linear(x, qweight, scales, ...) + bias`: x is [..., in_features] of a float
        dtype on the layer's device; the result has x's dtype (the bias is cast to it)."""
        self._check_scales_dtype()
        if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[-1] != self.in_features):
            raise RuntimeError(f"QuantizedLinear: x has shape {list(x.shape)}, but this layer takes "
                               f"[..., in_features = {self.in_features}]")
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return mixed_linear(x, self.qweight, self.scales, bits=self.bits, group_size=self.group_size, bias=bias)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight [out_features, in_features] the layer multiplies by
        (`dequantize_weight` of its qweight and scales), in `dtype`, the scales' unless given.
        A new tensor on the layer's device each call, outside autograd: for inspecting the
        weight, merging an adapter into it, or exporting it. The layer has no `.weight`.
        `dtype`: float32, float16, bfloat16 or float64 (float64 is exact; fp16 / bf16 from
        float32 scales are rounded twice, through float32)."""
        _check_float_dtype(dtype, "dequantize")
        self._check_scales_dtype()
        with torch.no_grad():
            return dequantize_weight(self.qweight, self.scales, bits=self.bits, group_size=self.group_size,
                                     dtype=dtype)

    def to_linear(self, dtype: torch.dtype | None = None) -> torch.nn.Linear:
        """An `nn.Linear` with the dequantised weight and the bias, on the layer's device, in
        `dtype` (the scales' unless given; as `dequantize`'s): the way back for code that needs
        a float layer."""
        _check_float_dtype(dtype, "to_linear")
        dtype = dtype or self.scales.dtype
        # skip_init: no random initialisation (it would advance the user's generator) of a
        # weight that is overwritten next
        linear = torch.nn.utils.skip_init(torch.nn.Linear, self.in_features, self.out_features,
                                          bias=self.bias is not None, device=self.qweight.device, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(self.dequantize(dtype))
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def extra_repr(self) -> str:
        g = f"group_size={self.group_size}" if self.group_size else "per-channel"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, {g}, bias={self.bias is not None}")


def _outcome(bits: int, group_size: int | None) -> str:
    return f"int{bits} " + (f"g{group_size}" if group_size else "per channel")


# Modules of torch that read a child Linear's .weight themselves (TransformerEncoderLayer's
# fast path in eval mode passes linear1.weight and linear2.weight to one fused kernel).
_READS_CHILD_WEIGHT = (torch.nn.TransformerEncoderLayer,)


def _is_compiled_wrapper(module: torch.nn.Module) -> bool:
    """torch.compile(module)'s OptimizedModule: its compiled forward is bound to the module it
    wrapped, so putting another in its `_orig_mod` changes nothing that runs."""
    if not hasattr(module, "_orig_mod"):
        return False
    from torch._dynamo.eval_frame import OptimizedModule
    return isinstance(module, OptimizedModule)


def _kept_because(linear: torch.nn.Linear, parents: list[torch.nn.Module], bits: int,
                  group_size: int | None, dtype: torch.dtype | None) -> str | None:
    """Why `linear` cannot become a QuantizedLinear with these settings, or None."""
    w = linear.weight
    if isinstance(w, torch.nn.parameter.UninitializedParameter):
        return "a lazy layer whose weight is not materialised yet: run a forward first"
    if torch.nn.utils.parametrize.is_parametrized(linear):
        return ("its weight is parametrized (torch.nn.utils.parametrize): remove that first, e.g. "
                "parametrize.remove_parametrizations(layer, 'weight', leave_parametrized=True)")
    if type(linear) is not torch.nn.Linear:
        return (f"a subclass of nn.Linear ({type(linear).__qualname__}): the code around it may read "
                "its .weight (nn.MultiheadAttention does), so only plain nn.Linear is replaced")
    for parent in parents:
        if isinstance(parent, _READS_CHILD_WEIGHT):
            return f"its parent, a {type(parent).__qualname__}, reads its .weight"
        if _is_compiled_wrapper(parent):
            return ("it was compiled on its own (torch.compile(layer)), and the compiled forward keeps "
                    "calling the float layer: quantise before compiling")
    if type(w) is not torch.nn.Parameter and type(w) is not torch.Tensor:
        return f"its weight is a {type(w).__qualname__}, not a plain tensor"
    if w.device.type not in ("cpu", "cuda", "meta"):
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
                     filter_fn: Callable[[torch.nn.Module, str], bool] | None = None) -> dict[str, str]:
    """Replace, in place, every `nn.Linear` inside `model` by `QuantizedLinear.from_linear(
    linear, bits=bits, group_size=group_size, dtype=dtype)`, and say what happened to each.

    Returns {qualified name: outcome} for every nn.Linear found, in the order of
    `model.named_modules(remove_duplicate=False)`: "int4 g128" (or "int8 per channel", ...)
    where it was replaced, "kept: <reason>" where not. A layer is kept when `filter_fn(module,
    name)` (torchao's order) is false for any of its names (e.g. to keep an `lm_head` in full
    precision), when it is a subclass of nn.Linear (its owner may read `.weight`, as
    nn.MultiheadAttention does with its `out_proj`) or parametrized, when its parent is a
    torch module that reads its `.weight` (nn.TransformerEncoderLayer), when its weight is
    lazy, a tensor subclass or not on cpu / cuda, when its dtype is not one the kernels take,
    when `group_size` does not divide its in_features (int4 also needs it even), when a scale
    would not fit the dtype (fp16: see `QuantizedLinear.from_linear`), or when the layer was
    itself compiled (`torch.compile(layer)` inside the model: quantise first). Other code
    that reads a replaced layer's `.weight` fails; keep such layers with `filter_fn`.

    A layer on the meta device (a model built under `torch.device("meta")`) becomes an empty
    QuantizedLinear on meta, to be filled by `model.load_state_dict(quantised_state_dict,
    assign=True)`. A module at several places is replaced by one QuantizedLinear at all of them.
    A weight that is also a parameter of a module not replaced (tied embeddings) keeps its
    float copy there; the report says so. The replacement keeps the layer's training mode and
    its bias' requires_grad; forward hooks are not carried over (the report says when a layer
    had some). `model` may be a torch.compile'd module (its original module is converted).

    Every argument is checked, every `filter_fn` called and every new layer built before the
    first one is put in place: an error leaves the model as it was. `group_size` defaults to
    128 for int8 too (None: one scale per output channel)."""
    from .ops import _bits_code

    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
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

    # Every place each Linear sits: (parent, attribute, qualified name), collected first.
    places: dict[int, list[tuple[torch.nn.Module, str, str]]] = {}
    linears: dict[int, torch.nn.Linear] = {}
    order: list[str] = []
    for name, child in model.named_modules(remove_duplicate=False):  # (named_children drops repeats)
        if isinstance(child, torch.nn.Linear):
            order.append(name)
            parent_name, _, attr = name.rpartition(".")
            places.setdefault(id(child), []).append((model.get_submodule(parent_name), attr, name))
            linears[id(child)] = child

    # Phase 1: decide, and build every replacement.
    decided: dict[int, tuple[QuantizedLinear | None, str]] = {}
    for key, linear in linears.items():
        names = [n for _, _, n in places[key]]
        why = None
        if filter_fn is not None:
            refused = [n for n in names if not filter_fn(linear, n)]
            if refused:
                why = f"filter_fn returned False for {refused[0]}"
        if why is None:
            why = _kept_because(linear, [p for p, _, _ in places[key]], bits, group_size, dtype)
        if why is not None:
            decided[key] = (None, f"kept: {why}")
            continue
        if linear.weight.is_meta:
            new = QuantizedLinear(linear.in_features, linear.out_features, bits=bits, group_size=group_size,
                                  bias=linear.bias is not None, dtype=dtype or linear.weight.dtype,
                                  device="meta")
            new.train(linear.training)
            if new.bias is not None:
                new.bias.requires_grad_(linear.bias.requires_grad)
            outcome = _outcome(bits, group_size) + " (empty, on meta: load a quantised state_dict with assign=True)"
        else:
            try:
                new = QuantizedLinear.from_linear(linear, bits=bits, group_size=group_size, dtype=dtype)
            except _ScaleRangeError as e:
                decided[key] = (None, "kept: " + str(e).removeprefix("QuantizedLinear.from_linear: "))
                continue
            outcome = _outcome(bits, group_size)
        if linear._forward_hooks or linear._forward_pre_hooks or "forward" in vars(linear):
            outcome += "; its forward hooks (or forward override) are not carried over"
        decided[key] = (new, outcome)

    # Ties to parameters of modules that stay (a head tied to the embedding).
    replaced_prefixes = tuple(n + "." for key, (new, _) in decided.items() if new is not None
                              for _, _, n in places[key])
    holders: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), []).append(pname)

    # Phase 2: put them in place and report.
    report: dict[str, str] = {}
    for key, (new, outcome) in decided.items():
        if new is not None:
            own = tuple(f"{n}." for _, _, n in places[key])
            others = [n for n in holders.get(id(linears[key].weight), []) if not n.startswith(own)]
            kept_copies = [n for n in others if not n.startswith(replaced_prefixes)]
            if kept_copies:
                outcome += f"; its weight is also {kept_copies[0]}, which keeps the float copy"
            elif others:  # only other replaced layers held it
                outcome += f"; its weight was tied to {others[0]}, which is quantised on its own"
            for parent, attr, _ in places[key]:
                setattr(parent, attr, new)
        first = places[key][0][2]
        for _, _, name in places[key]:
            report[name] = outcome if name == first else f"{outcome} (the same module as {first})"
    return {name: report[name] for name in order}
