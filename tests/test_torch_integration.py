"""opcheck on every op, torch.compile(fullgraph=True), autograd (gradcheck in float64 is
not possible - the ops take fp32/fp16/bf16 - so gradients are compared with torch's),
torch.export with a dynamic batch and AOTInductor packages."""

import aoti_check  # tests/aoti_check.py: the model, exported here and compiled in its child
import pytest
import torch
from conftest import DEVICES, act_ref, assert_close, dequant_ref, gemm_ref, rand

import portable_gemm as pg

ops = torch.ops.portable_gemm


def opcheck_samples(device):
    for dtype in (torch.float32, torch.bfloat16):
        a, b = rand((5, 12), dtype, device), rand((12, 7), dtype, device)
        yield ops.gemm.default, (a, b, rand((7,), dtype, device), 3)
        yield ops.gemm.default, (rand((2, 3, 12), dtype, device, ), b, None, 0)
    w = rand((16, 64), torch.bfloat16, device)
    yield ops.quantize_weight.default, (w, 8, 0)
    yield ops.quantize_weight.default, (w, 4, 32)
    q, s = pg.quantize_weight(w, bits=4, group_size=32)
    yield ops.mixed_linear.default, (rand((3, 64), torch.bfloat16, device), q, s, 4, 32, None, 2)
    q8, s8 = pg.quantize_weight(w, bits=8)
    yield ops.mixed_linear.default, (rand((1, 64), torch.bfloat16, device), q8, s8, 8, 0,
                                     rand((16,), torch.bfloat16, device), 1)
    # inputs that require grad: opcheck's autograd and AOT-dispatch checks run the backward
    # (without one they pass trivially), with K = 0 and N = 0 among them
    req = lambda t: t.requires_grad_()  # noqa: E731
    for (m, k, n), act in (((5, 12, 7), 2), ((3, 0, 4), 0), ((3, 5, 0), 1)):
        a, b = rand((m, k), torch.float32, device), rand((k, n), torch.float32, device)
        yield ops.gemm.default, (req(a), req(b), req(rand((n,), torch.float32, device)), act)
    for n, act in ((16, 3), (0, 0)):
        q8, s8 = pg.quantize_weight(rand((n, 64), torch.float32, device), bits=8)
        yield ops.mixed_linear.default, (req(rand((2, 3, 64), torch.float32, device)), q8, s8, 8, 0,
                                         req(rand((n,), torch.float32, device)), act)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    count = 0
    for op, args in opcheck_samples(device):
        torch.library.opcheck(op, args)
        count += 1
    assert count == 13


@pytest.mark.parametrize("device", DEVICES)
def test_backward_keeps_only_what_it_needs(device):
    # as torch's mm and linear: a frozen b keeps no `a` alive until backward, and mixed_linear
    # without an activation keeps no x (its weight is never differentiable)
    def saved(f):
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(tuple(t.shape)) or t, lambda t: t):
            out = f()
        out.sum().backward()
        return sorted(packed)

    a = rand((64, 32), torch.float32, device).requires_grad_()
    b = rand((32, 16), torch.float32, device)
    q, s = pg.quantize_weight(rand((16, 32), torch.float32, device), bits=8)
    bias = rand((16,), torch.float32, device).requires_grad_()
    assert saved(lambda: pg.gemm(a, b)) == [(32, 16)]
    assert saved(lambda: pg.gemm(a.detach(), b.requires_grad_())) == [(64, 32)]
    b.requires_grad_(False)
    assert saved(lambda: pg.mixed_linear(a, q, s, bits=8, bias=bias)) == [(16,), (16, 32)]
    assert saved(lambda: pg.mixed_linear(a.detach(), q, s, bits=8, bias=bias)) == []
    # an activation's gradient recomputes the pre-activation from every input
    assert saved(lambda: pg.mixed_linear(a, q, s, bits=8, bias=bias, activation="gelu")) == \
        [(16,), (16,), (16, 32), (64, 32)]


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_backward_and_dequantize_match_eager(device):
    torch._dynamo.reset()
    q, s = pg.quantize_weight(rand((32, 64), torch.float32, device), bits=4, group_size=32)

    def f(x, b, bias):
        h = pg.gemm(x, b, activation="silu")
        return pg.mixed_linear(h, q, s, bits=4, group_size=32, bias=bias, activation="gelu")

    inputs = [rand(shape, torch.float32, device) for shape in ((6, 48), (48, 64), (32,))]
    grads = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in inputs]
        fn(*leaves).square().sum().backward()
        grads.append([t.grad for t in leaves])
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    # dequantize_weight traces whole too (its checks' messages close over no tensor)
    deq = torch.compile(lambda q, s: pg.dequantize_weight(q, s, bits=4, group_size=32), fullgraph=True,
                        backend="aot_eager")
    assert torch.equal(deq(q, s), pg.dequantize_weight(q, s, bits=4, group_size=32))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    torch._dynamo.reset()
    w = rand((32, 64), torch.bfloat16, device)
    q, s = pg.quantize_weight(w, bits=4, group_size=32)

    def f(x, b):
        h = pg.gemm(x, b, activation="silu")
        return pg.mixed_linear(h, q, s, bits=4, group_size=32, activation="relu")

    x, b = rand((6, 48), torch.bfloat16, device), rand((48, 64), torch.bfloat16, device)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, b), f(x, b), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["none", "relu", "silu", "gelu"])
