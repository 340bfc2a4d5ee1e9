"""gemm against a float64 reference: named shape lists, dtypes, layouts, bias, activations."""

import os

import pytest
import torch
from conftest import (ACTIVATIONS, ALIGNED, BLOCK_EDGES, DEVICES, DTYPES, LARGE_K, M_SWEEP, ODD,
                      assert_close, gemm_ref, rand, strided_variants)

import portable_gemm as pg


def test_sentinel_is_active():
    # The output checks would be vacuous without the fill: torch's deterministic fill for the
    # tensors the tests make, PORTABLE_GEMM_FILL_OUTPUTS for the ones the ops allocate.
    assert torch.isnan(torch.empty(16)).all()
    assert os.environ.get("PORTABLE_GEMM_FILL_OUTPUTS") == "1"
    assert pg.info()["features"]["fill_outputs"].startswith("on:"), pg.info()["features"]


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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mkn", [(2085, 1088, 1100), (300, 4160, 100)], ids=str)
def test_block_edges_bias_activation(device, dtype, mkn):
    # The epilogue with a bias and an activation on large blocked shapes (BLOCK_EDGES' fifth
    # and eighth): on AMX the first takes K as one block, column blocks of 480 and 70 columns
    # and a 5-row last sliver; the second its K in blocks through fp32 partial sums. 2-byte
    # outputs take the 32-column stores; 1100 and 100 leave short tails.
    m, k, n = mkn
    a, b, bias = rand((m, k), dtype, device), rand((k, n), dtype, device), rand((n,), dtype, device)
    assert_close(pg.gemm(a, b, bias=bias, activation="gelu"), gemm_ref(a, b, bias, "gelu"), dtype)


@pytest.mark.parametrize("k", [300, 401])
@pytest.mark.parametrize("n", [8192, 8200])
def test_fp32_row_chunks_cpu(n, k):
    # AVX-512's fp32 kernels pack each kc block of A once per row chunk and pass every column
    # block of the task over it, with partial sums spanning the task's columns; the chunks are
    # as many rows as 32 MB of those sums allow. On one thread, 2101 rows over 8192 (8200)
    # columns make chunks of 708, 708 and 685 rows (the last ends in a 1-row sliver); K = 300
    # is one kc block (no partial sums), K = 401 two of 204 and 197. Other instruction sets
    # and thread counts (PORTABLE_GEMM_NUM_THREADS sizes the library's own pool) take other
    # blocks of the same shape.
    a, b, bias = rand((2101, k), torch.float32, "cpu"), rand((k, n), torch.float32, "cpu"), rand((n,), torch.float32, "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = pg.gemm(a, b, bias=bias, activation="relu")
    finally:
        torch.set_num_threads(threads)
    assert_close(out, gemm_ref(a, b, bias, "relu"), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layouts_blocked(device, dtype):
    # test_layouts on a shape past the CPU's column blocks and kc blocks (fp32 on AVX-512:
    # 550 columns a task on 2 threads, K in two blocks): A and B transposed or strided go
    # through the packers' other paths.
    a0, b0 = rand((300, 500), dtype, device), rand((500, 1100), dtype, device)
    ref = gemm_ref(a0, b0)
    for a_name, a in strided_variants(a0):
        for b_name, b in strided_variants(b0):
            assert_close(pg.gemm(a, b), ref, dtype, label=f"a {a_name}, b {b_name}")


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


def _bf16_view(rows: int, cols: int, row_stride: int, offset: int) -> torch.Tensor:
    """A [rows, cols] bf16 view with the given row stride (elements) starting `offset` elements
    into a NaN-filled buffer: offset 1 puts its rows 2 bytes off any 64-byte line."""
    buf = torch.full((offset + rows * row_stride,), float("nan"), dtype=torch.bfloat16)
    view = buf[offset:].as_strided((rows, cols), (row_stride, 1))
    view.copy_(rand((rows, cols), torch.bfloat16, "cpu"))
    return view


# bf16 A on CPUs with AVX512-BF16: the pair kernels read A's rows in place where the rows of a
# 12-row sliver take no more lines of an L1 set than the packed sliver (one more allowed), and
# pack A otherwise (gemm.cpp, a_in_place). (M, K, N, A's row stride, offset in elements):
A_IN_PLACE_CASES = [
    (100, 1024, 70, 1024, 0),  # pieces 2 KB apart: read in place, one kc block
    (100, 1024, 70, 1024, 1),  # the same 2 bytes off: every piece straddles a line
    (100, 1024, 70, 1040, 0),  # padded rows (not whole lines apart): each piece a line longer
    (100, 1600, 70, 1600, 0),  # two kc blocks of 800: partial sums between them
    (100, 1600, 2100, 1600, 0),  # and several column blocks a task (packed A would be kept)
    (100, 2048, 70, 2048, 0),  # pieces 4 KB apart pile into the same sets: packed
    (100, 1024, 70, 2048, 0),  # K = 1024 in rows 4 KB apart: packed
    (100, 1023, 70, 1024, 0),  # odd K: packed (the last pair has one element)
]


@pytest.mark.parametrize("case", A_IN_PLACE_CASES, ids=str)
def test_bf16_a_in_place_or_packed(case):
    m, k, n, row_stride, offset = case
    a = _bf16_view(m, k, row_stride, offset)
    b = rand((k, n), torch.bfloat16, "cpu")
    bias = rand((n,), torch.bfloat16, "cpu")
    assert_close(pg.gemm(a, b, bias=bias), gemm_ref(a, b, bias), torch.bfloat16)
    # the weight-only path multiplies x (the A operand) through the same driver above its
    # small-M kernels (M > 64)
    q, s = pg.quantize_weight(b.mT.contiguous(), bits=8)
    w = (q.float() * s.float()[:, None]).to(torch.float64)
    ref = a.to(torch.float64) @ w.mT
    assert_close(pg.mixed_linear(a, q, s, bits=8), ref, torch.bfloat16)
