"""The torch-free DLPack door: no torch import, same kernels as the torch ops (bit for bit on
the CPU), every dtype from NumPy, clear TypeError / ValueError for bad input."""

import json
import re

import numpy as np
import pytest
import torch
from conftest import run_python

import portable_gemm as pg
import portable_gemm.dlpack as door


def test_import_does_not_import_torch():
    proc = run_python("import sys, numpy as np\nimport portable_gemm.dlpack as d\n"
                      "d.gemm(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32))\n"
                      "print('torch' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_import_warns_about_ignored_settings():
    # The door reads PORTABLE_GEMM_ISA and PORTABLE_GEMM_NUM_THREADS itself: an ignored value
    # is warned about at its import too, attributed to the importing line.
    proc = run_python("import warnings; warnings.simplefilter('always')\n"
                      "import sys, portable_gemm.dlpack as d\n"
                      "print('torch' in sys.modules)",
                      env={"PORTABLE_GEMM_ISA": "sse9", "PORTABLE_GEMM_NUM_THREADS": "many"})
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "RuntimeWarning: portable_gemm:" in ln]
    assert len(lines) == 2 and all(ln.startswith("<string>:2: ") for ln in lines), proc.stderr[-2000:]
    assert "PORTABLE_GEMM_ISA='sse9'" in lines[0] and "PORTABLE_GEMM_NUM_THREADS='many'" in lines[1]


@pytest.mark.parametrize("env", [{}, {"PORTABLE_GEMM_ISA": "avx2"},
                                 {"PORTABLE_GEMM_ISA": "avx2", "PORTABLE_GEMM_AVX2_DQ": "1"},
                                 {"PORTABLE_GEMM_ISA": "avx2", "PORTABLE_GEMM_AVX2_DQ": "0"},
                                 {"PORTABLE_GEMM_ISA": "generic"}], ids=lambda e: ",".join(e.values()) or "unset")
