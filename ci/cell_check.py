#!/usr/bin/env python3
"""One cell of the version matrix: run inside a venv that holds one torch release and the
portable_gemm wheel under test (installed, not the source tree).

    python ci/cell_check.py --expect-target 2.11
    python ci/cell_check.py --expect-error "requires torch >= 2.9"     # a refused release

Checks that the loader picked the expected target, that info() is sane, runs every op on
CPU against a float64 reference, torch.library.opcheck on the gemm op, the autocast and vmap
rules (and forward-mode AD refused), one torch.compile(fullgraph=True) call, and (CUDA builds
of torch) that the CUDA binding was
dlopen'ed (it loads without a GPU). Prints progress, then one line

    CELL_RESULT {"passed": N, "failed": M, ...}

and exits 0 only if nothing failed. For a refused release the import must raise an
ImportError whose message contains the expected text (and the process exit normally).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
import zlib

T0 = time.perf_counter()
RESULT_TAG = "CELL_RESULT "


class Checks:
    def __init__(self) -> None:
        self.passed = 0
        self.failed: list[dict] = []

    def run(self, name: str, fn, *args, **kw):
        try:
            out = fn(*args, **kw)
        except Exception as e:  # a failed check, never a crashed cell
            msg = f"{type(e).__name__}: {e}".strip()
            self.failed.append({"check": name, "error": msg[:2000]})
            print(f"  FAIL {name}: {msg.splitlines()[0] if msg else ''}", flush=True)
            if os.environ.get("CELL_CHECK_VERBOSE"):
                traceback.print_exc()
            return None
        self.passed += 1
        return out


def emit(result: dict) -> None:
    result["seconds"] = round(time.perf_counter() - T0, 2)
    print(RESULT_TAG + json.dumps(result, sort_keys=True), flush=True)


# ----------------------------------------------------------------------------- references

def ref_act(z, activation: str):
    import torch
    if activation == "none":
        return z
    if activation == "relu":
        return torch.relu(z)
    if activation == "silu":
        return z * torch.sigmoid(z)
    if activation == "gelu":  # exact (erf) form, as F.gelu's default
        return 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))
    raise ValueError(activation)


def ref_dequant(qweight, scales, bits: int, group_size, k: int):
    """float64 [N, K] from the documented layout (independent of portable_gemm's helper)."""
    import torch
    if bits == 8:
        assert qweight.dtype == torch.int8, qweight.dtype
        q = qweight.to(torch.float64)
    else:
        assert qweight.dtype == torch.uint8, qweight.dtype
        b = qweight.to(torch.int64)
        low, high = b & 0xF, (b >> 4) & 0xF
        low = torch.where(low >= 8, low - 16, low)
        high = torch.where(high >= 8, high - 16, high)
        q = torch.stack((low, high), dim=-1).reshape(qweight.shape[0], k).to(torch.float64)
    s = scales.to(torch.float64)
    s = s.repeat_interleave(group_size, dim=1) if group_size else s.reshape(-1, 1)
    return q * s


def rel_err(out, ref) -> float:
    import torch
    out = out.to(torch.float64)
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- checks

def check_info(pg, torch, expect_target: str, allow_no_cuda: bool) -> dict:
    info = pg.info()
    problems = []
    if info.get("torch") != torch.__version__:
        problems.append(f"info()['torch']={info.get('torch')!r} but torch.__version__={torch.__version__!r}")
    if info.get("target") != expect_target:
        problems.append(f"loaded target {info.get('target')!r}, expected {expect_target!r}; "
                        f"candidates: {info.get('candidates')}")
    cands = info.get("candidates") or []
    loaded = [c for c in cands if c.get("status") in ("loaded", "selected")]
    if [c.get("target") for c in loaded] != [expect_target]:
        problems.append(f"candidates marked loaded: {loaded}")
    rt = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    for c in cands:
        if not c.get("reason"):
            problems.append(f"candidate {c} has no reason")
        tv = tuple(int(x) for x in str(c.get("target")).split(".")[:2])
        if tv > rt and c.get("status") != "rejected":
            problems.append(f"candidate {c} is newer than torch {torch.__version__} but not rejected")
    if not isinstance(info.get("features"), dict) or not info["features"]:
        problems.append(f"features is empty: {info.get('features')!r}")
    libs = info.get("libraries") or {}
    for k, p in libs.items():
        if p and not os.path.exists(p):
            problems.append(f"libraries[{k!r}] = {p} does not exist")
    if "cpu" not in libs:
        problems.append(f"no 'cpu' library in info()['libraries']: {libs}")
    # CPU threading: torch's pool from 2.10; 2.9 on torch's own OpenMP runtime wherever torch
    # runs on OpenMP (its Linux wheels do), never silently on the fallback pool.
    feats = info.get("features") or {}
    if expect_target == "2.9":
        own = os.environ.get("PORTABLE_GEMM_POOL") == "own" or os.environ.get("PORTABLE_GEMM_NUM_THREADS")
        want = ("torch_openmp" if "parallel backend: OpenMP" in torch.__config__.parallel_info() and not own
                else "portable_gemm_pool")
    else:
        want = "torch::stable::parallel_for"
    if feats.get("threading") != want or not feats.get("threading_why"):
        problems.append(f"CPU threading {feats.get('threading')!r} ({feats.get('threading_why')}), "
                        f"expected {want!r}")
    cuda = info.get("cuda") or {}
    if torch.version.cuda is not None and not cuda.get("loaded"):
        msg = f"torch is a CUDA {torch.version.cuda} build but the CUDA binding did not load: {cuda.get('reason')}"
        if allow_no_cuda:
            print(f"  note: {msg} (allowed by --allow-no-cuda)")
        else:
            problems.append(msg)
    if torch.version.cuda is None and cuda.get("loaded"):
        problems.append("CPU-only torch but info() says the CUDA binding loaded")
    if problems:
        raise AssertionError("; ".join(problems))
    return info


def check_gemm(pg, torch, dtype, activation: str, with_bias: bool, layout: str):
    tol = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{activation}{with_bias}{layout}".encode()))
    m, k, n = 37, 70, 45
    if layout == "batched":
        a = torch.randn(2, 3, m, k, generator=g).to(dtype)
        b = torch.randn(k, n, generator=g).to(dtype)
    elif layout == "transposed":  # a and b are non-contiguous views
        a = torch.randn(k, m, generator=g).to(dtype).t()
        b = torch.randn(n, k, generator=g).to(dtype).t()
    elif layout == "strided":
        a = torch.randn(m, 2 * k, generator=g).to(dtype)[:, ::2]
        b = torch.randn(k, n + 7, generator=g).to(dtype)[:, 3:3 + n]
    else:
        a = torch.randn(m, k, generator=g).to(dtype)
        b = torch.randn(k, n, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    out = pg.gemm(a, b, bias=bias, activation=activation)
    ref = a.double() @ b.double()
    if bias is not None:
        ref = ref + bias.double()
    ref = ref_act(ref, activation)
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == dtype, f"dtype {out.dtype} != {dtype}"
    err = rel_err(out, ref)
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


def check_quantize(pg, torch, dtype, bits: int, group_size):
    g = torch.Generator().manual_seed(bits * 1000 + (group_size or 0))
    n, k = 48, 256
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3).to(dtype)
    q, s = pg.quantize_weight(w, bits=bits, group_size=group_size)
    exp_q = (n, k) if bits == 8 else (n, k // 2)
    exp_s = (n,) if group_size is None else (n, k // group_size)
    assert tuple(q.shape) == exp_q, f"qweight shape {tuple(q.shape)} != {exp_q}"
    assert q.dtype == (torch.int8 if bits == 8 else torch.uint8), f"qweight dtype {q.dtype}"
    assert tuple(s.shape) == exp_s, f"scales shape {tuple(s.shape)} != {exp_s}"
    qmax = 2 ** (bits - 1) - 1
    wd = w.double()
    grp = wd.reshape(n, -1, group_size) if group_size else wd.reshape(n, 1, k)
    absmax = grp.abs().amax(dim=-1).reshape(exp_s)
    rtol_s = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    s_err = ((s.double() - absmax / qmax).abs() / (absmax / qmax).clamp_min(1e-30)).max().item()
    assert s_err <= rtol_s, f"scales differ from absmax/{qmax} by {s_err:.2e}"
    deq = ref_dequant(q, s, bits, group_size, k)
    step = s.double().repeat_interleave(group_size, dim=1) if group_size else s.double().reshape(-1, 1)
    # half a step, plus what storing the scale in `dtype` may cost (|q| <= qmax times the
    # scale's rounding; 2x unit roundoff to allow quantising with the unrounded fp32 scale)
    u = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    excess = ((deq - wd).abs() - step * (0.5 + qmax * u) - 1e-6).max().item()
    assert excess <= 0, f"dequantised weight off by more than half a step (+ scale rounding) by {excess:.2e}"


def check_mixed_linear(pg, torch, dtype, bits: int, group_size, with_bias: bool, activation: str):
    g = torch.Generator().manual_seed(bits * 7 + (group_size or 1) + with_bias)
    m, n, k = 5, 40, 256
    w = torch.randn(n, k, generator=g).to(dtype)
    q, s = pg.quantize_weight(w, bits=bits, group_size=group_size)
    x = torch.randn(2, m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    out = pg.mixed_linear(x, q, s, bits=bits, group_size=group_size, bias=bias, activation=activation)
    ref = x.double() @ ref_dequant(q, s, bits, group_size, k).T
    if bias is not None:
        ref = ref + bias.double()
    ref = ref_act(ref, activation)
    assert out.shape == ref.shape and out.dtype == dtype, f"{tuple(out.shape)} {out.dtype}"
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
    err = rel_err(out, ref)
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


def check_bad_input(pg, torch):
    a, b = torch.randn(4, 8), torch.randn(9, 3)
    try:
        pg.gemm(a, b)
    except (RuntimeError, ValueError, TypeError) as e:
        assert str(e), "empty error message"
        return
    raise AssertionError("gemm with mismatched K did not raise")


def check_scratch_release(pg, torch):
    # The CPU calls above left scratch; a release frees all of it (no call is running), and
    # the next call is right again.
    held = pg.cpu_scratch_bytes()
    assert held > 0, "no CPU scratch held after the CPU checks"
    freed = pg.release_cpu_scratch()
    assert freed == held and pg.cpu_scratch_bytes() == 0, f"held {held}, freed {freed}, left {pg.cpu_scratch_bytes()}"
    check_gemm(pg, torch, torch.float32, "none", False, "contiguous")


def check_opcheck(pg, torch):
    op = getattr(torch.ops, getattr(pg, "NAMESPACE", "portable_gemm")).gemm
    g = torch.Generator().manual_seed(0)
    samples = [
        (torch.randn(5, 8, generator=g), torch.randn(8, 3, generator=g), None, 0),
        (torch.randn(5, 8, generator=g), torch.randn(8, 3, generator=g), torch.randn(3, generator=g), 1),
        (torch.randn(2, 5, 8, generator=g).requires_grad_(), torch.randn(8, 3, generator=g).requires_grad_(),
         torch.randn(3, generator=g).requires_grad_(), 3),
        (torch.randn(5, 8, generator=g).to(torch.bfloat16), torch.randn(8, 3, generator=g).to(torch.bfloat16), None, 2),
    ]
    for args in samples:
        torch.library.opcheck(op, args)


def check_compile(pg, torch):
    def f(x, w, bias):
        y = pg.gemm(x, w, bias=bias, activation="silu")
        return y * 2 + 1

    g = torch.Generator().manual_seed(1)
    x, w, bias = torch.randn(16, 32, generator=g), torch.randn(32, 24, generator=g), torch.randn(24, generator=g)
    cf = torch.compile(f, fullgraph=True)
    out = cf(x, w, bias)
    ref = f(x, w, bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def check_autocast(pg, torch):
    """Under CPU autocast (bf16) both ops run in bf16, bit for bit the call with the inputs cast
    by hand; mixed_linear keeps its fp32 scales."""
    g = torch.Generator().manual_seed(2)
    a, b, bias = torch.randn(6, 40, generator=g), torch.randn(40, 9, generator=g), torch.randn(9, generator=g)
    q, s = pg.quantize_weight(torch.randn(9, 64, generator=g), bits=4, group_size=32)
    x = torch.randn(3, 64, generator=g)
    want = pg.gemm(a.bfloat16(), b.bfloat16(), bias=bias.bfloat16(), activation="relu")
    want_mixed = pg.mixed_linear(x.bfloat16(), q, s, bits=4, group_size=32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = pg.gemm(a, b, bias=bias, activation="relu")
        got_mixed = pg.mixed_linear(x, q, s, bits=4, group_size=32)
    if got.dtype != torch.bfloat16 or not torch.equal(got, want):
        raise AssertionError(f"gemm under autocast: {got.dtype}, equal to the hand-cast call: {torch.equal(got, want)}")
    if got_mixed.dtype != torch.bfloat16 or not torch.equal(got_mixed, want_mixed):
        raise AssertionError(f"mixed_linear under autocast: {got_mixed.dtype}")


def check_vmap(pg, torch):
    """vmap over a (one call) and over b (one call per element) equal the direct call and the
    loop; a gradient flows through vmap; forward-mode AD is refused."""
    g = torch.Generator().manual_seed(3)
    a, b, bs = torch.randn(4, 5, 24, generator=g), torch.randn(24, 7, generator=g), torch.randn(3, 24, 7, generator=g)
    if not torch.equal(torch.vmap(lambda t: pg.gemm(t, b), in_dims=1)(a), pg.gemm(a.movedim(1, 0), b)):
        raise AssertionError("vmap over a differs from the direct call")
    if not torch.equal(torch.vmap(lambda w: pg.gemm(a, w))(bs), torch.stack([pg.gemm(a, w) for w in bs])):
        raise AssertionError("vmap over b differs from the loop")
    x = a.clone().requires_grad_()
    torch.vmap(lambda t: pg.gemm(t, b))(x).sum().backward()
    torch.testing.assert_close(x.grad, b.sum(1).expand(4, 5, 24), rtol=1e-5, atol=1e-5)
    try:
        torch.func.jvp(lambda t: pg.gemm(t, b), (a,), (torch.ones_like(a),))
    except NotImplementedError:
        pass
    else:
        raise AssertionError("torch.func.jvp was not refused (its tangent would read zero)")


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    grp = ap.add_mutually_exclusive_group(required=True)
    grp.add_argument("--expect-target", help="target the loader must select, e.g. 2.11")
    grp.add_argument("--expect-error", help="text the import's ImportError must contain")
    ap.add_argument("--allow-no-cuda", action="store_true",
                    help="a CUDA torch without a loaded CUDA binding is only a note (wheel built without nvcc)")
    ap.add_argument("--skip-compile", action="store_true", help="skip the torch.compile check")
    args = ap.parse_args(argv)

    import torch

    base = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": sys.version.split()[0]}
    print(f"cell: torch {torch.__version__} (CUDA {torch.version.cuda}), python {base['python']}", flush=True)

    if args.expect_error is not None:
        try:
            import portable_gemm  # noqa: F401
        except ImportError as e:
            ok = args.expect_error in str(e)
            print(f"  import raised ImportError: {str(e).splitlines()[0]}", flush=True)
            emit({**base, "mode": "refused", "passed": int(ok), "failed": int(not ok),
                  "error": str(e)[:2000], "failures": [] if ok else
                  [{"check": "import", "error": f"ImportError lacks {args.expect_error!r}"}]})
            return 0 if ok else 1
        except BaseException as e:  # noqa: BLE001 - any other failure is a wrong answer
            emit({**base, "mode": "refused", "passed": 0, "failed": 1,
                  "failures": [{"check": "import", "error": f"{type(e).__name__}: {e}"[:2000]}]})
            return 1
        emit({**base, "mode": "refused", "passed": 0, "failed": 1,
              "failures": [{"check": "import", "error": "import succeeded on a release that must be refused"}]})
        return 1

    c = Checks()
    t_imp = time.perf_counter()
    try:
        import portable_gemm as pg
    except BaseException as e:  # noqa: BLE001
        emit({**base, "mode": "runtime", "expect_target": args.expect_target, "passed": 0, "failed": 1,
              "failures": [{"check": "import", "error": f"{type(e).__name__}: {e}"[:2000]}]})
        return 1
    import_ms = (time.perf_counter() - t_imp) * 1e3
    print(f"  imported {pg.__file__} in {import_ms:.0f} ms", flush=True)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def installed_copy():
        if os.path.abspath(pg.__file__).startswith(os.path.join(here, "python") + os.sep):
            raise AssertionError(f"imported from the source tree: {pg.__file__}")

    c.run("import: installed copy, not the source tree", installed_copy)

    info = c.run("info", check_info, pg, torch, args.expect_target, args.allow_no_cuda) or {}
    try:
        raw = pg.info()
    except Exception:  # already counted as a failure above
        raw = {}
    print(f"  target {raw.get('target')}, features {raw.get('features')}, cuda {raw.get('cuda')}", flush=True)

    n0 = c.passed + len(c.failed)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for act in ("none", "relu", "silu", "gelu"):
            for with_bias in (False, True):
                c.run(f"gemm {dtype} act={act} bias={with_bias}", check_gemm, pg, torch, dtype, act, with_bias, "contiguous")
        for layout in ("batched", "transposed", "strided"):
            c.run(f"gemm {dtype} {layout}", check_gemm, pg, torch, dtype, "relu", True, layout)
    print(f"  gemm: {c.passed + len(c.failed) - n0} checks", flush=True)

    n0 = c.passed + len(c.failed)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for bits in (8, 4):
            for gs in (None, 32, 64, 128):
                c.run(f"quantize_weight {dtype} bits={bits} group={gs}", check_quantize, pg, torch, dtype, bits, gs)
    print(f"  quantize_weight: {c.passed + len(c.failed) - n0} checks", flush=True)

    n0 = c.passed + len(c.failed)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for bits in (8, 4):
            for gs in (None, 32, 64, 128):
                c.run(f"mixed_linear {dtype} bits={bits} group={gs}", check_mixed_linear,
                      pg, torch, dtype, bits, gs, gs == 64, "gelu" if gs == 32 else "none")
    print(f"  mixed_linear: {c.passed + len(c.failed) - n0} checks", flush=True)

    c.run("release_cpu_scratch", check_scratch_release, pg, torch)
    c.run("bad input raises", check_bad_input, pg, torch)
    c.run("autocast (CPU, bf16)", check_autocast, pg, torch)
    c.run("vmap, a gradient through it, jvp refused", check_vmap, pg, torch)
    t = time.perf_counter()
    c.run("opcheck gemm", check_opcheck, pg, torch)
    print(f"  opcheck: {time.perf_counter() - t:.1f}s", flush=True)
    if not args.skip_compile:
        t = time.perf_counter()
        c.run("torch.compile(fullgraph=True)", check_compile, pg, torch)
        print(f"  torch.compile: {time.perf_counter() - t:.1f}s", flush=True)

    emit({**base, "mode": "runtime", "expect_target": args.expect_target, "target": raw.get("target"),
          "features": raw.get("features"), "cuda": raw.get("cuda"), "import_ms": round(import_ms, 1),
          "portable_gemm": getattr(pg, "__version__", None),
          "passed": c.passed, "failed": len(c.failed), "failures": c.failed})
    print(f"{c.passed} passed, {len(c.failed)} failed", flush=True)
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
