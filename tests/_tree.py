"""The repository's files, in a git checkout or an unpacked sdist (torch-free: test_ci_config.py
imports it)."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tree_files() -> list[str]:
    """The tracked files of a git checkout; in an unpacked sdist (no .git), every file in it
    but a build's or a venv's."""
    if (REPO / ".git").exists():
        return subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                              check=True, timeout=60).stdout.split()
    assert (REPO / "PKG-INFO").is_file(), f"{REPO} is neither a git checkout nor an unpacked sdist"
    skip = {"build", "dist", "dist-abi3", "__pycache__", ".pytest_cache"}
    return [p.relative_to(REPO).as_posix() for p in REPO.rglob("*")
            if p.is_file() and not skip.intersection(p.relative_to(REPO).parts)
            and not any(part.startswith(".venv") for part in p.relative_to(REPO).parts)]
