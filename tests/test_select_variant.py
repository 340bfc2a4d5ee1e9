"""select_variant is a pure function: tested here without any binary (the module is loaded
from its file, so importing it does not run the package's loader)."""

import importlib.util
import sys

import pytest
from conftest import REPO

spec = importlib.util.spec_from_file_location("pg_variant", REPO / "python/portable_gemm/_variant.py")
variant = importlib.util.module_from_spec(spec)
sys.modules["pg_variant"] = variant  # dataclasses resolve annotations through sys.modules
spec.loader.exec_module(variant)
select_variant = variant.select_variant

BUILT = ["2.9", "2.10", "2.11", "2.12", "2.13"]


def statuses(sel):
    return {c.target: c.status for c in sel.candidates}


@pytest.mark.parametrize("torch_version,expected", [
    ("2.9.1", "2.9"), ("2.9.0+cu128", "2.9"), ("2.10.0", "2.10"), ("2.11.0+cu130", "2.11"),
    ("2.12.1", "2.12"), ("2.13.0+cpu", "2.13"), ("2.14.1", "2.13"), ("2.15.0", "2.13"),
    ("3.0.0", "2.13"), ("2.14.0a0+git1234", "2.13"), ("2.10.0.dev20250901", "2.10"),
])
def test_newest_target_not_above_runtime(torch_version, expected):
    sel = select_variant(torch_version, BUILT)
    assert sel.error is None and sel.target == expected
    st = statuses(sel)
    assert st[expected] == "selected"
    for t in BUILT:
        if t != expected:
            newer = tuple(map(int, t.split("."))) > tuple(map(int, expected.split(".")))
            assert st[t] == ("rejected" if newer else "eligible"), t


def test_every_candidate_has_a_one_line_reason():
    sel = select_variant("2.11.0", BUILT)
    assert len(sel.candidates) == len(BUILT)
    for c in sel.candidates:
        assert c.reason and "\n" not in c.reason
    rejected = [c for c in sel.candidates if c.status == "rejected"]
    assert {c.target for c in rejected} == {"2.12", "2.13"}
    assert all("needs torch >= " in c.reason and "runtime is 2.11" in c.reason for c in rejected)
    assert "2.11 is newer" in next(c.reason for c in sel.candidates if c.target == "2.10")


def test_numeric_not_lexical_order():
    # "2.9" > "2.10" as strings; the choice must be numeric.
    assert select_variant("2.10.0", ["2.9", "2.10"]).target == "2.10"
    assert select_variant("2.9.1", ["2.10", "2.9"]).target == "2.9"


def test_forced_target():
    sel = select_variant("2.13.0", BUILT, forced="2.10")
    assert sel.target == "2.10"
    st = statuses(sel)
    assert st["2.10"] == "selected" and st["2.13"] == "eligible" and st["2.9"] == "eligible"
    assert "forced" in next(c.reason for c in sel.candidates if c.target == "2.13")


def test_forced_newer_than_runtime_is_refused():
    sel = select_variant("2.11.0", BUILT, forced="2.13")
    assert sel.target is None
    assert "newer than the installed torch 2.11.0" in sel.error
    # what to do instead: the targets this torch can run
    assert sel.error.endswith("unset PORTABLE_GEMM_TARGET or choose one of 2.11, 2.10, 2.9"), sel.error
    assert "2.13" in sel.explain() and "rejected" in sel.explain()


@pytest.mark.parametrize("forced", ["2.14", "2.8"])
def test_forced_unknown(forced):
    sel = select_variant("2.13.0", BUILT, forced=forced)
    assert sel.target is None and "names no built target" in sel.error


def test_forced_malformed():
    sel = select_variant("2.13.0", BUILT, forced="latest")
    assert sel.target is None and "is not a version" in sel.error


def test_empty_forced_means_not_forced():
    assert select_variant("2.12.0", BUILT, forced="").target == "2.12"


def test_torch_older_than_minimum():
    sel = select_variant("2.8.0", BUILT)
    assert sel.target is None
    assert "requires torch >= 2.9" in sel.error and "2.8.0" in sel.error
    assert sel.error.endswith("upgrade torch (pip install 'torch>=2.9')"), sel.error
    assert all(c.status == "rejected" for c in sel.candidates)
    # every target rejected for the same reason: one line, not five
    assert sel.explain() == "  2.13, 2.12, 2.11, 2.10, 2.9: rejected - torch 2.8.0 is older than 2.9, the oldest " \
        "stable ABI this wheel targets", sel.explain()
    # different reasons keep a line each
    assert len(select_variant("2.11.0", BUILT).explain().splitlines()) == len(BUILT)


def test_no_targets_built():
    sel = select_variant("2.13.0", [])
    assert sel.target is None and sel.error


def test_subset_of_targets():
    # a wheel built with only some targets still picks the newest runnable one
    assert select_variant("2.12.0", ["2.9", "2.13"]).target == "2.9"
    sel = select_variant("2.9.0", ["2.10", "2.13"])
    assert sel.target is None and "no built target runs on torch 2.9.0" in sel.error


def test_unparseable_torch_version():
    with pytest.raises(ValueError, match="major.minor"):
        select_variant("nightly", BUILT)


@pytest.mark.parametrize("forced", ["2.13abc", "2.10.5", "2.10 x", "v2.10", "2.", "2.10+cpu"])
def test_forced_must_be_exactly_major_minor(forced):
    # (was a prefix match: 2.13abc loaded 2.13 and 2.10.5 loaded 2.10)
    sel = select_variant("2.13.0", BUILT, forced=forced)
    assert sel.target is None and f"PORTABLE_GEMM_TARGET={forced!r} is not a version like '2.10'" in sel.error
    assert all(c.status == "rejected" for c in sel.candidates)


def test_forced_with_whitespace():
    assert select_variant("2.13.0", BUILT, forced=" 2.10\n").target == "2.10"


@pytest.mark.parametrize("target", ["2.13abc", "2.13.0", "latest"])
def test_unparseable_built_target(target):
    # the loader turns this into an ImportError with its reinstall advice (test_python_layer.py)
    with pytest.raises(ValueError, match=rf"{target!r} is not a target version like '2.10'"):
        select_variant("2.13.0", ["2.9", target])
