"""Typed Python wrappers over torch.ops.<namespace>.*, their fake (meta) kernels for
torch.compile / FakeTensor, and autograd built from the library's own ops."""

from __future__ import annotations

import ctypes
import math
import operator
import threading

import torch

from . import _load
from ._namespace import NAMESPACE

_load()  # the schemas must exist before fake kernels and autograd attach to them

# The fake kernels and autograd formulas below are registered through one Library object.
# importlib.reload re-runs this file in the same module: the previous run's registrations
# are dropped first (torch < 2.13 refuses a second register_fake for an operator).
if globals().get("_LIB") is not None:
    _LIB._destroy()
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")

ACTIVATIONS = {"none": 0, "relu": 1, "silu": 2, "gelu": 3}
GROUP_SIZES = (32, 64, 128)


def _ops():
    return getattr(torch.ops, NAMESPACE)


# Calls that need no gradient skip the autograd dispatch key: the Python autograd kernel
# that torch.library.register_autograd installs runs on every call otherwise, even without
# grad, and costs more host time than the rest of a decode-size call (measured in
# bench/GPU_NOTES.md, run 14). Not while torch.compile traces (it sees the plain op).
_below_autograd = torch._C._AutoDispatchBelowAutograd


def _needs_autograd(*tensors) -> bool:
    """True when the call must go through the autograd key: a tensor that needs a gradient,
    a torch.compile trace, or a torch.func transform with grad mode on; raises for an input
    that carries a forward-mode tangent. (A plain loop: this runs on every call, and a
    generator expression here cost ~0.5 us of a decode-size call's host time.)"""
    if _is_compiling():
        # (first: Dynamo traces under a functorch interpreter of its own, so the check below
        # would see a transform in every compiled call, and it cannot trace that check)
        return True
    transform = _functorch_transform()
    if transform is not None or _forward_ad._current_level >= 0:
        _refuse_forward_ad(tensors, transform)
    if not _grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    # inside torch.vmap the inputs are batched wrappers whose requires_grad reads False even
    # when the tensor they wrap requires grad
    return transform is not None


def _refuse_forward_ad(tensors, transform) -> None:
    """The ops have no forward derivative: torch would give their outputs a zero tangent
    (torch.func.jvp, jacfwd) or none (torch.autograd.forward_ad) without a word. Refused when
    an input carries a tangent (functorch: an input wrapped while a jvp transform is active)."""
    dual = False
    if _forward_ad._current_level >= 0:
        dual = any(t is not None and _forward_ad.unpack_dual(t).tangent is not None for t in tensors)
    if not dual and transform is not None:
        jvp = any(i.key() == _Jvp for i in _functorch_interpreters())
        dual = jvp and any(t is not None and _functorch_wrapped(t) for t in tensors)
    if dual:
        raise NotImplementedError(
            f"{NAMESPACE}: forward-mode AD (torch.func.jvp / jacfwd / hessian, torch.autograd.forward_ad) is not "
            "supported: the ops have no forward derivative, and their tangent would silently read zero. "
            "Use reverse mode (backward(), torch.autograd.grad)")


_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_functorch_transform = torch._C._functorch.peek_interpreter_stack
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_Jvp = torch._C._functorch.TransformType.Jvp
_forward_ad = torch.autograd.forward_ad


def _functorch_interpreters():
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    return retrieve_all_functorch_interpreters()


def _direct(name: str):
    """The C++ callable behind the op's default overload, resolved once: calls that skip the
    autograd key then skip the overload packet's and the overload's Python frames too
    (~1.3 of ~7.8 us of host time for a tiny CPU call, bench/GPU_NOTES.md, run 34)."""
    overload = getattr(_ops(), name).default
    return getattr(overload, "_op", overload)


_GEMM_DIRECT = _direct("gemm")
_MIXED_LINEAR_DIRECT = _direct("mixed_linear")


