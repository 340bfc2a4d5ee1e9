"""Every check in the bindings has a test: a Python exception whose message says what to fix."""

import re

import pytest
import torch
from conftest import rand

import portable_gemm as pg

f32, bf16 = torch.float32, torch.bfloat16


def gemm_cases():
    a, b = rand((4, 8), f32), rand((8, 3), f32)
    yield "dtype mismatch", lambda: pg.gemm(a, b.to(bf16)), r"b has dtype bfloat16 but a has float32"
    yield "int tensors", lambda: pg.gemm(a.to(torch.int32), b.to(torch.int32)), r"a must be float32, float16 or bfloat16, got int32"
    yield "float64", lambda: pg.gemm(a.double(), b.double()), r"a must be float32, float16 or bfloat16, got float64"
    yield "K mismatch", lambda: pg.gemm(a, rand((7, 3), f32)), r"a has K = 8 columns but b has 7 rows"
    yield "b rank", lambda: pg.gemm(a, rand((8,), f32)), r"b must have shape \[K, N\], got 1 dims"
    yield "a rank 0", lambda: pg.gemm(torch.tensor(1.0), b), r"a must have shape \[..., K\], got a 0-dim"
    yield "bias shape", lambda: pg.gemm(a, b, bias=rand((4,), f32)), r"bias must have shape \[N\] = \[3\]"
    yield "bias dtype", lambda: pg.gemm(a, b, bias=rand((3,), bf16)), r"bias has dtype bfloat16 but a has float32"
    yield "activation name", lambda: pg.gemm(a, b, activation="tanh"), r"activation must be one of"
    yield "activation code", lambda: torch.ops.portable_gemm.gemm(a, b, None, 9), r"activation code 9 is unknown"


def quant_cases():
    w = rand((8, 64), f32)
    yield "bits", lambda: pg.quantize_weight(w, bits=3), r"bits must be 4 or 8, got 3"
    yield "group divides", lambda: pg.quantize_weight(w, bits=8, group_size=48), r"group_size 48 must divide K = 64"
    yield "group negative", lambda: torch.ops.portable_gemm.quantize_weight(w, 8, -2), r"group_size must be None"
    yield "group type", lambda: pg.quantize_weight(w, bits=8, group_size=0), r"group_size must be None \(per channel\) or a positive int"
    yield "odd K int4", lambda: pg.quantize_weight(rand((8, 63), f32), bits=4), r"K \(63\) must be even"
    yield "rank", lambda: pg.quantize_weight(rand((2, 8, 64), f32), bits=8), r"weight must have shape \[N, K\]"
    yield "int weight", lambda: pg.quantize_weight(w.to(torch.int8), bits=8), r"weight must be float32, float16 or bfloat16, got int8"
    yield "bits bool", lambda: pg.quantize_weight(w, bits=True), r"bits must be 4 or 8, got True"
    yield "bits str", lambda: pg.quantize_weight(w, bits="8"), r"bits must be 4 or 8, got '8'"


def mixed_cases():
    w = rand((8, 64), bf16)
    q8, s8 = pg.quantize_weight(w, bits=8)
    q4, s4 = pg.quantize_weight(w, bits=4, group_size=32)
    x = rand((3, 64), bf16)
    yield "bits", lambda: pg.mixed_linear(x, q8, s8, bits=2), r"bits must be 4 or 8, got 2"
    yield "int4 given int8 weight", lambda: pg.mixed_linear(x, q8, s8, bits=4), r"bits=4 needs qweight of dtype uint8, got int8"
    yield "packed shape", lambda: pg.mixed_linear(rand((3, 32), bf16), q4, s4, bits=4, group_size=32), r"qweight has shape \[8, 32\] but x has K = 32, so it must be \[N, 16\]"
    yield "scales shape", lambda: pg.mixed_linear(x, q4, s4, bits=4, group_size=16), r"scales must have shape \[N, K / group_size\] = \[8, 4\]"
    yield "per-channel scales shape", lambda: pg.mixed_linear(x, q8, s8[:4], bits=8), r"scales must have shape \[N\] = \[8\]"
    yield "group scales, group_size left out", lambda: pg.mixed_linear(x, q4, s4, bits=4), \
        r"scales must have shape \[N\] = \[8\] for group_size=None \(per channel\); scales of shape \[8, 2\] come from group_size=32"
    yield "channel scales, group_size given", lambda: pg.mixed_linear(x, q8, s8, bits=8, group_size=32), \
        r"scales must have shape \[N, K / group_size\] = \[8, 2\] for group_size=32; scales of shape \[N\] come from group_size=None"
    yield "bits bool", lambda: pg.mixed_linear(x, q8, s8, bits=True), r"bits must be 4 or 8, got True"
    yield "group divides", lambda: pg.mixed_linear(x, q8, s8, bits=8, group_size=48), r"group_size 48 must divide K = 64"
    yield "x int", lambda: pg.mixed_linear(x.to(torch.int8), q8, s8, bits=8), r"x must be float32, float16 or bfloat16, got int8"
    yield "qweight rank", lambda: pg.mixed_linear(x, q8.reshape(-1), s8, bits=8), r"qweight must be 2-D"
    yield "scales int", lambda: pg.mixed_linear(x, q8, s8.to(torch.int32), bits=8), r"scales must be float32, float16 or bfloat16"
    yield "bias dtype", lambda: pg.mixed_linear(x, q8, s8, bits=8, bias=rand((8,), f32)), r"bias has dtype float32 but x has bfloat16"
    yield "bias shape", lambda: pg.mixed_linear(x, q8, s8, bits=8, bias=rand((9,), bf16)), r"bias must have shape \[N\] = \[8\]"
    yield "odd K int4", lambda: pg.mixed_linear(rand((3, 63), bf16), q4, s4, bits=4), r"int4 needs an even K, got K = 63"
    yield "x rank 0", lambda: pg.mixed_linear(torch.tensor(1.0, dtype=bf16), q8, s8, bits=8), r"x must have shape \[..., K\], got a 0-dim tensor"
    yield "int8 given int4 weight", lambda: pg.mixed_linear(x, q4, s4, bits=8, group_size=32), r"bits=8 needs qweight of dtype int8, got uint8"
    yield "bits 3", lambda: pg.mixed_linear(x, q4, s4, bits=3, group_size=32), r"bits must be 4 or 8, got 3"
    yield "activation code", lambda: torch.ops.portable_gemm.mixed_linear(x, q8, s8, 8, 0, None, -1), r"activation code -1 is unknown"


ALL = [("gemm", *c) for c in gemm_cases()] + [("quantize", *c) for c in quant_cases()] + \
      [("mixed", *c) for c in mixed_cases()]


@pytest.mark.parametrize("op,name,call,match", ALL, ids=[f"{c[0]}: {c[1]}" for c in ALL])
def test_bad_input_message(op, name, call, match):
    with pytest.raises((RuntimeError, ValueError), match=match) as e:
        call()
    # only what to change: no C++ function, file or line in front of it
    assert not re.search(r"\.(h|cpp|cu|cuh):\d+", str(e.value)), str(e.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to mix devices")
def test_mixed_devices():
    a = rand((4, 8), f32)
    b = rand((8, 3), f32, "cuda")
    with pytest.raises(RuntimeError, match=r"is on cuda:0 but a is on cpu|is on cpu but a is on cuda:0"):
        pg.gemm(a, b)
    with pytest.raises(RuntimeError, match=r"move all inputs to one device"):
        pg.gemm(b.T.contiguous(), b, bias=rand((3,), f32))