def test_cpu_units_and_avx2_dq_rows_agree_with_info(env):
    # The door's cpu_isa() / cpu_avx2_dq() and the torch package's info() read the same
    # kernel library: in one process they must say the same ("" where info() omits the rows).
    proc = run_python("import json, warnings; warnings.simplefilter('ignore')\n"
                      "import portable_gemm.dlpack as d, portable_gemm as pg\n"
                      "f = pg.info()['features']\n"
                      "print(json.dumps([d.cpu_isa(), d.cpu_avx2_dq(), f['cpu_isa'], f.get('cpu_avx2_dq', '')]))",
                      env=env, unset=("PORTABLE_GEMM_ISA", "PORTABLE_GEMM_AVX2_DQ"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    isa, dq, info_isa, info_dq = json.loads(proc.stdout.splitlines()[-1])
    assert (isa, dq) == (info_isa, info_dq)
    assert (dq != "") == (isa == "avx2"), (isa, dq)
    if isa == "avx2" and env.get("PORTABLE_GEMM_AVX2_DQ") == "0":
        assert dq == "off (PORTABLE_GEMM_AVX2_DQ=0)"
    elif isa == "avx2" and env.get("PORTABLE_GEMM_AVX2_DQ") == "1":
        assert "PORTABLE_GEMM_AVX2_DQ=1" in dq and dq.split()[0] in ("9", "13"), dq


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def from_bits(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_gemm_equals_torch_path_bitwise(dtype, activation):
    a, b = torch.randn(37, 70).to(dtype), torch.randn(70, 29).to(dtype)
    bias = torch.randn(29).to(dtype)
    want = pg.gemm(a, b, bias=bias, activation=activation)
    if dtype == torch.bfloat16:
        got = from_bits(door.gemm(bf16_bits(a), bf16_bits(b), bf16_bits(bias), activation, bf16_bits=True))
    else:
        got = torch.from_numpy(door.gemm(a.numpy(), b.numpy(), bias.numpy(), activation))
    assert torch.equal(got, want)


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_quantize_and_mixed_equal_torch_path(bits, group):
    w = torch.randn(24, 128)
    q_t, s_t = pg.quantize_weight(w, bits=bits, group_size=group)
    q_n, s_n = door.quantize_weight(w.numpy(), bits, group)
    assert torch.equal(torch.from_numpy(q_n), q_t) and torch.equal(torch.from_numpy(s_n), s_t)
    x = torch.randn(5, 128, dtype=torch.float16)
    want = pg.mixed_linear(x, q_t, s_t, bits=bits, group_size=group)
    got = door.mixed_linear(x.numpy(), q_n, s_n, bits, group)
    assert got.dtype == np.float16
    assert torch.equal(torch.from_numpy(got), want)


def test_strided_numpy_views():
    a = np.random.randn(40, 60).astype(np.float32)
    b = np.random.randn(30, 60).astype(np.float32).T  # transposed view
    got = door.gemm(a[::2, 1:], b[1:])
    np.testing.assert_allclose(got, a[::2, 1:].astype(np.float64) @ b[1:], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: door.gemm(np.ones((2, 3)), np.ones((3, 4))), TypeError, "got float64"),
    (lambda: door.gemm(np.ones((2, 3), np.float32), np.ones((3, 4), np.float16)), TypeError, "same dtype"),
    (lambda: door.gemm(np.ones(3, np.float32), np.ones((3, 4), np.float32)), ValueError, "must be 2-D"),
    (lambda: door.gemm(np.ones((2, 3), np.float32), np.ones((5, 4), np.float32)), ValueError, "K"),
    (lambda: door.gemm(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), activation="tanh"),
     ValueError, "activation must be one of"),
    (lambda: door.gemm([[1.0]], np.ones((1, 1), np.float32)), TypeError, "must be an array"),
    (lambda: door.gemm(np.ones((2, 3), ">f4"), np.ones((3, 4), np.float32)), TypeError,
     r"a must be an array .*got ndarray of non-native byte order \(>\); convert it first"),
    (lambda: door.gemm(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), bias=np.ones(4, np.float16)),
     TypeError, "bias must have a's dtype, got float16"),
    (lambda: door.gemm(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), bias=np.ones(5, np.float32)),
     ValueError, "bias must be a 1-D array of N = 4 elements"),
    (lambda: door.mixed_linear(np.ones((2, 64), np.float32), np.ones((4, 32), np.uint8), np.ones((4, 4), np.float32),
                               4, 32), ValueError, r"scales must be \[N, K / group_size\] = \[4, 2\] with contiguous "
     r"rows, got \[4, 4\]"),
    (lambda: door.mixed_linear(np.ones((2, 8), np.float32), np.ones((4, 8), np.int8), np.ones((4, 1), np.float32),
                               8), ValueError, r"scales must be 1-D \[N\] = \[4\] for per-channel quantisation, got \[4, 1\]"),
    (lambda: door.gemm(torch.ones(2, 3, requires_grad=True), torch.ones(3, 4)), TypeError,
     r"a requires grad, and the DLPack door runs outside autograd .*or pass a.detach\(\)"),
    (lambda: door.mixed_linear(torch.ones(2, 8), torch.ones(4, 8, dtype=torch.int8),
                               torch.ones(4, requires_grad=True), 8), TypeError, "scales requires grad"),
    (lambda: door.quantize_weight(np.ones((4, 6), np.float32), 3), ValueError, "bits must be 4 or 8"),
    (lambda: door.quantize_weight(np.ones((4, 6), np.float32), 8, 4), ValueError, "group_size must divide K"),
    (lambda: door.mixed_linear(np.ones((2, 8), np.float32), np.ones((4, 8), np.uint8),
                               np.ones(4, np.float32), 8), TypeError, "qweight must be int8"),
    (lambda: door.mixed_linear(np.ones((2, 8), np.float32), np.ones((4, 8), np.int8).T.copy().T,
                               np.ones(4, np.float32), 8), ValueError, "contiguous rows"),
])
def test_bad_input(call, exc, match):
    # the message begins with the function as it was reached (a copy's: test_vendor.py)
    with pytest.raises(exc, match=match) as info:
        call()
    fn = call.__code__.co_names[1]  # the door function the lambda calls: door.<fn>(...)
    assert fn in ("gemm", "quantize_weight", "mixed_linear"), call.__code__.co_names
    assert str(info.value).startswith(f"portable_gemm.dlpack.{fn}: "), str(info.value)
    # the name once: the kernel library's checks name it too ("gemm: ...", "quantize: ...")
    assert not re.match(rf"portable_gemm\.dlpack\.{fn}: [a-z_]+: ", str(info.value)), str(info.value)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cuda_torch_arrays_equal_torch_path(dtype):
    # torch CUDA tensors through DLPack (bf16 natively: DLPack has a bfloat16 code)
    a, b = torch.randn(37, 70, device="cuda").to(dtype), torch.randn(70, 29, device="cuda").to(dtype)
    bias = torch.randn(29, device="cuda").to(dtype)
    s = torch.cuda.current_stream()
    got = door.gemm(a, b, bias, "silu", stream=s.cuda_stream)
    assert isinstance(got, torch.Tensor) and got.device == a.device and got.dtype == dtype
    s.synchronize()
    assert torch.equal(got, pg.gemm(a, b, bias=bias, activation="silu"))
    w = torch.randn(48, 128, device="cuda").to(dtype)
    q, sc = door.quantize_weight(w, 4, 32, stream=s.cuda_stream)
    q_t, sc_t = pg.quantize_weight(w, bits=4, group_size=32)
    s.synchronize()
    assert torch.equal(q, q_t) and torch.equal(sc, sc_t)
    if dtype != torch.float32:
        x = torch.randn(5, 128, device="cuda").to(dtype)
        y = door.mixed_linear(x, q, sc, 4, 32, stream=s.cuda_stream)
        s.synchronize()
        assert torch.equal(y, pg.mixed_linear(x, q_t, sc_t, bits=4, group_size=32))


