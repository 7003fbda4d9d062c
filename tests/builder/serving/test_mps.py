"""`trtbuild serve --mps`: a CUDA MPS control daemon of the state folder (private pipe and log folders) that the
server's processes reach through their environment, quit on every way the server stops, refused in one line where
there is no GPU or no daemon binary. By default it is on for repositories with python-runner models on a GPU
where the daemon exists, and a daemon that does not start is then a warning; `--no-mps` turns it off. A stand-in
daemon here (no GPU on CI); the real one is exercised on a GPU host by bench/gpu/mps_check.py and
bench/gpu/serve_mps_check.sh."""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from builder.cli import main
from builder.errors import ServerError
from builder.serving import mps, triton_server
from builder.serving.processes import read_record
from builder.serving.triton_server import free_ports
from tests.helpers import mps_daemon
from tests.helpers.mps_daemon import calls_of
from tests.helpers.serve_cli import error_lines, serve_args


@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The stand-in daemon on PATH; the file its calls are logged to."""
    with mps_daemon.installed(tmp_path, monkeypatch) as calls:
        yield calls


def test_start_waits_for_the_socket_and_stop_removes_the_one_quit_leaves(daemon: Path, tmp_path: Path) -> None:
    state = tmp_path / "run"
    env = mps.start(state, [0])
    pipe = state.resolve() / "mps" / "pipe"
    assert env == {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(state.resolve() / "mps" / "log")}
    assert (pipe / "control").exists() and len(mps.daemon_pids(state)) == 1
    assert mps.stop(state) is True
    assert not mps.daemon_pids(state) and not (pipe / "control").exists()  # else the next start would wait on it
    assert mps.stop(state) is False  # nothing left to quit, and no call made
    assert calls_of(daemon) == ["-d", "quit"]


def test_a_daemon_that_ignores_quit_is_ended_and_another_folders_is_left(daemon: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "other"
    mps.start(other, [0])
    (other_pid,) = mps.daemon_pids(other)
    monkeypatch.setenv("STANDIN_HANG", "1")
    state = tmp_path / "run"
    mps.start(state, [0])
    assert len(mps.daemon_pids(state)) == 1
    assert mps.stop(state, timeout=0.5) is True
    assert not mps.daemon_pids(state) and not (state / "mps" / "pipe" / "control").exists()
    assert mps.daemon_pids(other) == [other_pid]
    monkeypatch.delenv("STANDIN_HANG")
    assert mps.stop(other) is True


def test_a_daemon_that_makes_no_socket_is_ended_with_one_line(daemon: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_NO_SOCKET", "1")
    state = tmp_path / "run"
    with pytest.raises(ServerError, match=r"^--mps: the MPS control daemon made no socket .* within 0 s; see "):
        mps.start(state, [0], timeout=0.3)
    assert mps.daemon_pids(state) == []


def test_a_socket_path_too_long_for_unix_is_one_line(daemon: Path, tmp_path: Path) -> None:
    state = tmp_path / ("d" * 120)
    with pytest.raises(ServerError, match=r"longer than a Unix socket's 107 bytes; use a shorter --state-dir$"):
        mps.start(state, [0])
    assert calls_of(daemon) == []


def test_the_daemon_sees_every_gpu_and_its_log_holds_its_own_clients(daemon: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_VISIBLE_DEVICES stays with the clients (MPS renumbers the devices its server sees); the log of an
    earlier daemon is set aside, so a count of clients is this daemon's."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    state = tmp_path / "run"
    log = state / "mps" / "log"
    log.mkdir(parents=True)
    (log / "control.log").write_text("[t] NEW CLIENT 11 from user 0: Server already exists\n")
    mps.start(state, [0, 1])
    assert daemon.read_text().split()[-1] == "unset"
    assert mps.clients(state) == 0 and "NEW CLIENT 11" in (log / "control.log.1").read_text()
    assert mps.stop(state) is True


def test_a_killed_daemons_socket_is_cleared_and_start_begins_afresh(daemon: Path, tmp_path: Path) -> None:
    state = tmp_path / "run"
    mps.start(state, [0])
    (pid,) = mps.daemon_pids(state)
    os.kill(pid, signal.SIGKILL)  # its socket stays; nothing answers it
    mps.start(state, [0])
    assert calls_of(daemon) == ["-d", "quit", "-d"] and len(mps.daemon_pids(state)) == 1
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


def test_clients_counts_the_processes_the_daemons_log_names(tmp_path: Path) -> None:
    log = tmp_path / "run" / "mps" / "log"
    log.mkdir(parents=True)
    assert mps.clients(tmp_path / "run") == 0
    # Lines of a real control.log (H200, driver 580.159.04): a client is named once per connection, and counted
    # once per process.
    (log / "control.log").write_text(
        "[2026-11-29 17:46:59.301 Control  7686] User did not send valid credentials\n"
        "[2026-11-29 17:46:59.301 Control  7686] NEW CLIENT 7688 from user 0: Server is not ready, push client to "
        "pending list\n"
        "[2026-11-29 17:46:59.460 Control  7686] NEW SERVER 7721: Ready\n"
        "[2026-11-29 17:46:59.474 Control  7686] NEW CLIENT 7688 from user 0: Server already exists\n"
        "[2026-11-29 17:47:39.502 Control  7686] NEW CLIENT 8071 from user 0: Server already exists\n")
    assert mps.clients(tmp_path / "run") == 2


def serve_mps(repository: Path, state: Path) -> list[str]:
    return serve_args(repository, state, "--mps")


@pytest.mark.server
@pytest.mark.usefixtures("gpu_here")
def test_serve_mps_gives_the_server_the_daemon_and_stop_quits_it(
        daemon: Path, one_model: Path, state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(serve_mps(one_model, state)) == 0
    record = read_record(state)
    assert record is not None
    environ = dict(item.split("=", 1) for item in
                   Path(f"/proc/{record.pid}/environ").read_text().split("\0") if "=" in item)
    assert environ["CUDA_MPS_PIPE_DIRECTORY"] == str(state.resolve() / "mps" / "pipe")
    assert environ["CUDA_MPS_LOG_DIRECTORY"] == str(state.resolve() / "mps" / "log")
    # A CPU-only server makes no CUDA context, so the daemon sees no client: said, not hidden.
    assert f"warning: CUDA MPS: no process has connected to the daemon ({state / 'mps'})" in capsys.readouterr().out
    assert main(["stop", "--state-dir", str(state)]) == 0
    assert calls_of(daemon) == ["-d", "quit"]
    assert not (state / "mps" / "pipe" / "control").exists() and mps.daemon_pids(state) == []


@pytest.mark.server
def test_serve_mps_without_a_gpu_starts_nothing(daemon: Path, one_model: Path, state: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(triton_server, "gpu_ids", lambda: [])
    assert main(serve_mps(one_model, state)) == 1
    errors = error_lines(capsys)
    assert errors == ["trtbuild: error: --mps: no NVIDIA GPU here (NVML lists none); CUDA MPS shares a GPU between "
                      "processes"]
    assert read_record(state) is None and calls_of(daemon) == []


def _calls_since(log: Path, mark: int) -> list[str]:
    return calls_of(log)[mark:]


@pytest.fixture
def gpu_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_server, "gpu_ids", lambda: [0])  # a GPU for --mps's check only:
    monkeypatch.setattr(triton_server, "cuda_pool_args", lambda gpus: [])  # the CPU server gets no CUDA pool


def server(repository: Path, state: Path) -> triton_server.TritonServer:
    return triton_server.TritonServer(repository, state, triton_server.Ports(*free_ports(3)), mps=True)


@pytest.mark.server
@pytest.mark.usefixtures("gpu_here")
def test_a_refused_second_serve_leaves_the_running_servers_daemon(daemon: Path, one_model: Path, state: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(serve_mps(one_model, state)) == 0
    mark = len(calls_of(daemon))
    assert main(serve_mps(one_model, state)) == 1
    assert _calls_since(daemon, mark) == [] and len(mps.daemon_pids(state)) == 1
    assert "already running" in capsys.readouterr().err
    assert main(["stop", "--state-dir", str(state)]) == 0
    assert _calls_since(daemon, mark) == ["quit"]


@pytest.mark.server
@pytest.mark.usefixtures("gpu_here")
def test_a_stopping_server_leaves_the_daemon_of_the_next_server_in_its_folder(daemon: Path, one_model: Path,
                                                                             state: Path) -> None:
    """A foreground server stopped by `trtbuild stop` from elsewhere, whose own stop() runs only after a new
    `serve --mps` took the folder: the new server's daemon stays."""
    first = server(one_model, state)
    first.start(timeout=120)
    assert triton_server.stop_recorded(state).pid == first.process.pid  # type: ignore[union-attr]
    second = server(one_model, state)
    second.start(timeout=120)
    mark = len(calls_of(daemon))
    first.stop()
    assert _calls_since(daemon, mark) == [] and len(mps.daemon_pids(state)) == 1
    second.stop()
    assert _calls_since(daemon, mark) == ["quit"]
    assert mps.daemon_pids(state) == []


