"""Vendoring without rebuilding: a copy under another namespace lives beside the real package."""

import pytest
import torch
from conftest import REPO, assert_close, dequant_ref, run_python

import portable_gemm as pg
from portable_gemm._vendor import vendor


@pytest.fixture(scope="module")
def vendored(tmp_path_factory):
    root = tmp_path_factory.mktemp("downstream")
    vendor(root / "pg_copy", "downstream_ns")
    return root


def test_real_and_vendored_in_one_process(vendored):
    code = f"""
import importlib, sys, torch
sys.path.insert(0, {str(vendored)!r})
import portable_gemm as pg
import pg_copy
a, b = torch.randn(9, 40), torch.randn(40, 7)
r1 = pg.gemm(a, b, activation="relu")
r2 = pg_copy.gemm(a, b, activation="relu")
assert torch.equal(r1, r2)
assert torch.equal(torch.ops.downstream_ns.gemm(a, b, None, 1), r1)
assert pg_copy.info()["namespace"] == "downstream_ns" and pg.info()["namespace"] == "portable_gemm"
assert pg_copy.info()["libraries"]["cpu"].startswith({str(vendored)!r})
w = torch.randn(16, 64)
q, s = pg_copy.quantize_weight(w, bits=4, group_size=32)
x = torch.randn(3, 64)
assert torch.equal(pg_copy.mixed_linear(x, q, s, bits=4, group_size=32),
                   pg.mixed_linear(x, q, s, bits=4, group_size=32))
importlib.reload(pg_copy)          # importing the same copy again is harmless
assert torch.equal(pg_copy.gemm(a, b, activation="relu"), r1)
print("OK")
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("OK")


def test_vendor_cli_and_refusals(tmp_path):
    proc = run_python("from portable_gemm.__main__ import main; import sys; "
                      f"sys.exit(main(['vendor', '--into', {str(tmp_path / 'x')!r}, '--namespace', 'aten']))")
    assert proc.returncode == 2 and "belongs to torch" in proc.stderr
    proc = run_python("from portable_gemm.__main__ import main; import sys; "
                      f"sys.exit(main(['vendor', '--into', {str(tmp_path / 'bad-name')!r}, '--namespace', 'ns1']))")
    assert proc.returncode == 2 and "not importable" in proc.stderr
    dest = tmp_path / "ok_copy"
    assert run_python("from portable_gemm.__main__ import main; import sys; "
                      f"sys.exit(main(['vendor', '--into', {str(dest)!r}, '--namespace', 'ns1']))").returncode == 0
    assert (dest / "lib" / "manifest.json").is_file()
    assert "NAMESPACE = 'ns1'" in (dest / "_namespace.py").read_text()
    proc = run_python("from portable_gemm.__main__ import main; import sys; "
                      f"sys.exit(main(['vendor', '--into', {str(dest)!r}, '--namespace', 'ns1']))")
    assert proc.returncode == 2 and "exists" in proc.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary folder left behind"


def test_example_downstream_package(tmp_path):
    import shutil
    ex = tmp_path / "downstream_py"
    shutil.copytree(REPO / "examples" / "downstream_py", ex)
    vendor(ex / "mylib" / "_gemm", "mylib_gemm")
    script = (ex / "use_both.py").read_text()
    proc = run_python(script.replace("__file__", repr(str(ex / "use_both.py"))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "agree bit for bit" in proc.stdout


def test_quantized_linear_module():
    lin = torch.nn.Linear(256, 96).to(torch.bfloat16)
    m = pg.nn.QuantizedLinear.from_linear(lin, bits=4, group_size=128)
    assert "bits=4, group_size=128" in repr(m)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    w = dequant_ref(m.qweight, m.scales, 4, 128)  # float64, independent of the package
    ref = x.double() @ w.T + lin.bias.double()
    out = m(x)
    assert_close(out, ref, torch.bfloat16)
    m2 = pg.nn.QuantizedLinear(256, 96, bits=4, group_size=128)
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2(x), out)
    assert m2.to("cpu").qweight.device.type == "cpu"
    with pytest.raises(ValueError, match="must divide in_features"):
        pg.nn.QuantizedLinear(100, 8, group_size=128)