def test_gemm_autograd(device, activation):
    a = rand((2, 5, 12), torch.float32, device).requires_grad_()
    b = rand((12, 7), torch.float32, device).requires_grad_()
    bias = rand((7,), torch.float32, device).requires_grad_()
    out = pg.gemm(a, b, bias=bias, activation=activation)
    g = torch.randn_like(out)
    da, db, dbias = torch.autograd.grad(out, (a, b, bias), g)
    a64, b64, bias64 = (t.detach().double().requires_grad_() for t in (a, b, bias))
    ref = act_ref(a64 @ b64 + bias64, activation)
    ra, rb, rbias = torch.autograd.grad(ref, (a64, b64, bias64), g.double())
    for got, want in ((da, ra), (db, rb), (dbias, rbias)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_linear_autograd(device):
    w = rand((24, 64), torch.float32, device)
    q, s = pg.quantize_weight(w, bits=8, group_size=32)
    q0, s0 = q.clone(), s.clone()
    x = rand((3, 64), torch.float32, device).requires_grad_()
    bias = rand((24,), torch.float32, device).requires_grad_()
    out = pg.mixed_linear(x, q, s, bits=8, group_size=32, bias=bias, activation="gelu")
    g = torch.randn_like(out)
    dx, dbias = torch.autograd.grad(out, (x, bias), g)
    wd = dequant_ref(q.cpu(), s.cpu(), 8, 32)
    x64 = x.detach().cpu().double().requires_grad_()
    b64 = bias.detach().cpu().double().requires_grad_()
    ref = act_ref(x64 @ wd.T + b64, "gelu")
    rx, rb = torch.autograd.grad(ref, (x64, b64), g.cpu().double())
    torch.testing.assert_close(dx.cpu().double(), rx, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dbias.cpu().double(), rb, rtol=1e-4, atol=1e-4)
    # forward and backward (which dequantises the saved qweight / scales) leave them as given
    assert torch.equal(q, q0) and torch.equal(s, s0)


@pytest.mark.parametrize("device", DEVICES)
def test_wrappers_skip_autograd_only_when_no_grad_is_needed(device):
    # The wrappers bypass the autograd key when nothing needs a gradient (host time per
    # call); the result must equal the torch.ops call bit for bit, and a gradient must
    # still flow as soon as an input requires one (also with grad mode toggled).
    ops = getattr(torch.ops, pg.info()["namespace"])
    a, b = rand((5, 32), torch.float32, device), rand((32, 7), torch.float32, device)
    w = rand((7, 64), torch.bfloat16, device)
    q, s = pg.quantize_weight(w, bits=4, group_size=32)
    x = rand((3, 64), torch.bfloat16, device)
    assert torch.equal(pg.gemm(a, b, activation="relu"), ops.gemm(a, b, None, 1))
    assert torch.equal(pg.mixed_linear(x, q, s, bits=4, group_size=32), ops.mixed_linear(x, q, s, 4, 32, None, 0))
    assert pg.gemm(a, b).grad_fn is None
    ar = a.clone().requires_grad_()
    y = pg.gemm(ar, b)
    assert y.grad_fn is not None
    y.sum().backward()
    want = b.cpu().double().sum(1).expand(5, 32)  # d(sum(a @ b)) / da, float64
    assert_close(ar.grad.cpu(), want, torch.float32)
    assert torch.allclose(ar.grad.cpu().double(), want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert pg.gemm(ar, b).grad_fn is None
    xr = x.clone().requires_grad_()
    y = pg.mixed_linear(xr, q, s, bits=4, group_size=32)
    assert y.grad_fn is not None
    y.sum().backward()
    want = dequant_ref(q.cpu(), s.cpu(), 4, 32).sum(0).expand(3, 64)  # d(sum(x @ W.T)) / dx, float64
    assert_close(xr.grad.cpu(), want, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_casts_like_matmul(device, dtype):
    # Under torch.autocast the ops follow torch.matmul / F.linear: fp32 inputs on the
    # autocast's device run in its dtype, bit for bit the call with the inputs cast by hand;
    # mixed_linear keeps its scales as stored (here fp32); float64 is left alone (and refused
    # as without autocast). Through the wrappers and torch.ops alike.
    ops = getattr(torch.ops, pg.info()["namespace"])
    a = rand((9, 40), torch.float32, device).T  # [40, 9]: a strided view
    b, bias = rand((9, 6), torch.float32, device), rand((6,), torch.float32, device)
    w = rand((24, 64), torch.float32, device)
    q, s = pg.quantize_weight(w, bits=4, group_size=32)
    assert s.dtype == torch.float32
    x, xbias = rand((3, 64), torch.float32, device), rand((24,), torch.float32, device)
    want_gemm = pg.gemm(a.to(dtype), b.to(dtype), bias=bias.to(dtype), activation="gelu")
    want_mixed = pg.mixed_linear(x.to(dtype), q, s, bits=4, group_size=32, bias=xbias.to(dtype))
    with torch.autocast(device, dtype=dtype):
        assert torch.matmul(a, b).dtype == dtype  # the rule being followed
        got = [pg.gemm(a, b, bias=bias, activation="gelu"), ops.gemm(a, b, bias, 3)]
        mixed = [pg.mixed_linear(x, q, s, bits=4, group_size=32, bias=xbias),
                 ops.mixed_linear(x, q, s, 4, 32, xbias, 0)]
        with pytest.raises(RuntimeError, match="a must be float32, float16 or bfloat16, got float64"):
            pg.gemm(a.double(), b.double())
    for y in got:
        assert y.dtype == dtype and torch.equal(y, want_gemm)
    for y in mixed:
        assert y.dtype == dtype and torch.equal(y, want_mixed)
    assert_close(got[0], gemm_ref(a, b, bias, "gelu"), dtype, tol=2e-2)  # and the cast inputs' result is right
    with torch.autocast(device, dtype=dtype, enabled=False):
        assert pg.gemm(a, b).dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_gradients_reach_the_fp32_inputs(device):
    # The casts are recorded by autograd: an fp32 leaf used under autocast gets an fp32 gradient.
    dtype = torch.get_autocast_dtype(device)
    a = rand((5, 32), torch.float32, device).requires_grad_()
    b = rand((32, 7), torch.float32, device).requires_grad_()
    with torch.autocast(device):
        y = pg.gemm(a, b)
    assert y.dtype == dtype
    y.float().sum().backward()
    assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    assert_close(a.grad.cpu(), b.detach().cpu().double().sum(1).expand(5, 32), dtype)
    assert_close(b.grad.cpu(), a.detach().cpu().double().sum(0)[:, None].expand(32, 7), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_under_compile(device):
    # torch.compile traces the autocast rule: the compiled graph casts as eager does.
    torch._dynamo.reset()
    w = rand((32, 48), torch.float32, device)
    q, s = pg.quantize_weight(w, bits=8)

    def f(x, b):
        with torch.autocast(device, dtype=torch.bfloat16):
            return pg.mixed_linear(pg.gemm(x, b, activation="silu"), q, s, bits=8)

    x, b = rand((6, 40), torch.float32, device), rand((40, 48), torch.float32, device)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, b)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, f(x, b))


@pytest.mark.parametrize("device", DEVICES)
def test_vmap(device):
    # Each op has a batching rule: a batch over a / x alone is one call (the dimension moved to
    # the front), bit for bit the direct call; a batch over the weights or the bias is one call
    # per element, bit for bit that loop. Nested vmap and a gradient through vmap (the wrappers
    # must not skip autograd on vmap's wrappers, whose requires_grad reads False).
    ns = pg.info()["namespace"]
    for name in ("gemm", "mixed_linear"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{ns}::{name}", "FuncTorchBatched")
    a, b, bias = rand((5, 4, 24), torch.float32, device), rand((24, 7), torch.float32, device), rand((7,), torch.float32, device)
    got = torch.vmap(lambda t: pg.gemm(t, b, bias=bias, activation="silu"), in_dims=1)(a)
    assert torch.equal(got, pg.gemm(a.movedim(1, 0), b, bias=bias, activation="silu"))
    bs, biases = rand((3, 24, 7), torch.float32, device), rand((3, 7), torch.float32, device)
    got = torch.vmap(lambda w, c: pg.gemm(a, w, bias=c))(bs, biases)
    assert got.shape == (3, 5, 4, 7)
    assert torch.equal(got, torch.stack([pg.gemm(a, bs[i], bias=biases[i]) for i in range(3)]))
    assert torch.equal(torch.vmap(torch.vmap(lambda t: pg.gemm(t, b)))(a), pg.gemm(a, b))
    assert_close(torch.vmap(pg.gemm)(a[:3], bs), torch.stack([gemm_ref(a[i], bs[i]) for i in range(3)]),
                 torch.float32)

    w = rand((3, 16, 64), torch.bfloat16, device)
    q, s = pg.quantize_weight(w[0], bits=4, group_size=32)
    x = rand((6, 2, 64), torch.bfloat16, device)
    mixed = torch.vmap(lambda t: pg.mixed_linear(t, q, s, bits=4, group_size=32, activation="relu"))(x)
    assert torch.equal(mixed, pg.mixed_linear(x, q, s, bits=4, group_size=32, activation="relu"))
    qs, ss = zip(*(pg.quantize_weight(w[i], bits=8) for i in range(3)))
    got = torch.vmap(lambda qi, si: pg.mixed_linear(x, qi, si, bits=8))(torch.stack(qs), torch.stack(ss))
    assert torch.equal(got, torch.stack([pg.mixed_linear(x, qs[i], ss[i], bits=8) for i in range(3)]))

    # edges: a 0-dim a per element is refused as the op refuses it (not read as K = the batch);
    # a batch of none over the weights has the shape torch's matmul gives, and is still checked
    with pytest.raises(RuntimeError, match="a must have shape \\[..., K\\], got a 0-dim tensor"):
        torch.vmap(lambda t: pg.gemm(t, b))(rand((24,), torch.float32, device))
    empty = torch.vmap(lambda w: pg.gemm(a, w, bias=bias))(bs[:0])
    assert empty.shape == (0, 5, 4, 7) == torch.vmap(lambda w: a @ w)(bs[:0]).shape and empty.device == a.device
    with pytest.raises(RuntimeError, match="a has K = 24 columns but b has 23 rows"):
        torch.vmap(lambda w: pg.gemm(a, w))(bs[:0, 1:])

    xr = rand((3, 5, 24), torch.float32, device).requires_grad_()
    torch.vmap(lambda t: pg.gemm(t, b))(xr).sum().backward()
    assert_close(xr.grad.cpu(), b.cpu().double().sum(1).expand(3, 5, 24), torch.float32)
    xr = rand((3, 2, 64), torch.bfloat16, device).requires_grad_()
    torch.vmap(lambda t: pg.mixed_linear(t, q, s, bits=4, group_size=32))(xr).sum().backward()
    assert_close(xr.grad.cpu(), dequant_ref(q.cpu(), s.cpu(), 4, 32).sum(0).expand(3, 2, 64), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_mode_ad_is_refused(device):
    # The ops have no forward derivative: torch would give a zero (torch.func) or missing
    # (forward_ad) tangent without a word, so the wrappers refuse an input that carries one.
    # A call whose inputs carry no tangent inside such a transform runs.
    import torch.autograd.forward_ad as fwAD
    a, b = rand((5, 24), torch.float32, device), rand((24, 7), torch.float32, device)
    q, s = pg.quantize_weight(rand((7, 24), torch.float32, device), bits=8)
    refused = pytest.raises(NotImplementedError, match="forward-mode AD .* is not supported")
    with refused:
        torch.func.jvp(lambda t: pg.gemm(t, b), (a,), (torch.ones_like(a),))
    with refused:
        torch.func.jacfwd(lambda t: pg.mixed_linear(t, q, s, bits=8))(a)
    with refused:
        torch.func.jvp(lambda w: pg.gemm(a, w), (b,), (torch.ones_like(b),))
    with fwAD.dual_level():
        with refused:
            pg.gemm(fwAD.make_dual(a, torch.ones_like(a)), b)
        assert pg.gemm(a, b).shape == (5, 7)
    out, tangent = torch.func.jvp(lambda t: t * 2 + pg.gemm(a, b).sum(), (torch.ones(3, device=device),),
                                  (torch.ones(3, device=device),))
    assert torch.equal(tangent, torch.full((3,), 2.0, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_export_keeps_the_ops_and_a_dynamic_batch(device):
    # torch.export traces through the fake kernels with a symbolic batch; the exported
    # program calls the same ops and gives the eager result bit for bit at other batches.
    m = aoti_check.build("ours", device)
    ep = aoti_check.export(m, device)
    called = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    ns = pg.info()["namespace"]
    assert sum(t.startswith(f"{ns}.gemm") for t in called) == 1, called
    assert sum(t.startswith(f"{ns}.mixed_linear") for t in called) == 2, called
    run = ep.module()
    for rows in (3, 17):
        x = rand((rows, 48), torch.bfloat16, device)
        y = run(x)
        assert y.shape == (rows, 24)
        assert torch.equal(y, m(x))


@pytest.mark.parametrize("device", DEVICES)
def test_aot_inductor_package_calls_the_ops(device, tmp_path):
    # The deployment path the stable ABI is for: AOTInductor compiles the exported program
    # into a .pt2 package whose generated code calls the ops through the dispatcher. Loaded
    # back, it must give the eager result bit for bit, at two batch sizes (aoti_check.py,
    # in a child process: a toolchain that builds packages wrong can crash the loader).
    aoti_check.package_or_skip(device, tmp_path)