def _pool_follower():
    """Target 2.9 has no stable parallel_for. Its CPU ops run on torch's OpenMP runtime, else
    on the kernel library's own pool (src/torch/compat/torch_openmp.h); the check returned
    here runs on each wrapper call so that torch.set_num_threads applies as on every target.
    - torch's OpenMP: its count of threads is per thread, and torch sets it on a thread at
      that thread's first parallel op. The check calls torch.get_num_threads() once on each
      thread, which does the same; without it a new thread would run our ops at OpenMP's
      default (every core).
    - the own pool: sized after torch.get_num_threads() now and again whenever that changed.
      PORTABLE_GEMM_NUM_THREADS, where set, fixes the size instead.
    None on targets that run on torch's pool."""
    state = _load()
    if state.features.get("threading") == "torch_openmp":
        seen = threading.local()
        get_count = torch.get_num_threads

        def init_thread() -> None:
            if not getattr(seen, "done", False) and not _is_compiling():
                get_count()
                seen.done = True

        init_thread()
        return init_thread
    if state.features.get("threading") != "portable_gemm_pool":
        return None
    set_size = ctypes.CDLL(state.libraries["kernels"]).portable_gemm_set_pool_threads
    set_size.argtypes = [ctypes.c_int]
    set_size.restype = ctypes.c_int
    get = torch.get_num_threads
    last = [0]

    def follow() -> None:
        if _is_compiling():  # traced code has no business with it (and would graph-break)
            return
        n = get()
        if n != last[0]:
            last[0] = n
            set_size(n)

    follow()
    return follow


_FOLLOW_THREADS = _pool_follower()


def _activation_code(activation: str) -> int:
    try:
        return ACTIVATIONS[activation]
    except (KeyError, TypeError):
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}") from None


def _group_code(group_size: int | None) -> int:
    """None -> 0 (per channel); a positive int, or anything operator.index takes (a NumPy
    integer, a 0-d integer tensor), -> that int."""
    if group_size is None:
        return 0
    try:
        group = operator.index(group_size)
    except TypeError:
        group = 0
    if isinstance(group_size, bool) or group <= 0:
        raise ValueError(f"group_size must be None (per channel) or a positive int such as "
                         f"{GROUP_SIZES}, got {group_size!r}")
    return group


def _bits_code(bits) -> int:
    """4 or 8 as an int (anything operator.index takes); a bool or a non-integer is refused
    here (the op's int argument would take True as 1). Other integers go on to the op's check."""
    try:
        value = operator.index(bits)
    except TypeError:
        value = None
    if isinstance(bits, bool) or value is None:
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    return value


_Tensor = torch.Tensor


def _raise_not_a_tensor(op: str, **args) -> None:
    """TypeError naming the first of args that is not a tensor (bias may be None). The
    wrappers call it only once an inline isinstance test failed (host time per call)."""
    for name, value in args.items():
        if not isinstance(value, _Tensor) and not (name == "bias" and value is None):
            got = "None" if value is None else type(value).__name__
            raise TypeError(f"{NAMESPACE}.{op}: {name} must be a torch.Tensor, got {got}")


def gemm(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None,
         activation: str = "none") -> torch.Tensor:
    """act(a @ b + bias): a [..., K], b [K, N] (fp32/fp16/bf16, one dtype, any strides,
    CPU or CUDA), bias [N]; accumulates in fp32; returns [..., N] in a's dtype."""
    if not (isinstance(a, _Tensor) and isinstance(b, _Tensor) and (bias is None or isinstance(bias, _Tensor))):
        _raise_not_a_tensor("gemm", a=a, b=b, bias=bias)
    act = _activation_code(activation)
    if _FOLLOW_THREADS is not None:
        _FOLLOW_THREADS()
    if _needs_autograd(a, b, bias):
        return _ops().gemm(a, b, bias, act)
    with _below_autograd():
        return _GEMM_DIRECT(a, b, bias, act)


