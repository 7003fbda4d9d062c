"""client.workers' rules as the library API enforces them (SessionConfig, the one place that decides them), for
callers that skip the CLI."""

from __future__ import annotations

import asyncio
import threading
import traceback
from pathlib import Path
from typing import Any

import pytest

from client.engine import LoadLevel, Measurement
from client.errors import PerfClientError, UsageConflict
from client.intervals import RequestIntervals
from client.protocol import Prepared, Protocol
from client.session import SessionConfig
from client.shared_memory import SharedMemory, SharedMemoryKind
from client.workers import ProcessPool, WorkerCrashed, shares
from tests.helpers.waiting import wait_until_async

_GAPS = RequestIntervals(Path("gaps.txt"), (1000, 3000))
_PER_PROCESS = "(expected at least one request in flight per process)"


@pytest.mark.parametrize(("extra", "message"), [
    ({"models": ("a", "b"), "simultaneous": True, "levels": (LoadLevel(concurrency=4),)},
     "--simultaneous (the workers drive one model at a time)"),
    ({"measurement": Measurement(request_count=50)},
     "--request-count 50 (the parent times the windows; use --measurement-interval)"),
    ({"levels": (LoadLevel(request_rate=_GAPS.rate, intervals=_GAPS),)},
     "--request-intervals gaps.txt (one replayed schedule, one process)"),
    ({"validate": Path("expected.npz")}, "--validate expected.npz (answers are checked in one process only)"),
    ({"levels": (LoadLevel(concurrency=3),)}, f"--concurrency 3 {_PER_PROCESS}"),
    ({}, f"--concurrency 1 (the default) {_PER_PROCESS}"),
    ({"levels": tuple(LoadLevel(concurrency=c) for c in range(1, 9))},
     "--concurrency-range 1:8 (every level needs >= 4)"),
    ({"levels": tuple(LoadLevel(concurrency=c) for c in range(1, 9, 3))},
     "--concurrency-range 1:7:3 (every level needs >= 4)"),
    ({"models": ("a", "b"), "levels": (LoadLevel(concurrency=4),), "model_levels": {"b": (LoadLevel(concurrency=1),)}},
     f"--model-concurrency b=1 {_PER_PROCESS}"),
])
def test_the_session_alone_refuses_what_workers_cannot_do(extra: dict[str, Any], message: str) -> None:
    # The library API decides every --processes conflict itself (the CLI only maps the error to exit 2): one
    # line naming both options, the same line the command prints.
    fields: dict[str, Any] = {"models": ("a",), "url": "127.0.0.1:1", "processes": 4, **extra}
    with pytest.raises(PerfClientError) as raised:
        SessionConfig(**fields)
    assert isinstance(raised.value, UsageConflict)
    assert str(raised.value) == f"--processes 4: not with {message}"


@pytest.mark.parametrize("extra", [
    {"levels": (LoadLevel(concurrency=2),)},
    {"levels": (LoadLevel(request_rate=10.0),), "shared_memory": SharedMemory(SharedMemoryKind.SYSTEM)},
    # b's own rate is what b is driven at; the shared level (concurrency 1) is nobody's.
    {"models": ("a", "b"), "levels": (LoadLevel(concurrency=1),),
     "model_levels": {"a": (LoadLevel(concurrency=2),), "b": (LoadLevel(request_rate=50.0),)}},
    {"processes": 1, "levels": (LoadLevel(concurrency=1),), "measurement": Measurement(request_count=50),
     "validate": Path("expected.npz")},
])
def test_the_session_takes_what_workers_can_do(extra: dict[str, Any]) -> None:
    fields: dict[str, Any] = {"models": ("a",), "url": "127.0.0.1:1", "processes": 2, **extra}
    assert SessionConfig(**fields).processes == fields["processes"]


def test_a_level_the_session_refuses_is_a_bug_in_shares() -> None:
    # shares() trusts SessionConfig: a level it would refuse reaching the workers is ours, not the user's.
    with pytest.raises(AssertionError):
        shares(LoadLevel(concurrency=2), 3)
    with pytest.raises(AssertionError):
        shares(LoadLevel(request_rate=_GAPS.rate, intervals=_GAPS), 2)


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