@pytest.mark.server
@pytest.mark.usefixtures("gpu_here")
def test_the_daemon_is_quit_when_the_server_died_or_never_came_up(daemon: Path, one_model: Path, state: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Died: SIGKILLed, then `trtbuild stop` finds its record of an exited server.
    assert main(serve_mps(one_model, state)) == 0
    record = read_record(state)
    assert record is not None
    os.kill(record.pid, signal.SIGKILL)
    os.waitpid(record.pid, 0)
    mark = len(calls_of(daemon))
    assert main(["stop", "--state-dir", str(state)]) == 0
    assert _calls_since(daemon, mark) == ["quit"]
    # Ctrl-C while the models load: the server is stopped and so is its daemon.
    interrupted = server(one_model, state)

    def interrupt(*args: object, **kwargs: object) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(triton_server, "ready", interrupt)
    mark = len(calls_of(daemon))
    with pytest.raises(KeyboardInterrupt):
        interrupted.start(timeout=120)
    assert interrupted.process is not None and interrupted.process.poll() is not None
    assert _calls_since(daemon, mark) == ["-d", "quit"] and read_record(state) is None
    # The server binary does not start at all.
    missing = server(one_model, state)
    monkeypatch.setattr(missing, "argv", lambda: [str(state / "no-such-tritonserver")])
    mark = len(calls_of(daemon))
    with pytest.raises(FileNotFoundError):
        missing.start(timeout=120)
    assert _calls_since(daemon, mark) == ["-d", "quit"]


@pytest.mark.server
@pytest.mark.usefixtures("gpu_here")
def test_tune_mps_measures_on_a_private_server_under_the_daemon(daemon: Path, repo_copy: Path, tmp_path: Path) -> None:
    from builder.tuning.objective import Goal, Objective
    from builder.tuning.points import Space
    from builder.tuning.run import TuneConfig, tune
    from builder.tuning.strategies import Search

    report = tune(TuneConfig(repo_copy, Space(("mlp_fp32",), (8,), (0,), (1,)), Objective(Goal.THROUGHPUT),
                             search=Search.HILL, concurrencies=[2], measurement_ms=300, default_variant="mlp_fp32",
                             report_path=tmp_path / "tune.json", plot_path=None, max_trials=2, compare=False,
                             write=False, mps=True))
    assert report.mps and json.loads((tmp_path / "tune.json").read_text())["mps"] is True
    # One private server, under a daemon of its own temporary state folder, quit with it.
    assert calls_of(daemon) == ["-d", "quit"]
    (pipe,) = [line.split()[1] for line in daemon.read_text().splitlines() if line.startswith("-d")]
    assert "trtbuild-tune-" in pipe and not Path(pipe).exists()  # the folder went with the run


@pytest.mark.parametrize("flag", ["--mps", "--no-mps"])
def test_tune_mps_either_way_with_url_is_one_line(flag: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "m", flag, "--url", "127.0.0.1:8000", "--manifest", str(tmp_path / "models.toml"),
                 "--repository", str(tmp_path)]) == 1
    assert error_lines(capsys) == [
        f"trtbuild: error: {flag}: only for tune's private server; with --url, start that server with "
        "`trtbuild serve --mps` or `--no-mps`"]


