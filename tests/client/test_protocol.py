"""client.protocol against a real Triton: the server accepts our request bytes on both protocols, and
failures are labelled by the exception's type and status."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import grpc
import numpy as np
import pytest
from numpy.typing import NDArray

from client.errors import PerfClientError
from client.protocol import Connection, HttpStatusError, Protocol, describe, error_kind
from client.server_stats import ServerStats
from client.shared_memory import SharedMemory
from tests.helpers.servers import Endpoints
from tests.helpers.waiting import wait_until_async

X = np.random.default_rng(0).standard_normal((2, 4, 32)).astype(np.float32)


async def _send(protocol: Protocol, url: str, model: str, arrays: dict[str, NDArray[Any]],
                timeout_s: float = 10.0) -> BaseException | None:
    async with await Connection.open(protocol, url, timeout_s=timeout_s) as conn:
        try:
            await conn.send(await conn.prepare(model, arrays))
        except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
            return exc
    return None


async def _successes(protocol: Protocol, url: str, model: str) -> ServerStats | None:
    async with await Connection.open(protocol, url) as conn:
        return await conn.statistics(model)


@pytest.mark.parametrize("protocol", list(Protocol))
def test_the_server_accepts_and_counts_our_requests(protocol: Protocol, endpoints: Endpoints) -> None:
    url = endpoints.url(protocol)
    before = asyncio.run(_successes(protocol, url, "mlp_fp32"))

    async def send_five() -> None:
        async with await Connection.open(protocol, url) as conn:
            prepared = await conn.prepare("mlp_fp32", {"x": X})
            for _ in range(5):
                await conn.send(prepared)

    asyncio.run(send_five())
    after = asyncio.run(_successes(protocol, url, "mlp_fp32"))
    assert before is not None and after is not None
    # Other tests share the server, so at least our five; each carried a batch of two.
    assert after.success_count - before.success_count >= 5
    assert after.inference_count - before.inference_count >= 10


@pytest.mark.parametrize("protocol", list(Protocol))
def test_metadata_without_the_batch_axis(protocol: Protocol, endpoints: Endpoints) -> None:
    async def meta() -> Any:
        async with await Connection.open(protocol, endpoints.url(protocol)) as conn:
            return await conn.model("mlp_fp32"), await conn.model("seq_fp32")

    mlp, seq = asyncio.run(meta())
    assert mlp.max_batch_size == 8 and [(t.name, t.datatype, t.shape) for t in mlp.inputs] == [("x", "FP32", (4, 32))]
    assert [(t.name, t.datatype, t.shape) for t in seq.inputs] == [("ids", "INT64", (-1,))]


@pytest.mark.parametrize("protocol", list(Protocol))
@pytest.mark.parametrize(
    ("model", "arrays", "kind", "words"),
    [
        ("no_such_model", {"x": X}, "unknown_model", "unknown model"),
        ("mlp_fp32", {"x": X.astype(np.int32)}, "invalid_argument", "data-type"),
        ("mlp_fp32", {"x": X[:, :, :31]}, "invalid_argument", "unexpected shape"),
    ],
)
def test_rejections_are_labelled_by_status(protocol: Protocol, model: str, arrays: dict[str, NDArray[Any]],
                                           kind: str, words: str, endpoints: Endpoints) -> None:
    exc = asyncio.run(_send(protocol, endpoints.url(protocol), model, arrays))
    assert exc is not None and error_kind(exc) == kind
    assert words in describe(exc) and "\n" not in describe(exc)
    if protocol is Protocol.HTTP:
        assert isinstance(exc, HttpStatusError) and describe(exc).startswith("HTTP 4")


@pytest.mark.parametrize("protocol", list(Protocol))
def test_nobody_listening_is_unavailable(protocol: Protocol, dead_url: str) -> None:
    exc = asyncio.run(_send(protocol, dead_url, "mlp_fp32", {"x": X}, timeout_s=5))
    assert exc is not None and error_kind(exc) == "unavailable"


def test_timeouts_and_unknown_errors_keep_distinct_labels() -> None:
    assert error_kind(TimeoutError()) == "timeout"
    assert error_kind(HttpStatusError(503, b'{"error":"overloaded"}')) == "unavailable"
    assert error_kind(HttpStatusError(500, b"")) == "internal"
    assert error_kind(HttpStatusError(418, b"")) == "http_418"
    with pytest.raises(ValueError, match="bad"):  # not a request's failure: a bug, raised again
        error_kind(ValueError("bad"))


def test_every_grpc_status_code_has_its_own_kind() -> None:
    # By code, never by message: the same text under two codes gives two kinds.
    kinds = {code: error_kind(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "same words"))
             for code in grpc.StatusCode}
    assert len(set(kinds.values())) == len(kinds)
    assert kinds[grpc.StatusCode.UNAVAILABLE] == "unavailable" and kinds[grpc.StatusCode.NOT_FOUND] == "unknown_model"
    assert kinds[grpc.StatusCode.RESOURCE_EXHAUSTED] == "resource_exhausted"
    assert kinds[grpc.StatusCode.DEADLINE_EXCEEDED] == "timeout"


@pytest.mark.parametrize("protocol", list(Protocol))
def test_statistics_of_an_unreachable_server_are_none(protocol: Protocol, dead_url: str) -> None:
    assert asyncio.run(_successes(protocol, dead_url, "mlp_fp32")) is None


@pytest.mark.parametrize("url", ["localhost", "localhost:http", "[::1]"])
def test_an_http_url_without_a_port_is_one_line_and_leaves_nothing_open(url: str) -> None:
    async def go() -> list[str]:
        seen: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: seen.append(context["message"]))
        with pytest.raises(PerfClientError, match=r"^-u .*: expected HOST:PORT$"):
            Connection(Protocol.HTTP, url)
        gc.collect()  # an unclosed aiohttp session says so when collected
        await asyncio.sleep(0)
        return seen

    assert asyncio.run(go()) == []


@pytest.mark.parametrize("protocol", list(Protocol))
def test_only_a_connection_failure_says_the_server_cannot_be_reached(protocol: Protocol, dead_url: str) -> None:
    async def probe() -> None:
        async with await Connection.open(protocol, dead_url, timeout_s=5) as conn:
            await conn.model("mlp_fp32")

    with pytest.raises(PerfClientError, match=f"^-u {dead_url}: cannot reach Triton over {protocol} "):
        asyncio.run(probe())

    async def broken_liveness() -> None:
        async with await Connection.open(protocol, dead_url, timeout_s=5) as conn:

            async def is_server_live() -> bool:
                raise KeyError("a bug of ours in the liveness call")

            conn._control.is_server_live = is_server_live
            await conn.model("mlp_fp32")

    with pytest.raises(KeyError, match="a bug of ours"):  # not "cannot reach Triton": it keeps its traceback
        asyncio.run(broken_liveness())


class _Held:
    """One of the shared-memory pool's (blocking) control calls, held until another coroutine of the same
    event loop releases it: released in time only while the loop keeps serving during the call."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.entered = threading.Event()
        self.released = threading.Event()
        self.in_time: list[bool] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        self.in_time.append(self.released.wait(5))
        return self.call(*args, **kwargs)

    async def release(self) -> None:
        await wait_until_async(self.entered.is_set, what="the control call made", timeout_s=10)
        self.released.set()


@pytest.mark.parametrize("protocol", list(Protocol))
def test_registering_and_unregistering_shared_memory_leave_the_event_loop_serving(
        protocol: Protocol, endpoints: Endpoints) -> None:
    async def go() -> tuple[_Held, _Held]:
        conn = await Connection.open(protocol, endpoints.url(protocol), shared_memory=SharedMemory("system", 4096))
        client = conn._shm._client  # type: ignore[union-attr]
        register = client.register_system_shared_memory = _Held(client.register_system_shared_memory)
        unregister = client.unregister_system_shared_memory = _Held(client.unregister_system_shared_memory)
        try:
            prepared, _ = await asyncio.gather(conn.prepare("mlp_fp32", {"x": X}), register.release())
            await conn.send(prepared)
        finally:
            await asyncio.gather(conn.close(), unregister.release())
        return register, unregister

    register, unregister = asyncio.run(go())
    assert register.in_time and all(register.in_time)  # the input region, then the output region
    assert unregister.in_time and all(unregister.in_time)
