"""Runs tests/cpp/test_kernels_cpu.cpp (the torch-free kernel library through its C++ API,
no torch in the process) against the installed wheel's headers and library, once per
instruction-set path the dispatcher can take on this CPU."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, run_python

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
        return flag in Path("/proc/cpuinfo").read_text().split()  # whole words: avx512f is not avx512fp16
    except OSError:
        return False


AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # what the dispatcher asks for


def expected_isa_names(isa: str) -> set[str]:
    """What the binary's first line (`isa: NAME, threads: ...`, cpu::isa()) must name when run
    with PORTABLE_GEMM_ISA=isa ("native": unset) on this CPU, its flags read independently
    from /proc/cpuinfo; skips where the request is above what the CPU has (the dispatcher
    then quietly takes a lower path, which the run would not test)."""
    avx512 = all(cpu_has(f) for f in AVX512_FLAGS)
    bf16 = avx512 and cpu_has("avx512_bf16")
    amx = bf16 and cpu_has("amx_bf16") and cpu_has("amx_tile")
    need = {"avx2": cpu_has("avx2") and cpu_has("fma"), "avx512": avx512, "avx512_bf16": bf16}
    if not need.get(isa, True):
        pytest.skip(f"PORTABLE_GEMM_ISA={isa} asks for more than this CPU has (no {isa}): the "
                    "dispatcher would fall back to a lower path")
    if isa == "generic":
        return {"generic"}
    if isa == "avx2":
        return {"avx2"}
    if isa == "avx512":  # the fp32-conversion path: no bf16 pair kernels, no AMX
        return {"avx512"}
    if isa == "avx512_bf16":  # the bf16 pair (vdpbf16ps) kernels, no AMX
        return {"avx512+bf16"}
    assert isa == "native", isa
    if not avx512:
        return {"avx2"} if need["avx2"] else {"generic"}
    if not bf16:
        return {"avx512"}
    if not amx:
        return {"avx512+bf16"}
    # Linux grants the AMX tile state on request from 5.16 on; an older kernel may refuse it
    major, minor = (int(v) for v in re.findall(r"\d+", os.uname().release)[:2])
    return {"avx512+bf16+amx"} if (major, minor) >= (5, 16) else {"avx512+bf16+amx", "avx512+bf16"}


# "empty" and "unknown": PORTABLE_GEMM_ISA set to "" or to no known name is ignored, so the
# native choice runs (an empty value once switched AMX off and nothing else).
UNSET_LIKE = {"empty": "", "unknown": "avx512bf16"}
# "avx2_dq_on" / "avx2_dq_off": the AVX2 kernels with PORTABLE_GEMM_AVX2_DQ=1 / 0, so that
# small_rows_dq_avx2 (9-48 rows of x, 13-128 on Zen 1 cores) runs, and does not, on any CPU
# with AVX2: by default the later Zen cores never take it (bench/CPU_NOTES.md 73).
AVX2_DQ = {"avx2_dq_on": "1", "avx2_dq_off": "0"}


@pytest.mark.parametrize("isa", ["native", "avx512_bf16", "avx512", "avx2", "avx2_dq_on", "avx2_dq_off", "generic",
                                 "empty", "unknown"])
def test_kernel_library_cpp(test_binary, isa):
    want = expected_isa_names("native" if isa in UNSET_LIKE else "avx2" if isa in AVX2_DQ else isa)
    env = dict(os.environ)
    env.pop("PORTABLE_GEMM_ISA", None)
    env.pop("PORTABLE_GEMM_AVX2_DQ", None)
    if isa in AVX2_DQ:
        env["PORTABLE_GEMM_ISA"] = "avx2"
        env["PORTABLE_GEMM_AVX2_DQ"] = AVX2_DQ[isa]
    elif isa != "native":
        env["PORTABLE_GEMM_ISA"] = UNSET_LIKE.get(isa, isa)
    proc = subprocess.run([str(test_binary)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    first = proc.stdout.splitlines()[0] if proc.stdout else ""
    got = re.match(r"isa: ([^,]+), threads: ", first)
    assert got, f"first line is not `isa: NAME, threads: ...`: {first!r}"
    assert got.group(1) in want, f"PORTABLE_GEMM_ISA={isa}: the kernels ran {got.group(1)!r}, expected " \
                                 f"{' or '.join(sorted(want))} on this CPU"
    assert "all passed" in proc.stdout, proc.stdout[-500:]


def kernel_sources_without_cuda() -> list[Path]:
    """The kernel library's sources as src/kernels/CMakeLists.txt lists them for a build
    without CUDA (its `set(sources ...)` block and the stub that stands in for CUDA)."""
    cmake = (REPO / "src/kernels/CMakeLists.txt").read_text()
    block = re.search(r"set\(sources\s+([^)]*)\)", cmake)
    stub = re.search(r"list\(APPEND sources (cuda/unavailable\.cpp)\)", cmake)
    assert block and stub, "src/kernels/CMakeLists.txt: no set(sources ...) / CUDA stub found"
    return [REPO / "src/kernels" / f for f in block.group(1).split() + [stub.group(1)]]


def test_kernel_library_without_x86_kernels(tmp_path):
    # What a CPU other than x86 (the aarch64 wheels) compiles: the library without any x86
    # kernel (PG_PORTABLE_ONLY), built here from the sources with warnings as errors and run
    # through the same C++ test. The x86 builds never compile those paths that way: a
    # constant defined only next to the AVX-512 code once broke it unnoticed.
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to build the C++ kernel test")
    exe = tmp_path / "test_kernels_portable"
    cmd = ["g++", "-O2", "-std=c++17", "-DPG_PORTABLE_ONLY", "-Wall", "-Wextra", "-Werror",
           f"-I{REPO / 'include'}", f"-I{REPO / 'src/kernels'}",
           *map(str, kernel_sources_without_cuda()), str(REPO / "tests/cpp/test_kernels_cpu.cpp"),
           "-lpthread", "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.stdout.startswith("isa: generic"), proc.stdout[:200]
    assert "all passed" in proc.stdout, proc.stdout[-500:]


def kernel_cxx_flags() -> list[str]:
    """The C++ flags src/kernels/CMakeLists.txt gives the kernel library (its
    `$<$<COMPILE_LANGUAGE:CXX>:...>` options)."""
    cmake = (REPO / "src/kernels/CMakeLists.txt").read_text()
    flags = re.search(r"target_compile_options\(portable_gemm_kernels PRIVATE\s+"
                      r"\$<\$<COMPILE_LANGUAGE:CXX>:([^>]*)>\)", cmake)
    assert flags, "src/kernels/CMakeLists.txt: the kernel library's CXX options not found"
    return flags.group(1).split()


def test_kernel_library_builds_without_warnings(tmp_path):
    # The x86 library as the wheel builds it (its own flags, every kernel), warnings as
    # errors: the wheel's build log is read for real problems, so it must stay free of
    # noise. Some warnings (-Warray-bounds) come only from the optimiser's inlining, hence
    # the real -O3 and whole objects rather than a syntax check.
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to build the kernel library")
    if os.uname().machine not in ("x86_64", "AMD64"):
        pytest.skip("the x86 kernels build only on x86; test_kernel_library_without_x86_kernels covers this CPU")
    flags = kernel_cxx_flags()
    assert "-Wall" in flags and "-Wextra" in flags, flags
    procs = []
    for i, src in enumerate(kernel_sources_without_cuda()):
        cmd = ["g++", "-std=c++17", "-fPIC", *flags, "-Werror", f"-I{REPO / 'include'}",
               f"-I{REPO / 'src/kernels'}", '-DPG_VERSION="test"', '-DPG_CXX_COMPILER="g++"',
               "-c", str(src), "-o", str(tmp_path / f"{i}.o")]
        procs.append((src, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    failed = []
    for src, proc in procs:
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            failed.append(f"{src.relative_to(REPO)}:\n{err[-3000:]}")
    assert not failed, "\n".join(failed)


def test_cpu_isa_names_the_units_in_use():
    # info()'s cpu_isa says which units the CPU kernels dispatch to; it must agree with the
    # CPU's flags (read independently here), so that a user can tell whether the bf16 pair
    # kernels (vdpbf16ps) and the AMX tile path are in use on their machine.
    isa = portable_gemm.info()["features"]["cpu_isa"]
    if os.environ.get("PORTABLE_GEMM_ISA"):
        pytest.skip("PORTABLE_GEMM_ISA lowers the choice")
    if cpu_has("avx512f") and cpu_has("avx512bw") and cpu_has("avx512vl") and cpu_has("avx512dq"):
        assert isa.startswith("avx512"), isa
        assert ("+bf16" in isa) == cpu_has("avx512_bf16"), isa
        amx_cpu = cpu_has("amx_bf16") and cpu_has("amx_tile") and cpu_has("avx512_bf16")
        if "+amx" in isa:
            assert amx_cpu, isa
        elif amx_cpu:
            # Linux grants the tile state on request from 5.16 on; an older kernel may refuse
            major, minor = (int(v) for v in os.uname().release.split(".")[:2])
            assert (major, minor) < (5, 16), f"{isa}: AMX-BF16 CPU, kernel {os.uname().release}"
    elif cpu_has("avx2") and cpu_has("fma"):
        assert isa == "avx2", isa
    else:
        assert isa == "generic", isa


def cpu_core() -> tuple[str, int, int]:
    """(vendor, family, model) of the first CPU in /proc/cpuinfo, as Linux decodes them."""
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields.get("vendor_id", ""), int(fields.get("cpu family", 0)), int(fields.get("model", 0))


@pytest.mark.parametrize("isa,dq", [("native", None), ("avx2", None), ("avx2", "0"), ("avx2", "1"),
                                    ("avx2", "yes"), ("generic", "1")])
def test_info_names_the_avx2_dequantise_once_rows(isa, dq):
    # info()["features"]["cpu_avx2_dq"] says from which rows of x the AVX2 weight-only
    # kernels dequantise each weight row once (small_rows_dq_avx2), and why: the core kind
    # (read here from /proc/cpuinfo, apart from the library's CPUID) and PORTABLE_GEMM_AVX2_DQ.
    # Absent where the AVX2 kernels do not run.
    if not Path("/proc/cpuinfo").exists() or not (cpu_has("avx2") and cpu_has("fma")):
        pytest.skip("needs an x86 CPU with AVX2 and FMA, read from /proc/cpuinfo")
    env = {}
    if isa != "native":
        env["PORTABLE_GEMM_ISA"] = isa
    if dq is not None:
        env["PORTABLE_GEMM_AVX2_DQ"] = dq
    proc = run_python("import json, warnings, portable_gemm as pg\n"
                      "warnings.simplefilter('ignore')\n"
                      "print(json.dumps(pg.info()['features']))",
                      env=env, unset=("PORTABLE_GEMM_ISA", "PORTABLE_GEMM_AVX2_DQ"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    features = json.loads(proc.stdout.splitlines()[-1])
    got = features.get("cpu_avx2_dq")
    if features["cpu_isa"] != "avx2":
        assert got is None, features
        assert isa == "generic" or any(cpu_has(f) for f in AVX512_FLAGS), features
        return
    assert isa != "generic", features
    vendor, family, model = cpu_core()
    half_width = (vendor == "AuthenticAMD" and family == 0x17 and model < 0x30) or \
                 (vendor == "HygonGenuine" and family == 0x18)
    later_zen = vendor == "AuthenticAMD" and family >= 0x17 and not half_width
    if dq == "0":
        assert got == "off (PORTABLE_GEMM_AVX2_DQ=0)"
    elif half_width:
        assert got.startswith("13 to 128 rows of x (int4 per channel from 16)"), got
        assert ("PORTABLE_GEMM_AVX2_DQ=1" in got) == (dq == "1"), got
    elif dq == "1":
        assert got == "9 to 48 rows of x while x fits 4 MiB as fp32 (PORTABLE_GEMM_AVX2_DQ=1)"
    elif later_zen:  # unset, or a value other than 0 / 1 (warned about): the core decides
        assert got.startswith("off on this core (a later Zen"), got
    else:
        assert got == "9 to 48 rows of x while x fits 4 MiB as fp32"


@pytest.mark.parametrize("probe,args,expect", [
    ("kernel_gemm.cpp", ["37", "29", "300", "2"], r"M=37 N=29 K=300: error \S+, median"),
    ("kernel_mixed_linear.cpp", ["3", "64", "256", "128", "2", "4", "2"], r"bits=4 copies=2: max error .* median"),
    ("kernel_mixed_linear.cpp", ["1", "48", "512", "0", "2", "8", "1"], r"bits=8 copies=1: max error .* median"),
])
def test_bench_probe_builds_and_checks(tmp_path, probe, args, expect):
    """The benchmark's C++ probes (bench/probes/, kernel-library A/Bs in bench/CPU_NOTES.md)
    build against the installed headers and library, and their float64 self-check passes
    (each exits non-zero on a wrong result) on a small case."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to build the probes")
    exe = tmp_path / probe.removesuffix(".cpp")
    cmd = ["g++", "-O2", "-std=c++17", f"-I{PKG / 'include'}", str(REPO / "bench/probes" / probe),
           f"-L{PKG / 'lib'}", "-lportable_gemm_kernels", f"-Wl,-rpath,{PKG / 'lib'}", "-lpthread", "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PORTABLE_GEMM_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(expect, proc.stdout), proc.stdout