def quantize_weight(weight: torch.Tensor, *, bits: int,
                    group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantisation of an nn.Linear-style weight [N, K].

    bits=8 gives int8 [N, K]; bits=4 gives uint8 [N, K/2], two signed nibbles per byte (low
    nibble = even k). scale = absmax / (2^(bits-1) - 1) per output channel (group_size=None,
    scales [N]) or per group of group_size along K (scales [N, K/group_size]), in weight's dtype.
    q = round-half-even(w / stored scale), clamped; an all-zero group gets scale 0 and q 0, and
    so, in fp16, does a group whose absmax is under (2^(bits-1) - 1) * 2^-25 (its scale
    underflows; just above that floor the scales are subnormal, with fewer bits: quantise such
    weights from float32 or bfloat16).
    Non-finite weights are not hidden: a NaN makes its group's scale NaN, an Inf makes it Inf,
    and that group's q are 0 (so every output the group reaches is NaN).

    Not differentiable: neither output ever requires grad, even when weight does (the op's
    autograd key falls through).
    """
    if not isinstance(weight, _Tensor):
        _raise_not_a_tensor("quantize_weight", weight=weight)
    bits, group = _bits_code(bits), _group_code(group_size)
    if _FOLLOW_THREADS is not None:
        _FOLLOW_THREADS()
    return _ops().quantize_weight(weight, bits, group)


def mixed_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, *, bits: int,
                 group_size: int | None = None, bias: torch.Tensor | None = None,
                 activation: str = "none") -> torch.Tensor:
    """Weight-only quantised linear: act(x @ dequant(qweight).T + bias), x [..., K]
    (fp16/bf16, and fp32), qweight/scales from quantize_weight; returns [..., N] in x's dtype.
    Differentiable in x and bias; scales that require grad are refused (no gradient to them)."""
    if not (isinstance(x, _Tensor) and isinstance(qweight, _Tensor) and isinstance(scales, _Tensor)
            and (bias is None or isinstance(bias, _Tensor))):
        _raise_not_a_tensor("mixed_linear", x=x, qweight=qweight, scales=scales, bias=bias)
    bits, group, act = _bits_code(bits), _group_code(group_size), _activation_code(activation)
    if _FOLLOW_THREADS is not None:
        _FOLLOW_THREADS()
    if _needs_autograd(x, bias, scales):
        return _ops().mixed_linear(x, qweight, scales, bits, group, bias, act)
    with _below_autograd():
        return _MIXED_LINEAR_DIRECT(x, qweight, scales, bits, group, bias, act)


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, *, bits: int,
                      group_size: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The [N, K] weight that quantize_weight's output stands for (torch ops, any device), in
    `dtype` (the scales' unless given): q * s computed in float32 and cast to it (exact in
    float32 for fp16 / bf16 scales), or for a float64 result computed in float64, exactly.
    Checks qweight and scales as mixed_linear does."""
    op = f"{NAMESPACE}.dequantize_weight"
    if not (isinstance(qweight, _Tensor) and isinstance(scales, _Tensor)):
        _raise_not_a_tensor("dequantize_weight", qweight=qweight, scales=scales)
    bits, group = _bits_code(bits), _group_code(group_size)
    _check_qweight(qweight, bits, op)
    n, k = qweight.shape[0], qweight.shape[1] * (1 if bits == 8 else 2)
    _check_scales(scales, n, k, group, op)
    _check_device(qweight, scales, op, "qweight", "scales")
    if bits == 8:
        q = qweight
    else:
        low = (qweight.to(torch.int16) << 12 >> 12).to(torch.int8)   # sign-extend nibble
        high = (qweight.to(torch.int16) << 8 >> 12).to(torch.int8)
        q = torch.stack((low, high), dim=-1).reshape(n, k)
    # q * s is exact in float64; in float32 it is rounded once (exact for fp16 / bf16 scales)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    s = scales.to(work)
    s = s.repeat_interleave(group, dim=1) if group else s.reshape(n, 1)
    return (q.to(work) * s).to(dtype or scales.dtype)


# ---- input checks of the C++ op bodies (src/torch/ops_common.h), same order and messages:
# the fake kernels run them, so FakeTensor / torch.compile refuse what the real op refuses.

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                torch.int8: "int8", torch.uint8: "uint8", torch.float64: "float64",
                torch.int32: "int32", torch.int64: "int64"}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_name(t: torch.Tensor) -> str:
    return _DTYPE_NAMES.get(t.dtype, "an unsupported dtype")


# (The message closures below hold plain values, never a tensor: Dynamo refuses a closure over
# one, and dequantize_weight runs these checks under torch.compile itself.)
def _check_float(t, op, name):
    got = _dtype_name(t)
    torch._check(t.dtype in _FLOATS, lambda: f"{op}: {name} must be float32, float16 or bfloat16, got {got}")


def _check_device(ref, t, op, ref_name, name):
    here, there = t.device, ref.device
    torch._check(here == there, lambda: f"{op}: {name} is on {here} but {ref_name} is on {there}; "
                                        "move all inputs to one device")


def _check_bits(bits, op):
    torch._check(bits in (4, 8), lambda: f"{op}: bits must be 4 or 8, got {bits}")


def _check_group(group_size, k, op):
    torch._check(group_size >= 0, lambda: f"{op}: group_size must be None (per channel) or positive, got {group_size}")
    if group_size > 0:
        torch._check(k % group_size == 0, lambda: f"{op}: group_size {group_size} must divide K = {k}")


