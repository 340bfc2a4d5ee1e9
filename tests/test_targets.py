"""Every built target is exercised: under the test torch each one can be forced, reports
itself, and computes correctly (in its own interpreter, since the choice is made at import).
Also the loader's refusals: a target newer than torch, an unknown target, torch < 2.9."""

import json
import os

import pytest
import torch
from conftest import assert_close, dequant_ref, gemm_ref, run_python

import portable_gemm as pg

BUILT = sorted((b["target"] for b in pg.info()["manifest"]["binaries"]
                if b.get("kind") == "binding" and b["device"] == "cpu"),
               key=lambda t: tuple(map(int, t.split("."))))

# Runs under the forced target in its own interpreter and saves its inputs and outputs
# (torch.save, to the path in PG_SMOKE_OUT); the parent checks them against its float64
# references with each dtype's tolerance.
SMOKE = r"""
import json, os, torch
import portable_gemm as pg
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)  # the NaN sentinel in new outputs, as in conftest
saved = {"gemm": [], "mixed": []}
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    a, b = torch.randn(67, 300).to(dtype), torch.randn(300, 45).to(dtype)
    bias = torch.randn(45).to(dtype)
    out = pg.gemm(a, b, bias=bias, activation="silu")
    saved["gemm"].append({"a": a, "b": b, "bias": bias, "out": out})
for bits, g in ((8, None), (4, 128)):
    w = torch.randn(96, 256)
    q, s = pg.quantize_weight(w, bits=bits, group_size=g)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    out = pg.mixed_linear(x, q, s, bits=bits, group_size=g)
    saved["mixed"].append({"bits": bits, "group": g, "x": x, "q": q, "s": s, "out": out})
torch.library.opcheck(torch.ops.portable_gemm.gemm.default, (a, b, bias, 2))
torch.save(saved, os.environ["PG_SMOKE_OUT"])
print("RESULT" + json.dumps({"info": pg.info()}, default=str))
"""


