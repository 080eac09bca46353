"""`python -m benchmarks start`: a server's start timed from this tree and from a revision
checked out in a temporary git worktree, in turn; the worktree is removed afterwards."""

from __future__ import annotations

import json
import subprocess

from conftest import run_lab

from benchmarks.start import ROOT


def worktrees() -> list[str]:
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "list", "--porcelain"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [line for line in listed.splitlines() if line.startswith("worktree ")]


def test_a_start_of_this_tree_against_head(tiny_checkpoint, tmp_path):
    before = worktrees()
    saved = tmp_path / "start.json"
    out = run_lab(
        ["start", str(tiny_checkpoint("llama")), "--serve-args", "--dtype float32"]
        + ["--against", "HEAD", "--rounds", "1", "--save-result", str(saved)]
    )
    runs = json.loads(saved.read_text())["runs"]
    assert set(runs) == {"this tree", "HEAD"}
    for done in runs.values():
        (run,) = done
        assert 0 < run["ready_s"] < 300 and run["cpu_s"] > 0.5  # torch alone is more
    assert "this tree / HEAD: ready" in out
    assert worktrees() == before  # the revision's worktree is gone
