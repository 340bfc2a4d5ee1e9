"""Child process of test_torch_integration.py's AOTInductor test.

    python aoti_check.py ours|plain DEVICE DIR

Exports a small model with a dynamic batch, compiles it into an AOTInductor package in DIR,
loads it back and compares it with eager at two batch sizes, bit for bit; prints "ok" at the
end. "ours" is a gemm with bias and SiLU, then an int4 g32 and an int8 per-channel
QuantizedLinear, and the package's extern-call spec must name both ops; "plain" is the same
shapes in torch's own nn.Linear layers, the control that tells a broken AOTInductor
toolchain on the machine from a fault of ours. It runs in a child because loading a package
that the machine's toolchain built wrong can crash the process: on the lent GPU machines
(torch 2.11), packages built through their CXX, a wrapper script around g++ 13, crash at load
with signal 11, the plain model's too; /usr/bin/g++ builds working ones (bench/GPU_NOTES.md,
runs 101-103).
"""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import torch


def build(kind: str, device: str) -> torch.nn.Module:
    torch.manual_seed(0)

    def linear(k, n):
        return torch.nn.Linear(k, n).to(device=device, dtype=torch.bfloat16)

    if kind == "plain":
        return torch.nn.Sequential(linear(48, 64), torch.nn.SiLU(), linear(64, 40), linear(40, 24)).eval()
    import portable_gemm as pg

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


def main(kind: str, device: str, out: Path) -> None:
    m = build(kind, device)
    ep = export(m, device)
    out.mkdir(parents=True, exist_ok=True)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(out / f"{kind}.pt2"))
    print("compiled", path, flush=True)
    if kind == "ours":
        import portable_gemm as pg

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
        assert y.shape == (rows, 24), y.shape
        assert torch.equal(y, want), f"rows {rows}: max |diff| {(y.float() - want.float()).abs().max().item()}"
    print("ok", flush=True)


def child(kind: str, device: str, out: Path) -> subprocess.CompletedProcess:
    """This script in a child process. The target in force (PORTABLE_GEMM_TARGET) carries
    over. PG_TEST_AOTI_CXX, where set, is the C++ compiler AOTInductor runs there (its CXX):
    ci/gpu_session.sh sets it on the GPU machines, whose CXX wrapper builds packages that
    crash at load (runs 101-103)."""
    env = dict(os.environ)
    if os.environ.get("PG_TEST_AOTI_CXX"):
        env["CXX"] = os.environ["PG_TEST_AOTI_CXX"]
    return subprocess.run([sys.executable, __file__, kind, device, str(out)], capture_output=True, text=True,
                          timeout=1200, env=env)


def package_or_skip(device: str, out: Path) -> Path:
    """Builds the "ours" package in a child (checked there against eager) and returns its path.
    Where that fails before loading and the plain control fails too, torch's AOTInductor does
    not work on this machine: the calling test is skipped with the reason. Any other failure
    fails the test."""
    import pytest

    r = child("ours", device, out / "ours")
    if r.returncode != 0 and "loaded" not in r.stdout:
        control = child("plain", device, out / "plain")
        if control.returncode != 0:
            pytest.skip(f"torch {torch.__version__}'s AOTInductor fails on this machine without our ops "
                        f"too (CXX={os.environ.get('PG_TEST_AOTI_CXX') or os.environ.get('CXX') or 'unset'}): "
                        f"a package of plain nn.Linear layers exits {control.returncode} "
                        f"({(control.stderr.strip().splitlines() or ['no output'])[-1][:200]})")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("ok"), r.stdout[-3000:] + r.stderr[-3000:]
    return out / "ours" / "ours.pt2"


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
