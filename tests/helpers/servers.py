"""Addresses of the Triton servers the client tests talk to (types for the fixtures in conftest.py).

Not a test module: test modules import these types, never each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
