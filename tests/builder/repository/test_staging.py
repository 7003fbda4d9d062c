"""Staging and the repository lock: whole models or none, never a missing model folder, one writer
at a time, and another build's staging left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from builder.errors import BuilderError
from builder.repository.lock import repository_lock
from builder.repository.staging import Staging, exchange
from tests.helpers.tiny_models import mlp_onnx


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


HOLD = """
import sys, time
from pathlib import Path
from builder.repository.lock import repository_lock
with repository_lock(Path(sys.argv[1]), what="the build of holder"):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_a_second_writer_fails_naming_the_holder_or_waits_for_it(tmp_path: Path) -> None:
    repository = tmp_path / "repo"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(repository), "2"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        busy = rf"being written by the build of holder \(pid {holder.pid}, "
        with pytest.raises(BuilderError, match=busy), repository_lock(repository, what="test", wait=False):
            pass
        started = time.monotonic()
        with repository_lock(repository, what="test", wait=True, timeout_s=30):
            waited = time.monotonic() - started
        assert waited > 1.0  # the holder kept it 2 s after saying so: this writer waited for it
    finally:
        holder.kill()
        holder.wait()


HOLD_UNTIL_TOLD = """
import sys
from pathlib import Path
from builder.repository.lock import repository_lock
with repository_lock(Path(sys.argv[1]), what="the build of holder"):
    print("held", flush=True)
    sys.stdin.readline()
"""


def _build(onnx_path: Path, repository: Path, name: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "builder", "build", "--onnx", str(onnx_path), "--name", name,
                             "--precision", "fp32", "--task", "classification", "--repository", str(repository)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _assert_both_landed(repository: Path) -> None:
    for name in ("first_fp32", "second_fp32"):
        assert (repository / name / "config.pbtxt").is_file() and (repository / name / "build.json").is_file()
        assert (repository / name / "1" / "model.onnx").is_file()
    assert not [p for p in repository.iterdir() if p.name.startswith((".staging-", ".trash-"))]


@pytest.mark.parametrize("offset_s", [0.0, 0.3, 2.0])
def test_two_builds_into_one_repository_at_once_both_land(tmp_path: Path, offset_s: float) -> None:
    # Whether these two overlap depends on the machine's load (start-up takes longer than the build):
    # the property is that both land, whatever the interleaving.
    onnx_path = mlp_onnx(tmp_path / "mlp.onnx")
    repository = tmp_path / "repo"
    first = _build(onnx_path, repository, "first")
    time.sleep(offset_s)
    second = _build(onnx_path, repository, "second")
    for proc in (first, second):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
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

        def read(index: int) -> None:
            stream = builds[index].stderr
            assert stream is not None
            for line in stream:
                lines[index].append(line)
                if "waiting for the build of holder" in line:
                    waiting[index].set()

        readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
        for reader in readers:
            reader.start()
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
