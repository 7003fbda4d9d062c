"""`trtbuild serve --mps`: a CUDA MPS control daemon of the state folder (private pipe and log folders) that the
server's processes reach through their environment, quit on every way the server stops, refused in one line where
there is no GPU or no daemon binary. A stand-in daemon here (no GPU on CI); the real one is exercised on a GPU host
by bench/gpu/mps_check.py."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.cli import main
from builder.errors import ServerError
from builder.serving import mps, triton_server
from builder.serving.processes import read_record
from builder.serving.triton_server import free_ports

# Like the real one: -d makes the socket and runs; quit ends the daemon but leaves the socket behind (seen on an
# H200); any command without a live daemon fails. Every call is logged.
CONTROL = """#!/bin/sh
pipe="$CUDA_MPS_PIPE_DIRECTORY"
if [ "$1" = "-d" ]; then
  echo "-d $pipe" >> "$CALLS"
  mkdir -p "$pipe" && : > "$pipe/control" && echo up > "$pipe/.alive"
  echo "[t] Starting control daemon using socket $pipe/control" >> "$CUDA_MPS_LOG_DIRECTORY/control.log"
  exit 0
fi
read cmd
echo "$cmd $pipe" >> "$CALLS"
[ -f "$pipe/.alive" ] || { echo "Cannot find MPS control daemon process" >&2; exit 1; }
case "$cmd" in
  quit) rm -f "$pipe/.alive" ;;
  get_server_list) echo 4242 ;;
esac
"""


@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in on PATH; the file its calls are logged to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / mps.CONTROL
    control.write_text(CONTROL)
    control.chmod(control.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    calls = tmp_path / "calls"
    calls.touch()
    monkeypatch.setenv("CALLS", str(calls))
    return calls


def calls_of(log: Path) -> list[str]:
    return [line.split()[0] for line in log.read_text().splitlines()]


def test_start_waits_for_the_socket_and_stop_removes_the_one_quit_leaves(daemon: Path, tmp_path: Path) -> None:
    state = tmp_path / "run"
    env = mps.start(state, [0])
    pipe = state.resolve() / "mps" / "pipe"
    assert env == {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(state.resolve() / "mps" / "log")}
    assert (pipe / "control").exists()
    assert mps.stop(state) is True
    assert not (pipe / "control").exists()  # else the next start would take it for a live daemon
    assert mps.stop(state) is False  # nothing left to quit, and no call made
    assert calls_of(daemon) == ["-d", "quit", "get_server_list"]


def test_a_killed_daemons_socket_is_cleared_and_start_begins_afresh(daemon: Path, tmp_path: Path) -> None:
    state = tmp_path / "run"
    mps.start(state, [0])
    (state / "mps" / "pipe" / ".alive").unlink()  # the daemon SIGKILLed: its socket stays, nothing answers
    mps.start(state, [0])
    assert calls_of(daemon) == ["-d", "quit", "-d"]
    assert mps.stop(state) is True


@pytest.mark.parametrize(("gpus", "on_path", "expected"), [
    ([], True, "--mps: no NVIDIA GPU here (NVML lists none)"),
    ([0], False, f"--mps: {mps.CONTROL} not found on PATH"),
])
def test_refused_in_one_line_without_a_gpu_or_the_daemon(daemon: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          gpus: list[int], on_path: bool, expected: str) -> None:
    if not on_path:  # a PATH without it (a GPU host has the real one in its PATH)
        monkeypatch.setenv("PATH", str(tmp_path / "bin"))
        (tmp_path / "bin" / mps.CONTROL).unlink()
    with pytest.raises(ServerError) as raised:
        mps.start(tmp_path / "run", gpus)
    assert str(raised.value).startswith(expected) and "\n" not in str(raised.value)
    assert not (tmp_path / "run" / "mps").exists() and calls_of(daemon) == []


def test_clients_counts_the_daemons_new_client_lines(tmp_path: Path) -> None:
    log = tmp_path / "run" / "mps" / "log"
    log.mkdir(parents=True)
    assert mps.clients(tmp_path / "run") == 0
    # Lines of a real control.log (H200, driver 580.159.04): a client is named once per connection.
    (log / "control.log").write_text(
        "[2026-11-29 17:46:59.301 Control  7686] User did not send valid credentials\n"
        "[2026-11-29 17:46:59.301 Control  7686] NEW CLIENT 7688 from user 0: Server is not ready, push client to "
        "pending list\n"
        "[2026-11-29 17:46:59.460 Control  7686] NEW SERVER 7721: Ready\n"
        "[2026-11-29 17:46:59.474 Control  7686] NEW CLIENT 7688 from user 0: Server already exists\n")
    assert mps.clients(tmp_path / "run") == 2


@pytest.fixture
def one_model(repo_copy: Path) -> Path:
    for child in repo_copy.iterdir():
        if child.is_dir() and child.name != "mlp_fp32":
            shutil.rmtree(child)
    return repo_copy


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "run"
    yield folder
    main(["-q", "stop", "--state-dir", str(folder)])


def serve_args(repository: Path, state: Path) -> list[str]:
    http, grpc, metrics = free_ports(3)
    return ["serve", "--background", "--mps", "--repository", str(repository), "--state-dir", str(state),
            "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--timeout", "120"]


@pytest.mark.server
def test_serve_mps_gives_the_server_the_daemon_and_stop_quits_it(
        daemon: Path, one_model: Path, state: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(triton_server, "gpu_ids", lambda: [0])  # a GPU for --mps's check only:
    monkeypatch.setattr(triton_server, "cuda_pool_args", lambda gpus: [])  # the CPU server gets no CUDA pool
    assert main(serve_args(one_model, state)) == 0
    record = read_record(state)
    assert record is not None
    environ = dict(item.split("=", 1) for item in
                   Path(f"/proc/{record.pid}/environ").read_text().split("\0") if "=" in item)
    assert environ["CUDA_MPS_PIPE_DIRECTORY"] == str(state.resolve() / "mps" / "pipe")
    assert environ["CUDA_MPS_LOG_DIRECTORY"] == str(state.resolve() / "mps" / "log")
    # A CPU-only server makes no CUDA context, so the daemon sees no client: said, not hidden.
    assert f"warning: --mps: no process has connected to the CUDA MPS daemon ({state / 'mps'})" in \
        capsys.readouterr().out
    assert main(["stop", "--state-dir", str(state)]) == 0
    assert calls_of(daemon) == ["-d", "quit", "get_server_list"]
    assert not (state / "mps" / "pipe" / "control").exists() and not (state / "mps" / "pipe" / ".alive").exists()


@pytest.mark.server
def test_serve_mps_without_a_gpu_starts_nothing(daemon: Path, one_model: Path, state: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(triton_server, "gpu_ids", lambda: [])
    assert main(serve_args(one_model, state)) == 1
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("trtbuild: error:")]
    assert errors == ["trtbuild: error: --mps: no NVIDIA GPU here (NVML lists none); CUDA MPS shares a GPU between "
                      "processes"]
    assert read_record(state) is None and calls_of(daemon) == []
