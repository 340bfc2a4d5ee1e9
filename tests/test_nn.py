"""portable_gemm.nn.quantize_linears: a model's nn.Linear layers replaced by QuantizedLinear in
place, each layer's outcome reported, the model's output that of its dequantised weights
(float64 reference), and the quantised model's state_dict loadable into another."""

from __future__ import annotations

import copy

import numpy as np

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, assert_close, dequant_ref
from torch import nn

import portable_gemm as pg

f32, bf16 = torch.float32, torch.bfloat16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(256, 384)
        self.down = nn.Linear(384, 256, bias=False)

    def forward(self, h):
        return h + self.down(F.silu(self.up(h)))


class Model(nn.Module):
    """Every case quantize_linears tells apart: plain layers in a ModuleList, one layer at two
    places, MultiheadAttention's out_proj (an nn.Linear subclass whose weight MHA reads), a
    head tied to the embedding, a layer whose in_features 200 is no multiple of 128 (fed a
    non-contiguous slice), and a layer a filter keeps."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 256)
        self.blocks = nn.ModuleList([Block(), Block()])
        shared = nn.Linear(256, 256)
        self.s1, self.s2 = shared, shared
        self.attn = nn.MultiheadAttention(256, 4, batch_first=True)
        self.head = nn.Linear(256, 50, bias=False)
        self.head.weight = self.emb.weight
        self.odd = nn.Linear(200, 64)
        self.gate = nn.Linear(256, 8)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        h = self.s2(F.relu(self.s1(h)))
        a, _ = self.attn(h, h, h, need_weights=False)
        h = h + a
        return torch.cat([self.head(h), self.odd(h[..., 28:228]), self.gate(h)], dim=-1)


SUBCLASS = ("kept: a subclass of nn.Linear (NonDynamicallyQuantizableLinear): the code around it may "
            "read its .weight (nn.MultiheadAttention does), so only plain nn.Linear is replaced")


def expected_report(outcome: str) -> dict[str, str]:
    return {
        "blocks.0.up": outcome, "blocks.0.down": outcome, "blocks.1.up": outcome,
        "blocks.1.down": outcome,
        "s1": outcome, "s2": f"{outcome} (the same module as s1)",
        "attn.out_proj": SUBCLASS,
        "head": f"{outcome}; its weight is also emb.weight, which keeps the float copy",
        "odd": ("kept: in_features 200 is not a multiple of group_size 128" if "g128" in outcome else outcome),
        "gate": "kept: filter_fn returned False for gate",
    }


ORDER = ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "s1", "s2", "attn.out_proj",
         "head", "odd", "gate"]


def make_model(device, dtype, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        m = Model().to(device=device, dtype=dtype)
        for p in m.parameters():  # weights of a trained layer's size, not of init's
            p.normal_(0, 0.05)
    return m.eval()


def reference(original: nn.Module, quantised: nn.Module, report: dict[str, str]) -> nn.Module:
    """The original model in float64 with each replaced layer's weight set to what its
    QuantizedLinear holds, dequantised independently of the package (the bias stays the
    original's)."""
    ref = copy.deepcopy(original).double()
    qmods = dict(quantised.named_modules(remove_duplicate=False))
    rmods = dict(ref.named_modules(remove_duplicate=False))
    with torch.no_grad():
        for name, outcome in report.items():
            if outcome.startswith("kept"):
                continue
            q = qmods[name]
            w = dequant_ref(q.qweight, q.scales, q.bits, q.group_size)
            if name == "head":  # tied: the reference keeps the float embedding, as the model does
                rmods[name].weight = nn.Parameter(w)
            else:
                rmods[name].weight.copy_(w)
    return ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [f32, bf16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bits,group", [(4, 128), (8, None), (4, None)], ids=["int4-g128", "int8-chan", "int4-chan"])
def test_quantize_linears_replaces_reports_and_computes(device, dtype, bits, group):
    original = make_model(device, dtype)
    model = copy.deepcopy(original)
    weights = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    before = dict(model.named_modules(remove_duplicate=False))
    asked = []

    def keep_gate(module, name):
        asked.append((name, module is before[name]))
        return name != "gate"

    report = pg.nn.quantize_linears(model, bits=bits, group_size=group, filter_fn=keep_gate)
    outcome = f"int{bits} " + (f"g{group}" if group else "per channel")
    assert report == expected_report(outcome) and list(report) == ORDER
    assert sorted(asked) == sorted((n, True) for n in ORDER)  # every name, with its module

    mods = dict(model.named_modules(remove_duplicate=False))
    for name, what in report.items():
        if what.startswith("kept"):
            assert mods[name] is before[name], name  # the very module, untouched
            continue
        q = mods[name]
        assert type(q) is pg.nn.QuantizedLinear and (q.bits, q.group_size) == (bits, group), name
        assert q.scales.dtype == dtype and q.qweight.device.type == device and not q.training, name
        # exactly the quantisation of the original weight
        q_ref, s_ref = pg.quantize_weight(weights[name if name != "s2" else "s1"], bits=bits, group_size=group)
        assert torch.equal(q.qweight, q_ref) and torch.equal(q.scales, s_ref), name
        if before[name].bias is not None:
            assert torch.equal(q.bias, before[name].bias) and q.bias.requires_grad, name
    assert mods["s1"] is mods["s2"]
    assert model.emb.weight.dtype == dtype  # the embedding keeps its float weight

    ids = torch.randint(0, 50, (3, 7), device=device)
    ref = reference(original, model, report)
    with torch.no_grad():
        out = model(ids)
        expected = ref(ids)
    assert_close(out, expected, dtype, tol={f32: 2e-5, bf16: 1e-2}[dtype], label=f"{outcome} {device}")


@pytest.mark.parametrize("device", DEVICES)
def test_quantized_model_state_dict_loads_into_another(device):
    # A quantised checkpoint: quantise a model of the same architecture (its own weights),
    # then load the state_dict; the outputs are bit-equal to the model it was saved from.
    a = make_model(device, bf16, seed=0)
    pg.nn.quantize_linears(a, bits=4, group_size=128)
    b = make_model(device, bf16, seed=1)
    pg.nn.quantize_linears(b, bits=4, group_size=128)
    ids = torch.randint(0, 50, (2, 5), device=device)
    with torch.no_grad():
        assert not torch.equal(a(ids), b(ids))
        b.load_state_dict(a.state_dict())
        assert torch.equal(a(ids), b(ids))


def test_quantize_linears_keeps_what_it_cannot_quantise():
    lazy = nn.LazyLinear(8)
    parametrized = nn.Linear(64, 8)
    torch.nn.utils.parametrize.register_parametrization(parametrized, "weight", nn.Identity())
    hooked = nn.Linear(64, 8)
    hooked.register_forward_hook(lambda *a: None)
    model = nn.Sequential(
        nn.Linear(64, 8, dtype=torch.float64),  # 0: a dtype the kernels do not take
        nn.Linear(65, 8),                       # 1: int4 needs an even in_features
        lazy,                                   # 2: not materialised
        parametrized,                           # 3
        nn.TransformerEncoderLayer(64, 4, dim_feedforward=32, batch_first=True),  # 4: reads linear1.weight
        hooked,                                 # 5: replaced, its hook is lost
        nn.Linear(64, 8),                       # 6: fine
    )
    report = pg.nn.quantize_linears(model, bits=4, group_size=None)
    reads = "kept: its parent, a TransformerEncoderLayer, reads its .weight"
    assert report == {
        "0": ("kept: its weight is torch.float64; the kernels take float32, float16 or bfloat16 "
              "(pass dtype= to quantise it from one of those)"),
        "1": "kept: int4 packs two values per byte: in_features 65 is odd",
        "2": "kept: a lazy layer whose weight is not materialised yet: run a forward first",
        "3": ("kept: its weight is parametrized (torch.nn.utils.parametrize): remove that first, e.g. "
              "parametrize.remove_parametrizations(layer, 'weight', leave_parametrized=True)"),
        "4.self_attn.out_proj": SUBCLASS, "4.linear1": reads, "4.linear2": reads,
        "5": "int4 per channel; its forward hooks (or forward override) are not carried over",
        "6": "int4 per channel",
    }
    assert [type(m).__name__ for m in model] == ["Linear", "Linear", "LazyLinear", "ParametrizedLinear",
                                                 "TransformerEncoderLayer", "QuantizedLinear", "QuantizedLinear"]
    with torch.no_grad():  # the encoder layer's eval fast path still finds its weights
        model[4].eval()(torch.randn(2, 3, 64))
    # dtype= quantises the float64 layer from bf16, and int8 takes the odd one
    report = pg.nn.quantize_linears(model, bits=8, dtype=bf16, group_size=None)
    assert report["0"] == report["1"] == "int8 per channel" and model[0].scales.dtype == bf16
    assert "6" not in report  # already a QuantizedLinear


def test_quantize_linears_ties_containers_modes_and_compile():
    # a ModuleDict, two plain Linears sharing one weight, a frozen layer in train mode, and the
    # model handed over through torch.compile's wrapper (names without "_orig_mod.")
    a, b = nn.Linear(64, 64), nn.Linear(64, 64)
    b.weight = a.weight
    frozen = nn.Linear(64, 32).requires_grad_(False)
    model = nn.Sequential()
    model.add_module("d", nn.ModuleDict({"a": a, "b": b}))
    model.add_module("frozen", frozen)
    model.train()
    compiled = torch.compile(model)
    report = pg.nn.quantize_linears(compiled, bits=8, group_size=32)
    assert report == {
        "d.a": "int8 g32; its weight was tied to d.b.weight, which is quantised on its own",
        "d.b": "int8 g32; its weight was tied to d.a.weight, which is quantised on its own",
        "frozen": "int8 g32",
    }
    assert type(model.d.a) is type(model.d.b) is pg.nn.QuantizedLinear and model.d.a is not model.d.b
    assert model.frozen.training and not model.frozen.bias.requires_grad
    assert model.d.a.training and model.d.a.bias.requires_grad
    with pytest.raises(TypeError, match="for a single layer use QuantizedLinear.from_linear"):
        pg.nn.quantize_linears(torch.compile(nn.Linear(64, 8)))


def test_quantize_linears_changes_nothing_when_it_fails_midway():
    model = nn.Sequential(nn.Linear(64, 8), nn.Linear(8, 4), nn.Linear(4, 2))

    def filter_fn(module, name):
        if name == "2":
            raise RuntimeError("a filter that fails on the last layer")
        return True

    with pytest.raises(RuntimeError, match="a filter that fails"):
        pg.nn.quantize_linears(model, bits=8, group_size=None, filter_fn=filter_fn)
    assert all(type(m) is nn.Linear for m in model)


@pytest.mark.parametrize("device", DEVICES)
def test_meta_model_takes_a_quantised_state_dict(device):
    # The way to load a large quantised checkpoint: the model built on meta (no memory), its
    # Linears made empty QuantizedLinears, then load_state_dict(assign=True).
    source = make_model(device, bf16)
    pg.nn.quantize_linears(source, bits=4, group_size=128)
    with torch.device("meta"):
        model = Model().to(bf16).eval()
    report = pg.nn.quantize_linears(model, bits=4, group_size=128)
    assert report["blocks.0.up"] == "int4 g128 (empty, on meta: load a quantised state_dict with assign=True)"
    assert model.blocks[0].up.qweight.is_meta
    model.load_state_dict(source.state_dict(), assign=True)
    # (head is a QuantizedLinear now, tied to nothing; the state_dict has no stray float copy)
    assert "head.weight" not in model.state_dict() and set(model.state_dict()) == set(source.state_dict())
    ids = torch.randint(0, 50, (2, 5), device=device)
    with torch.no_grad():
        assert torch.equal(model(ids), source(ids))
NONE_CALLS: list[str] = []


def NONE(module, name):  # keeps every layer, and counts its calls
    NONE_CALLS.append(name)
    return False


@pytest.mark.parametrize("call,exc,match", [
    (lambda m: pg.nn.quantize_linears(nn.Linear(64, 8)), TypeError,
     r"replaces the nn.Linear layers inside a module; for a single layer use QuantizedLinear.from_linear"),
    (lambda m: pg.nn.quantize_linears({"fc": nn.Linear(64, 8)}), TypeError, r"takes a torch.nn.Module, got dict"),
    (lambda m: pg.nn.quantize_linears(m, filter_fn=NONE, bits=3), ValueError, r"bits must be 4 or 8, got 3"),
    (lambda m: pg.nn.quantize_linears(m, filter_fn=NONE, bits=True), ValueError, r"bits must be 4 or 8, got True"),
    (lambda m: pg.nn.quantize_linears(m, filter_fn=NONE, group_size=0), ValueError, r"group_size must be None \(per channel\)"),
    (lambda m: pg.nn.quantize_linears(m, filter_fn=NONE, dtype=torch.float64), ValueError,
     r"dtype must be None \(each layer's own\), torch.float32, torch.float16 or torch.bfloat16, got torch.float64"),
], ids=["a Linear", "not a module", "bits 3", "bits True", "group 0", "dtype f64"])
def test_quantize_linears_refuses_bad_arguments_before_replacing(call, exc, match):
    # (a filter that keeps every layer: the errors must come from the argument checks, made
    # before any filter_fn call, not from building a layer)
    model = nn.Sequential(nn.Linear(64, 8), nn.Linear(8, 4))
    NONE_CALLS.clear()
    with pytest.raises(exc, match=match):
        call(model)
    assert NONE_CALLS == []


# QuantizedLinear.dequantize and .to_linear: the float weight the layer multiplies by, equal to
# conftest's float64 dequantisation rounded once to the dtype (and to it whole in float64),
# and an nn.Linear that computes what the layer does.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [f32, bf16], ids=str)
@pytest.mark.parametrize("bits,group", [(4, 128), (8, None), (4, 32)], ids=str)
def test_quantized_linear_dequantize_and_to_linear(device, dtype, bits, group):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, device=device, dtype=dtype)
    layer = pg.nn.QuantizedLinear.from_linear(linear, bits=bits, group_size=group)
    want = dequant_ref(layer.qweight, layer.scales, bits, group)
    w = layer.dequantize()
    assert (w.shape, w.dtype, w.device.type, w.requires_grad) == ((96, 256), dtype, device, False)
    assert torch.equal(w, want.to(dtype))
    assert torch.equal(layer.dequantize(torch.float64), want)

    rng = torch.cuda.get_rng_state if device == "cuda" else torch.get_rng_state
    before = rng()
    back = layer.to_linear()
    assert torch.equal(rng(), before), "to_linear drew random numbers (an initialisation it overwrites)"
    assert type(back) is nn.Linear and back.weight.dtype == dtype and back.weight.device.type == device
    assert torch.equal(back.weight, w) and torch.equal(back.bias, layer.bias)
    assert back.weight.requires_grad and back.weight.data_ptr() != w.data_ptr()
    x = torch.randn(5, 256, device=device, dtype=dtype)
    assert_close(layer(x), x.double() @ want.T + layer.bias.double(), dtype)
    assert_close(back(x), x.double() @ want.T + layer.bias.double(), dtype)
    assert pg.nn.QuantizedLinear(256, 96, bias=False).to_linear().bias is None
    assert layer.to_linear(torch.float16).weight.dtype == torch.float16
    for bad in (torch.int8, torch.uint8, torch.complex64, "float32"):
        with pytest.raises(ValueError, match=r"QuantizedLinear\.dequantize: dtype must be None"):
            layer.dequantize(bad)
        with pytest.raises(ValueError, match=r"QuantizedLinear\.to_linear: dtype must be None"):
            layer.to_linear(bad)


def test_quantize_linears_keeps_a_layer_compiled_on_its_own():
    # torch.compile(layer) inside a model: its compiled forward is bound to the float layer, so
    # replacing the wrapper's _orig_mod would report a quantised layer that never runs
    inner = nn.Linear(64, 8)
    model = nn.Sequential(torch.compile(inner), nn.Linear(8, 4))
    report = pg.nn.quantize_linears(model, bits=8, group_size=None)
    assert report == {
        "0._orig_mod": ("kept: it was compiled on its own (torch.compile(layer)), and the compiled forward "
                        "keeps calling the float layer: quantise before compiling"),
        "1": "int8 per channel",
    }
    assert model[0]._orig_mod is inner and type(model[1]) is pg.nn.QuantizedLinear


@pytest.mark.parametrize("bits", [8, 4])
def test_fp16_scales_that_do_not_fit_are_refused(bits):
    # in fp16 a tiny group's scale underflows to 0 (its weights would read as 0), and an fp32
    # weight beyond 65504 overflows (inf scale: NaN outputs); bf16 has float32's range
    torch.manual_seed(0)
    q = 2 ** (bits - 1) - 1
    linear = nn.Linear(256, 4)
    with torch.no_grad():
        linear.weight[0, :128] *= 0.5 * q * 2.0 ** -25 / linear.weight[0, :128].abs().max()  # under the floor
        linear.weight[1, 128:] *= 2.0 * q * 2.0 ** -25 / linear.weight[1, 128:].abs().max()  # just above it
        linear.weight[2, 5] = 1e5
    with pytest.raises(ValueError, match=r"from_linear: in torch.float16, 1 of 8 groups' scales underflow to 0 "
                                         r"\(their weights would read as 0\) and 1 of 8 groups' scales overflow to "
                                         r"inf \(their outputs would be NaN\); quantise with dtype=torch.float32"):
        pg.nn.QuantizedLinear.from_linear(linear, bits=bits, group_size=128, dtype=torch.float16)
    layer = pg.nn.QuantizedLinear.from_linear(linear, bits=bits, group_size=128, dtype=bf16)
    assert (layer.scales.float() > 0).all() and layer.scales.float().isfinite().all()
    with torch.no_grad():
        linear.weight[2, 5] = 0.0
    layer = pg.nn.QuantizedLinear.from_linear(linear, bits=bits, group_size=None, dtype=torch.float16)
    assert (layer.scales > 0).all()  # per channel: each row's absmax is above the floor
    # quantize_linears keeps such a layer (the reason in the report) and converts the rest;
    # a row of weights under 1e-6: under int8's floor (3.8e-6), above int4's (2.1e-7)
    model = nn.Sequential(nn.Linear(256, 4), linear)
    with torch.no_grad():
        linear.weight[0] = torch.randn(256) * 1e-6 / 4
    report = pg.nn.quantize_linears(model, bits=bits, dtype=torch.float16)
    assert report["0"] == f"int{bits} g128"
    if bits == 8:
        assert report["1"].startswith("kept: in torch.float16, 2 of 8 groups' scales underflow to 0"), report
        assert model[1] is linear
    else:
        assert report["1"] == "int4 g128" and type(model[1]) is pg.nn.QuantizedLinear


def test_quantized_linear_checks_its_inputs_and_keeps_the_linears_state():
    frozen = nn.Linear(64, 8).eval().requires_grad_(False)
    layer = pg.nn.QuantizedLinear.from_linear(frozen, group_size=None)
    assert not layer.training and not layer.bias.requires_grad
    live = pg.nn.QuantizedLinear.from_linear(nn.Linear(64, 8), group_size=32)
    assert live.training and live.bias.requires_grad
    with pytest.raises(RuntimeError, match=r"x has shape \[2, 32\], but this layer takes \[\.\.\., in_features = 64\]"):
        layer(torch.randn(2, 32))
    with pytest.raises(ValueError, match=r"the Linear's weight is torch.float64, .* pass dtype= \(e.g. dtype=torch.float32\)"):
        pg.nn.QuantizedLinear.from_linear(nn.Linear(64, 8, dtype=torch.float64))
    assert pg.nn.QuantizedLinear(64, 8, bits=np.int64(8), group_size=np.int64(32)).bits == 8
    with pytest.raises(ValueError, match="bits must be 4 or 8, got True"):
        pg.nn.QuantizedLinear(64, 8, bits=True)
    double = copy.deepcopy(layer).double()
    for call in (double, lambda x: double.dequantize(), lambda x: double.to_linear()):
        with pytest.raises(TypeError, match=r"its scales are torch.float64 .* convert the module with \.float\(\)"):
            call(torch.randn(2, 64, dtype=torch.float64))


def test_state_dict_of_another_bit_width_is_refused():
    # bits are not in the state_dict: an int8 qweight [8, 128] fits an int4 layer of
    # in_features 256 by shape, and copy_ would turn its negative codes into garbage
    int8 = pg.nn.QuantizedLinear.from_linear(nn.Linear(128, 8), bits=8, group_size=None)
    int4 = pg.nn.QuantizedLinear(256, 8, bits=4, group_size=None, dtype=f32)
    before = int4.qweight.clone()
    with pytest.raises(RuntimeError, match=r"qweight is torch.int8 in the state_dict, but this layer has bits=4 "
                                           r"\(torch.uint8\): build it with bits=8"):
        int4.load_state_dict(int8.state_dict())
    assert torch.equal(int4.qweight, before)
    with torch.device("meta"):
        empty = pg.nn.QuantizedLinear(256, 8, bits=4, group_size=None, dtype=f32)
    with pytest.raises(RuntimeError, match="qweight is torch.int8 in the state_dict"):
        empty.load_state_dict(int8.state_dict(), assign=True)
    assert empty.qweight.dtype == torch.uint8
