"""The kernels' build lock belongs to a live process (issue 56): a first start killed while it
compiled (Ctrl-C, a CI timeout) left torch's `lock` file in the build folder, and every start
after it waited on that file for ever. Real processes build in a temporary cache folder
(CONVEYOR_CACHE_DIR); only torch's compile step is faked (the real one takes minutes), so
conveyor's locking and torch's own build lock both run as they do at a start."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# One start's kernel build: kernels.load() with torch's ninja step replaced by one that marks
# that it ran and, with "hang", never ends. Nothing is compiled, so the final import fails and
# load() returns None with a warning: the build itself ran to its end.
START = r"""
import sys, time
from pathlib import Path
from torch.utils import cpp_extension

marker, mode = Path(sys.argv[1]), sys.argv[2]

def compile_step(*args, **kwargs):
    marker.write_text("compiling")
    if mode == "hang":
        time.sleep(600)

cpp_extension._write_ninja_file_and_build_library = compile_step
from conveyor.model import kernels
kernels.load()
"""
REPO = Path(__file__).resolve().parents[2]
SECONDS = 90  # for one start of a Python process that imports torch, on 2 busy cores


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def start(cache):
    """start(marker, mode, log=pipe): a start (START) in the temporary cache, its stderr to the
    file `log` or a pipe; any still running at the end of the test is killed."""
    procs: list[subprocess.Popen] = []

    def run(marker: Path, mode: str, log=subprocess.PIPE) -> subprocess.Popen:
        command = [sys.executable, "-c", START, str(marker), mode]
        proc = subprocess.Popen(command, cwd=REPO, env=os.environ.copy(),
                                stdout=subprocess.PIPE, stderr=log, text=True)  # fmt: skip
        procs.append(proc)
        return proc

    yield run
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _wait_for(marker: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + SECONDS
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the first start never reached its compile step"
        time.sleep(0.1)


def _killed_mid_build(start, cache: Path, tmp_path: Path) -> None:
    first = start(tmp_path / "first", "hang")
    _wait_for(tmp_path / "first", first)
    first.kill()
    first.communicate()
    assert list(cache.glob("kernels/*/lock")), "torch's lock file is left behind"


def _finish(proc: subprocess.Popen, marker: Path, timeout: float = SECONDS) -> None:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the start waited on the build lock for more than {timeout} s")
    assert proc.returncode == 0, err
    assert marker.exists(), err


def test_a_start_after_a_build_killed_mid_way_builds_at_once(start, cache, tmp_path):
    _killed_mid_build(start, cache, tmp_path)
    second = start(tmp_path / "second", "quick")
    _finish(second, tmp_path / "second")
    assert not list(cache.glob("kernels/*/lock")), "torch's lock is released after the build"


def test_a_start_waits_for_a_live_build_and_goes_on_when_its_process_dies(start, tmp_path):
    first = start(tmp_path / "first", "hang")
    _wait_for(tmp_path / "first", first)
    log = tmp_path / "second.log"
    with open(log, "w") as file:
        second = start(tmp_path / "second", "quick", log=file)
    try:
        deadline = time.monotonic() + SECONDS
        while "waiting for another process's kernel build" not in log.read_text():
            assert second.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the second start never said that it waits"
            time.sleep(0.1)
        assert not (tmp_path / "second").exists()
    finally:
        first.kill()
        first.communicate()
    _finish(second, tmp_path / "second")


def test_a_lock_file_left_without_a_live_builder_is_removed(start, tmp_path):
    """An older conveyor's, or a build that died before this lock existed."""
    from conveyor.model import kernels

    folder = kernels.build_dir()
    folder.mkdir(parents=True)
    (folder / "lock").touch()
    _finish(start(tmp_path / "marker", "quick"), tmp_path / "marker")
