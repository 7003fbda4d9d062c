"""A tritonserver that dies (issue 24: Triton 2.51 once died of SIGSEGV mid-tune, 'Signal (11) received' in
pthread_mutex_lock; see docs/triton-crash.md): tune restarts its private server and measures the point
again, and says so; serve and verify name what happened and show the server's last lines.

The server is killed with SIGSEGV from inside its own python-backend stub (os.kill of the stub's parent),
once: a marker file created with O_EXCL makes the second load or request of the point go through."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from builder.cli import main
from builder.serving.processes import STATE_FILE
from builder.serving.triton_server import exit_text, free_ports, last_lines, ready
from builder.spec import ModelSpec
from builder.tuning.objective import Goal, Objective
from builder.tuning.points import Space
from builder.tuning.run import TuneConfig, tune
from builder.tuning.strategies import Search


def segv_once(marker: Path, hook: str) -> str:
    """Appended to the variant's Python model: SIGSEGV to the server the first time a max_batch_size 4
    config reaches `hook` (initialize: while loading; execute: while measuring)."""
    return f'''

_Model = TritonPythonModel


def _segv_once():
    import os
    import signal
    import time
    try:
        os.close(os.open({str(marker)!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    server = os.getppid()
    os.kill(server, signal.SIGSEGV)
    # Until the server is gone (this stub is handed to another parent): the load or request that got here
    # must not be answered first (Triton's handler prints a stack while its other threads run on).
    deadline = time.monotonic() + 60
    while os.getppid() == server and time.monotonic() < deadline:
        time.sleep(0.01)


class TritonPythonModel(_Model):  # noqa: F811
    def initialize(self, args):
        self._mbs = json.loads(args["model_config"]).get("max_batch_size")
        if {hook!r} == "initialize" and self._mbs == 4:
            _segv_once()
        super().initialize(args)

    def execute(self, requests):
        if {hook!r} == "execute" and self._mbs == 4:
            _segv_once()
        return super().execute(requests)
'''


@pytest.mark.server
@pytest.mark.parametrize(("hook", "stage"), [("initialize", "loading"), ("execute", "measuring")])
def test_a_tuning_server_killed_mid_point_is_restarted_and_the_point_measured_again(
        hook: str, stage: str, repo_copy: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    marker = tmp_path / "segv-sent"
    model = repo_copy / "mlp_fp32" / "1" / "model.py"
    model.write_text(model.read_text() + segv_once(marker, hook))
    space = Space(("mlp_fp32",), (8, 4), (0,), (1,))
    with caplog.at_level(logging.WARNING, logger="builder"):
        report = tune(TuneConfig(repo_copy, space, Objective(Goal.THROUGHPUT), search=Search.EXHAUSTIVE,
                                 concurrencies=[1],
                      measurement_ms=300, default_variant="mlp_fp32", report_path=tmp_path / "t.json",
                      plot_path=None, max_trials=2, compare=False, write=False, point_timeout_s=120))
    assert marker.exists(), "the premise: the server was sent SIGSEGV"
    killed = next(e for e in report.points if e.point.max_batch_size == 4)
    assert killed.failure is None and killed.results and killed.throughput > 0  # measured on the new server
    expected = f"the tuning server {exit_text(-signal.SIGSEGV)} while {stage} it"
    assert len(killed.restarts) == 1 and killed.restarts[0].startswith(expected), killed.restarts
    assert all(not e.restarts for e in report.points if e is not killed)
    assert report.restarts == 1 and report.failed == 0 and report.partial is None and report.measurements == 2
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["restarts"] == 1
    assert [len(p["restarts"]) for p in doc["points"]] == [1, 0]  # sorted: mbs=4 first
    warnings = [r.getMessage() for r in caplog.records if "restarted the server" in r.getMessage()]
    assert len(warnings) == 1 and killed.label in warnings[0] and "SIGSEGV" in warnings[0]


def _wait_for(condition: str, check: Callable[[], bool], deadline_s: float) -> None:
    """Poll `check` until it holds, failing after the deadline."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {deadline_s:.0f} s: {condition}")