def _check_bias(bias, ref, n, op, ref_name):
    if bias is None:
        return
    _check_device(ref, bias, op, ref_name, "bias")
    torch._check(bias.dtype == ref.dtype, lambda: f"{op}: bias has dtype {_dtype_name(bias)} but {ref_name} has {_dtype_name(ref)}")
    torch._check(bias.dim() == 1 and bias.shape[0] == n, lambda: f"{op}: bias must have shape [N] = [{n}]")


def _check_activation(code, op):
    torch._check(0 <= code <= 3, lambda: f"{op}: activation code {code} is unknown (0 none, 1 relu, 2 silu, 3 gelu)")


def _check_qweight(qweight, bits, op):
    """bits, and a 2-D qweight of the dtype bits needs."""
    _check_bits(bits, op)
    dims, got = qweight.dim(), _dtype_name(qweight)
    torch._check(dims == 2, lambda: f"{op}: qweight must be 2-D [N, K] (int8) or [N, K/2] (int4), got {dims} dims")
    qtype = torch.int8 if bits == 8 else torch.uint8
    torch._check(qweight.dtype == qtype, lambda: f"{op}: bits={bits} needs qweight of dtype {_DTYPE_NAMES[qtype]}, "
                                                 f"got {got} (use quantize_weight)")