def _config(repository: Path, name: str, text: str) -> None:
    (repository / name).mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(text)


def test_only_python_models_on_a_gpu_choose_mps_by_default(daemon: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    repository = tmp_path / "repo"
    _config(repository, "cpu_runner", 'name: "cpu_runner"\nbackend: "python"\ninstance_group [{ kind: KIND_CPU }]\n')
    _config(repository, "native", 'name: "native"\nbackend: "onnxruntime"\ninstance_group [{ kind: KIND_GPU }]\n')
    _config(repository, "broken", 'name: "broken"\nbackend: "python"\ninstance_group [{ kind: KIND_GPU \n')
    assert mps.gpu_runner_instances(repository, [0]) == {} and mps.auto(repository, [0]) == (False, None)
    _config(repository, "gpu_runner", 'name: "gpu_runner"\nbackend: "python"\n'
                                      'instance_group [{ kind: KIND_CPU }, { count: 4, kind: KIND_GPU }]\n')
    _config(repository, "placed", 'name: "placed"\nbackend: "python"\n'
                                  'instance_group [{ count: 2, kind: KIND_GPU, gpus: [1] }]\n')
    # 4 on every GPU, 2 more on GPU 1
    assert mps.gpu_runner_instances(repository, [0, 1]) == {0: {"gpu_runner": 4}, 1: {"gpu_runner": 4, "placed": 2}}
    assert mps.auto(repository, [0, 1]) == (True, None)
    assert mps.auto(repository, []) == (False, None)  # such models cannot load without a GPU: Triton says so
    # More clients on one GPU than an MPS server takes: not by default.
    _config(repository, "many", 'name: "many"\nbackend: "python"\ninstance_group [{ count: 42, kind: KIND_GPU }]\n')
    assert mps.auto(repository, [0, 1]) == (False, "GPU 1 would hold 48 python-runner instances (many 42, gpu_runner "
                                                   "4, placed 2) and the server, more than the 48 clients an MPS "
                                                   "server takes per GPU; serve fewer instances (models.toml's "
                                                   "[model.serving] instances) or spread them with --gpus")
    (repository / "many" / "config.pbtxt").unlink()
    # A daemon the host already runs (here in the folder CUDA_MPS_PIPE_DIRECTORY names) is left to serve them;
    # a socket nobody listens on (a daemon leaves it after quit) is no daemon.
    host = tmp_path / "host"
    host.mkdir()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(host))
    assert mps.host_daemon() is None and mps.auto(repository, [0]) == (True, None)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as quit_daemon:  # its socket, left after it quit
        quit_daemon.bind(str(host / "control"))
    assert mps.host_daemon() is None and mps.auto(repository, [0]) == (True, None)
    (host / "control").unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listening:
        listening.bind(str(host / "control"))
        listening.listen()
        assert mps.host_daemon() == host / "control" and mps.auto(repository, [0]) == (False, None)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert mps.auto(repository, [0]) == (False, f"{mps.CONTROL} not found on PATH (it comes with the NVIDIA "
                                                "driver's utilities)")
    assert calls_of(daemon) == []  # choosing starts nothing


