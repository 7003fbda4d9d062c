"""trtbuild verify against a real Triton: one client per protocol sends every sample of a variant (a client per
request costs a connection each, and with gRPC a channel)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from builder.serving.triton_server import TritonServer
from builder.serving.verify import verify_variant
from builder.spec import ModelSpec
from client.protocol import Protocol
from tests.helpers.tiny_models import mlp_samples


def _counted(real: type, protocol: Protocol, opened: list[Protocol]) -> type:
    """tritonclient's client class, noting each client made."""

    class Counted(real):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            opened.append(protocol)
            super().__init__(*args, **kwargs)

    return Counted


def test_verify_opens_one_client_per_protocol_for_all_its_samples(
        triton: TritonServer, tiny_repository: tuple[Path, list[ModelSpec]], monkeypatch: pytest.MonkeyPatch) -> None:
    import tritonclient.grpc as grpc_tc
    import tritonclient.http as http_tc

    opened: list[Protocol] = []
    monkeypatch.setattr(grpc_tc, "InferenceServerClient", _counted(grpc_tc.InferenceServerClient, Protocol.GRPC,
                                                                   opened))
    monkeypatch.setattr(http_tc, "InferenceServerClient", _counted(http_tc.InferenceServerClient, Protocol.HTTP,
                                                                   opened))
    repository, _ = tiny_repository
    urls = {Protocol.GRPC: f"127.0.0.1:{triton.ports.grpc}", Protocol.HTTP: f"127.0.0.1:{triton.ports.http}"}
    results = verify_variant(repository, "mlp_fp32", mlp_samples(12), urls, batch=4)  # 3 requests per protocol
    assert [(r.protocol, r.samples, r.ok) for r in results] == [(Protocol.GRPC, 12, True), (Protocol.HTTP, 12, True)]
    assert opened == [Protocol.GRPC, Protocol.HTTP]
