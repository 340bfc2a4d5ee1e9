"""portable_gemm.nn.quantize_linears: a model's nn.Linear layers replaced by QuantizedLinear in
place, each layer's outcome reported, the model's output that of its dequantised weights
(float64 reference), and the quantised model's state_dict loadable into another."""

from __future__ import annotations

import copy

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
        "gate": "kept: filter_fn returned False",
    }


def make_model(device, dtype, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        m = Model().to(device=device, dtype=dtype)
        for p in m.parameters():  # weights of a trained layer's size, not of init's
            p.normal_(0, 0.05)
    return m.eval()


def reference(original: nn.Module, quantised: nn.Module, report: dict[str, str]) -> nn.Module:
    """The original model in float64 with each replaced layer's weight (and bias) set to what
    its QuantizedLinear holds, dequantised independently of the package."""
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
            if q.bias is not None:
                rmods[name].bias.copy_(q.bias.double())
    return ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [f32, bf16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bits,group", [(4, 128), (8, None), (4, None)], ids=["int4-g128", "int8-chan", "int4-chan"])
def test_quantize_linears_replaces_reports_and_computes(device, dtype, bits, group):
    original = make_model(device, dtype)
    model = copy.deepcopy(original)
    weights = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    report = pg.nn.quantize_linears(model, bits=bits, group_size=group,
                                    filter_fn=lambda name, lin: name != "gate")
    outcome = f"int{bits} " + (f"g{group}" if group else "per channel")
    assert report == expected_report(outcome)

    mods = dict(model.named_modules(remove_duplicate=False))
    for name, what in report.items():
        if what.startswith("kept"):
            assert type(mods[name]) is not pg.nn.QuantizedLinear, name
            continue
        q = mods[name]
        assert type(q) is pg.nn.QuantizedLinear and (q.bits, q.group_size) == (bits, group), name
        assert q.scales.dtype == dtype and q.qweight.device.type == device and not q.training, name
        # exactly the quantisation of the original weight
        q_ref, s_ref = pg.quantize_weight(weights[name if name != "s2" else "s1"], bits=bits, group_size=group)
        assert torch.equal(q.qweight, q_ref) and torch.equal(q.scales, s_ref), name
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
    model = nn.Sequential(
        nn.Linear(64, 8, device="meta"),      # 0: not materialised
        nn.Linear(64, 8, dtype=torch.float64),  # 1: a dtype the kernels do not take
        nn.Linear(65, 8),                     # 2: int4 needs an even in_features
        nn.LazyLinear(8),                     # 3: a subclass (and lazy)
        nn.Linear(64, 8),                     # 4: fine
    )
    report = pg.nn.quantize_linears(model, bits=4, group_size=None)
    assert report == {
        "0": "kept: its weight is not materialised (meta device or lazy): load the weights first",
        "1": ("kept: its weight is torch.float64; the kernels take float32, float16 or bfloat16 "
              "(pass dtype= to quantise it from one of those)"),
        "2": "kept: int4 packs two values per byte: in_features 65 is odd",
        "3": ("kept: a subclass of nn.Linear (LazyLinear): the code around it may read its .weight "
              "(nn.MultiheadAttention does), so only plain nn.Linear is replaced"),
        "4": "int4 per channel",
    }
    assert [type(m).__name__ for m in model] == ["Linear", "Linear", "Linear", "LazyLinear", "QuantizedLinear"]
    # dtype= quantises the float64 layer from bf16, and int8 takes the odd one
    report = pg.nn.quantize_linears(model, bits=8, dtype=bf16, group_size=None)
    assert report["1"] == report["2"] == "int8 per channel" and model[1].scales.dtype == bf16
    assert "4" not in report  # already a QuantizedLinear


@pytest.mark.parametrize("call,exc,match", [
    (lambda m: pg.nn.quantize_linears(nn.Linear(64, 8)), TypeError,
     r"replaces the nn.Linear layers inside a module; for a single layer use QuantizedLinear.from_linear"),
    (lambda m: pg.nn.quantize_linears({"fc": nn.Linear(64, 8)}), TypeError, r"takes a torch.nn.Module, got dict"),
    (lambda m: pg.nn.quantize_linears(m, bits=3), ValueError, r"bits must be 4 or 8, got 3"),
    (lambda m: pg.nn.quantize_linears(m, bits=True), ValueError, r"bits must be 4 or 8, got True"),
    (lambda m: pg.nn.quantize_linears(m, group_size=0), ValueError, r"group_size must be None \(per channel\)"),
    (lambda m: pg.nn.quantize_linears(m, dtype=torch.float64), ValueError,
     r"dtype must be None \(each layer's own\), torch.float32, torch.float16 or torch.bfloat16, got torch.float64"),
], ids=["a Linear", "not a module", "bits 3", "bits True", "group 0", "dtype f64"])
def test_quantize_linears_refuses_bad_arguments_before_replacing(call, exc, match):
    model = nn.Sequential(nn.Linear(64, 8), nn.Linear(8, 4))
    with pytest.raises(exc, match=match):
        call(model)
    assert all(type(m) is nn.Linear for m in model)
