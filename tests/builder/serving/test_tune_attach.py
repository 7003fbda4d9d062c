"""Attach mode: `trtbuild tune --url` on a running Triton with explicit model control."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.errors import ServerError
from builder.serving.triton_server import ModelControl, Ports, TritonServer, free_ports
from builder.tuning.control import Endpoints
from builder.tuning.objective import Goal, Objective
from builder.tuning.points import Space, point_of
from builder.tuning.run import TuneConfig, tune
from builder.tuning.strategies import Search

OFF = None


def get(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=10) as response:
        data = json.loads(response.read())
    assert isinstance(data, dict)
    return data


def states(http: str) -> dict[str, str]:
    request = urllib.request.Request(f"http://{http}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        return {m["name"]: m.get("state", "") for m in json.loads(response.read())}


@pytest.fixture
def explicit_server(repo_copy: Path, tmp_path: Path) -> Iterator[tuple[TritonServer, Endpoints]]:
    http, grpc, metrics = free_ports(3)
    server = TritonServer(repo_copy, tmp_path / "state", Ports(http, grpc, metrics),
                          model_control=ModelControl.EXPLICIT, extra_args=["--load-model=mlp_fp32"])
    server.start(timeout=120)
    try:
        yield server, Endpoints(f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics")
    finally:
        server.stop()


@pytest.mark.server
def test_attach_mode_changes_the_served_config_and_the_repository(
        explicit_server: tuple[TritonServer, Endpoints], repo_copy: Path, tmp_path: Path) -> None:
    server, endpoints = explicit_server
    assert states(endpoints.http).get("mlp_fp32") == "READY" and states(endpoints.http).get("mlp_int8") != "READY"
    space = Space(("mlp_fp32", "mlp_int8"), (2,), (700,), (2,))
    report = tune(TuneConfig(repo_copy, space, Objective(Goal.THROUGHPUT), search=Search.EXHAUSTIVE, concurrencies=[2],
                  measurement_ms=300, default_variant="mlp_fp32", report_path=tmp_path / "t.json", plot_path=None,
                  max_trials=2, compare=False, attach=endpoints))
    winner = report.winner
    assert winner is not None and winner.max_batch_size == 2 and report.attached == endpoints.http
    # The server serves the winner's settings, and the repository holds them.
    config = get(f"http://{endpoints.http}/v2/models/{winner.variant}/config")
    assert config["max_batch_size"] == 2
    assert config["instance_group"][0]["count"] == 2  # type: ignore[index]
    assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == 700  # type: ignore[index]
    assert point_of(winner.variant, (repo_copy / winner.variant / "config.pbtxt").read_text()) == winner
    # The other variant is as it was: loaded with the repository's config, or not loaded.
    after = states(endpoints.http)
    assert after[winner.variant] == "READY"
    if winner.variant == "mlp_int8":
        other = get(f"http://{endpoints.http}/v2/models/mlp_fp32/config")
        assert after["mlp_fp32"] == "READY" and other["max_batch_size"] == 8
    else:
        assert after.get("mlp_int8") != "READY"
    assert server.process is not None and server.process.poll() is None


def test_attach_to_a_server_without_explicit_model_control_is_one_line(
        triton: TritonServer, tiny_repository: tuple[Path, list[object]], tmp_path: Path) -> None:
    repository, _ = tiny_repository
    ports = triton.ports
    endpoints = Endpoints(f"127.0.0.1:{ports.http}", f"127.0.0.1:{ports.grpc}")
    with pytest.raises(ServerError, match="start it with explicit model control"):
        tune(TuneConfig(repository, Space(("mlp_fp32",), (8,), (0,), (1,)), Objective(), search=Search.EXHAUSTIVE,
             concurrencies=[1], measurement_ms=300, default_variant="mlp_fp32", report_path=None, plot_path=None,
             max_trials=2, compare=False, attach=endpoints, write=False))


def test_attach_to_nothing_is_one_line(repo_copy: Path) -> None:
    port = free_ports(1)[0]
    with pytest.raises(ServerError, match=rf"--url 127.0.0.1:{port}: Triton is not ready"):
        tune(TuneConfig(repo_copy, Space(("mlp_fp32",), (8,), (0,), (1,)), Objective(), search=Search.EXHAUSTIVE,
             concurrencies=[1], measurement_ms=300, default_variant="mlp_fp32", report_path=None, plot_path=None,
             attach=Endpoints(f"127.0.0.1:{port}", f"127.0.0.1:{port}")))


@pytest.mark.server
def test_serve_with_explicit_model_control_loads_nothing_and_says_how_to_load(
        repo_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from builder.cli import main

    http, grpc, metrics = free_ports(3)
    state = tmp_path / "state"
    assert main(["serve", "--repository", str(repo_copy), "--state-dir", str(state), "--http-port", str(http),
                 "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--model-control", "explicit",
                 "--background"]) == 0
    try:
        out = capsys.readouterr().out
        assert f"POST http://127.0.0.1:{http}/v2/repository/models/NAME/load" in out
        assert "READY" not in states(f"127.0.0.1:{http}").values()
    finally:
        assert main(["stop", "--state-dir", str(state)]) == 0
