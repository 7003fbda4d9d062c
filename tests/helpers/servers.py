"""Addresses of the Triton servers the client tests talk to (types for the fixtures in conftest.py).

Not a test module: test modules import these types, never each other.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from builder.serving.triton_server import TritonServer
from client.protocol import Protocol


@dataclass(frozen=True)
class Endpoints:
    """HOST:PORT for each protocol, and the metrics URL, of one running server."""

    grpc: str
    http: str
    metrics: str

    def url(self, protocol: Protocol | str) -> str:
        return self.grpc if Protocol(protocol) is Protocol.GRPC else self.http


@dataclass(frozen=True)
class PrivateServer:
    """A server of the test's own, which the test may stop part-way through a run."""

    endpoints: Endpoints
    stop: Callable[[], None]


class SharedServerRestarted(RuntimeWarning):
    """The session's shared Triton had died between tests and was started again (see tests/conftest.py)."""


def revive(server: TritonServer) -> str | None:
    """Start `server` again on the same ports if its process has exited; what it last wrote, or None when
    it was still running."""
    if server.process is None or server.process.poll() is None:
        return None
    tail = f"status {server.process.returncode}: {server.log_tail(8)}"
    server.stop()  # forgets its record and stops the stubs it left
    server.start(timeout=120)
    return tail


def served(http: str, model: str) -> int:
    """Requests for `model` that the server at `http` (HOST:PORT) has answered successfully, by its own
    statistics: what tests wait on to know that load has run, instead of sleeping for it."""
    with urllib.request.urlopen(f"http://{http}/v2/models/{model}/stats", timeout=10) as response:
        stats = json.load(response)
    return sum(int(m["inference_stats"]["success"]["count"]) for m in stats["model_stats"])
