"""AOTInductor packages of a small model, for tests/test_torch_integration.py and
tests/test_cpp_consumer.py; run as a script, the child process that builds and checks one:

    python aoti_check.py ours|plain DEVICE DIR [MODULE]

MODULE is the package whose ops "ours" calls: portable_gemm, or a vendored copy importable
in the child (its folder on PYTHONPATH). It exports the model with a dynamic batch, compiles it into an AOTInductor package in DIR,
loads it back and runs it at two batch sizes; it prints "compiled", "loaded", "ran" as it
gets there and "ok" at the end. "ours" is a gemm with bias and SiLU, then an int4 g32 and an
int8 per-channel QuantizedLinear: the package's extern-call spec must name both ops and its
output must equal eager bit for bit. "plain" is the same shapes in torch's own nn.Linear
layers: the control that tells a broken AOTInductor toolchain on the machine from a fault of
ours. It must compile, load and run; its bits are not compared, since Inductor may fuse
torch's layers differently from eager (on CUDA it splits addmm + SiLU).

A child, because loading a package that the machine's toolchain built wrong can crash the
process: on the lent GPU machines (torch 2.11), packages built through their CXX, a wrapper
script around g++ 13, crash at load with signal 11, the plain model's too; /usr/bin/g++
builds working ones (bench/GPU_NOTES.md, runs 101-103).
"""

import importlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import torch


def build(kind: str, device: str, module: str = "portable_gemm") -> torch.nn.Module:
    torch.manual_seed(0)

    def linear(k, n):
        return torch.nn.Linear(k, n).to(device=device, dtype=torch.bfloat16)

    if kind == "plain":
        return torch.nn.Sequential(linear(48, 64), torch.nn.SiLU(), linear(64, 40), linear(40, 24)).eval()
    pg = importlib.import_module(module)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            first = linear(48, 64)
            self.w = torch.nn.Parameter(first.weight.detach().t().contiguous(), requires_grad=False)
            self.b = torch.nn.Parameter(first.bias.detach(), requires_grad=False)
            self.q4 = pg.nn.QuantizedLinear.from_linear(linear(64, 40), bits=4, group_size=32)
            self.q8 = pg.nn.QuantizedLinear.from_linear(linear(40, 24), bits=8, group_size=None)

        def forward(self, x):
            return self.q8(self.q4(pg.gemm(x, self.w, bias=self.b, activation="silu")))

    return Block().eval()


def export(m: torch.nn.Module, device: str) -> torch.export.ExportedProgram:
    """m exported with a dynamic batch (2 to 64 rows of 48)."""
    batch = torch.export.Dim("batch", min=2, max=64)
    x0 = torch.randn(5, 48, device=device).to(torch.bfloat16)
    return torch.export.export(m, (x0,), dynamic_shapes=({0: batch},))


def main(kind: str, device: str, out: Path, module: str = "portable_gemm") -> None:
    m = build(kind, device, module)
    ep = export(m, device)
    out.mkdir(parents=True, exist_ok=True)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(out / f"{kind}.pt2"))
    print("compiled", path, flush=True)
    if kind == "ours":
        pg = importlib.import_module(module)

        # the extern-call spec names both ops: they are called, not traced into
        with zipfile.ZipFile(path) as z:
            spec = b"".join(z.read(n) for n in z.namelist() if n.endswith(".wrapper.json"))
        ns = pg.info()["namespace"]
        for op in ("gemm", "mixed_linear"):
            assert f"{ns}::{op}".encode() in spec, (op, spec[:400])
    run = torch._inductor.aoti_load_package(path)
    print("loaded", flush=True)
    for rows in (3, 17):
        x = torch.randn(rows, 48, device=device).to(torch.bfloat16)
        y, want = run(x), m(x)
        print("ran", flush=True)
        assert y.shape == (rows, 24), y.shape
        # The control only probes the toolchain: Inductor may fuse torch's own layers
        # differently from eager (on CUDA it splits addmm + SiLU), so its bits may differ.
        if kind == "ours":
            assert torch.equal(y, want), f"rows {rows}: max |diff| {(y.float() - want.float()).abs().max().item()}"
    print("ok", flush=True)


def child(kind: str, device: str, out: Path, module: str = "portable_gemm",
          path: Path | None = None) -> subprocess.CompletedProcess:
    """This script in a child process, path (where module lives) first on its PYTHONPATH. The target in force (PORTABLE_GEMM_TARGET) carries
    over. PG_TEST_AOTI_CXX, where set, is the C++ compiler AOTInductor runs there (its CXX):
    ci/gpu_session.sh sets it on the GPU machines, whose CXX wrapper builds packages that
    crash at load (runs 101-103)."""
    env = dict(os.environ)
    if os.environ.get("PG_TEST_AOTI_CXX"):
        env["CXX"] = os.environ["PG_TEST_AOTI_CXX"]
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, __file__, kind, device, str(out), module], capture_output=True,
                          text=True, timeout=300, env=env)


STAGES = ("compiled", "loaded", "ran")  # what a child prints as it gets there


def stage(r: subprocess.CompletedProcess) -> int:
    """How far a child got: the number of STAGES it printed (as whole lines)."""
    lines = {line.split(" ")[0] for line in r.stdout.splitlines()}
    return sum(s in lines for s in STAGES)


_packages: dict[tuple, Path | str] = {}  # (device, module, path) -> the package, or why the tests skip


def package_or_skip(device: str, out: Path, module: str = "portable_gemm", path: Path | None = None) -> Path:
    """Builds the "ours" package of module (found in path) in a child (checked there against
    eager) and returns its path; once a session per device and module, the tests that need it
    share it. Where ours fails without an
    assertion of ours and the plain control fails at the same stage or earlier, torch's
    AOTInductor does not work on this machine: the calling test is skipped with the reason.
    Any other failure fails the test."""
    import pytest

    key = (device, module, path)
    done = _packages.get(key)
    if isinstance(done, Path):
        return done
    if isinstance(done, str):
        pytest.skip(done)
    r = child("ours", device, out / "ours", module, path)
    if r.returncode != 0 and "AssertionError" not in r.stderr:
        control = child("plain", device, out / "plain")
        if control.returncode != 0 and stage(control) <= stage(r):
            why = (f"torch {torch.__version__}'s AOTInductor fails on this machine without our ops too "
                   f"(CXX={os.environ.get('PG_TEST_AOTI_CXX') or os.environ.get('CXX') or 'unset'}): a package of "
                   f"plain nn.Linear layers exits {control.returncode} after {stage(control)} of the stages "
                   f"{', '.join(STAGES)} (ours: {stage(r)}); "
                   f"{(control.stderr.strip().splitlines() or ['no output'])[-1][:200]}")
            _packages[key] = why
            pytest.skip(why)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("ok"), r.stdout[-3000:] + r.stderr[-3000:]
    _packages[key] = out / "ours" / "ours.pt2"
    return _packages[key]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), *sys.argv[4:5])
