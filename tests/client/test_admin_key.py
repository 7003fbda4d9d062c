"""perfclient against a server whose restricted APIs need the admin key: shared-memory registration is
refused without it and works with $TRITON_ADMIN_KEY (HTTP and gRPC, each under its own header name)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.serving.exposure import Exposure
from builder.serving.triton_server import Ports, TritonServer, free_ports
from builder.spec import ModelSpec
from client.admin_key import GRPC_KEY_HEADER, KEY_ENV, KEY_HEADER, parse_header, request_headers
from client.cli import main
from client.errors import PerfClientError

KEY = "perfclient-admin-key-0123456789"


def test_headers_take_perf_analyzers_form_and_the_key_from_the_environment() -> None:
    assert parse_header("X-Trace: on") == ("x-trace", "on")
    with pytest.raises(PerfClientError, match="expected NAME:VALUE"):
        parse_header("no colon")
    with pytest.raises(PerfClientError, match="expected NAME:VALUE"):
        parse_header("bad name: x")
    env = {KEY_ENV: KEY}
    assert request_headers("http", (), env) == ((KEY_HEADER, KEY),)
    assert request_headers("grpc", (), env) == ((GRPC_KEY_HEADER, KEY),)
    assert request_headers("http", (f"{KEY_HEADER}:given",), env) == ((KEY_HEADER, "given"),)  # -H wins
    assert request_headers("http", (), {}) == ()


@pytest.fixture(scope="module")
def restricted(tiny_repository: tuple[Path, list[ModelSpec]],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ports]:
    repository, _ = tiny_repository
    ports = Ports(*free_ports(3))
    server = TritonServer(repository, tmp_path_factory.mktemp("restricted"), ports,
                          exposure=Exposure("0.0.0.0", KEY))
    server.start(timeout=120)
    try:
        yield ports
    finally:
        server.stop()


@pytest.mark.server
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_shared_memory_needs_the_key_and_takes_it_from_the_environment(
        protocol: str, restricted: Ports, quick_args: list[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    port = restricted.grpc if protocol == "grpc" else restricted.http
    args = ["-m", "mlp_fp32", "-u", f"127.0.0.1:{port}", "-i", protocol, "-b", "2", "--concurrency", "2",
            "--shared-memory", "system", "--power-source", "none", *quick_args]
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert main(args) == 1
    assert "refused to register" in capsys.readouterr().err
    monkeypatch.setenv(KEY_ENV, KEY)
    out_json = tmp_path / "r.json"
    assert main([*args, "--json", str(out_json)]) == 0
    capsys.readouterr()
    (result,) = json.loads(out_json.read_text())["results"]
    assert result["errors"] == {} and result["requests"] > 0
    assert KEY not in out_json.read_text()
