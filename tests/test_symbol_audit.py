"""ci/symbol_audit.py can fail, and fails for the right reason.

Tiny binding libraries are compiled here with g++ against the stable-ABI headers of the
torch in this interpreter and audited against the committed export lists
(version_matrix/exports/*.json, written by ci/gen_exports.py): no network.

- a target-2.9 binding that calls the 2.10-only C shim `torch_parallel_for` through a
  hand-written extern "C" declaration (the header gate cannot see it) is rejected, naming
  the symbol and the runtime (2.9.1) that lacks it;
- the same call through `torch::stable::parallel_for` does not even compile at target 2.9
  (and does at 2.10: the failure is the version gate, nothing else);
- a correct minimal target-2.9 binding passes;
- a kernel library touching torch or Python, and a CUDA binding using the wrong stream API
  for its target, are rejected.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
AUDIT = ROOT / "ci" / "symbol_audit.py"
EXPORTS = ROOT / "version_matrix" / "exports"

GXX = shutil.which("g++")
GCC = shutil.which("gcc") or shutil.which("cc")
pytestmark = pytest.mark.skipif(GXX is None or GCC is None,
                                reason="g++/gcc not found: cannot compile the test bindings")

T29 = "0x0209000000000000"
T210 = "0x020a000000000000"


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin, "torch is not installed in this interpreter"
    return Path(spec.origin).parent


TORCH = _torch_dir()
INC = TORCH / "include"
LIB = TORCH / "lib"

GOOD_SRC = r"""
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/core/ScalarType.h>

namespace {
torch::stable::Tensor twice(torch::stable::Tensor a) {
  STD_TORCH_CHECK(a.scalar_type() == torch::headeronly::ScalarType::Float, "float only");
  torch::stable::Tensor out = torch::stable::empty_like(a);
  const float* src = static_cast<const float*>(a.data_ptr());
  float* dst = static_cast<float*>(out.data_ptr());
  for (int64_t i = 0; i < a.numel(); ++i) dst[i] = 2 * src[i];
  return out;
}
}  // namespace

