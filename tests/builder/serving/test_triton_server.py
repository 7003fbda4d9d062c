"""The server's lifecycle in a state folder, against the real bundled tritonserver: the record, a
second serve refused, stop signalling only our own server, recovery after SIGKILL (stubs, /dev/shm)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.cli import main
from builder.serving.processes import (
    LEGACY_PID_FILE,
    SHM_DIR,
    SHM_REGION,
    STATE_FILE,
    STUB_NAME,
    ServerRecord,
    alive,
    read_record,
    start_ticks,
)
from builder.serving.triton_server import (
    STUB_TIMEOUT_S,
    Ports,
    TritonServer,
    free_ports,
    prepare_backends,
)
from tests.helpers.serve_cli import error_lines, serve_args


def _cmdline(pid: int) -> list[str]:
    try:
        return [p.decode() for p in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]
    except OSError:
        return []


def stubs_of(state: Path) -> dict[int, str]:
    """Live python-backend stubs run from this state folder → their /dev/shm region (seen by the test itself)."""
    python_dir = str(state.resolve() / "backends" / "python")
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and alive(int(entry.name)):
            argv = _cmdline(int(entry.name))
            if argv and Path(argv[0]).name == STUB_NAME and python_dir in argv:
                found[int(entry.name)] = next(a for a in argv if SHM_REGION.fullmatch(a))
    return found


def _kill_hard(pid: int) -> None:
    """SIGKILL the server and leave it unreaped (it is this process's child: serve ran in-process).

    Stubs poll their server's pid and exit about a second after it is reaped; but one can hang in
    its exit path (seen here: a stub alive 16 min after "Non-graceful termination detected").
    A zombie still answers that poll, so leaving the server unreaped holds its stubs running for
    the test, deterministically; `alive()` counts a zombie as dead, as it should."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


@pytest.mark.server
def test_serve_records_the_server_and_refuses_a_second_one(
    one_model: Path, state: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    assert main(serve_args(one_model, state)) == 0
    assert not any("cleaned up" in r.getMessage() for r in caplog.records)  # nothing to clean in a new folder
    record = read_record(state)
    assert record is not None and alive(record.pid)
    assert record.start_ticks == start_ticks(record.pid)
    on_disk = json.loads((state / STATE_FILE).read_text())
    assert Path(on_disk["argv"][0]).name == "tritonserver"
    assert on_disk["repository"] == str(one_model.resolve()) and on_disk["command"] and on_disk["started"]
    capsys.readouterr()

    assert main(serve_args(one_model, state)) == 1
    lines = error_lines(capsys)
    assert lines == [f"trtbuild: error: --state-dir {state}: a tritonserver started from here is already running "
                     f"(pid {record.pid}, http :{record.ports['http']}); stop it with `trtbuild stop` first"]
    assert alive(record.pid) and read_record(state) == record  # the first server is neither orphaned nor touched

    assert main(["stop", "--state-dir", str(state)]) == 0
    assert f"tritonserver stopped (pid {record.pid})" in capsys.readouterr().out
    assert not alive(record.pid) and not (state / STATE_FILE).exists()
    assert stubs_of(state) == {}
    assert not any("cleaned up" in r.getMessage() for r in caplog.records)  # a normal stop leaves nothing


@pytest.fixture
def crashed(one_model: Path, state: Path) -> Iterator[tuple[ServerRecord, dict[int, str]]]:
    """A server started by `trtbuild serve` and SIGKILLed: its record and the stubs it left running."""
    assert main(serve_args(one_model, state)) == 0
    dead = read_record(state)
    assert dead is not None
    old = stubs_of(state)
    assert old, "the python backend started no stub"
    assert all((SHM_DIR / region).exists() for region in old.values())
    _kill_hard(dead.pid)
    yield dead, old
    _reap(dead.pid)


@pytest.mark.server
def test_serve_after_sigkill_starts_cleanly_and_no_stub_survives(
    one_model: Path, state: Path, crashed: tuple[ServerRecord, dict[int, str]],
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    dead, old = crashed
    # Not a synchronisation: a stub checks on its server about once a second; this gives each a check to
    # exit on (they do not while it is an unreaped zombie), so the clean-up below is the one that stops them.
    time.sleep(1.0)
    assert all(alive(pid) for pid in old), "the premise: SIGKILL of tritonserver leaves its stubs running"

    caplog.clear()
    assert main(serve_args(one_model, state)) == 0, error_lines(capsys)
    assert not any(alive(pid) for pid in old)
    assert not any((SHM_DIR / region).exists() for region in old.values())
    cleaned = [r.getMessage() for r in caplog.records if "cleaned up after a dead tritonserver" in r.getMessage()]
    assert len(cleaned) == 1
    assert f"(pid {dead.pid})" in cleaned[0] and f"stopped {len(old)} python-backend stub(s)" in cleaned[0]
    assert f"freed their {len(old)} shared-memory region(s) in {SHM_DIR}" in cleaned[0]

    fresh = read_record(state)
    assert fresh is not None and fresh.pid != dead.pid and alive(fresh.pid)
    new = stubs_of(state)
    assert new and not set(new) & set(old)
    assert all(_cmdline(pid)[5] == str(fresh.pid) for pid in new)  # every stub now is the new server's


@pytest.mark.server
def test_stop_after_sigkill_cleans_the_stubs(
    state: Path, crashed: tuple[ServerRecord, dict[int, str]], capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture
) -> None:
    dead, old = crashed
    capsys.readouterr()
    assert main(["stop", "--state-dir", str(state)]) == 0
    assert f"no tritonserver was running (recorded pid {dead.pid} had exited)" in capsys.readouterr().out
    assert not any(alive(pid) for pid in old) and stubs_of(state) == {}
    assert not any((SHM_DIR / region).exists() for region in old.values())
    assert any("cleaned up after a dead tritonserver" in r.getMessage() for r in caplog.records)
    assert not (state / STATE_FILE).exists()


def _block_every_signal() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())  # SIGKILL and SIGSTOP stay unblockable


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {name: value.strip() for name, _, value in (line.partition(":") for line in lines)}


def _signalled(pid: int) -> bool:
    """Whether any signal reached `pid` (blocking them all, see `sleeper`): one pending, or it has ended."""
    status = _status(pid)
    return status["State"].startswith(("Z", "X")) or int(status["SigPnd"], 16) | int(status["ShdPnd"], 16) != 0


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """`sleep 60` with every blockable signal blocked: a signal sent to it stays pending, seen at once in
    /proc/<pid>/status (a SIGKILL is pending until it runs), rather than ending it at some later time."""
    proc = subprocess.Popen(["sleep", "60"], preexec_fn=_block_every_signal)
    assert int(_status(proc.pid)["SigBlk"], 16) & (1 << (signal.SIGINT - 1)), "the premise: SIGINT is blocked"
    assert not _signalled(proc.pid)
    yield proc
    proc.kill()
    proc.wait(timeout=10)


@pytest.mark.parametrize("record", ["json", "json-recycled", "legacy-pid-file"])
def test_stop_refuses_a_pid_that_is_not_our_tritonserver(
    record: str, sleeper: subprocess.Popen[bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "run"
    state.mkdir()
    ticks = start_ticks(sleeper.pid)
    assert ticks is not None
    if record == "legacy-pid-file":
        (state / LEGACY_PID_FILE).write_text(f"{sleeper.pid}\n")
        source, why = state / LEGACY_PID_FILE, "is not a tritonserver (it runs `sleep 60`)"
    else:
        recorded = ticks - 1 if record == "json-recycled" else ticks
        (state / STATE_FILE).write_text(json.dumps({"pid": sleeper.pid, "start_ticks": recorded}))
        source = state / STATE_FILE
        why = ("has exited; the pid now belongs to another process (`sleep 60`)" if record == "json-recycled"
               else "is not a tritonserver (it runs `sleep 60`)")
    if record == "json-recycled":  # our server exited and its pid was reused: nothing of ours to stop
        assert main(["stop", "--state-dir", str(state)]) == 0
        assert f"recorded pid {sleeper.pid} had exited" in capsys.readouterr().out
    else:
        assert main(["stop", "--state-dir", str(state)]) == 1
        assert error_lines(capsys) == [f"trtbuild: error: pid {sleeper.pid} in {source} {why}: not signalled; "
                                       "removed the stale record"]
    assert not _signalled(sleeper.pid)  # untouched
    assert read_record(state) is None


@pytest.mark.server
def test_stop_honours_the_previous_versions_pid_file(
    one_model: Path, state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(serve_args(one_model, state)) == 0
    record = read_record(state)
    assert record is not None
    (state / STATE_FILE).unlink()
    (state / LEGACY_PID_FILE).write_text(f"{record.pid}\n")
    capsys.readouterr()
    assert main(["stop", "--state-dir", str(state)]) == 0
    assert f"tritonserver stopped (pid {record.pid})" in capsys.readouterr().out
    assert not alive(record.pid) and not (state / LEGACY_PID_FILE).exists()


def test_backends_are_prepared_by_rename_while_the_stub_file_runs(tmp_path: Path) -> None:
    """Writing over a running executable fails with ETXTBSY; prepare_backends renames instead."""
    state = tmp_path / "run"
    python_dir = prepare_backends(state) / "python"
    stub = python_dir / STUB_NAME
    wanted = stub.read_bytes()
    sleep = shutil.which("sleep")
    assert sleep is not None
    shutil.copy2(sleep, stub)  # a different executable at the stub's name, running
    busy = subprocess.Popen([str(stub), "60"])
    try:
        # Popen returns once the child has exec'd: the stub file is being executed now.
        assert Path(os.readlink(f"/proc/{busy.pid}/exe")) == stub.resolve()
        with pytest.raises(OSError, match="Text file busy"), stub.open("r+b"):
            pass
        assert prepare_backends(state) == python_dir.parent
        assert stub.read_bytes() == wanted and os.access(stub, os.X_OK)
        assert busy.poll() is None  # still running its (now unlinked) file
        assert not [p for p in python_dir.iterdir() if p.name.endswith(".tmp")]
    finally:
        busy.kill()
        busy.wait(timeout=10)



@pytest.mark.server
def test_serve_removes_a_dead_builds_staging_folder_that_triton_would_load(
    one_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (one_model / ".staging-1-dead" / "mlp_fp32").mkdir(parents=True)  # as a killed build leaves it
    state = tmp_path / "run-staging"
    assert main(serve_args(one_model, state)) == 0
    try:
        assert not (one_model / ".staging-1-dead").exists()
    finally:
        assert main(["stop", "--state-dir", str(state)]) == 0


@pytest.mark.server
def test_the_python_backend_waits_long_enough_for_a_gpu_runner_to_load(one_model: Path, tmp_path: Path) -> None:
    """A GPU runner loads a session per batch bucket (up to ~36 s on an H100), past the python backend's
    default 30 s wait for its stub: the server is started with a longer one, and Triton applies it."""
    http, grpc, metrics = free_ports(3)
    server = TritonServer(one_model, tmp_path / "run", Ports(http, grpc, metrics), extra_args=["--log-verbose=1"])
    assert f"--backend-config=python,stub-timeout-seconds={STUB_TIMEOUT_S}" in server.argv()
    assert STUB_TIMEOUT_S >= 120
    server.start(timeout=120)
    try:
        log = server.log_file.read_text(errors="replace")
    finally:
        server.stop()
    assert f"stub-timeout-seconds={STUB_TIMEOUT_S}" in log, log[-2000:]


def test_a_gpu_host_gets_a_cuda_pool_large_enough_for_gpu_inputs(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """GPU inputs reach the python stubs through Triton's CUDA pool: its 64 MB default held FP16 at c=256 to
    6785 infer/s on an H200 (10028-10542 with 1 GiB). Each GPU NVML lists gets one; a host without gets none."""
    from builder.serving import triton_server

    ports = Ports(1, 2, 3)
    monkeypatch.setattr(triton_server, "gpu_ids", lambda: [0, 1])
    argv = triton_server.command(tmp_path, ports, tmp_path, tmp_path / "log")
    assert [a for a in argv if a.startswith("--cuda-memory-pool-byte-size=")] == [
        "--cuda-memory-pool-byte-size=0:1073741824", "--cuda-memory-pool-byte-size=1:1073741824"]
    monkeypatch.setattr(triton_server, "gpu_ids", lambda: [])
    assert not any("cuda-memory-pool" in a for a in triton_server.command(tmp_path, ports, tmp_path, tmp_path / "l"))


def _open_paths() -> list[str]:
    paths = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            paths.append(os.readlink(f"/proc/self/fd/{fd}"))
    return paths


@pytest.mark.server
def test_a_server_that_cannot_be_started_leaves_no_open_log_file(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    server = TritonServer(tmp_path / "repo", tmp_path / "run", Ports(*free_ports(3)))
    monkeypatch.setattr(TritonServer, "argv", lambda self: [str(tmp_path / "no-such-tritonserver")])
    with pytest.raises(FileNotFoundError) as caught:
        server.start(timeout=10)
    # Closed by start itself, not by the garbage collector once the error (and its frames) is dropped.
    out = str((tmp_path / "run" / "tritonserver.out").resolve())
    assert out not in _open_paths()
    assert caught.value.filename == str(tmp_path / "no-such-tritonserver")


@pytest.mark.server
def test_a_server_whose_record_cannot_be_written_is_stopped_not_orphaned(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """Unrecorded, no `trtbuild stop` could find it: the failed write stops it, then raises."""
    (tmp_path / "repo").mkdir()
    state = tmp_path / "run"
    (state / STATE_FILE / "in-the-way").mkdir(parents=True)  # the record cannot be renamed into place
    server = TritonServer(tmp_path / "repo", state, Ports(*free_ports(3)))
    monkeypatch.setattr(TritonServer, "argv", lambda self: [sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        with pytest.raises(OSError):
            server.start(timeout=10)
        assert server.process is not None
        assert server.process.poll() is not None, "the unrecorded server is still running"
    finally:
        if server.process is not None and server.process.poll() is None:
            server.process.kill()
            server.process.wait()
