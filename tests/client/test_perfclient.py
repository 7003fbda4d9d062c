"""perfclient against a real Triton server on loopback: every mode, both protocols, faults."""

from __future__ import annotations

import asyncio
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from builder.manifest import ModelSpec
from builder.triton_server import Ports, TritonServer, free_ports
from client.cli import main, measure, parse_config
from client.protocol import Connection
from client.report import CSV_COLUMNS

FAST = ["--measurement-interval", "400", "--max-trials", "4", "--stability-percentage", "60", "--warmup", "5",
        "--no-progress"]


def url(server: TritonServer, protocol: str) -> str:
    return f"127.0.0.1:{server.ports.grpc if protocol == 'grpc' else server.ports.http}"


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_concurrency_mode_writes_the_documented_json_and_csv(
    protocol: str, triton: TritonServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    code, out, _ = run(["-m", "mlp_fp32", "-u", url(triton, protocol), "-i", protocol, "--concurrency", "4",
                        "--json", str(out_json), "--csv", str(out_csv), "--plot", str(tmp_path / "p.png"),
                        "--metrics-url", f"http://127.0.0.1:{triton.ports.metrics}/metrics", *FAST], capsys)
    assert code == 0
    assert "mlp_fp32" in out and "power source: none" in out
    doc = json.loads(out_json.read_text())
    assert doc["model"] == "mlp_fp32" and doc["protocol"] == protocol
    (result,) = doc["results"]
    assert result["concurrency"] == 4 and result["throughput"] > 0 and result["errors"] == {}
    assert set(result["latency_us"]) == {"avg", "p50", "p90", "p95", "p99", "max"}
    lat = result["latency_us"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p95"] <= lat["p99"] <= lat["max"]
    assert set(result["server"]) == {"queue_us", "compute_input_us", "compute_infer_us", "compute_output_us",
                                     "avg_batch"}
    assert result["server"]["compute_infer_us"] > 0 and result["server"]["avg_batch"] >= 1
    assert result["power"]["source"] == "none" and result["power"]["reason"]
    assert isinstance(result["stable"], bool) and 1 <= result["windows"] <= 4
    rows = list(csv.reader(out_csv.open()))
    assert rows[0] == CSV_COLUMNS and rows[1][0] == "4"
    assert float(rows[1][1]) == pytest.approx(result["throughput"], rel=1e-3)
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_concurrency_sweep_and_batch_size(triton: TritonServer, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = run(["-m", "mlp_int8", "-u", url(triton, "grpc"), "--concurrency-range", "1:3:2", "-b", "2",
                      "--json", str(tmp_path / "s.json"), *FAST], capsys)
    assert code == 0
    results = json.loads((tmp_path / "s.json").read_text())["results"]
    assert [r["concurrency"] for r in results] == [1, 3]
    assert all(r["server"]["avg_batch"] >= 2 for r in results)


@pytest.mark.parametrize("distribution", ["constant", "poisson"])
def test_open_loop_holds_the_rate_and_counts_late_sends(
    distribution: str, triton: TritonServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, _ = run(["-m", "mlp_fp16", "-u", url(triton, "grpc"), "--request-rate", "80", "--distribution",
                      distribution, "--json", str(tmp_path / "o.json"), "--measurement-interval", "1500",
                      "--max-trials", "3", "--no-progress"], capsys)
    assert code == 0
    (result,) = json.loads((tmp_path / "o.json").read_text())["results"]
    assert result["request_rate"] == 80 and result["distribution"] == distribution
    assert result["throughput"] == pytest.approx(80, rel=0.35)
    assert result["late_sends"] >= 0 and result["errors"] == {}


def test_request_count_mode_and_server_side_counts(
    triton: TritonServer, tiny_repository: tuple[Path, list[ModelSpec]]
) -> None:
    config, _ = parse_config(["-m", "mlp_fp32", "-u", url(triton, "http"), "-i", "http", "--concurrency", "2",
                              "--request-count", "30", "--max-trials", "3", "--warmup", "0", "--no-progress"])

    async def server_successes() -> int:
        conn = Connection("http", url(triton, "http"))
        try:
            return (await conn.statistics("mlp_fp32")).success_count
        finally:
            await conn.close()

    before = asyncio.run(server_successes())
    rows = asyncio.run(measure(config))
    after = asyncio.run(server_successes())
    (_, result) = rows[0]
    assert all(w.requests >= 30 for w in result.windows)
    counted = sum(w.requests for w in result.windows)
    assert result.server["requests"] >= 1
    # The server saw every request the client completed, plus the probe, warm-up and the ones in
    # flight when the level ended (at most the concurrency).
    assert counted <= after - before
    assert result.summary is not None


def test_real_input_data_from_npz(triton: TritonServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.savez(tmp_path / "in.npz", x=np.random.default_rng(0).standard_normal((8, 4, 32)).astype(np.float32))
    code, _, err = run(["-m", "mlp_fp32", "-u", url(triton, "grpc"), "--input-data", str(tmp_path / "in.npz"),
                        "-b", "2", *FAST], capsys)
    assert code == 0, err
    np.savez(tmp_path / "bad.npz", pixels=np.zeros((8, 4, 32), np.float32))
    code, _, err = run(["-m", "mlp_fp32", "-u", url(triton, "grpc"), "--input-data", str(tmp_path / "bad.npz"),
                        *FAST], capsys)
    assert code == 1 and "holds ['pixels'], model mlp_fp32 expects ['x']" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-m", "mlp_fp32", "-u", "127.0.0.1:{dead}"], "cannot reach Triton over grpc"),
        (["-m", "resnet_nope", "-u", "{grpc}"], "-m resnet_nope: model is not served"),
        (["-m", "seq_fp32", "-u", "{grpc}"], "has dynamic dims [-1]; expected --shape ids:DIMS"),
        (["-m", "mlp_fp32", "-u", "{grpc}", "--shape", "x:4,31"], "model mlp_fp32 expects [4, 32]"),
        (["-m", "mlp_fp32", "-u", "{grpc}", "--shape", "pixels:3"], "--shape pixels: not an input"),
        (["-m", "mlp_fp32", "-u", "{grpc}", "-b", "64"], "-b 64: model mlp_fp32 accepts at most 8"),
        (["-m", "mlp_fp32", "-i", "udp"], "-i 'udp': expected one of grpc, http"),
        (["-m", "mlp_fp32", "--concurrency-range", "4:2"], "expected 1 <= START <= END"),
        (["-m", "mlp_fp32", "--request-rate", "-5"], "--request-rate -5.0: expected a positive rate"),
        (["-m", "mlp_fp32", "--request-rate", "5", "--distribution", "bursty"], "--distribution 'bursty'"),
    ],
)
def test_bad_input_is_one_line_and_exit_1(args: list[str], message: str, triton: TritonServer,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    dead = free_ports(1)[0]
    filled = [a.format(dead=dead, grpc=url(triton, "grpc")) for a in args]
    code, _, err = run([*filled, *FAST], capsys)
    assert code == 1
    lines = err.strip().splitlines()
    assert lines[-1].startswith("perfclient: error:") and message in lines[-1], lines[-1]
    assert "Traceback" not in err


def test_server_dying_mid_run_keeps_the_windows_and_exits_non_zero(
    tiny_repository: tuple[Path, list[ModelSpec]], tmp_path: Path
) -> None:
    repository, _ = tiny_repository
    http, grpc, metrics = free_ports(3)
    server = TritonServer(repository, tmp_path / "state", Ports(http, grpc, metrics))
    server.start(timeout=120)
    out = tmp_path / "partial.json"
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "client", "-m", "mlp_fp32", "-u", f"127.0.0.1:{grpc}", "--concurrency", "2",
             "--measurement-interval", "500", "--max-trials", "40", "--stability-percentage", "0.001",
             "--json", str(out), "--no-progress"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        time.sleep(4)
    finally:
        server.stop()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert "server stopped answering" in stderr.strip().splitlines()[-1]
    doc = json.loads(out.read_text())
    assert "stopped answering" in doc["error"]
    assert doc["results"] and doc["results"][0]["throughput"] >= 0
    assert "Traceback" not in stderr
