"""Fixtures for the client tests, on top of tests/conftest.py's `triton` and `tiny_repository`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from builder.serving.triton_server import Ports, TritonServer, free_ports
from client.engine import Measurement
from tests.helpers.servers import Endpoints, PrivateServer


def _endpoints(ports: Ports) -> Endpoints:
    return Endpoints(grpc=f"127.0.0.1:{ports.grpc}", http=f"127.0.0.1:{ports.http}",
                     metrics=f"http://127.0.0.1:{ports.metrics}/metrics")


@pytest.fixture(scope="session")
def endpoints(triton: TritonServer) -> Endpoints:
    """The shared server's addresses (tiny models mlp_fp32, mlp_fp16, mlp_int8, seq_fp32, seq_fp16)."""
    return _endpoints(triton.ports)


@pytest.fixture
def private_server(tiny_repository: tuple[Path, Any], tmp_path: Path) -> Iterator[PrivateServer]:
    """A server over the tiny repository that only this test uses; stopped at the end if still up."""
    repository, _ = tiny_repository
    server = TritonServer(repository, tmp_path / "state", Ports(*free_ports(3)))
    server.start(timeout=120)
    try:
        yield PrivateServer(_endpoints(server.ports), server.stop)
    finally:
        server.stop()


@pytest.fixture
def dead_url() -> str:
    """HOST:PORT where nothing listens."""
    return f"127.0.0.1:{free_ports(1)[0]}"


@pytest.fixture
def quick() -> Measurement:
    """Short windows and a loose stability rule: the tests check properties, not figures."""
    return Measurement(measurement_ms=400, stability_percentage=60, max_trials=4, warmup_requests=5)


@pytest.fixture
def quick_args() -> list[str]:
    """`quick` as perfclient flags."""
    return ["--measurement-interval", "400", "--max-trials", "4", "--stability-percentage", "60", "--warmup", "5",
            "--no-progress"]
