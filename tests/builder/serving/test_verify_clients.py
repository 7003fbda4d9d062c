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


def test_an_answer_that_does_not_fit_is_a_mismatch_with_a_warning_not_a_traceback(
        tiny_repository: tuple[Path, list[ModelSpec]], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # A server that answers each batch of 4 with 2 rows: before, `reshape` raised ValueError out of verify.
    from builder.serving import verify

    class Short:
        def __init__(self, protocol: Protocol, url: str, key: str | None) -> None:
            pass

        def __enter__(self) -> Short:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def infer(self, model: str, feed: dict[str, Any], outputs: list[str]) -> dict[str, Any]:
            import numpy as np

            rows = len(next(iter(feed.values())))
            return {name: np.ones((rows // 2, 16), np.float32) for name in outputs}

    monkeypatch.setattr(verify, "_Client", Short)
    repository, _ = tiny_repository
    (result,) = verify_variant(repository, "mlp_fp32", mlp_samples(8), {Protocol.GRPC: "127.0.0.1:1"}, batch=4)
    assert not result.ok and result.max_abs_diff == float("inf")
    assert any("mlp_fp32: output" in r.getMessage() and "expected [4, 16]" in r.getMessage() for r in caplog.records)