@cuda
def test_cuda_cupy_arrays():
    cp = pytest.importorskip("cupy")
    a = cp.random.standard_normal((33, 65), dtype=cp.float32)
    b = cp.random.standard_normal((65, 17), dtype=cp.float32)
    out = door.gemm(a, b)
    cp.cuda.Stream.null.synchronize()
    assert isinstance(out, cp.ndarray)
    ref = cp.asnumpy(a).astype(np.float64) @ cp.asnumpy(b).astype(np.float64)
    np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=1e-5, atol=1e-4)


@cuda
def test_cuda_mixed_devices_refused():
    with pytest.raises(ValueError, match="move all arrays to one device"):
        door.gemm(torch.ones(2, 3, device="cuda"), torch.ones(3, 4))


# ---- out=: the result written into the caller's array -------------------------------------

OUT_SHAPES = {"aligned": (16, 64, 32), "odd": (7, 70, 29), "one row": (1, 128, 45)}  # (M, K, N)


@pytest.mark.parametrize("shape", OUT_SHAPES.values(), ids=OUT_SHAPES.keys())
@pytest.mark.parametrize("pad", [0, 5], ids=["contiguous", "row-padded"])
def test_gemm_out_equals_fresh_result_and_keeps_its_padding(shape, pad):
    m, k, n = shape
    rng = np.random.default_rng(m * 1000 + n)
    a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    bias = rng.standard_normal(n, np.float32)
    buf = np.full((m, n + pad), np.nan, np.float32)  # sentinel: what the kernel must not touch stays NaN
    out = buf[:, :n]
    got = door.gemm(a, b, bias, "relu", out=out)
    assert got is out
    assert np.array_equal(out, door.gemm(a, b, bias, "relu"))
    ref = np.maximum(a.astype(np.float64) @ b.astype(np.float64) + bias, 0)  # float64, independent
    assert np.linalg.norm(out - ref) <= 2e-5 * np.linalg.norm(ref)
    assert np.isnan(buf[:, n:]).all()


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
@pytest.mark.parametrize("pad", [0, 3], ids=["contiguous", "row-padded"])
def test_mixed_linear_out_equals_fresh_result_and_keeps_its_padding(bits, group, pad):
    w = torch.randn(45, 128)
    q, s = door.quantize_weight(w.numpy(), bits, group)
    x = torch.randn(5, 128).to(torch.bfloat16)
    buf = np.full((5, 45 + pad), 0x7FC0, np.uint16)  # bf16 NaN bits
    out = buf[:, :45]
    xb = bf16_bits(x)
    sb = s  # scales stay float32 here; the door takes them in any float dtype
    got = door.mixed_linear(xb, q, sb, bits, group, bf16_bits=True, out=out)
    assert got is out
    assert np.array_equal(out, door.mixed_linear(xb, q, sb, bits, group, bf16_bits=True))
    assert (buf[:, 45:] == 0x7FC0).all()
    # and it is the torch op's result, bit for bit
    want = pg.mixed_linear(x, torch.from_numpy(q), torch.from_numpy(s), bits=bits, group_size=group)
    assert torch.equal(from_bits(out.copy()), want)


