"""Runs tests/cpp/test_kernels_cpu.cpp (the torch-free kernel library through its C++ API,
no torch in the process) against the installed wheel's headers and library, once per
instruction-set path the dispatcher can take on this CPU."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

import portable_gemm

PKG = Path(portable_gemm.__file__).resolve().parent


@pytest.fixture(scope="module")
def test_binary(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to build the C++ kernel test")
    exe = tmp_path_factory.mktemp("cpp") / "test_kernels_cpu"
    cmd = ["g++", "-O2", "-std=c++17", f"-I{PKG / 'include'}", str(REPO / "tests/cpp/test_kernels_cpu.cpp"),
           f"-L{PKG / 'lib'}", "-lportable_gemm_kernels", f"-Wl,-rpath,{PKG / 'lib'}", "-lpthread", "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return exe


def cpu_has(flag: str) -> bool:
    try:
        return f" {flag}" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("isa", ["native", "avx512", "avx2", "generic"])
def test_kernel_library_cpp(test_binary, isa):
    if isa in ("avx512", "avx2") and not cpu_has({"avx512": "avx512f", "avx2": "avx2"}[isa]):
        pytest.skip(f"this CPU has no {isa}")
    env = dict(os.environ)
    if isa != "native":
        env["PORTABLE_GEMM_ISA"] = isa
    proc = subprocess.run([str(test_binary)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
