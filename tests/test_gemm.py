"""gemm against a float64 reference: named shape lists, dtypes, layouts, bias, activations."""

import pytest
import torch
from conftest import (ACTIVATIONS, ALIGNED, BLOCK_EDGES, DEVICES, DTYPES, LARGE_K, M_SWEEP, ODD,
                      assert_close, gemm_ref, rand, strided_variants)

import portable_gemm as pg


def test_sentinel_is_active():
    # The check below would be vacuous if new tensors were not NaN-filled.
    assert torch.isnan(torch.empty(16)).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mkn", ALIGNED + ODD + LARGE_K + BLOCK_EDGES, ids=str)
def test_shapes(device, dtype, mkn):
    m, k, n = mkn
    a, b = rand((m, k), dtype, device), rand((k, n), dtype, device)
    assert_close(pg.gemm(a, b), gemm_ref(a, b), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_m_sweep(device, dtype):
    for m, k, n in M_SWEEP:
        a, b = rand((m, k), dtype, device), rand((k, n), dtype, device)
        bias = rand((n,), dtype, device)
        assert_close(pg.gemm(a, b, bias=bias), gemm_ref(a, b, bias), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_bias_activation(device, dtype, activation):
    a, b, bias = rand((37, 70), dtype, device), rand((70, 29), dtype, device), rand((29,), dtype, device)
    assert_close(pg.gemm(a, b, bias=bias, activation=activation), gemm_ref(a, b, bias, activation), dtype)
    assert_close(pg.gemm(a, b, activation=activation), gemm_ref(a, b, None, activation), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layouts(device, dtype):
    a0, b0 = rand((45, 67), dtype, device), rand((67, 23), dtype, device)
    bias_big = rand((46,), dtype, device)
    bias = bias_big[::2]  # strided bias
    ref = gemm_ref(a0, b0, bias)
    for a_name, a in strided_variants(a0):
        for b_name, b in strided_variants(b0):
            out = pg.gemm(a, b, bias=bias)
            assert out.is_contiguous()
            assert_close(out, ref, dtype, label=f"a {a_name}, b {b_name}")


@pytest.mark.parametrize("device", DEVICES)
def test_batch_dims(device):
    dtype = torch.float32
    a = rand((2, 3, 5, 24), dtype, device)
    b = rand((24, 7), dtype, device)
    out = pg.gemm(a, b)
    assert out.shape == (2, 3, 5, 7)
    assert_close(out, gemm_ref(a, b), dtype)
    # leading dims that cannot merge into one stride (a permuted batch): copied internally
    ap = a.permute(1, 0, 2, 3)
    assert_close(pg.gemm(ap, b), gemm_ref(ap, b), dtype)
    # 1-D input like F.linear
    v = rand((24,), dtype, device)
    assert_close(pg.gemm(v, b), gemm_ref(v, b), dtype)
    # broadcast (stride 0) rows
    e = rand((24,), dtype, device).expand(6, 24)
    assert_close(pg.gemm(e, b), gemm_ref(e, b), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_dims(device, dtype):
    b = rand((5, 4), dtype, device)
    assert pg.gemm(rand((0, 5), dtype, device), b).shape == (0, 4)
    assert pg.gemm(rand((3, 5), dtype, device), rand((5, 0), dtype, device)).shape == (3, 0)
    a0, b0 = rand((3, 0), dtype, device), rand((0, 4), dtype, device)
    bias = rand((4,), dtype, device)
    out = pg.gemm(a0, b0, bias=bias, activation="relu")
    assert torch.equal(out, torch.relu(bias).expand(3, 4))
    assert torch.equal(pg.gemm(a0, b0), torch.zeros(3, 4, dtype=dtype, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_nan_inf_propagate(device):
    a = rand((4, 8), torch.float32, device)
    b = rand((8, 3), torch.float32, device)
    a[1, 2] = float("nan")
    a[2, 0] = float("inf")
    out = pg.gemm(a, b)
    assert torch.isnan(out[1]).all()
    assert not torch.isfinite(out[2]).any()
    assert torch.isfinite(out[[0, 3]]).all()
