"""C++ consumers: the wheel's CMake package finds the kernel library; a downstream
stable-ABI op built against it (examples/cpp_consumer) loads and computes."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, run_python


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("c++") is None,
                    reason="needs cmake and a C++ compiler")
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