def run_smoke(env, out_path):
    proc = run_python(SMOKE, env={**env, "PG_SMOKE_OUT": str(out_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    res = json.loads(line[len("RESULT"):])
    res["saved"] = torch.load(out_path)
    return res


def check_smoke_results(saved, target):
    assert len(saved["gemm"]) == 3 and len(saved["mixed"]) == 2
    for c in saved["gemm"]:
        dtype = c["a"].dtype
        assert c["out"].dtype == dtype
        assert_close(c["out"], gemm_ref(c["a"], c["b"], c["bias"], "silu"), dtype,
                     label=f"target {target} gemm {dtype}")
    for c in saved["mixed"]:
        ref = c["x"].double() @ dequant_ref(c["q"], c["s"], c["bits"], c["group"]).T
        assert c["out"].dtype == torch.bfloat16
        assert_close(c["out"], ref, torch.bfloat16, label=f"target {target} mixed int{c['bits']}")


def test_all_five_targets_built():
    assert BUILT == ["2.9", "2.10", "2.11", "2.12", "2.13"]


def test_default_is_newest_eligible():
    rt = tuple(map(int, torch.__version__.split(".")[:2]))
    eligible = [t for t in BUILT if tuple(map(int, t.split("."))) <= rt]
    # the suite may run under a forced target (the GPU session runs it under 2.11, 2.10, 2.9)
    assert pg.info()["target"] == (os.environ.get("PORTABLE_GEMM_TARGET") or eligible[-1])


@pytest.mark.slow
@pytest.mark.parametrize("target", BUILT)
def test_forced_target_computes(target, tmp_path):
    rt = tuple(map(int, torch.__version__.split(".")[:2]))
    if tuple(map(int, target.split("."))) > rt:
        pytest.skip(f"target {target} needs torch >= {target}; runtime is {torch.__version__}")
    res = run_smoke({"PORTABLE_GEMM_TARGET": target}, tmp_path / "smoke.pt")
    info = res["info"]
    assert info["target"] == target
    loaded = [c for c in info["candidates"] if c["status"] == "loaded"]
    assert [c["target"] for c in loaded] == [target]
    assert info["libraries"]["cpu"].endswith(f"portable_gemm_cpu_t{target.replace('.', '_')}.so")
    if target != "2.9":
        want_threads = "torch::stable::parallel_for"
    else:  # torch's OpenMP runtime where torch runs on OpenMP (its Linux wheels), else the own pool
        want_threads = "torch_openmp" if "parallel backend: OpenMP" in torch.__config__.parallel_info() \
            else "portable_gemm_pool"
    assert info["features"]["threading"] == want_threads, info["features"]
    assert info["features"]["threading_why"], info["features"]
    check_smoke_results(res["saved"], target)


@pytest.mark.parametrize("target, pool, threading_", [
    ("2.9", "own", "portable_gemm_pool"),
    ("2.9", "banana", "portable_gemm_pool"),
    ("2.10", "banana", "torch::stable::parallel_for"),
])
def test_pool_env(target, pool, threading_):
    """PORTABLE_GEMM_POOL=own puts target 2.9 on the library's own pool, and says so; a value
    that is neither 'own' nor 'openmp' is warned about at import (only 2.9 reads it)."""
    code = ("import warnings; warnings.simplefilter('always')\n"
            "import json, torch, portable_gemm as pg\n"
            "print('FEATURES', json.dumps(pg.info()['features']))")
    proc = run_python(code, env={"PORTABLE_GEMM_TARGET": target, "PORTABLE_GEMM_POOL": pool})
    assert proc.returncode == 0, proc.stderr[-2000:]
    features = __import__("json").loads(proc.stdout.split("FEATURES ", 1)[1])
    assert features["threading"] == threading_, features
    if target == "2.9":
        assert features["threading_why"].startswith(f"PORTABLE_GEMM_POOL={pool}"), features
    warned = f"PORTABLE_GEMM_POOL='{pool}' is neither 'own' nor 'openmp'" in proc.stderr
    assert warned == (pool not in ("own", "openmp")), proc.stderr[-2000:]


@pytest.mark.parametrize("value, lowers", [("avx2", True), ("", False), ("avx512bf16", False)])
def test_isa_env(value, lowers):
    """PORTABLE_GEMM_ISA lowers the CPU units for testing; an empty value is the same as unset,
    and a name the library does not know is ignored and warned about at import."""
    code = ("import warnings; warnings.simplefilter('always')\n"
            "import torch, portable_gemm as pg\n"
            "print('ISA', pg.info()['features']['cpu_isa'])")
    native = run_python(code, unset=("PORTABLE_GEMM_ISA",))
    proc = run_python(code, env={"PORTABLE_GEMM_ISA": value})
    assert native.returncode == 0 and proc.returncode == 0, (native.stderr[-2000:], proc.stderr[-2000:])
    isa, native_isa = (p.stdout.split("ISA ", 1)[1].strip() for p in (proc, native))
    if lowers:
        assert isa == ("avx2" if native_isa != "generic" else "generic"), (isa, native_isa)
    else:
        assert isa == native_isa, (value, isa, native_isa)
    warned = f"PORTABLE_GEMM_ISA={value!r} is not one of" in proc.stderr
    assert warned == (value == "avx512bf16"), proc.stderr[-2000:]
    assert "PORTABLE_GEMM_ISA" not in native.stderr, native.stderr[-2000:]


@pytest.mark.parametrize("forced,message", [
    ("2.14", r"PORTABLE_GEMM_TARGET=2.14 names no built target"),
    ("9.9", r"PORTABLE_GEMM_TARGET=9.9 names no built target"),
    ("banana", r"is not a version like"),
])
def test_forced_refused_cleanly(forced, message):
    proc = run_python("import torch\nimport portable_gemm", env={"PORTABLE_GEMM_TARGET": forced})
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])  # an exception, not a signal
    assert "ImportError" in proc.stderr
    assert message.replace("\\", "") in proc.stderr or __import__("re").search(message, proc.stderr)
    assert "candidates:" in proc.stderr


def test_forced_newer_than_runtime():
    # Pretend to be torch 2.11: forcing 2.13 must be refused before any dlopen.
    code = ("import torch; torch.__version__ = '2.11.0'\n"
            "import portable_gemm")
    proc = run_python(code, env={"PORTABLE_GEMM_TARGET": "2.13"})
    assert proc.returncode == 1
    assert "PORTABLE_GEMM_TARGET=2.13 is newer than the installed torch 2.11.0" in proc.stderr


def test_torch_older_than_minimum_is_refused():
    proc = run_python("import torch; torch.__version__ = '2.8.0'\nimport portable_gemm")
    assert proc.returncode == 1
    assert "ImportError: portable_gemm: requires torch >= 2.9; found torch 2.8.0" in proc.stderr


def test_door_under_a_refused_torch():
    # The README's advice: with a torch the loader refuses already imported, the door's import
    # loads the package and is refused too; imported before torch, the door works and the
    # torch ops say why at their first use.
    after = run_python("import torch; torch.__version__ = '2.8.0'\nimport portable_gemm.dlpack")
    assert after.returncode == 1 and "requires torch >= 2.9; found torch 2.8.0" in after.stderr, after.stderr[-2000:]
    before = run_python("""
import numpy as np
import portable_gemm.dlpack as door
import torch
torch.__version__ = '2.8.0'
a, b = np.random.rand(5, 7).astype(np.float32), np.random.rand(7, 3).astype(np.float32)
assert np.allclose(door.gemm(a, b), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
import portable_gemm as pg
try:
    pg.gemm(torch.from_numpy(a), torch.from_numpy(b))
    raise AssertionError("the torch op ran under a refused torch")
except ImportError as e:
    assert "requires torch >= 2.9; found torch 2.8.0" in str(e), str(e)
print("OK")
""")
    assert before.returncode == 0 and before.stdout.strip() == "OK", before.stderr[-2000:]


def test_info_cli():
    proc = run_python("from portable_gemm.__main__ import main; main(['info', '--json'])")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["target"] == pg.info()["target"]
    assert {"torch", "target", "candidates", "features", "libraries", "cuda"} <= d.keys()
    assert d["cuda"]["loaded"] is (torch.version.cuda is not None and "cuda" in d["libraries"])
    if torch.version.cuda is None:
        assert "CPU-only build" in d["cuda"]["reason"]
    proc = run_python("from portable_gemm.__main__ import main; main(['info'])")
    assert "candidates:" in proc.stdout and "loaded" in proc.stdout


# The README's first command ends in `python -m portable_gemm demo`: its main job.
DEMO_ROWS = ("gemm float32 +bias gelu", "gemm float16 +bias gelu", "gemm bfloat16 +bias gelu",
             "quantize_weight int8 gchan", "mixed_linear int8 gchan", "quantize_weight int4 g128",
             "mixed_linear int4 g128")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_demo_cli_runs_every_op_and_says_what_it_chose(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    proc = run_python("", args=["-m", "portable_gemm", "demo", "--device", device])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # what it chose and why: the loaded target with its reason, every other candidate's
    target = pg.info()["target"]
    assert f"target       {target}" in out
    assert f"  {target}" in out and "loaded    newest target <= torch" in out
    for cand in pg.info()["candidates"]:
        assert cand["reason"] in out, cand
    # every op ran against its float64 reference within tolerance, on the asked device
    for name in DEMO_ROWS:
        row = next((ln for ln in out.splitlines() if ln.startswith(name + " ")), None)
        assert row is not None, f"no row for {name}:\n{out}"
        cols = row[len(name):].split()
        assert cols[0] == device and cols[-1] == "ok", row
        assert float(cols[-4]) <= float(cols[-3]), row  # rel.err <= tol
    assert f"{len(DEMO_ROWS)} passed, 0 failed" in out


def run_demo_patched(patch: str, device: str = "cpu"):
    """`python -m portable_gemm demo --device DEVICE` after `patch` ran (pg and torch imported)."""
    code = ("import sys, torch, portable_gemm as pg\n" + patch
            + f"from portable_gemm.__main__ import main\nsys.exit(main(['demo', '--device', {device!r}]))\n")
    return run_python(code)


def test_demo_cli_fails_when_an_op_is_wrong():
    # The demo's check can fail: with gemm's output scaled by 1.05 it reports FAIL, exit 1.
    proc = run_demo_patched("real = pg.gemm\npg.gemm = lambda *a, **k: real(*a, **k) * 1.05\n")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("FAIL") == 3 and "4 passed, 3 failed" in proc.stdout


def test_demo_cli_fails_when_the_quantiser_loses_the_weight():
    # mixed_linear's reference is built from q and s; the quantize_weight rows compare them
    # with the weight itself, so zero scales (every weight read as 0) fail there
    proc = run_demo_patched("real = pg.quantize_weight\n"
                            "pg.quantize_weight = lambda *a, **k: (lambda q, s: (q, s * 0))(*real(*a, **k))\n")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    failed = [ln.split("  ")[0] for ln in proc.stdout.splitlines() if ln.endswith("FAIL")]
    assert failed == ["quantize_weight int8 gchan", "quantize_weight int4 g128"], proc.stdout


def test_demo_cli_refuses_cuda_without_a_device():
    # One line and exit 2, not torch's traceback from the first CUDA tensor.
    proc = run_python("", args=["-m", "portable_gemm", "demo", "--device", "cuda"],
                      env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr.startswith("demo: --device cuda asked for, but "), proc.stderr


def test_demo_cli_refuses_cuda_where_the_cuda_binding_is_not_loaded():
    # torch sees a GPU but portable_gemm's CUDA binding did not load (here: a CPU-only torch
    # told it has CUDA): one line with the binding's reason and exit 2, not the dispatcher's
    # "Could not run ... with arguments from the 'CUDA' backend" from the first op
    if pg.info()["cuda"]["loaded"]:
        pytest.skip("the CUDA binding is loaded here")
    reason = pg.info()["cuda"]["reason"]
    proc = run_demo_patched("torch.cuda.is_available = lambda: True\n", device="cuda")
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip() == f"demo: --device cuda asked for, but the CUDA binding is not loaded: {reason}"


@pytest.mark.parametrize("cmd", ["info", "demo"])
def test_cli_prints_the_loaders_refusal_without_a_traceback(cmd):
    proc = run_python("", args=["-m", "portable_gemm", cmd], env={"PORTABLE_GEMM_TARGET": "banana"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "is not a version like" in proc.stderr and "candidates:" in proc.stderr, proc.stderr


@pytest.mark.parametrize("env, target, warning", [
    ({"PORTABLE_GEMM_POOL": "own"}, "2.10", "PORTABLE_GEMM_POOL='own' applies to target 2.9 only"),
    ({"PORTABLE_GEMM_NUM_THREADS": "2"}, "2.10", "PORTABLE_GEMM_NUM_THREADS='2' sizes the library's own pool, "
                                                 "which target 2.10's torch ops do not use"),
    ({"PORTABLE_GEMM_NUM_THREADS": "abc"}, "2.9", "PORTABLE_GEMM_NUM_THREADS='abc' is not a whole number >= 1"),
    ({"PORTABLE_GEMM_NUM_THREADS": "0"}, "2.9", "PORTABLE_GEMM_NUM_THREADS='0' is not a whole number >= 1"),
    ({"PORTABLE_GEMM_HUGE_PAGES": "off"}, "2.10", "PORTABLE_GEMM_HUGE_PAGES='off' is neither '0' (off) nor '1'"),
    ({"PORTABLE_GEMM_NUM_THREADS": "2"}, "2.9", None),
    ({"PORTABLE_GEMM_POOL": "own"}, "2.9", None),
    ({"PORTABLE_GEMM_HUGE_PAGES": "0"}, "2.10", None),
])
def test_env_settings_that_do_nothing_are_warned_about(env, target, warning):
    """A setting the library ignores, or that does nothing under the loaded target, warns at
    import, attributed to the importing line (here `-c` code, "<string>"), not to the package."""
    code = ("import warnings; warnings.simplefilter('always')\n"
            "import json, torch, portable_gemm as pg\n"
            "print('FEATURES', json.dumps(pg.info()['features']))")
    proc = run_python(code, env={"PORTABLE_GEMM_TARGET": target, **env},
                      unset=("PORTABLE_GEMM_POOL", "PORTABLE_GEMM_NUM_THREADS", "PORTABLE_GEMM_HUGE_PAGES"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "RuntimeWarning: portable_gemm:" in ln]
    if warning is None:
        assert not lines, proc.stderr[-2000:]
        return
    assert len(lines) == 1 and warning in lines[0], proc.stderr[-2000:]
    assert lines[0].startswith("<string>:2: RuntimeWarning"), lines[0]
    if "abc" in warning or "'0'" in warning:
        # a malformed count is ignored everywhere: 2.9 keeps the runtime it would have had
        features = json.loads(proc.stdout.split("FEATURES ", 1)[1])
        assert "PORTABLE_GEMM_NUM_THREADS" not in features["threading_why"], features


def test_dir_lists_the_lazily_loaded_names():
    assert {"gemm", "quantize_weight", "mixed_linear", "dequantize_weight", "info", "nn",
            "release_cpu_scratch", "cpu_scratch_bytes", "__version__"} <= set(dir(pg))
