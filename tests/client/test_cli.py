"""perfclient, the command line, against a real Triton: outputs, the one-line error contract, logging."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from client.cli import main, parse_config
from client.engine import Distribution, LoadLevel
from client.inputs import InputKind
from client.power import PowerSource
from client.protocol import Protocol
from client.report import CSV_COLUMNS
from common.logs import configure_logging
from tests.helpers.servers import Endpoints, PrivateServer
from tests.helpers.waiting import wait_until


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """main() configures logging for the process (levels, the root handler); put it back afterwards."""
    root, ours = logging.getLogger(), logging.getLogger("client")
    saved = (root.level, ours.level, root.handlers[:])
    yield
    root.setLevel(saved[0])
    ours.setLevel(saved[1])
    root.handlers[:] = saved[2]


def perfclient(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_flags_become_one_session_config(tmp_path: Path) -> None:
    cli = parse_config(["-m", "a", "-m", "b", "-i", "http", "--request-rate", "20", "--distribution", "poisson",
                        "-b", "4", "--input-data", "zero", "--shape", "ids:12", "--power-source", "none",
                        "--max-trials", "3", "--json", str(tmp_path / "r.json"), "-vv"])
    s = cli.session
    assert s.models == ("a", "b") and s.url == "localhost:8000" and s.protocol is Protocol.HTTP
    assert s.levels == (LoadLevel(request_rate=20.0, distribution=Distribution.POISSON),)
    assert s.batch == 4 and s.input_data.kind is InputKind.ZERO and s.shapes == {"ids": (12,)}
    assert s.power_source is PowerSource.NONE and s.measurement.max_trials == 3
    assert s.metrics_endpoint == "http://localhost:8002/metrics"
    assert cli.json_path == tmp_path / "r.json" and cli.progress and cli.verbose == 2 and not cli.quiet
    sweep = parse_config(["-m", "a", "--concurrency-range", "2:8:3", "-q"])
    assert [lv.concurrency for lv in sweep.session.levels] == [2, 5, 8] and sweep.session.url == "localhost:8001"
    assert not sweep.progress and sweep.quiet


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_concurrency_mode_writes_the_documented_json_and_csv(
    protocol: str, endpoints: Endpoints, quick_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    code, out, _ = perfclient(["-m", "mlp_fp32", "-u", endpoints.url(protocol), "-i", protocol, "--concurrency", "4",
                               "--json", str(out_json), "--csv", str(out_csv), "--plot", str(tmp_path / "p.png"),
                               "--metrics-url", endpoints.metrics, *quick_args], capsys)
    assert code == 0
    assert "mlp_fp32" in out
    doc = json.loads(out_json.read_text())
    assert doc["model"] == "mlp_fp32" and doc["protocol"] == protocol
    (result,) = doc["results"]
    assert result["concurrency"] == 4 and result["throughput"] > 0 and result["errors"] == {}
    lat = result["latency_us"]
    assert set(lat) == {"avg", "p50", "p90", "p95", "p99", "max"}
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p95"] <= lat["p99"] <= lat["max"]
    assert set(result["server"]) == {"queue_us", "compute_input_us", "compute_infer_us", "compute_output_us",
                                     "avg_batch"}
    assert result["server"]["compute_infer_us"] > 0 and result["server"]["avg_batch"] >= 1
    # Whatever source this host has (none on a CPU machine, nvml on a GPU host): named in the table and
    # the JSON, with energy figures when it measured, a reason when it did not.
    power = result["power"]
    assert f"power source: {power['source']}" in out
    assert power["source"] in ("none", "nvml", "triton", "rapl")
    assert power.get("reason") if power["source"] == "none" else power.get("energy_j") is not None
    assert result["partial"] is False
    assert isinstance(result["stable"], bool) and 1 <= result["windows"] <= 4
    assert result["stable"] or result["windows"] == 4  # a level stops early only when stable
    # A window's end is a timer callback: the event loop may run it up to its clock resolution early.
    assert len(result["window_seconds"]) == result["windows"] and min(result["window_seconds"]) >= 0.39
    assert "late_sends" not in result and "request_rate" not in result  # open-loop figures only
    rows = list(csv.reader(out_csv.open()))
    assert rows[0] == CSV_COLUMNS and rows[1][0] == "4"
    assert float(rows[1][1]) == pytest.approx(result["throughput"], rel=1e-3)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_concurrency_sweep_and_batch_size(endpoints: Endpoints, quick_args: list[str], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = perfclient(["-m", "mlp_int8", "-u", endpoints.grpc, "--concurrency-range", "1:3:2", "-b", "2",
                             "--json", str(tmp_path / "s.json"), *quick_args], capsys)
    assert code == 0
    results = json.loads((tmp_path / "s.json").read_text())["results"]
    assert [r["concurrency"] for r in results] == [1, 3]
    assert all(r["server"]["avg_batch"] >= 2 for r in results)


@pytest.mark.parametrize("distribution", ["constant", "poisson"])
def test_open_loop_holds_the_rate_and_counts_late_sends(
    distribution: str, endpoints: Endpoints, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, _ = perfclient(["-m", "mlp_fp16", "-u", endpoints.grpc, "--request-rate", "80", "--distribution",
                             distribution, "--json", str(tmp_path / "o.json"), "--measurement-interval", "1500",
                             "--max-trials", "3", "--no-progress"], capsys)
    assert code == 0
    (result,) = json.loads((tmp_path / "o.json").read_text())["results"]
    assert result["request_rate"] == 80 and result["distribution"] == distribution
    # Late sends are counted among the summary's requests (every one succeeded).
    assert result["errors"] == {} and type(result["late_sends"]) is int
    assert 0 <= result["late_sends"] <= result["requests"]
    # As many completed in the summary's span as were due in it, give or take the sends whose latency
    # (counted from the scheduled time: a loaded machine's late sends included) moved them across its
    # edges, and for Poisson arrivals five standard deviations of their count.
    span = sum(result["window_seconds"][-3:])
    due = 80 * span
    slack = 80 * result["latency_us"]["max"] / 1e6 + 2 + (5 * math.sqrt(due) if distribution == "poisson" else 0)
    assert abs(result["requests"] - due) <= slack, (result["requests"], due, slack)
    assert result["throughput"] == pytest.approx(result["requests"] / span, rel=1e-3)


def test_real_input_data_from_npz(endpoints: Endpoints, quick_args: list[str], tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    np.savez(tmp_path / "in.npz", x=np.random.default_rng(0).standard_normal((8, 4, 32)).astype(np.float32))
    code, _, err = perfclient(["-m", "mlp_fp32", "-u", endpoints.grpc, "--input-data", str(tmp_path / "in.npz"),
                               "-b", "2", *quick_args], capsys)
    assert code == 0, err
    np.savez(tmp_path / "bad.npz", pixels=np.zeros((8, 4, 32), np.float32))
    code, _, err = perfclient(["-m", "mlp_fp32", "-u", endpoints.grpc, "--input-data", str(tmp_path / "bad.npz"),
                               *quick_args], capsys)
    assert code == 1 and "holds ['pixels'], model mlp_fp32 expects ['x']" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-m", "mlp_fp32", "-u", "{dead}"], "cannot reach Triton over grpc"),
        (["-m", "resnet_nope", "-u", "{grpc}"], "-m resnet_nope: model is not served"),
        (["-m", "seq_fp32", "-u", "{grpc}"], "has dynamic dims [-1]; expected --shape ids:DIMS"),
        (["-m", "mlp_fp32", "-u", "{grpc}", "--shape", "x:4,31"], "model mlp_fp32 expects [4, 32]"),
        (["-m", "mlp_fp32", "-u", "{grpc}", "--shape", "pixels:3"], "--shape pixels: not an input"),
        (["-m", "mlp_fp32", "-u", "{grpc}", "-b", "64"], "-b 64: model mlp_fp32 accepts at most 8"),
        (["-m", "mlp_fp32", "-i", "udp"], "-i 'udp': expected one of grpc, http"),
        (["-m", "mlp_fp32", "--concurrency-range", "4:2"], "expected 1 <= START <= END"),
        (["-m", "mlp_fp32", "--request-rate", "-5"], "--request-rate -5.0: expected a positive rate"),
        (["-m", "mlp_fp32", "--request-rate", "5", "--distribution", "bursty"], "--distribution 'bursty'"),
        (["-m", "mlp_fp32", "--max-trials", "0"], "--max-trials 0: expected an integer >= 1"),
        (["-m", "mlp_fp32", "--power-source", "meter"], "--power-source 'meter': expected one of auto, nvml"),
        (["-m", "mlp_fp32", "--input-data", "nowhere/at/all"], "--input-data 'nowhere/at/all': expected random"),
        (["-m", "mlp_fp32", "-u", "{grpc}", "--json", "{unwritable}"], "--json {unwritable}: cannot write"),
    ],
)
def test_bad_input_is_one_line_and_exit_1(args: list[str], message: str, endpoints: Endpoints, dead_url: str,
                                          quick_args: list[str], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    unwritable = str(tmp_path / "file" / "r.json")  # a path under a regular file
    fill = {"dead": dead_url, "grpc": endpoints.grpc, "unwritable": unwritable}
    code, _, err = perfclient(quick_args + [a.format(**fill) for a in args], capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert lines[-1].startswith("perfclient: error:") and message.format(**fill) in lines[-1], lines[-1]
    assert "Traceback" not in err


def _assert_partial_outputs(tmp_path: Path, stdout: str, stderr: str, reason: str) -> None:
    """What a cut-short run leaves: JSON, CSV and plot of the completed windows, marked partial."""
    doc = json.loads((tmp_path / "partial.json").read_text())
    assert reason in doc["error"]
    (result,) = doc["results"]
    assert result["partial"] is True and result["stable"] is False and reason in result["stop_reason"]
    assert result["throughput"] > 0 and result["windows"] >= 2
    assert result["latency_us"] is not None and result["latency_us"]["p50"] > 0
    (row,) = csv.DictReader((tmp_path / "partial.csv").open(newline=""))
    assert float(row["Inferences/Second"]) > 0 and int(row["p50 latency"]) > 0
    assert (tmp_path / "partial.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "partial.html").read_text()
    assert "Partial run" in page and reason in page
    assert "mlp_fp32" in stdout and "partial" in stdout  # the table of what was measured
    assert "Traceback" not in stderr


def _perfclient_argv(url: str, tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "client", "-m", "mlp_fp32", "-u", url, "--concurrency", "2", "--measurement-interval",
            "500", "--max-trials", "40", "--stability-percentage", "0.001", "--json", str(tmp_path / "partial.json"),
            "--csv", str(tmp_path / "partial.csv"), "--plot", str(tmp_path / "partial.png"),
            "--html", str(tmp_path / "partial.html"), "--no-progress", *extra]


def _perfclient_process(url: str, tmp_path: Path, *extra: str,
                        new_session: bool = False) -> tuple[subprocess.Popen[str], Path]:
    """A perfclient run with -v, its stderr going to a file (read while it runs); the process and that file."""
    err_path = tmp_path / "stderr.log"
    with err_path.open("w") as err_file:
        proc = subprocess.Popen(_perfclient_argv(url, tmp_path, "-v", *extra), stdout=subprocess.PIPE,
                                stderr=err_file, text=True, start_new_session=new_session)
    return proc, err_path


def _wait_for_windows(proc: subprocess.Popen[str], err_path: Path, count: int = 3) -> None:
    """Until the run has measured `count` windows (-v logs `window N:` once window N closed and the readings
    at its end came back, so a server dying later leaves it kept), failing if the run ends first."""
    def measured() -> bool:
        assert proc.poll() is None, err_path.read_text()
        return f"window {count}:" in err_path.read_text()

    wait_until(measured, what=f"{count} windows measured", timeout_s=120, interval_s=0.1)


def test_server_dying_mid_run_keeps_the_windows_and_exits_non_zero(private_server: PrivateServer,
                                                                     tmp_path: Path) -> None:
    proc, err_path = _perfclient_process(private_server.endpoints.grpc, tmp_path)
    try:
        _wait_for_windows(proc, err_path)
    finally:
        private_server.stop()
    stdout, _ = proc.communicate(timeout=60)
    stderr = err_path.read_text()
    assert proc.returncode == 1, stderr
    assert "server stopped answering" in stderr.strip().splitlines()[-1]
    _assert_partial_outputs(tmp_path, stdout, stderr, "stopped answering")


def test_ctrl_c_keeps_the_windows_and_exits_non_zero(endpoints: Endpoints, tmp_path: Path) -> None:
    proc, err_path = _perfclient_process(endpoints.grpc, tmp_path)
    try:
        _wait_for_windows(proc, err_path)
    finally:
        proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=60)
    stderr = err_path.read_text()
    assert proc.returncode == 1, stderr
    assert "interrupted (Ctrl-C)" in stderr.strip().splitlines()[-1]
    _assert_partial_outputs(tmp_path, stdout, stderr, "interrupted (Ctrl-C)")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_process_group_with_worker_processes_keeps_the_windows(
    signum: signal.Signals, endpoints: Endpoints, tmp_path: Path
) -> None:
    # Ctrl-C in a terminal reaches every process of the group, the spawned workers too (as does a SIGTERM
    # sent to the group): the parent alone handles it, stops its workers and keeps the windows measured.
    proc, err_path = _perfclient_process(endpoints.grpc, tmp_path, "--processes", "2", new_session=True)
    try:
        _wait_for_windows(proc, err_path)
    finally:
        os.killpg(proc.pid, signum)
    stdout, _ = proc.communicate(timeout=60)
    stderr = err_path.read_text()
    reason = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated (SIGTERM)"
    assert proc.returncode == 1, stderr
    assert reason in stderr.strip().splitlines()[-1]
    _assert_partial_outputs(tmp_path, stdout, stderr, reason)


@pytest.mark.parametrize(
    ("flags", "ours", "theirs"),
    [([], logging.INFO, logging.WARNING), (["-v"], logging.DEBUG, logging.WARNING),
     (["-vv"], logging.DEBUG, logging.DEBUG), (["-q"], logging.WARNING, logging.WARNING)],
)
def test_verbosity_flags_set_the_levels(flags: list[str], ours: int, theirs: int, restore_logging: None) -> None:
    cli = parse_config(["-m", "m", *flags])
    configure_logging(["client"], verbose=cli.verbose, quiet=cli.quiet)
    assert logging.getLogger("client.session").getEffectiveLevel() == ours
    assert logging.getLogger("asyncio").getEffectiveLevel() == theirs


@pytest.mark.parametrize(("flags", "shown"), [(["-v"], True), ([], False), (["-q"], False)])
def test_verbose_shows_the_session_debug_lines(flags: list[str], shown: bool, endpoints: Endpoints,
                                               quick_args: list[str], caplog: pytest.LogCaptureFixture,
                                               capsys: pytest.CaptureFixture[str], restore_logging: None) -> None:
    # pytest's handler stands in for the terminal's: what reaches it is what the logger levels let through.
    code, _, _ = perfclient(["-m", "mlp_fp32", "-u", endpoints.grpc, *flags, *quick_args, "--max-trials", "1"],
                            capsys)
    assert code == 0
    lines = [(r.levelno, r.name, r.getMessage()) for r in caplog.records]
    assert ((logging.DEBUG, "client.session", "measuring mlp_fp32 at concurrency 1") in lines) is shown


@pytest.mark.parametrize(("flags", "shown"), [(["-v"], True), ([], False)])
def test_verbose_reaches_the_terminal(flags: list[str], shown: bool, dead_url: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "client", "-m", "mlp_fp32", "-u", dead_url, *flags],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.splitlines()[-1].startswith("perfclient: error: ")
    assert (f"DEBUG client.protocol: connecting to {dead_url} over grpc" in proc.stderr) is shown


def test_simultaneous_models_give_one_row_each_and_a_whole_run(endpoints: Endpoints, quick_args: list[str],
                                                               tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = perfclient(["-m", "mlp_fp32", "-m", "mlp_int8", "--simultaneous", "-u", endpoints.grpc,
                                 "--concurrency", "2", "--model-concurrency", "mlp_int8=1", "--power-source", "none",
                                 "--json", str(tmp_path / "s.json"), "--csv", str(tmp_path / "s.csv"),
                                 "--plot", str(tmp_path / "s.png"), "--html", str(tmp_path / "s.html"), *quick_args],
                                capsys)
    assert code == 0, err
    runs = {d["model"]: d["results"] for d in json.loads((tmp_path / "s.json").read_text())["runs"]}
    assert set(runs) == {"mlp_fp32", "mlp_int8", "(whole run)"}
    assert runs["mlp_fp32"][0]["concurrency"] == 2 and runs["mlp_int8"][0]["concurrency"] == 1
    assert runs["(whole run)"][0]["throughput"] > 0
    assert "(whole run)" in out
    rows = list(csv.DictReader((tmp_path / "s.csv").open(newline="")))
    # Per model, as perf_analyzer's, told apart by the leading Model column; the whole run is not a model.
    assert sorted((r["Model"], r["Concurrency"]) for r in rows) == [("mlp_fp32", "2"), ("mlp_int8", "1")]
    assert (tmp_path / "s.png").stat().st_size > 0 and "(whole run)" in (tmp_path / "s.html").read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["--model-concurrency", "mlp_fp32"], "--model-concurrency 'mlp_fp32': expected MODEL=NUMBER, once per model"),
    (["--model-request-rate", "mlp_fp32=fast"],
     "--model-request-rate 'mlp_fp32=fast': expected MODEL=NUMBER, once per model"),
    (["--simultaneous"], "--simultaneous: expected two or more -m models, got 1"),
    (["--request-timeout-ms", "0"], "--request-timeout-ms 0: expected a positive integer"),
    (["--request-rate", "5", "--max-inflight", "0"], "--max-inflight 0: expected a positive integer"),
    (["--time-limit", "-1"], "--time-limit -1.0: expected a positive number of seconds"),
    (["--request-intervals", "gaps.txt", "--distribution", "poisson"],
     "--distribution poisson: not with --request-intervals (the file gives the gaps)"),
])
def test_new_flags_check_their_values(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = perfclient(["-m", "mlp_fp32", *args], capsys)
    assert code == 1 and err.strip() == f"perfclient: error: {message}"


def test_processes_from_the_command_line(endpoints: Endpoints, tmp_path: Path) -> None:
    # A real `python -m client` run with spawned worker processes, end to end.
    proc = subprocess.run(
        [sys.executable, "-m", "client", "-m", "mlp_fp32", "-u", endpoints.grpc, "--concurrency", "4", "--processes",
         "2", "--measurement-interval", "400", "--max-trials", "3", "--stability-percentage", "60", "--power-source",
         "none", "--json", str(tmp_path / "p.json"), "--no-progress"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (result,) = json.loads((tmp_path / "p.json").read_text())["results"]
    assert result["throughput"] > 0 and result["errors"] == {} and result["partial"] is False