@pytest.mark.server
def test_serve_says_how_the_server_died_and_shows_its_last_lines(repo_copy: Path, tmp_path: Path) -> None:
    state = tmp_path / "run"
    http, grpc, metrics = free_ports(3)
    proc = subprocess.Popen([sys.executable, "-m", "builder", "serve", "--repository", str(repo_copy),
                             "--state-dir", str(state), "--http-port", str(http), "--grpc-port", str(grpc),
                             "--metrics-port", str(metrics)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    # Killed once serve itself says the server is ready: Triton answering its health check comes first, and a
    # kill between the two is a server that died while starting (a fresh-clone CI run hit that window).
    said_ready = threading.Event()
    err_lines: list[str] = []

    def read_stdout() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("tritonserver ready"):
                said_ready.set()

    def read_stderr() -> None:
        assert proc.stderr is not None
        err_lines.extend(proc.stderr)

    readers = [threading.Thread(target=f, daemon=True) for f in (read_stdout, read_stderr)]
    for reader in readers:
        reader.start()
    try:
        assert said_ready.wait(120), "serve did not say the server was ready within 120 s"
        pid = int(json.loads((state / STATE_FILE).read_text())["pid"])
        os.kill(pid, signal.SIGSEGV)
        proc.wait(timeout=120)
        for reader in readers:
            reader.join(timeout=30)
        err = "".join(err_lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    lines = err.strip().splitlines()
    assert proc.returncode == 1, err
    first = next(i for i, ln in enumerate(lines) if ln.startswith("trtbuild: error: "))
    assert lines[first] == (f"trtbuild: error: tritonserver (pid {pid}) {exit_text(-signal.SIGSEGV)}; the last lines "
                            f"it wrote ({state / 'tritonserver.log'}):")
    tail = lines[first + 1:]
    # What the server wrote last (its log, then its stdout, where Triton prints the crash's stack): the stack
    # can be longer than 12 lines, so "Signal (11) received" itself may be above them.
    # (the stubs may still add lines after serve read them: each line shown is one the server's files hold).
    wrote = {f"  {ln}".rstrip() for ln in last_lines([state / "tritonserver.log", state / "tritonserver.out"],
                                                      10_000)}
    assert 0 < len(tail) <= 12 and all(ln in wrote for ln in tail), err
    assert "Signal (11) received" in "\n".join(last_lines([state / "tritonserver.out", state / "tritonserver.log"],
                                                            10_000)), err


@pytest.mark.server
def test_verify_names_a_dead_server_and_shows_its_last_lines(
        repo_copy: Path, tiny_repository: tuple[Path, list[ModelSpec]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "run"
    http, grpc, metrics = free_ports(3)
    assert main(["serve", "--repository", str(repo_copy), "--state-dir", str(state), "--http-port", str(http),
                 "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--background"]) == 0
    pid = int(json.loads((state / STATE_FILE).read_text())["pid"])
    os.kill(pid, signal.SIGSEGV)
    _wait_for("the server gone", lambda: not ready(http, timeout=0.2) and _gone(pid), 60)
    data = tiny_repository[0].parent
    manifest = tmp_path / "models.toml"
    manifest.write_text(f'''[[model]]
name = "mlp"
onnx = "{data / 'mlp.onnx'}"
precisions = ["fp32"]
batch = {{ min = 1, opt = 4, max = 8 }}

[model.evaluation]
source = "{data / 'mlp_eval.npz'}"
samples = 32
''')
    capsys.readouterr()
    code = main(["verify", "--manifest", str(manifest), "--repository", str(repo_copy), "--state-dir", str(state),
                 "--http-url", f"127.0.0.1:{http}", "--grpc-url", f"127.0.0.1:{grpc}", "--samples", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1, err
    line = next(ln for ln in err if ln.startswith("trtbuild: error: "))
    assert f"the tritonserver started from {state} (pid {pid}) has exited; the last lines it wrote:" in line
    # The signal is named, also where Triton's crash stack outgrew the lines shown (its first lines then come
    # first, then "…"), and the lines end with the server's last (its stubs may still add lines after).
    files = [state / "tritonserver.log", state / "tritonserver.out"]
    tail = err[err.index(line) + 1:]
    assert any("Signal (11) received" in ln for ln in tail), err
    wrote = {" ".join(ln.split()) for ln in last_lines(files, 10_000)}
    assert all(" ".join(ln.split()) in wrote for ln in tail if ln.strip() != "…"), err
    assert " ".join(tail[-1].split()) in {" ".join(ln.split()) for ln in last_lines(files, 40)}, err
    main(["stop", "--state-dir", str(state)])  # cleans the stubs it left


def _gone(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return text[text.rindex(")") + 2] in "ZX"


def test_a_dead_servers_lines_name_its_signal_when_its_stack_outgrew_them(tmp_path: Path) -> None:
    from builder.serving.triton_server import dead_server_lines

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    (tmp_path / STATE_FILE).write_text(json.dumps({"pid": int(gone.stdout), "start_ticks": 1}))
    (tmp_path / "tritonserver.log").write_text("I1130 model loaded\n")
    stack = [f"  {i}# frame{i} in /lib/libtriton.so" for i in range(30)]
    (tmp_path / "tritonserver.out").write_text("\n".join(["Signal (11) received.", *stack]) + "\n")
    lines = dead_server_lines(tmp_path)
    assert lines[0].endswith("has exited; the last lines it wrote:")
    shown = [ln.strip() for ln in lines[1:]]
    assert len(shown) == 12
    assert shown[:8] == ["Signal (11) received.", *(f"{i}# frame{i} in /lib/libtriton.so" for i in range(6)), "…"]
    assert shown[8:] == [f"{i}# frame{i} in /lib/libtriton.so" for i in range(26, 30)]  # still the last ones
    # A short stack is shown as it is: the signal is among the last lines.
    (tmp_path / "tritonserver.out").write_text("\n".join(["Signal (11) received.", *stack[:3]]) + "\n")
    assert [ln.strip() for ln in dead_server_lines(tmp_path)[1:]] == [
        "I1130 model loaded", "Signal (11) received.", *(f"{i}# frame{i} in /lib/libtriton.so" for i in range(3))]
