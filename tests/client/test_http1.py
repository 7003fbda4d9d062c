"""client.http1 against small real servers on loopback: answers framed by length, by chunks or by
close; keep-alive reuse; a late answer never taken for the next request's; the connection limit."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from client.http1 import Pool, _Connection, request_bytes
from client.protocol import error_kind
from client.wire import ResponseFormatError
from tests.helpers.addresses import resolve_every_name_to
from tests.helpers.waiting import wait_until_async

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, dict[str, Any]], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return await reader.readexactly(length)


def _ok(body: bytes, extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


async def _serve(handler: Handler, test: Callable[[Pool, dict[str, Any]], Awaitable[None]], *,
                 limit: int = 8, timeout_s: float = 5.0) -> dict[str, Any]:
    state: dict[str, Any] = {"connections": 0, "open": 0, "max_open": 0}

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state["connections"] += 1
        state["open"] += 1
        state["max_open"] = max(state["max_open"], state["open"])
        try:
            await handler(reader, writer, state)
        finally:
            state["open"] -= 1
            writer.close()

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Pool("127.0.0.1", port, limit=limit, timeout_s=timeout_s)
    try:
        await test(pool, state)
    finally:
        pool.close()
        server.close()
        await server.wait_closed()
    return state


def _req(body: bytes) -> bytes:
    return request_bytes("127.0.0.1", "/v2/models/m/infer", body, {"Content-Type": "application/octet-stream"})


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
    while (body := await _read_request(reader)) is not None:
        writer.write(_ok(b"echo:" + body))
        await writer.drain()


def test_answers_come_back_whole_and_one_connection_serves_many_requests() -> None:
    async def test(pool: Pool, state: dict[str, Any]) -> None:
        for i in range(20):
            response = await pool.request(_req(b"x" * i))
            assert (response.status, response.body) == (200, b"echo:" + b"x" * i)
        assert state["connections"] == 1

    asyncio.run(_serve(_echo, test))


def test_the_request_is_sent_as_http_1_1_with_its_length_and_headers() -> None:
    data = request_bytes("h:1", "/p", b"abc", {"Inference-Header-Content-Length": "2", "Content-Length": "99"})
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /p HTTP/1.1" and b"Host: h:1" in lines and body == b"abc"
    assert [line for line in lines if line.lower().startswith(b"content-length")] == [b"Content-Length: 3"]
    assert b"Inference-Header-Content-Length: 2" in lines


def test_a_chunked_answer_is_joined_and_the_connection_reused() -> None:
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
        while await _read_request(reader) is not None:
            # Split across writes, so the parser sees partial chunks.
            for piece in (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nab", b"cd\r\n3;ext=1\r\nefg\r\n",
                          b"0\r\n\r\n"):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.01)

    async def test(pool: Pool, state: dict[str, Any]) -> None:
        for _ in range(3):
            assert (await pool.request(_req(b"q"))).body == b"abcdefg"
        assert state["connections"] == 1

    asyncio.run(_serve(chunked, test))


def test_connection_close_means_a_new_connection_for_the_next_request() -> None:
    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
        if await _read_request(reader) is not None:
            writer.write(_ok(b"bye", "Connection: close\r\n"))
            await writer.drain()

    async def test(pool: Pool, state: dict[str, Any]) -> None:
        for _ in range(3):
            assert (await pool.request(_req(b"q"))).body == b"bye"
        assert state["connections"] == 3

    asyncio.run(_serve(closing, test))


def test_an_answer_framed_by_close_is_read_to_the_end() -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
        if await _read_request(reader) is not None:
            writer.write(b"HTTP/1.0 500 Internal\r\n\r\nsomething broke")
            await writer.drain()

    async def test(pool: Pool, state: dict[str, Any]) -> None:
        response = await pool.request(_req(b"q"))
        assert (response.status, response.body) == (500, b"something broke")

    asyncio.run(_serve(until_close, test))


def test_a_server_that_drops_the_connection_mid_answer_is_a_connection_error() -> None:
    async def dropping(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
        if await _read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
            await writer.drain()

    async def test(pool: Pool, state: dict[str, Any]) -> None:
        with pytest.raises(ConnectionError) as caught:
            await pool.request(_req(b"q"))
        assert error_kind(caught.value) == "unavailable"

    asyncio.run(_serve(dropping, test))


def test_garbage_is_a_format_error_not_an_answer() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
        if await _read_request(reader) is not None:
            writer.write(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00\r\n\r\n")  # an HTTP/2 frame, say
            await writer.drain()

    async def test(pool: Pool, state: dict[str, Any]) -> None:
        with pytest.raises(ResponseFormatError, match=r"not an HTTP/1\.x answer"):
            await pool.request(_req(b"q"))

    asyncio.run(_serve(garbage, test))


def test_a_late_answer_is_never_taken_for_the_next_requests() -> None:
    # The server answers the first request only once the client has given up on it (its deadline passed),
    # and the next request is sent only once that late answer is written: it must go on a new connection.
    async def late_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
        while (body := await _read_request(reader)) is not None:
            if body == b"slow":
                await state["gave_up"].wait()
            writer.write(_ok(b"answer to " + body))
            if body == b"slow":
                state["late_written"].set()
            try:
                await writer.drain()
            except ConnectionError:
                return

    async def test(pool: Pool, state: dict[str, Any]) -> None:
        state["gave_up"], state["late_written"] = asyncio.Event(), asyncio.Event()
        with pytest.raises(TimeoutError) as caught:
            await pool.request(_req(b"slow"))
        assert error_kind(caught.value) == "timeout"
        state["gave_up"].set()
        await asyncio.wait_for(state["late_written"].wait(), 10)
        pool.timeout_s = 10.0  # the next request's deadline: a loaded machine may take a while to answer it
        assert (await pool.request(_req(b"fast"))).body == b"answer to fast"
        assert state["connections"] == 2

    asyncio.run(_serve(late_first, test, timeout_s=0.2))


def test_no_more_connections_than_the_limit_and_every_request_answered() -> None:
    # Nothing is answered until three connections are open: the pool reaches its limit, and the nine
    # requests left wait for those three instead of opening more.
    async def once_three_are_open(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                  state: dict[str, Any]) -> None:
        while (body := await _read_request(reader)) is not None:
            await wait_until_async(lambda: state["max_open"] >= 3, what="three connections open")
            writer.write(_ok(body))
            await writer.drain()

    async def test(pool: Pool, state: dict[str, Any]) -> None:
        answers = await asyncio.gather(*[pool.request(_req(str(i).encode())) for i in range(12)])
        assert sorted(int(a.body) for a in answers) == list(range(12))
        assert state["max_open"] == 3

    asyncio.run(_serve(once_three_are_open, test, limit=3, timeout_s=30.0))


def test_a_cancelled_request_does_not_leave_its_connection_for_another() -> None:
    # The first request is cancelled while the server holds it; the server answers it only afterwards, as the
    # second request goes out: on the first's connection, that late answer would be taken for the second's.
    async def held_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
        while (body := await _read_request(reader)) is not None:
            if body == b"first":
                state["first_arrived"].set()
                await state["release"].wait()
            writer.write(_ok(b"answer to " + body))
            try:
                await writer.drain()
            except ConnectionError:
                return

    async def test(pool: Pool, state: dict[str, Any]) -> None:
        state["first_arrived"], state["release"] = asyncio.Event(), asyncio.Event()
        task = asyncio.ensure_future(pool.request(_req(b"first")))
        await asyncio.wait_for(state["first_arrived"].wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        state["release"].set()
        assert (await pool.request(_req(b"second"))).body == b"answer to second"

    asyncio.run(_serve(held_first, test))


def test_nobody_listening_is_a_connection_error() -> None:
    async def test() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        pool = Pool("127.0.0.1", port, limit=2, timeout_s=2)
        with pytest.raises(OSError) as caught:
            await pool.request(_req(b"q"))
        assert error_kind(caught.value) == "unavailable"
        pool.close()

    asyncio.run(test())


def test_an_interim_1xx_answer_is_skipped_for_the_final_one() -> None:
    # RFC 9110 15.2: a client must parse 1xx answers before the final one, even unasked; the final answer
    # is the request's, and the connection stays usable.
    async def continuing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
        while (body := await _read_request(reader)) is not None:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(b"HTTP/1.1 102 Processing\r\n\r\n" + _ok(b"answer to " + body))
            await writer.drain()

    async def test(pool: Pool, state: dict[str, Any]) -> None:
        for i in range(3):
            response = await pool.request(_req(str(i).encode()))
            assert (response.status, response.body) == (200, f"answer to {i}".encode())
        assert state["connections"] == 1

    asyncio.run(_serve(continuing, test))


@pytest.mark.parametrize(
    "answer",
    [b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\nabc",  # would wait for a body that is never complete
     b"HTTP/1.1 200 OK\r\nContent-Length: -2\r\n\r\n0\r\n\r\n",  # -2 and -3 were the parser's own markers
     b"HTTP/1.1 200 OK\r\nContent-Length: +3\r\n\r\nabc",
     b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\nabc\r\n0\r\n\r\n",
     b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x3\r\nabc\r\n0\r\n\r\n",
     b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n"],  # chunk longer than said
    ids=["length-1", "length-2", "length+3", "chunk-1", "chunk0x3", "chunk-overrun"],
)
def test_a_misframed_answer_is_a_format_error_at_once(answer: bytes) -> None:
    async def misframed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
        if await _read_request(reader) is not None:
            writer.write(answer)
            await writer.drain()
            with contextlib.suppress(ConnectionError):  # open until the client goes: only the framing ends its wait
                await reader.read()

    async def test(pool: Pool, state: dict[str, Any]) -> None:
        with pytest.raises(ResponseFormatError):
            await pool.request(_req(b"q"))

    asyncio.run(_serve(misframed, test, timeout_s=2.0))


def test_a_waiter_woken_and_cancelled_at_once_passes_its_turn_on() -> None:
    # The race of a waiter whose deadline (or cancellation) comes in the same loop step as its wake-up: the
    # freed connection must go to the next waiter, not wait for a release that never comes.
    async def held_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
        while (body := await _read_request(reader)) is not None:
            if body == b"a":
                state["a_arrived"].set()
                await state["release"].wait()
            writer.write(_ok(b"answer to " + body))
            await writer.drain()

    async def test(pool: Pool, state: dict[str, Any]) -> None:
        state["a_arrived"], state["release"] = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(pool.request(_req(b"a")))
        await asyncio.wait_for(state["a_arrived"].wait(), 10)  # `first` holds the only connection
        second = asyncio.create_task(pool.request(_req(b"b")))
        third = asyncio.create_task(pool.request(_req(b"c")))
        await wait_until_async(lambda: len(pool._waiting) == 2, what="both waiting for the connection")
        release = pool._release

        def release_then_cancel_the_woken(conn: Any, *, reuse: bool) -> None:
            release(conn, reuse=reuse)
            second.cancel()  # woken by the release above, cancelled before it ran

        pool._release = release_then_cancel_the_woken  # type: ignore[method-assign]
        state["release"].set()
        assert (await first).body == b"answer to a"
        pool._release = release  # type: ignore[method-assign]
        with pytest.raises(asyncio.CancelledError):
            await second
        assert (await third).body == b"answer to c"  # before the fix: TimeoutError at its deadline

    asyncio.run(_serve(held_first, test, limit=1, timeout_s=5.0))


def test_a_failed_connect_frees_its_place_for_a_waiter() -> None:
    # limit 1: the second request waits while the first connects; the first's connect fails, so the second
    # must try its own (and be refused: unavailable), not wait to its deadline and be counted a timeout.
    async def test() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        pool = Pool("127.0.0.1", port, limit=1, timeout_s=1.0)
        try:
            outcomes = await asyncio.gather(pool.request(_req(b"a")), pool.request(_req(b"b")),
                                            return_exceptions=True)
        finally:
            pool.close()
        assert [error_kind(exc) for exc in outcomes if isinstance(exc, Exception)] == ["unavailable"] * 2

    asyncio.run(test())



def test_every_address_of_a_name_refused_is_unavailable() -> None:
    # `localhost` that resolves to ::1 and 127.0.0.1 with nobody listening: asyncio tries both and raises a
    # bare OSError("Multiple exceptions: ...") without errno, which was counted "os_error", not unavailable.
    async def test() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        resolve_every_name_to("127.0.0.1", "127.0.0.2")
        pool = Pool("localhost", port, limit=2, timeout_s=2)
        try:
            with pytest.raises(ConnectionError) as caught:
                await pool.request(_req(b"q"))
        finally:
            pool.close()
        assert error_kind(caught.value) == "unavailable"

    asyncio.run(test())


class _NullTransport:
    def write(self, data: bytes) -> None:
        pass

    def abort(self) -> None:
        pass


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
    b"HTTP/1.1 100 Continue\r\n\r\n"
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhe\r\n3\r\nllo\r\n0\r\n\r\n",
    b"HTTP/1.1 204 No Content\r\n\r\n",
], ids=["length", "continue-chunked", "no-content"])
def test_an_answer_split_anywhere_parses_the_same(answer: bytes) -> None:
    # Every cut into two and three pieces, the cut at the head/body boundary among them: the same answer,
    # and the connection still reusable.
    async def go() -> None:
        for cut in range(1, len(answer)):
            for cut2 in sorted({cut, min(cut + 1, len(answer) - 1)}):
                conn = _Connection()
                conn.transport = _NullTransport()  # type: ignore[assignment]
                answered = conn.send(b"request")
                pieces = [answer[:cut], answer[cut:cut2], answer[cut2:]]
                for piece in pieces:
                    if piece:  # a transport never delivers empty data
                        conn.data_received(piece)
                response = answered.result()
                assert response.body == (b"" if b"204" in answer else b"hello"), (cut, cut2)
                assert conn.reusable, (cut, cut2)

    asyncio.run(go())


def test_a_request_still_connecting_when_the_pool_closes_is_never_sent() -> None:
    async def counting(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
        while (body := await _read_request(reader)) is not None:
            state["requests"] = state.get("requests", 0) + 1
            writer.write(_ok(body))
            await writer.drain()

    async def test(pool: Pool, state: dict[str, Any]) -> None:
        request = asyncio.create_task(pool.request(_req(b"q")))
        await asyncio.sleep(0)  # one loop step: the task ran up to its connect (tasks run in the order made)
        assert [c.transport for c in pool._open] == [None], "the premise: it is connecting now"
        pool.close()
        with pytest.raises(ConnectionError):
            await request
        # The server saw that connection open and end: whatever was sent on it has been read by now.
        await wait_until_async(lambda: state["connections"] == 1 and state["open"] == 0,
                               what="the server to see the abandoned connection end")
        assert state.get("requests", 0) == 0  # before: sent on a connection the closed pool no longer owned

    asyncio.run(_serve(counting, test))


def test_a_keep_alive_connection_closed_as_we_write_is_retried_once_on_a_new_one() -> None:
    # The server answers the first request, then drops the connection on the next one unanswered (its idle
    # timeout firing as the request arrived): that request goes again on a new connection, once.
    async def idle_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
        state.setdefault("requests", []).append(state["connections"])
        if state["connections"] == 1:
            if (body := await _read_request(reader)) is not None:
                writer.write(_ok(body))
                await writer.drain()
            if await _read_request(reader) is not None:
                state["requests"].append("dropped")
            return  # closes the connection without an answer
        await _echo(reader, writer, state)

    async def test(pool: Pool, state: dict[str, Any]) -> None:
        assert (await pool.request(_req(b"one"))).body == b"one"
        assert (await pool.request(_req(b"two"))).body == b"echo:two"
        assert state["connections"] == 2 and "dropped" in state["requests"]
        assert pool.retries == 1  # counted: the results report it (issue 27)

    asyncio.run(_serve(idle_close, test))


def test_a_new_connection_closed_unanswered_is_an_error_not_retried() -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
        await _read_request(reader)  # read it, answer nothing, close

    async def test(pool: Pool, state: dict[str, Any]) -> None:
        with pytest.raises(ConnectionError) as caught:
            await pool.request(_req(b"q"))
        assert error_kind(caught.value) == "unavailable"
        assert state["connections"] == 1  # sent once: a fresh connection's failure is the request's outcome

    asyncio.run(_serve(drop, test))


def test_a_reused_connection_dropped_mid_answer_is_not_retried() -> None:
    async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, Any]) -> None:
        if (body := await _read_request(reader)) is not None:
            writer.write(_ok(body))
            await writer.drain()
        if await _read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\npart")  # the server had started answering
            await writer.drain()

    async def test(pool: Pool, state: dict[str, Any]) -> None:
        await pool.request(_req(b"one"))
        with pytest.raises(ConnectionError):
            await pool.request(_req(b"two"))
        assert state["connections"] == 1

    asyncio.run(_serve(half, test))
