"""Staging and the repository lock: whole models or none, never a missing model folder, one writer
at a time, and another build's staging left alone."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from builder.errors import BuilderError
from builder.repository.lock import LOCK_FILE, repository_lock
from builder.repository.staging import Staging, exchange
from tests.helpers.tiny_models import mlp_onnx
from tests.helpers.waiting import wait_until


def _stage(repository: Path, name: str, content: str) -> Staging:
    staging = Staging(repository)
    folder = staging.dir(name)
    (folder / "1").mkdir()
    (folder / "config.pbtxt").write_text(content)
    return staging


def test_a_reader_never_finds_the_model_folder_missing_during_commits(tmp_path: Path) -> None:
    if not _can_exchange(tmp_path):
        pytest.skip("this filesystem cannot exchange folders atomically")
    repository = tmp_path / "repo"
    staging = _stage(repository, "m", "v0")
    staging.commit()
    staging.discard()
    missing: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                (repository / "m" / "config.pbtxt").read_text()
            except FileNotFoundError as exc:
                missing.append(str(exc))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for version in range(1, 150):
            staging = _stage(repository, "m", f"v{version}")
            staging.commit()
            staging.discard()
    finally:
        stop.set()
        thread.join()
    assert missing == []
    assert (repository / "m" / "config.pbtxt").read_text() == "v149"
    assert sorted(p.name for p in repository.iterdir()) == ["m"]  # no staging or trash left behind


def _can_exchange(root: Path) -> bool:
    (root / "x").mkdir()
    (root / "y").mkdir()
    return exchange(root / "x", root / "y")


def test_a_new_build_removes_every_leftover_staging_folder_old_names_included(tmp_path: Path) -> None:
    repository = tmp_path / "repo"
    (repository / "m" / "1").mkdir(parents=True)
    for leftover in (f".staging-{os.getpid()}-abc/m", ".staging-1-def", ".staging-k2j3h4", ".trash-m-123"):
        (repository / leftover).mkdir(parents=True)
    staging = Staging(repository)  # built under the repository lock: no other writer can be running
    assert sorted(p.name for p in repository.iterdir()) == sorted(["m", staging.root.name])
    staging.discard()


def test_an_unusable_repository_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(BuilderError, match=r"--repository .*/file/repo: cannot create or lock it"), \
            repository_lock(tmp_path / "file" / "repo", what="test"):
        pass


HOLD_UNTIL_TOLD = """
import sys
from pathlib import Path
from builder.repository.lock import repository_lock
with repository_lock(Path(sys.argv[1]), what="the build of holder"):
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_a_second_writer_fails_naming_the_holder_or_waits_for_it(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    repository = tmp_path / "repo"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_UNTIL_TOLD, str(repository)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    told = threading.Event()  # set just before the holder is told to let go
    took_it_after_told: list[bool] = []

    def second_writer() -> None:
        with repository_lock(repository, what="test", wait=True, timeout_s=120):
            took_it_after_told.append(told.is_set())

    waiter = threading.Thread(target=second_writer, daemon=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        busy = rf"being written by the build of holder \(pid {holder.pid}, "
        with pytest.raises(BuilderError, match=busy), repository_lock(repository, what="test", wait=False):
            pass
        caplog.set_level(logging.WARNING, logger="builder")
        waiter.start()
        wait_until(lambda: any(f"waiting for the build of holder (pid {holder.pid}," in r.getMessage()
                               for r in caplog.records), what="the second writer saying whom it waits for")
        assert took_it_after_told == []  # waiting, not writing
        told.set()
        assert holder.stdin is not None
        holder.stdin.write("go\n")
        holder.stdin.flush()
        waiter.join(timeout=120)
        assert took_it_after_told == [True]  # it wrote only once the holder had let go
    finally:
        holder.kill()
        holder.wait()


def _read_lines(proc: subprocess.Popen[str], lines: list[str], event: threading.Event, text: str) -> threading.Thread:
    """A thread collecting `proc`'s stderr into `lines`, setting `event` at the first line holding `text`."""
    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if text in line:
                event.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _lock_holder_pid(repository: Path) -> int | None:
    """The pid the lock file names (written by each holder once it has the lock); None before any."""
    try:
        return int(json.loads((repository / LOCK_FILE).read_text() or "{}")["pid"])
    except (OSError, ValueError, KeyError):
        return None


def _locked(repository: Path) -> bool:
    """Whether some process holds the repository's lock now (a probe that lets go at once if it got it)."""
    fd = os.open(repository / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _build(onnx_path: Path, repository: Path, name: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "builder", "build", "--onnx", str(onnx_path), "--name", name,
                             "--precision", "fp32", "--task", "classification", "--repository", str(repository)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _assert_both_landed(repository: Path) -> None:
    for name in ("first_fp32", "second_fp32"):
        assert (repository / name / "config.pbtxt").is_file() and (repository / name / "build.json").is_file()
        assert (repository / name / "1" / "model.onnx").is_file()
    assert not [p for p in repository.iterdir() if p.name.startswith((".staging-", ".trash-"))]


def test_two_builds_started_at_once_both_land(tmp_path: Path) -> None:
    # How these two interleave is up to the machine (start-up takes longer than the build): whatever it is,
    # both land. The test below makes one of them find the other writing, for certain.
    onnx_path = mlp_onnx(tmp_path / "mlp.onnx")
    repository = tmp_path / "repo"
    builds = [_build(onnx_path, repository, name) for name in ("first", "second")]
    for proc in builds:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    _assert_both_landed(repository)


def test_a_build_started_while_another_writes_waits_for_it_and_both_land(tmp_path: Path) -> None:
    # The first build is stopped (SIGSTOP) while it holds the lock, mid-build: the second must find the
    # repository being written, say whom it waits for, and land after the first once that one goes on.
    onnx_path = mlp_onnx(tmp_path / "mlp.onnx")
    repository = tmp_path / "repo"
    first = _build(onnx_path, repository, "first")
    builds = [first]
    try:
        wait_until(lambda: _lock_holder_pid(repository) == first.pid, what="the first build holding the lock",
                   timeout_s=120)
        os.kill(first.pid, signal.SIGSTOP)
        assert _locked(repository), "the premise: the first build, stopped, still holds the lock"
        second = _build(onnx_path, repository, "second")
        builds.append(second)
        lines: list[str] = []
        waiting = threading.Event()
        reader = _read_lines(second, lines, waiting, f"waiting for the build of first (pid {first.pid},")
        assert waiting.wait(timeout=120), lines
        assert second.poll() is None and not (repository / "second_fp32").exists()
        os.kill(first.pid, signal.SIGCONT)
        _, err = first.communicate(timeout=300)
        assert first.returncode == 0, err
        assert second.wait(timeout=300) == 0, lines
        reader.join(timeout=10)
    finally:
        for proc in builds:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait()
    _assert_both_landed(repository)


def test_builds_that_find_the_repository_being_written_wait_say_so_and_land(tmp_path: Path) -> None:
    onnx_path = mlp_onnx(tmp_path / "mlp.onnx")
    repository = tmp_path / "repo"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_UNTIL_TOLD, str(repository)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    builds: list[subprocess.Popen[str]] = []
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        builds = [_build(onnx_path, repository, name) for name in ("first", "second")]
        lines: list[list[str]] = [[], []]
        waiting = [threading.Event(), threading.Event()]
        readers = [_read_lines(build, lines[i], waiting[i], "waiting for the build of holder")
                   for i, build in enumerate(builds)]
        for index, event in enumerate(waiting):
            assert event.wait(timeout=120), lines[index]
        assert not any((repository / name).exists() for name in ("first_fp32", "second_fp32"))
        assert holder.stdin is not None
        holder.stdin.write("go\n")
        holder.stdin.flush()
        for index, proc in enumerate(builds):
            assert proc.wait(timeout=300) == 0, lines[index]
        for reader in readers:
            reader.join(timeout=10)
    finally:
        for proc in [holder, *builds]:
            proc.kill()
            proc.wait()
    _assert_both_landed(repository)
