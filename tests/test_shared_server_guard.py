"""The guard in tests/conftest.py: a server whose process died between tests is started again on the same
ports (Triton 2.51 once segfaulted under the suite and every later test failed with 'connection refused')."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from builder.serving.triton_server import Ports, TritonServer, free_ports, ready
from tests.helpers.servers import revive


@pytest.mark.server
def test_a_dead_server_is_started_again_on_its_ports_and_a_live_one_is_left_alone(
        tiny_repository: tuple[Path, Any], tmp_path: Path) -> None:
    repository, _ = tiny_repository
    server = TritonServer(repository, tmp_path / "state", Ports(*free_ports(3)))
    server.start(timeout=120)
    try:
        first = server.process
        assert first is not None and revive(server) is None and server.process is first
        first.kill()
        first.wait(timeout=30)
        tail = revive(server)
        assert tail is not None and tail.startswith("status -9")
        assert server.process is not first and ready(server.ports.http)
    finally:
        server.stop()
