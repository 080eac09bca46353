"""A Hugging Face Hub cache laid out as huggingface_hub lays one out, for models named by their
Hub id (conveyor/hub.py): the tests never download (conftest.py sets HF_HUB_OFFLINE)."""

from __future__ import annotations

from pathlib import Path

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def hub_cache(root: Path, repo: str, source: Path, commit: str = COMMIT_A, ref="main") -> Path:
    """huggingface_hub's cache of `repo` at `commit`, named by `ref`: refs/<ref> holds the
    commit, snapshots/<commit>/ links to the files of `source` (a folder or one file)."""
    store = root / f"models--{repo.replace('/', '--')}"
    (store / "refs").mkdir(parents=True, exist_ok=True)
    (store / "refs" / ref).write_text(commit)
    snapshot = store / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()) if source.is_dir() else [source]:
        (snapshot / file.name).symlink_to(file)
    return snapshot
