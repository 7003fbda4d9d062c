"""client.workers' rules as the library API enforces them (SessionConfig), for callers that skip the CLI."""

from __future__ import annotations

import asyncio
import threading
import traceback
from pathlib import Path
from typing import Any

import pytest

from client.engine import LoadLevel, Measurement
from client.errors import PerfClientError
from client.protocol import Prepared, Protocol
from client.session import SessionConfig
from client.workers import ProcessPool, WorkerCrashed, shares
from tests.helpers.waiting import wait_until_async


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


class _BuggyCheck:
    """A --validate check whose own code fails: a bug of ours inside a worker process, not a request error."""

    def due(self) -> bool:
        raise KeyError("a bug inside the worker")


def test_a_bug_in_a_worker_is_raised_by_the_parent_with_the_workers_traceback() -> None:
    async def go() -> None:
        pool = ProcessPool(1, protocol=Protocol.HTTP, url="127.0.0.1:1", timeout_s=1.0, model="m",
                           payloads=[Prepared("m", b"", expected=_BuggyCheck())], batch=1)  # type: ignore[arg-type]
        await pool.start(LoadLevel(concurrency=1))
        await asyncio.sleep(0.2)  # its driver has died of the bug by now
        with pytest.raises(WorkerCrashed) as raised:
            await pool.stop()  # before: logged at debug level, and the run went on as if nothing happened
        text = "".join(traceback.format_exception(raised.value))
        assert "a bug inside the worker" in text and "in due" in text  # the worker's frame, by name

    asyncio.run(go())


class _SlowToExit:
    """A worker process as ProcessPool.stop sees it: it exits once `released` is set, by another coroutine
    of the same event loop (so only while the loop keeps serving)."""

    def __init__(self) -> None:
        self.joining = threading.Event()
        self.released = threading.Event()
        self.killed = False

    def join(self, timeout: float | None = None) -> None:
        self.joining.set()
        self.released.wait(timeout)

    def is_alive(self) -> bool:
        return not self.released.is_set()

    def kill(self) -> None:
        self.killed = True


def test_waiting_for_the_workers_to_exit_leaves_the_event_loop_serving() -> None:
    pool = ProcessPool(1, protocol=Protocol.GRPC, url="127.0.0.1:1", timeout_s=1.0, model="m", payloads=[], batch=1)
    worker = _SlowToExit()
    pool._procs = [worker]  # type: ignore[list-item]

    async def go() -> None:
        async def release_once_joined() -> None:
            await wait_until_async(worker.joining.is_set, what="the join started", timeout_s=10)
            worker.released.set()

        await asyncio.gather(pool.stop(), release_once_joined())

    asyncio.run(go())
    assert not worker.killed  # it exited within the join: the loop ran the releasing coroutine meanwhile
