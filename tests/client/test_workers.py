"""client.workers' rules as the library API enforces them (SessionConfig), for callers that skip the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from client.engine import LoadLevel, Measurement
from client.errors import PerfClientError
from client.session import SessionConfig
from client.workers import shares


@pytest.mark.parametrize(("extra", "other"), [
    ({"models": ("a", "b"), "simultaneous": True}, "--simultaneous"),
    ({"measurement": Measurement(request_count=50)}, "--request-count"),
    ({"validate": Path("expected.npz")}, "--validate"),
])
def test_the_session_refuses_what_workers_cannot_do(extra: dict[str, Any], other: str) -> None:
    fields: dict[str, Any] = {"models": ("a",), "url": "127.0.0.1:1", "levels": (LoadLevel(concurrency=4),),
                              "processes": 2, **extra}
    with pytest.raises(PerfClientError) as raised:
        SessionConfig(**fields)
    assert str(raised.value) == f"--processes 2: not with {other}"


def test_concurrency_splits_exactly_and_the_rate_evenly() -> None:
    split = shares(LoadLevel(concurrency=7), 3)
    assert [level.concurrency for level, _ in split] == [3, 2, 2]
    rates = shares(LoadLevel(request_rate=300.0, max_inflight=10), 3)
    assert [level.request_rate for level, _ in rates] == [100.0, 100.0, 100.0]
    assert [offset for _, offset in rates] == pytest.approx([0.0, 1e9 / 300, 2e9 / 300])