def _out_refusals():
    a, b = np.ones((4, 6), np.float32), np.ones((6, 5), np.float32)
    sq = np.ones((4, 4), np.float32)
    x, q, s = np.ones((2, 8), np.float32), np.ones((3, 8), np.int8), np.ones(3, np.float32)
    ro = np.zeros((4, 5), np.float32)
    ro.setflags(write=False)
    return [
        ("shape", lambda o: door.gemm(a, b, out=o), np.zeros((4, 6), np.float32), ValueError, r"shape \(4, 5\)"),
        ("dtype", lambda o: door.gemm(a, b, out=o), np.zeros((4, 5), np.float16), TypeError, "result's dtype"),
        ("3-D", lambda o: door.gemm(a, b, out=o), np.zeros((1, 4, 5), np.float32), ValueError, "2-D"),
        ("transposed", lambda o: door.gemm(a, b, out=o), np.zeros((5, 4), np.float32).T, ValueError,
         "unit column stride"),
        ("rows overlap", lambda o: door.gemm(a, b, out=o), np.lib.stride_tricks.as_strided(
            np.zeros(12, np.float32), (4, 5), (8, 4)), ValueError, "row stride"),
        ("read-only", lambda o: door.gemm(a, b, out=o), ro, TypeError, "writable"),
        ("not an array", lambda o: door.gemm(a, b, out=o), [[0.0] * 5] * 4, TypeError, "writable array"),
        ("aliases a", lambda o: door.gemm(o, sq, out=o), sq.copy(), ValueError, "overlaps a"),
        ("aliases b", lambda o: door.gemm(sq, o, out=o), sq.copy(), ValueError, "overlaps b"),
        ("aliases x", lambda o: door.mixed_linear(o, q, s, 8, out=o[:, :3]), x.copy(), ValueError, "overlaps x"),
        ("mixed dtype", lambda o: door.mixed_linear(x, q, s, 8, out=o), np.zeros((2, 3), np.float64), TypeError,
         "float32, float16 or bfloat16"),
    ]


@pytest.mark.parametrize("case", _out_refusals(), ids=lambda c: c[0])
def test_out_refused_before_anything_is_written(case):
    _, call, out, exc, match = case
    before = np.array(out, copy=True) if isinstance(out, np.ndarray) else None
    with pytest.raises(exc, match=match):
        call(out)
    if before is not None:  # a refused call leaves out as it was
        assert np.array_equal(np.asarray(out), before)


def test_out_refuses_a_tensor_that_requires_grad():
    # the write would be hidden from autograd; the tensor is left as it was
    out = torch.zeros(4, 5, requires_grad=True)
    with pytest.raises(TypeError, match="out requires grad"):
        door.gemm(np.ones((4, 6), np.float32), np.ones((6, 5), np.float32), out=out)
    assert (out == 0).all() and out._version == 0
    # a detached tensor (or one that never required grad) is written as any array
    got = door.gemm(torch.ones(4, 6), torch.ones(6, 5), out=out.detach())
    assert got.data_ptr() == out.data_ptr() and (out == 6).all()


def test_out_refuses_a_dlpack_capsule():
    import torch.utils.dlpack as tdl

    a, b = np.ones((4, 6), np.float32), np.ones((6, 5), np.float32)
    with pytest.raises(TypeError, match="not a DLPack capsule"):
        door.gemm(a, b, out=tdl.to_dlpack(torch.zeros(4, 5)))


def test_out_next_to_an_empty_operand():
    # an operand with no elements occupies no bytes, even where its address lies inside out
    buf = np.full((5, 8), np.nan, np.float32)
    a = buf[1:5, 2:2]  # (4, 0), K = 0: its address lies inside out's span (elements 4..31)
    out = buf[0:4, 4:8]
    assert door.gemm(a, np.ones((0, 4), np.float32), out=out) is out
    assert (out == 0).all()  # a sum over no k


def test_out_partial_overlap_detected_through_views():
    # out is a window of the same buffer as a, shifted by one row: they share bytes
    buf = np.random.default_rng(0).standard_normal((9, 8), np.float32)
    a, out = buf[:8], buf[1:9]
    with pytest.raises(ValueError, match="overlaps a"):
        door.gemm(a, np.eye(8, dtype=np.float32), out=out)
    # disjoint windows of one buffer are fine
    a2, out2 = buf[:4], buf[4:8]
    want = a2.astype(np.float64) @ np.eye(8)
    assert door.gemm(a2, np.eye(8, dtype=np.float32), out=out2) is out2
    np.testing.assert_allclose(out2, want, rtol=1e-6)