def _check_scales(scales, n, k, group_size, op):
    """group_size against K, and float scales of shape [N] or [N, K / group_size]."""
    _check_group(group_size, k, op)
    _check_float(scales, op, "scales")
    want, shape = (n, k // group_size) if group_size else (n,), tuple(scales.shape)
    torch._check(shape == want, lambda: f"{op}: scales must have shape "
                 + (f"[N, K / group_size] = [{n}, {k // group_size}]" if group_size else f"[N] = [{n}]")
                 + f" for group_size={group_size or 'None (per channel)'}" + _scales_hint(shape, n, k))


def _scales_hint(shape: tuple, n, k) -> str:
    """Which group_size scales of this shape come from, where that can be read off them."""
    if len(shape) == 2 and shape[0] == n and shape[1] > 0 and k % shape[1] == 0:
        return f"; scales of shape [{n}, {shape[1]}] come from group_size={k // shape[1]}"
    if len(shape) == 1 and shape[0] == n:
        return "; scales of shape [N] come from group_size=None"
    return ""


def _check_gemm(a, b, bias, activation):
    op = f"{NAMESPACE}.gemm"
    torch._check(a.dim() >= 1, lambda: f"{op}: a must have shape [..., K], got a 0-dim tensor")
    torch._check(b.dim() == 2, lambda: f"{op}: b must have shape [K, N], got {b.dim()} dims")
    _check_float(a, op, "a")
    torch._check(b.dtype == a.dtype, lambda: f"{op}: b has dtype {_dtype_name(b)} but a has {_dtype_name(a)}; "
                                             "cast both to one dtype")
    _check_device(a, b, op, "a", "b")
    k, n = a.shape[-1], b.shape[1]
    torch._check(b.shape[0] == k, lambda: f"{op}: a has K = {k} columns but b has {b.shape[0]} rows; b must be [K, N]")
    _check_bias(bias, a, n, op, "a")
    _check_activation(activation, op)


def _check_quantize(weight, bits, group_size):
    op = f"{NAMESPACE}.quantize_weight"
    torch._check(weight.dim() == 2, lambda: f"{op}: weight must have shape [N, K] like nn.Linear.weight, "
                                            f"got {weight.dim()} dims")
    _check_float(weight, op, "weight")
    _check_bits(bits, op)
    k = weight.shape[1]
    _check_group(group_size, k, op)
    if bits == 4:
        torch._check(k % 2 == 0, lambda: f"{op}: int4 packs two values per byte, so K ({k}) must be even")


def _check_mixed_linear(x, qweight, scales, bits, group_size, bias, activation):
    op = f"{NAMESPACE}.mixed_linear"
    torch._check(x.dim() >= 1, lambda: f"{op}: x must have shape [..., K], got a 0-dim tensor")
    _check_float(x, op, "x")
    _check_qweight(qweight, bits, op)
    k, n = x.shape[-1], qweight.shape[0]
    packed_k = k if bits == 8 else k // 2
    torch._check(bits == 8 or k % 2 == 0, lambda: f"{op}: int4 needs an even K, got K = {k}")
    torch._check(qweight.shape[1] == packed_k, lambda: f"{op}: qweight has shape [{n}, {qweight.shape[1]}] but x has "
                 f"K = {k}, so it must be [N, {packed_k}]" + (" (int4: two values per byte)" if bits == 4 else ""))
    _check_scales(scales, n, k, group_size, op)
    _check_device(x, qweight, op, "x", "qweight")
    _check_device(x, scales, op, "x", "scales")
    _check_bias(bias, x, n, op, "x")
    _check_activation(activation, op)


# ---- fake kernels: the real op's checks, then shapes and dtypes -----------------------------

@torch.library.register_fake(f"{NAMESPACE}::gemm", lib=_LIB)
def _gemm_fake(a, b, bias=None, activation=0):
    _check_gemm(a, b, bias, activation)
    return a.new_empty((*a.shape[:-1], b.shape[1]))


@torch.library.register_fake(f"{NAMESPACE}::quantize_weight", lib=_LIB)
def _quantize_fake(weight, bits, group_size=0):
    _check_quantize(weight, bits, group_size)
    n, k = weight.shape
    q = weight.new_empty((n, k), dtype=torch.int8) if bits == 8 else weight.new_empty((n, k // 2), dtype=torch.uint8)
    scales = weight.new_empty((n, k // group_size) if group_size else (n,))
    return q, scales


@torch.library.register_fake(f"{NAMESPACE}::mixed_linear", lib=_LIB)
def _mixed_linear_fake(x, qweight, scales, bits, group_size=0, bias=None, activation=0):
    _check_mixed_linear(x, qweight, scales, bits, group_size, bias, activation)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


# ---- autograd -----------------------------------------------------------------------------

def _activation_grad(z: torch.Tensor, code: int) -> torch.Tensor:
    """d act(z) / dz in fp32."""
    z = z.float()
    if code == ACTIVATIONS["relu"]:
        return (z > 0).float()
    if code == ACTIVATIONS["silu"]:
        s = torch.sigmoid(z)
        return s * (1 + z * (1 - s))
    if code == ACTIVATIONS["gelu"]:
        return 0.5 * (1 + torch.erf(z / math.sqrt(2))) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    return torch.ones_like(z)


def _grad_pre_activation(grad, code, recompute):
    if code == 0:
        return grad
    return (grad.float() * _activation_grad(recompute(), code)).to(grad.dtype)


# What backward needs, and no more (as torch's mm and linear save): an activation's gradient
# recomputes the pre-activation from all inputs; grad_a needs b, grad_b needs a, grad_bias
# only the incoming gradient. So a frozen b keeps no `a` alive until backward.
def _gemm_setup(ctx, inputs, output):
    a, b, bias, activation = inputs
    need_a, need_b, _ = ctx.needs_input_grad[:3]
    act = activation != 0
    ctx.save_for_backward(a if act or need_b else None, b if act or need_a else None, bias if act else None)
    ctx.activation, ctx.has_bias, ctx.shape_b = activation, bias is not None, tuple(b.shape)


def _rows(t: torch.Tensor) -> int:
    """The rows of t as a matrix [rows, t.shape[-1]]: reshape(-1, 0) cannot infer them."""
    return math.prod(t.shape[:-1])


def _gemm_backward(ctx, grad):
    a, b, bias = ctx.saved_tensors
    op = _ops().gemm
    g = _grad_pre_activation(grad, ctx.activation, lambda: op(a, b, bias, 0))
    k, n = ctx.shape_b
    grad_a = op(g, b.mT, None, 0) if ctx.needs_input_grad[0] else None
    grad_b = op(a.reshape(_rows(a), k).mT, g.reshape(_rows(g), n), None, 0) if ctx.needs_input_grad[1] else None
    grad_bias = g.reshape(_rows(g), n).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_a, grad_b, grad_bias, None


torch.library.register_autograd(f"{NAMESPACE}::gemm", _gemm_backward, setup_context=_gemm_setup, lib=_LIB)


def _mixed_setup(ctx, inputs, output):
    x, qweight, scales, bits, group_size, bias, activation = inputs
    # here, not in the wrapper: this sees the real tensors also under vmap (whose wrappers
    # read requires_grad False) and for torch.ops callers
    if scales.requires_grad:
        raise RuntimeError(f"{NAMESPACE}.mixed_linear: scales require grad, but the quantised weight is "
                           "not differentiable (gradients flow to x and bias only); pass scales.detach()")
    # (as gemm's: x only to recompute an activation's input; the weight for grad_x or that)
    act, need_w = activation != 0, activation != 0 or ctx.needs_input_grad[0]
    ctx.save_for_backward(x if act else None, qweight if need_w else None, scales if need_w else None,
                          bias if act else None)
    ctx.bits, ctx.group_size, ctx.activation = bits, group_size, activation
    ctx.has_bias, ctx.n, ctx.x_dtype = bias is not None, qweight.shape[0], x.dtype


def _mixed_backward(ctx, grad):
    x, qweight, scales, bias = ctx.saved_tensors
    op = _ops()
    g = _grad_pre_activation(grad, ctx.activation, lambda: op.mixed_linear(
        x, qweight, scales, ctx.bits, ctx.group_size, bias, 0))
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        w = dequantize_weight(qweight, scales, bits=ctx.bits, group_size=ctx.group_size or None,
                              dtype=ctx.x_dtype)
        grad_x = op.gemm(g, w, None, 0)  # [..., N] @ [N, K]
    if ctx.has_bias and ctx.needs_input_grad[5]:
        grad_bias = g.reshape(_rows(g), ctx.n).sum(0)
    return grad_x, None, None, None, None, grad_bias, None


torch.library.register_autograd(f"{NAMESPACE}::mixed_linear", _mixed_backward,
                                setup_context=_mixed_setup, lib=_LIB)

# Quantisation is not differentiable: its autograd key falls through, so the outputs never
# require grad (without this, a weight that requires grad gave `scales` a grad_fn that warns
# "an autograd kernel was not registered", and opcheck failed).
_LIB.impl("quantize_weight", torch.library.fallthrough_kernel, "Autograd")


# ---- autocast -----------------------------------------------------------------------------
# Under torch.autocast the ops follow torch.matmul and F.linear (autocast's lower-precision
# list): their floating inputs on the autocast's device, float64 excepted, are cast to the
# autocast dtype (torch.get_autocast_dtype: bf16 on the CPU, fp16 on CUDA unless chosen), and
# the op runs with that device's autocast off. mixed_linear casts x and bias only: its scales
# are part of the quantised weight and stay as stored (the kernels take any float scales).

def _autocast_cast(t, device_type: str, dtype: torch.dtype):
    if isinstance(t, _Tensor) and t.is_floating_point() and t.dtype != torch.float64 \
            and t.device.type == device_type:
        return t.to(dtype)
    return t


def _register_autocast(name: str, cast_positions: tuple[int, ...]) -> None:
    op = getattr(_ops(), name).default
    for device_type, key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
        off = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(_keyset, *args, _device_type=device_type, _off=off):
            dtype = torch.get_autocast_dtype(_device_type)
            args = tuple(_autocast_cast(a, _device_type, dtype) if i in cast_positions else a
                         for i, a in enumerate(args))
            with torch._C._ExcludeDispatchKeyGuard(_off):
                return op(*args)

        _LIB.impl(name, kernel, key, with_keyset=True)


_register_autocast("gemm", (0, 1, 2))          # a, b, bias
_register_autocast("mixed_linear", (0, 5))     # x, bias (not scales)


# ---- vmap ---------------------------------------------------------------------------------
# torch.vmap: the ops take [..., K] activations, so a batch over a / x alone is one call with
# that dimension moved to the front. A batch over the weights (b, qweight, scales) or the bias
# runs one call per batch element, the fallback torch would take (without its warning).

def _register_vmap(name: str) -> None:
    op = getattr(_ops(), name).default

    def rule(info, in_dims, *args):
        if all(d is None for d in in_dims[1:]) and args[0].dim() >= 2:  # (a 0-dim a / x is refused below)
            first = args[0].movedim(in_dims[0], 0)
            return op(first, *args[1:]), 0
        if info.batch_size == 0:  # one element's checks and shape, from the fake kernel on meta tensors
            def meta(a, d):
                if not isinstance(a, _Tensor):
                    return a
                return a.new_empty(a.shape if d is None else a.shape[:d] + a.shape[d + 1:], device="meta")

            one = op(*(meta(a, d) for a, d in zip(args, in_dims)))
            return args[0].new_empty((0, *one.shape), dtype=one.dtype), 0
        per_item = [[a.select(d, i) if d is not None else a for a, d in zip(args, in_dims)]
                    for i in range(info.batch_size)]
        return torch.stack([op(*item) for item in per_item]), 0

    torch.library.register_vmap(f"{NAMESPACE}::{name}", rule, lib=_LIB)


_register_vmap("gemm")
_register_vmap("mixed_linear")
