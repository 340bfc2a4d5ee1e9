"""CUDA-only behaviour: torch's current stream is honoured (non-default streams, CUDA graph
capture and replay), the device guard, and the binding's stream branch."""

import pytest
import torch
from conftest import assert_close, dequant_ref, gemm_ref, rand

import portable_gemm as pg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_binding_loaded():
    info = pg.info()
    assert info["cuda"]["loaded"], info["cuda"]["reason"]
    want = "Stream::nativeHandle" if info["target"] == "2.13" else "aoti_torch_get_current_cuda_stream"
    assert info["features"]["stream_api"] == want
    want_check = "own_macro" if info["target"] == "2.9" else "STD_CUDA_CHECK"
    assert info["features"]["cuda_error_check"] == want_check


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_default_stream(dtype):
    # Large enough that a kernel racing on the wrong stream would read unfinished inputs.
    s = torch.cuda.Stream()
    a0 = rand((2048, 2048), dtype, "cuda")
    b0 = rand((2048, 1024), dtype, "cuda")
    ref = gemm_ref(a0, b0)
    with torch.cuda.stream(s):
        a = a0 * 1.0  # produced on s
        b = b0 * 1.0
        out = pg.gemm(a, b)
        w = rand((1024, 2048), torch.bfloat16, "cuda")
        q, sc = pg.quantize_weight(w, bits=4, group_size=128)
        y = pg.mixed_linear(a[:16].to(torch.bfloat16), q, sc, bits=4, group_size=128)
    s.synchronize()
    assert_close(out, ref, dtype)
    ref_y = a0[:16].to(torch.bfloat16).double() @ dequant_ref(q, sc, 4, 128).cuda().T
    assert_close(y, ref_y, torch.bfloat16)


def test_cuda_graph_capture_and_replay():
    a = rand((64, 256), torch.bfloat16, "cuda")
    b = rand((256, 128), torch.bfloat16, "cuda")
    w = rand((512, 256), torch.bfloat16, "cuda")
    q, sc = pg.quantize_weight(w, bits=8, group_size=64)
    x = rand((4, 256), torch.bfloat16, "cuda")
    pg.gemm(a, b)  # warm-up outside the graph
    pg.mixed_linear(x, q, sc, bits=8, group_size=64)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = pg.gemm(a, b, activation="relu")
        y = pg.mixed_linear(x, q, sc, bits=8, group_size=64)
    for _ in range(2):
        a.copy_(rand((64, 256), torch.bfloat16, "cuda"))
        x.copy_(rand((4, 256), torch.bfloat16, "cuda"))
        g.replay()
        torch.cuda.synchronize()
        assert_close(out, gemm_ref(a, b, None, "relu"), torch.bfloat16)
        assert_close(y, x.double() @ dequant_ref(q, sc, 8, 64).cuda().T, torch.bfloat16)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_device_guard_second_gpu():
    a = rand((33, 65), torch.float16, "cuda:1")
    b = rand((65, 17), torch.float16, "cuda:1")
    out = pg.gemm(a, b)
    assert out.device == torch.device("cuda:1")
    assert_close(out, gemm_ref(a, b), torch.float16)


def test_cpu_and_cuda_mixed_is_an_error():
    with pytest.raises(RuntimeError, match="move all inputs to one device"):
        pg.gemm(rand((4, 8), torch.float32, "cuda"), rand((8, 3), torch.float32))
    w = rand((8, 64), torch.bfloat16)
    q, s = pg.quantize_weight(w, bits=8)
    with pytest.raises(RuntimeError, match="move all inputs to one device"):
        pg.mixed_linear(rand((2, 64), torch.bfloat16, "cuda"), q, s, bits=8)
