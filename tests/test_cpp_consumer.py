"""C++ consumers: the wheel's CMake package finds the kernel library; a downstream
stable-ABI op built against it (examples/cpp_consumer) loads and computes; a C++ program
without Python runs an AOTInductor package that calls the ops (examples/aoti_cpp)."""

import json
import os
import shutil
import subprocess
import sys

import aoti_check  # tests/aoti_check.py
import pytest
import torch
from conftest import REPO, run_python

import portable_gemm as pg

needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("c++") is None,
                                 reason="needs cmake and a C++ compiler")


@needs_cmake
def test_cpp_consumer_builds_and_runs(tmp_path):
    cmake_dir = subprocess.run([sys.executable, "-m", "portable_gemm", "--cmake-dir"], capture_output=True,
                               text=True, check=True).stdout.strip()
    assert os.path.isfile(os.path.join(cmake_dir, "PortableGemmConfig.cmake"))
    torch_inc = os.path.join(os.path.dirname(torch.__file__), "include")
    build = tmp_path / "build"
    cfg = subprocess.run(["cmake", "-S", str(REPO / "examples" / "cpp_consumer"), "-B", str(build),
                          f"-DPortableGemm_DIR={cmake_dir}", f"-DTORCH_INCLUDE_DIR={torch_inc}",
                          "-DCMAKE_BUILD_TYPE=Release"], capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    bld = subprocess.run(["cmake", "--build", str(build)], capture_output=True, text=True)
    assert bld.returncode == 0, bld.stdout + bld.stderr
    lib = build / "libmylib_ops.so"
    code = f"""
import torch
torch.ops.load_library({str(lib)!r})
a, b = torch.randn(17, 33), torch.randn(33, 9)
out = torch.ops.mylib.scaled_gemm(a, b, 0.5)
ref = 0.5 * (a.double() @ b.double())
err = ((out.double() - ref).norm() / ref.norm()).item()
assert err < 1e-5, err
print("OK", err)
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("OK")


@pytest.fixture(scope="module")
def run_package(tmp_path_factory):
    """examples/aoti_cpp built once for this module's tests: the run_package program."""
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.skip("needs cmake and a C++ compiler")
    torch_dir = os.path.dirname(torch.__file__)
    build = tmp_path_factory.mktemp("aoti_cpp") / "build"
    # the compiler the packages are built with, where the session names one (aoti_check.child)
    cxx = [f"-DCMAKE_CXX_COMPILER={os.environ['PG_TEST_AOTI_CXX']}"] if os.environ.get("PG_TEST_AOTI_CXX") else []
    for cmd in (["cmake", "-S", str(REPO / "examples" / "aoti_cpp"), "-B", str(build), f"-DTORCH_DIR={torch_dir}",
                 "-DCMAKE_BUILD_TYPE=Release", *cxx], ["cmake", "--build", str(build)]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return build / "run_package"


ROWS = 9


def run_cpp(exe, package, tmp_path, bindings, namespace=None) -> tuple[subprocess.CompletedProcess, torch.Tensor]:
    """run_package on a fixed bf16 input of ROWS x 48: the process, and the input."""
    x = torch.randn(ROWS, 48, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    (tmp_path / "x.bin").write_bytes(x.view(torch.int16).numpy().tobytes())
    ns = ["--namespace", namespace] if namespace else []
    r = subprocess.run([str(exe), *ns, str(package), str(tmp_path / "x.bin"), str(tmp_path / "y.bin"), str(ROWS), "48",
                        *bindings], capture_output=True, text=True, timeout=600)
    return r, x


def output(tmp_path) -> torch.Tensor:
    return torch.frombuffer(bytearray((tmp_path / "y.bin").read_bytes()), dtype=torch.bfloat16).view(ROWS, 24)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_aoti_package_runs_from_cpp_without_python(tmp_path, device, request):
    # Deployment without Python: examples/aoti_cpp loads the bindings this process's loader
    # picked, registers the ops (portable_gemm_register) and runs the package through
    # torch's AOTIModelPackageLoader. Its output must equal the eager model's bit for bit.
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if device == "cuda" and "cuda" not in pg.info()["libraries"]:
        pytest.skip(f"no CUDA binding loaded: {pg.info()['cuda'].get('reason')}")
    package = aoti_check.package_or_skip(device, tmp_path)
    run_package = request.getfixturevalue("run_package")  # built once the package exists
    devices = ["cpu"] + (["cuda"] if device == "cuda" else [])  # the CPU binding defines the ops
    bindings = [pg.info()["libraries"][d] for d in devices]
    run, x = run_cpp(run_package, package, tmp_path, bindings)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # the bindings the loader picked: one line each, CPU then CUDA, of this target
    infos = [json.loads(line.split(" ", 1)[1]) for line in run.stdout.splitlines() if line.startswith("binding ")]
    assert [(i["target"], i["device"]) for i in infos] == [(pg.info()["target"], d) for d in devices], run.stdout
    assert f"output [{ROWS}, 24] BFloat16 from {device}" in run.stdout, run.stdout
    with torch.no_grad():
        want = aoti_check.build("ours", device)(x.to(device)).cpu()
    assert torch.equal(output(tmp_path), want), (output(tmp_path).float() - want.float()).abs().max()


def test_aoti_package_of_a_vendored_copy_runs_from_cpp(tmp_path, request):
    # A downstream library that vendored the ops exports its model with its own namespace:
    # run_package --namespace registers the copy's binding under it. Without the option the
    # package's ops are missing (registered as portable_gemm::*), and torch says so.
    from portable_gemm._vendor import vendor

    root = tmp_path / "downstream"
    vendor(root / "pg_copy", "downstream_ns")
    package = aoti_check.package_or_skip("cpu", tmp_path / "pkg", module="pg_copy", path=root)
    run_package = request.getfixturevalue("run_package")
    # the copy's CPU binding for this torch: the one its own loader picks
    probe = run_python(f"import json, sys; sys.path.insert(0, {str(root)!r}); import pg_copy; "
                       "print(json.dumps(pg_copy.info()))")
    assert probe.returncode == 0, probe.stderr[-2000:]
    info = json.loads(probe.stdout)
    binding = info["libraries"]["cpu"]
    assert binding.startswith(str(root / "pg_copy")) and info["namespace"] == "downstream_ns", info

    run, x = run_cpp(run_package, package, tmp_path, [binding], namespace="downstream_ns")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"output [{ROWS}, 24] BFloat16 from cpu" in run.stdout, run.stdout
    with torch.no_grad():
        want = aoti_check.build("ours", "cpu")(x)  # the same weights, through portable_gemm's ops
    assert torch.equal(output(tmp_path), want), (output(tmp_path).float() - want.float()).abs().max()

    wrong, _ = run_cpp(run_package, package, tmp_path, [binding])
    assert wrong.returncode == 7, wrong.stdout[-2000:] + wrong.stderr[-2000:]
    # torch 2.13: "Could not find schema for downstream_ns::gemm"
    assert "downstream_ns::gemm" in wrong.stderr, wrong.stderr[-2000:]