STABLE_TORCH_LIBRARY(audit_test, m) { m.def("twice(Tensor a) -> Tensor"); }
STABLE_TORCH_LIBRARY_IMPL(audit_test, CPU, m) { m.impl("twice", TORCH_BOX(&twice)); }
"""

# The bug the audit exists for: a 2.10-only C shim reached around the header gate. It is
# linked into the same binding as GOOD_SRC (one translation unit of its own, so the torch
# headers are parsed once for both libraries).
SNEAKY_SRC = r"""
#include <cstdint>
extern "C" {
typedef void (*PgParallelFunc)(int64_t, int64_t, void*);
int32_t torch_parallel_for(int64_t, int64_t, int64_t, PgParallelFunc, void*);
}
namespace {
void body(int64_t, int64_t, void*) {}
}
extern "C" __attribute__((visibility("default"))) int pg_sneaky(void) {
  return torch_parallel_for(0, 10, 1, &body, nullptr);
}
"""

PARALLEL_SRC = r"""
#include <torch/csrc/stable/ops.h>
void fill(float* p, int64_t n) {
  torch::stable::parallel_for(0, n, 1024, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) p[i] = 0.f;
  });
}
"""

KERNEL_OK_SRC = "int pg_kernel_version(void) { return 1; }\n"

KERNEL_BAD_SRC = r"""
int aoti_torch_get_numel(void*, long*);
void* PyLong_FromLong(long);
int pg_kernel_version(void) { long n; PyLong_FromLong(1); return aoti_torch_get_numel(0, &n); }
"""

# A "CUDA binding" for target 2.13 that still uses the pre-2.13 stream API.
CUDA_OLD_STREAM_SRC = r"""
int aoti_torch_get_current_cuda_stream(int, void**);
int pg_stream(void** s) { return aoti_torch_get_current_cuda_stream(0, s); }
"""


def _compile(src: str, out: Path, *extra: str, cxx: bool = True) -> subprocess.Popen:
    out.parent.mkdir(parents=True, exist_ok=True)
    ext = ".cpp" if cxx else ".c"
    src_path = out.with_name(out.name + ext)
    src_path.write_text(src)
    cmd = [GXX if cxx else GCC, "-O0", "-fPIC", "-fvisibility=hidden", str(src_path), *extra]
    if cxx:
        cmd[1:1] = ["-std=c++17", "-Wundef", "-isystem", str(INC)]
    return subprocess.Popen(cmd + (["-o", str(out)] if "-fsyntax-only" not in extra else []),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _torch_link(*libs: str) -> list[str]:
    return ["-shared", "-L", str(LIB), *[f"-l{l}" for l in libs], "-Wl,-z,defs"]


def _finish(p: subprocess.Popen) -> tuple[int, str]:
    out, _ = p.communicate(timeout=120)
    return p.returncode, out


def _fake_wheel(root: Path, libs: dict[str, Path], entries: list[dict]) -> Path:
    lib_dir = root / "portable_gemm" / "lib"
    lib_dir.mkdir(parents=True)
    for name, path in libs.items():
        shutil.copy2(path, lib_dir / name)
    (lib_dir / "manifest.json").write_text(json.dumps({
        "binaries": [{"file": "libportable_gemm_kernels.so", "kind": "kernels", "device": "cpu"}]
        + entries}, indent=2))
    return root


def _audit(path: Path) -> tuple[int, str]:
    r = subprocess.run([sys.executable, str(AUDIT), str(path)], capture_output=True, text=True,
                       timeout=60)
    return r.returncode, r.stdout + r.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """Compile every test library once, in parallel (the C++ ones dominate: ~3 s each)."""
    assert (LIB / "libtorch_cpu.so").exists(), f"no libtorch_cpu.so under {LIB}"
    assert sorted(EXPORTS.glob("torch-*.json")), "no committed export lists (run ci/gen_exports.py)"
    d = tmp_path_factory.mktemp("audit_bins")
    out = {k: d / f"{k}.so" for k in ("good", "bad", "kernel_ok", "kernel_bad", "cuda_stub", "cuda_old")}
    good_o, sneaky_o = d / "good.o", d / "sneaky.o"
    jobs = {
        "good.o": _compile(GOOD_SRC, good_o, f"-DTORCH_TARGET_VERSION={T29}", "-c"),
        "sneaky.o": _compile(SNEAKY_SRC, sneaky_o, f"-DTORCH_TARGET_VERSION={T29}", "-c"),
        "kernel_ok": _compile(KERNEL_OK_SRC, out["kernel_ok"], "-shared", cxx=False),
        "kernel_bad": _compile(KERNEL_BAD_SRC, out["kernel_bad"], "-shared", cxx=False),
        # Stand-in for libtorch_cuda.so (this torch may be a CPU build): only its SONAME matters.
        "cuda_stub": _compile("void pg_stub(void) {}\n", out["cuda_stub"], "-shared",
                              "-Wl,-soname,libtorch_cuda.so", cxx=False),
    }
    for k, p in jobs.items():
        rc, log = _finish(p)
        assert rc == 0, f"compiling {k} failed:\n{log}"
    for k, objs in (("good", [good_o]), ("bad", [good_o, sneaky_o])):
        rc, log = _finish(subprocess.Popen([GXX, "-fPIC", *map(str, objs), *_torch_link("torch_cpu", "c10"),
                                            "-o", str(out[k])], stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True))
        assert rc == 0, f"linking {k} failed:\n{log}"
    stub_dir = d / "stub"
    stub_dir.mkdir()
    shutil.copy2(out["cuda_stub"], stub_dir / "libtorch_cuda.so")
    rc, log = _finish(_compile(CUDA_OLD_STREAM_SRC, out["cuda_old"], "-shared", "-L", str(LIB),
                               "-L", str(stub_dir), "-Wl,--no-as-needed", "-ltorch_cpu", "-lc10",
                               "-ltorch_cuda", cxx=False))
    assert rc == 0, f"compiling cuda_old failed:\n{log}"
    return out


def test_exports_committed_for_every_matrix_runtime():
    m = json.loads((ROOT / "version_matrix" / "matrix.json").read_text())
    for r in m["runtimes"] + m.get("refused", []):
        f = EXPORTS / f"torch-{r['torch']}.json"
        assert f.exists(), f"missing {f.name}: run python ci/gen_exports.py {r['torch']}"
        data = json.loads(f.read_text())
        assert data["wheel"].startswith(f"torch-{r['torch']}") and len(data["sha256"]) == 64
        assert len(data["libraries"]["libtorch_cpu.so"]) > 100
        if r in m["runtimes"]:  # outputs of every target come from it (compat/alloc.h)
            assert "aoti_torch_empty_strided" in data["libraries"]["libtorch_cpu.so"], f.name
    # the facts the version branches rest on
    ex = {v: json.loads((EXPORTS / f"torch-{v}.json").read_text())["libraries"] for v in ("2.9.1", "2.10.0", "2.13.0")}
    assert "torch_parallel_for" not in ex["2.9.1"]["libtorch_cpu.so"]
    assert "torch_parallel_for" in ex["2.10.0"]["libtorch_cpu.so"]
    assert "aoti_torch_cuda_caching_allocator_raw_alloc" not in ex["2.9.1"]["libtorch_cuda.so"]
    assert "torch_stream_native_handle" in ex["2.13.0"]["libtorch_cpu.so"]


def test_good_target_29_binding_passes(built, tmp_path):
    wheel = _fake_wheel(tmp_path, {"portable_gemm_cpu_t2_9.so": built["good"],
                                   "libportable_gemm_kernels.so": built["kernel_ok"]},
                        [{"file": "portable_gemm_cpu_t2_9.so", "kind": "binding", "device": "cpu", "target": "2.9"}])
    rc, out = _audit(wheel)
    assert rc == 0, out
    assert "symbol audit passed" in out
    assert "symbols added after 2.9: none" in out
    assert "(f) skipped: no CUDA bindings" in out


def test_binding_calling_2_10_shim_at_target_29_fails(built, tmp_path):
    wheel = _fake_wheel(tmp_path, {"portable_gemm_cpu_t2_9.so": built["bad"],
                                   "libportable_gemm_kernels.so": built["kernel_ok"]},
                        [{"file": "portable_gemm_cpu_t2_9.so", "kind": "binding", "device": "cpu", "target": "2.9"}])
    rc, out = _audit(wheel)
    assert rc == 1, out
    viol = [l for l in out.splitlines() if "VIOLATION" in l]
    assert any("torch 2.9.1" in l and "torch_parallel_for" in l for l in viol), out
    # only 2.9.1 lacks it; every later runtime exports it
    assert not any("torch 2.10.0" in l for l in viol), out
    # (e) names what ties the binary to 2.10
    assert any(l.split() == ["2.10.0", "torch_parallel_for"] for l in out.splitlines()), out
    assert "SYMBOL AUDIT FAILED" in out


def test_binding_name_fallback_without_manifest(built, tmp_path):
    lib_dir = tmp_path / "portable_gemm" / "lib"
    lib_dir.mkdir(parents=True)
    shutil.copy2(built["bad"], lib_dir / "portable_gemm_cpu_t2_9.so")
    shutil.copy2(built["kernel_ok"], lib_dir / "libportable_gemm_kernels.so")
    rc, out = _audit(tmp_path)
    assert rc == 1 and "torch_parallel_for" in out and "classifying by file name" in out, out
    # the same binary declared as target 2.10 is fine: 2.10.0+ all export the symbol
    (lib_dir / "portable_gemm_cpu_t2_9.so").rename(lib_dir / "portable_gemm_cpu_t2_10.so")
    rc, out = _audit(tmp_path)
    assert rc == 0, out


def test_stable_parallel_for_does_not_compile_at_target_29(tmp_path):
    p29 = _compile(PARALLEL_SRC, tmp_path / "p29", f"-DTORCH_TARGET_VERSION={T29}", "-fsyntax-only")
    p210 = _compile(PARALLEL_SRC, tmp_path / "p210", f"-DTORCH_TARGET_VERSION={T210}", "-fsyntax-only")
    rc29, log29 = _finish(p29)
    rc210, log210 = _finish(p210)
    assert rc29 != 0, f"torch::stable::parallel_for compiled at target 2.9:\n{log29}"
    assert "parallel_for" in log29 and "error" in log29, log29
    assert rc210 == 0, f"the same source must compile at target 2.10:\n{log210}"


def test_kernel_library_must_be_torch_and_python_free(built, tmp_path):
    wheel = _fake_wheel(tmp_path, {"portable_gemm_cpu_t2_9.so": built["good"],
                                   "libportable_gemm_kernels.so": built["kernel_bad"]},
                        [{"file": "portable_gemm_cpu_t2_9.so", "kind": "binding", "device": "cpu", "target": "2.9"}])
    rc, out = _audit(wheel)
    assert rc == 1, out
    assert "(c) kernel library has undefined torch symbols: aoti_torch_get_numel" in out, out
    assert "(d) uses/exports Python C-API symbols: PyLong_FromLong" in out, out


def test_cuda_binding_stream_api_follows_target(built, tmp_path):
    wheel = _fake_wheel(tmp_path, {"portable_gemm_cuda_t2_13.so": built["cuda_old"],
                                   "portable_gemm_cuda_t2_9.so": built["cuda_old"],
                                   "libportable_gemm_kernels.so": built["kernel_ok"]},
                        [{"file": "portable_gemm_cuda_t2_13.so", "kind": "binding", "device": "cuda", "target": "2.13"},
                         {"file": "portable_gemm_cuda_t2_9.so", "kind": "binding", "device": "cuda", "target": "2.9"}])
    rc, out = _audit(wheel)
    assert rc == 1, out
    viol = [l for l in out.splitlines() if "VIOLATION" in l]
    assert any("(f) target 2.13" in l and "does not import torch_stream_native_handle" in l for l in viol), out
    assert any("(f) target 2.13" in l and "still imports aoti_torch_get_current_cuda_stream" in l for l in viol), out
    assert not any("(f) target 2.9" in l for l in viol), out
    # the old stream API is exported by libtorch_cuda of every runtime: no (a) violation
    assert not any("(a)" in l for l in viol), out