@pytest.fixture
def gpu_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU test model counted as a python-runner model on a GPU, for the default's choice only."""
    monkeypatch.setattr(mps, "gpu_runner_instances", lambda repository, gpus: {0: {"mlp_fp32": 1}})


@pytest.mark.server
@pytest.mark.usefixtures("gpu_here", "gpu_models")
def test_serve_runs_gpu_runner_models_under_mps_by_default_and_no_mps_turns_it_off(
        daemon: Path, one_model: Path, state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(serve_args(one_model, state)) == 0
    assert calls_of(daemon) == ["-d"] and len(mps.daemon_pids(state)) == 1
    record = read_record(state)
    assert record is not None
    assert f"CUDA_MPS_PIPE_DIRECTORY={state.resolve() / 'mps' / 'pipe'}" in \
        Path(f"/proc/{record.pid}/environ").read_text().split("\0")
    capsys.readouterr()
    assert main(["stop", "--state-dir", str(state)]) == 0
    assert calls_of(daemon) == ["-d", "quit"] and mps.daemon_pids(state) == []
    assert main(serve_args(one_model, state, "--no-mps")) == 0
    out = capsys.readouterr().out
    assert main(["stop", "--state-dir", str(state)]) == 0
    assert calls_of(daemon) == ["-d", "quit"] and "MPS" not in out  # asked off: nothing started, nothing said


@pytest.mark.server
@pytest.mark.usefixtures("gpu_here", "gpu_models")
def test_a_default_daemon_that_does_not_start_is_a_warning_and_mps_insisted_on_is_an_error(
        daemon: Path, one_model: Path, state: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("STANDIN_NO_SOCKET", "1")
    monkeypatch.setattr(mps, "start", functools.partial(mps.start, timeout=0.5))
    assert main(serve_args(one_model, state)) == 0
    out, err = capsys.readouterr()
    assert "warning: CUDA MPS off: the MPS control daemon made no socket" in out
    assert "--no-mps silences this" in out and mps.daemon_pids(state) == []
    assert out.count("MPS") == 2 and "MPS" not in err  # said once (the line names --no-mps)
    record = read_record(state)
    assert record is not None
    assert not any(item.startswith("CUDA_MPS_") for item in
                   Path(f"/proc/{record.pid}/environ").read_text().split("\0"))
    assert main(["stop", "--state-dir", str(state)]) == 0
    assert main(serve_mps(one_model, state)) == 1
    assert error_lines(capsys)[0].startswith("trtbuild: error: --mps: the MPS control daemon made no socket")
    assert read_record(state) is None and mps.daemon_pids(state) == []


@pytest.mark.server
@pytest.mark.usefixtures("gpu_here")
def test_a_repository_without_gpu_runner_models_gets_no_daemon_and_no_line(
        daemon: Path, one_model: Path, state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(serve_args(one_model, state)) == 0
    out = capsys.readouterr().out
    assert main(["stop", "--state-dir", str(state)]) == 0
    assert calls_of(daemon) == [] and "MPS" not in out


@pytest.mark.parametrize(("value", "flag"), [("", None), ("0", "--no-mps"), ("no", "--no-mps"), ("1", "--mps"),
                                             ("true", "--mps")])
def test_make_mps_maps_to_the_flag(value: str, flag: str | None, tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[3]
    # STAMP: a fresh file, so its install rule is up to date and the dry run prints the target's own command (a
    # file of the checkout, such as the Makefile, would be remade by make even under -n: it is a makefile).
    stamp = tmp_path / "stamp"
    stamp.touch()
    for target in ("serve", "serve-bg", "tune"):
        done = subprocess.run(["make", "-n", "--no-print-directory", target, f"MPS={value}", f"STAMP={stamp}"],
                              cwd=root, capture_output=True, text=True, timeout=60, check=True)
        words = done.stdout.split()
        assert [w for w in words if w in ("--mps", "--no-mps")] == ([flag] if flag else []), target
    bad = subprocess.run(["make", "-n", "--no-print-directory", "serve", "MPS=maybe", f"STAMP={stamp}"], cwd=root,
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "MPS=maybe: expected 1, yes or true" in bad.stderr


def _tune(repository: Path, report: Path, mps_setting: bool | None) -> Any:
    from builder.tuning.objective import Goal, Objective
    from builder.tuning.points import Space
    from builder.tuning.run import TuneConfig, tune
    from builder.tuning.strategies import Search

    return tune(TuneConfig(repository, Space(("mlp_fp32",), (8,), (0,), (1,)), Objective(Goal.THROUGHPUT),
                           search=Search.HILL, concurrencies=[2], measurement_ms=300, default_variant="mlp_fp32",
                           report_path=report, plot_path=None, max_trials=1, compare=False, write=False,
                           mps=mps_setting))


@pytest.mark.server
@pytest.mark.usefixtures("gpu_here", "gpu_models")
def test_tune_decides_as_serve_does_and_says_why_not(daemon: Path, repo_copy: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    report = _tune(repo_copy, tmp_path / "on.json", None)
    assert report.mps and report.mps_note is None and calls_of(daemon) == ["-d", "quit"]
    monkeypatch.setenv("STANDIN_NO_SOCKET", "1")  # the default's daemon does not start: measured without it
    monkeypatch.setattr(mps, "start", functools.partial(mps.start, timeout=0.5))
    report = _tune(repo_copy, tmp_path / "off.json", None)
    assert not report.mps and report.mps_note is not None and "made no socket" in report.mps_note
    assert json.loads((tmp_path / "off.json").read_text())["mps_note"] == report.mps_note


def test_tune_notes_a_restart_that_lost_mps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A private server that died and came back without its daemon: the report must not say MPS."""
    from builder.tuning import targets

    outcomes = iter([(True, None), (False, "the MPS control daemon made no socket")])

    class StandInServer:
        def __init__(self, repository: Path, state_dir: Path, ports: object, **kwargs: object) -> None:
            self.repository, self.state_dir, self.process = repository, state_dir, None
            self.mps_used, self.mps_note = False, None

        def start(self, timeout: float = 120.0) -> None:
            self.mps_used, self.mps_note = next(outcomes)

        def stop(self) -> None:
            pass

    (tmp_path / "repo" / "m").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text('name: "m"\n')
    monkeypatch.setattr(targets, "TritonServer", StandInServer)
    with targets.LocalTarget(tmp_path / "repo", ["m"], mps=None) as target:
        assert target.mps_used and target.mps_note is None
        target.restart()
        assert not target.mps_used and target.mps_note == "the MPS control daemon made no socket"


@pytest.mark.parametrize(("mps_used", "instances", "refused"), [(True, 48, True), (True, 47, False),
                                                              (False, 60, False)])
def test_tune_refuses_a_point_past_the_mps_clients_of_a_gpu_before_loading_it(
        mps_used: bool, instances: int, refused: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tune point with more python-runner instances on one GPU than an MPS server takes (48 with the server's
    own context) could not load under the daemon: the point is rejected with that reason, nothing is loaded."""
    from builder.tuning import targets
    from builder.tuning.control import Rejected
    from builder.tuning.points import Point

    class StandInServer:
        def __init__(self, repository: Path, state_dir: Path, ports: object, **kwargs: object) -> None:
            self.repository, self.state_dir, self.process = repository, state_dir, None
            self.mps_used, self.mps_note = mps_used, None

        def start(self, timeout: float = 120.0) -> None:
            pass

        def stop(self) -> None:
            pass

    (tmp_path / "repo" / "m").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text(
        'name: "m"\nbackend: "python"\nmax_batch_size: 8\ninstance_group [{ count: 4, kind: KIND_GPU }]\n')
    monkeypatch.setattr(targets, "TritonServer", StandInServer)
    loaded: list[str] = []
    with targets.LocalTarget(tmp_path / "repo", ["m"], mps=None) as target:
        monkeypatch.setattr(target, "_while_running", lambda label, call, stage="loading": loaded.append(label))
        point = Point("m", 8, 0, instances)
        if refused:
            with pytest.raises(Rejected) as info:
                target.load(point)
            assert str(info.value) == (f"{instances} python-runner instances on one GPU and the server are more than "
                                       "the 48 clients a CUDA MPS server takes per GPU; tune with --no-mps to "
                                       "measure this many")
            assert not loaded
            assert "count: 4" in (target.tmp / "repository" / "m" / "config.pbtxt").read_text()  # not written
        else:
            target.load(point)
            assert loaded == [point.label()]


@pytest.mark.server
@pytest.mark.usefixtures("gpu_here", "gpu_models")
def test_the_ready_line_names_the_default_and_how_to_turn_it_off(daemon: Path, one_model: Path, state: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(mps, "clients", lambda state_dir: 5)  # as if the stubs had reached the daemon
    assert main(serve_args(one_model, state)) == 0
    assert (f"CUDA MPS: control daemon in {state / 'mps'}, 5 client processes so far; stopped with the server (on "
            "by default for python-runner models on a GPU; --no-mps turns it off)") in capsys.readouterr().out
    assert main(["stop", "--state-dir", str(state)]) == 0
    assert main(serve_mps(one_model, state)) == 0
    out = capsys.readouterr().out
    assert main(["stop", "--state-dir", str(state)]) == 0
    assert "5 client processes so far; stopped with the server\n" in out  # asked for: no note on the default



class _Stop(Exception):
    pass


@pytest.mark.parametrize(("flags", "expected"), [([], None), (["--mps"], True), (["--no-mps"], False)])
def test_serve_and_tune_leave_the_choice_to_the_default_unless_told(flags: list[str], expected: bool | None,
                                                                    tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from builder.tuning import run as tune_run

    seen: list[bool | None] = []

    class Captured:
        def __init__(self, *args: object, mps: bool | None = False, **kwargs: object) -> None:
            seen.append(mps)
            raise _Stop

    def capture(config: Any) -> None:
        seen.append(config.mps)
        raise _Stop

    monkeypatch.setattr(triton_server, "TritonServer", Captured)
    monkeypatch.setattr(tune_run, "tune", capture)
    (tmp_path / "models.toml").write_text('[[model]]\nname = "mlp"\nonnx = "mlp.onnx"\nprecisions = ["fp32"]\n')
    (tmp_path / "repository" / "mlp_fp32").mkdir(parents=True)
    with pytest.raises(_Stop):
        main(["serve", "--repository", str(tmp_path / "repository"), "--state-dir", str(tmp_path / "run"), *flags])
    with pytest.raises(_Stop):
        main(["tune", "mlp", "--manifest", str(tmp_path / "models.toml"), "--repository", str(tmp_path / "repository"),
              "--report", str(tmp_path / "t.json"), "--plot", str(tmp_path / "t.png"), "--html",
              str(tmp_path / "t.html"), *flags])
    assert seen == [expected, expected]  # what reached TritonServer, and tune's config


@pytest.mark.server
@pytest.mark.usefixtures("gpu_here", "gpu_models")
def test_ctrl_c_just_after_the_default_daemon_started_quits_it(daemon: Path, one_model: Path, state: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    started = mps.start

    def start_then_interrupt(state_dir: Path, gpus: list[int], timeout: float = 10.0) -> dict[str, str]:
        started(state_dir, gpus, timeout)
        raise KeyboardInterrupt

    monkeypatch.setattr(mps, "start", start_then_interrupt)
    server = triton_server.TritonServer(one_model, state, triton_server.Ports(*free_ports(3)), mps=None)
    with pytest.raises(KeyboardInterrupt):
        server.start(timeout=120)
    assert calls_of(daemon) == ["-d", "quit"] and mps.daemon_pids(state) == [] and server.process is None


def test_tunes_note_names_what_tune_has() -> None:
    from builder.tuning.targets import _tune_note

    assert _tune_note(None) is None
    made_none = "the MPS control daemon made no socket /tmp/t/mps/pipe/control within 10 s"
    assert _tune_note(f"{made_none}; see /tmp/t/mps/log/control.log") == made_none
    assert _tune_note("the daemon's socket /x would be longer than a Unix socket's 107 bytes; use a shorter "
                      "--state-dir").endswith("set a shorter TMPDIR (tune's server runs in a folder there)")
