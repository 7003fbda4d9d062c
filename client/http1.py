"""A lean HTTP/1.1 client for perfclient's load path: keep-alive connections, requests sent as bytes
built once, answers parsed by llhttp (`httptools`, the parser under uvloop's and Node's HTTP servers):
its framing, our connection handling. It replaced a hand-written parser (7.6-10.8 us an answer against
llhttp's 1.3-2.2 us, issue 27) and the edge cases a hand-written one gets wrong.

Why not aiohttp: measured on a trivial model against the bundled Triton (`bench/client_cost.py`:
2-core machine, closed loop, concurrency 16), aiohttp spent 147 us of client CPU per request, this
client 45 us. The client's CPU is what limits the rate a load generator can drive; on a small machine
it also competes with the server it measures. Control calls (metadata, statistics) still go through tritonclient.

One request per connection at a time (no pipelining): concurrency N uses N connections, as
perf_analyzer's HTTP client does. A request that outlives its deadline aborts its connection: HTTP/1.1
has no other way to cancel it, and an answer arriving later must not be taken for the next request's.
A request written on a reused connection that the server closes before any byte of an answer (its idle
timeout racing our write) is sent once more on a new connection, as curl does; its latency includes both.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from ssl import SSLContext
from typing import cast

import httptools

from client.connecting import connect
from client.wire import ResponseFormatError

# An answer's head larger than this is not Triton's: refuse it rather than buffer without bound.
_MAX_HEAD_BYTES = 64 * 1024


class ConnectionClosedError(ConnectionResetError):
    """The server closed the connection before the whole answer arrived."""


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]  # names lower-cased; a repeated header keeps its last value
    body: bytes


def request_bytes(host: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    """One POST request, whole: request line, headers, body."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()
              if name.lower() not in ("host", "content-length", "connection", "transfer-encoding")]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _Connection(asyncio.Protocol):
    """One keep-alive connection; its answers parsed by llhttp (httptools) as their bytes arrive.

    One parser per connection, fed every byte the connection receives: framing (Content-Length, chunks,
    keep-alive) is llhttp's; which answer belongs to which request (one at a time), 1xx answers skipped,
    answers framed by the connection's close, the head's size limit and trust in the connection are ours.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[Response] | None = None
        self.reusable = True
        self.answered = 0  # answers completed on this connection
        self.heard = False  # whether any byte of the current request's answer arrived
        self._parser = httptools.HttpResponseParser(self)
        self._status = 0
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._head_done = False  # the current answer's head parsed
        self._head_bytes = 0  # bytes received while the current answer's head was incomplete
        self._until_close = False  # the current answer is framed by the connection's close

    # asyncio.Protocol -------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # bytes nobody asked for: this connection can no longer be trusted
            self.reusable = False
            self.abort()
            return
        self.heard = True
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self._status == 101:
                self._fail(ResponseFormatError("101 Switching Protocols, though no upgrade was asked for"))
            elif self.waiter is None:  # the answer was whole; what followed it is not HTTP: never reuse this
                self.reusable = False
            elif self._status == 0:
                self._fail(ResponseFormatError(f"not an HTTP/1.x answer: {data[:40]!r} ({exc})"))
            else:
                self._fail(ResponseFormatError(f"malformed HTTP/1.1 answer: {exc}"))
            return
        if not self._head_done and self.waiter is not None:
            self._head_bytes += len(data)
            if self._head_bytes > _MAX_HEAD_BYTES:
                self._fail(ResponseFormatError(f"answer's head exceeds {_MAX_HEAD_BYTES} bytes"))

    def eof_received(self) -> bool | None:
        self.reusable = False
        if self.waiter is not None and self._head_done and self._until_close:
            self._finish()
        return None  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self.transport = None
        if self.waiter is not None:
            self._fail(ConnectionClosedError("connection closed by the server before its answer was complete")
                       if exc is None else exc)

    # llhttp's callbacks (httptools) -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.waiter is None:  # a second answer after the request's: nothing may follow it
            self.reusable = False
        self._status, self._headers, self._body = 0, {}, []
        self._head_done, self._until_close = False, False

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1").strip()

    def on_headers_complete(self) -> None:
        self._status = status = self._parser.get_status_code()
        if 100 <= status < 200:
            return  # interim (100, 102, 103): skipped, RFC 9110 15.2; 101 fails in data_received
        self._head_done = True
        headers = self._headers
        if not self._parser.should_keep_alive():
            self.reusable = False
        self._until_close = (status not in (204, 304) and "content-length" not in headers
                             and "chunked" not in headers.get("transfer-encoding", "").lower())

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._head_done and self.waiter is not None:
            self._finish()

    # our side ---------------------------------------------------------------------------------------
    def send(self, data: bytes) -> asyncio.Future[Response]:
        assert self.waiter is None and self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.heard = False
        self._status, self._head_bytes = 0, 0
        self.transport.write(data)
        return self.waiter

    def abort(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: BaseException) -> None:
        self.reusable = False
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.abort()

    def _finish(self) -> None:
        self.answered += 1
        waiter, self.waiter = self.waiter, None
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        if waiter is not None and not waiter.done():
            waiter.set_result(Response(self._status, self._headers, body))


class Pool:
    """Keep-alive connections to one host:port, at most `limit` open; idle ones are reused first."""

    def __init__(self, host: str, port: int, *, limit: int, timeout_s: float, ssl: SSLContext | None = None,
                 server_hostname: str | None = None) -> None:
        self.host, self.port = host, port
        self._ssl, self._server_hostname = ssl, server_hostname  # TLS (client.tls), SNI name
        self.limit = limit
        self.timeout_s = timeout_s
        self._idle: collections.deque[_Connection] = collections.deque()
        self._open: set[_Connection] = set()
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False
        self.retries = 0  # requests sent once more after the idle-close race

    async def request(self, data: bytes) -> Response:
        """Send one whole request (request_bytes) and wait for its answer, at most `timeout_s`.

        Raises TimeoutError after the deadline, OSError when the server cannot be reached or drops the
        connection, ResponseFormatError when the answer is not HTTP/1.x.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        for attempt in range(2):
            conn = await self._acquire(deadline)
            reused = conn.answered > 0
            ok = False
            try:
                future = conn.send(data)
                timer = loop.call_at(deadline, _expire, future)
                try:
                    response = await future
                finally:
                    timer.cancel()
                ok = True
                return response
            except ConnectionError:
                # A keep-alive connection the server closed while idle, just as we wrote on it: nothing of an
                # answer came back, so the server dropped the request unread. Once more on a new connection,
                # as curl does; any other connection error is the request's outcome.
                if attempt == 0 and reused and not conn.heard:
                    self.retries += 1
                    continue
                raise
            finally:
                self._release(conn, reuse=ok and conn.reusable)
        raise AssertionError("unreachable: the second attempt returns or raises")

    async def _acquire(self, deadline: float) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if conn.transport is not None and conn.reusable and not conn.transport.is_closing():
                return conn
            self._open.discard(conn)
        while len(self._open) >= self.limit:
            slot = asyncio.get_running_loop().create_future()
            self._waiting.append(slot)
            try:
                async with asyncio.timeout_at(deadline):
                    await slot
            except BaseException:
                # Woken, but leaving (its deadline or a cancellation came in the same step): the place it
                # was woken for goes to the next waiter, or that one would wait for a release never coming.
                if slot.done() and not slot.cancelled():
                    self._wake_one()
                raise
            finally:
                if slot in self._waiting:
                    self._waiting.remove(slot)
            if self._idle:
                return await self._acquire(deadline)
        if self._closed:
            raise ConnectionClosedError("the connection pool is closed")
        placeholder = _Connection()  # counts against the limit while it connects
        self._open.add(placeholder)
        try:
            async with asyncio.timeout_at(deadline):
                conn = await connect(_Connection, self.host, self.port, ssl=self._ssl,
                                     server_hostname=self._server_hostname)
        except BaseException:
            self._open.discard(placeholder)
            self._wake_one()  # its place is free again: a waiter may connect in its stead
            raise
        self._open.discard(placeholder)
        if self._closed:  # closed while this one connected: not the pool's any more, so never used
            conn.abort()
            raise ConnectionClosedError("the connection pool is closed")
        self._open.add(conn)
        return conn

    def _release(self, conn: _Connection, *, reuse: bool) -> None:
        if reuse and not self._closed:
            self._idle.append(conn)
        else:
            conn.abort()
            self._open.discard(conn)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiting:
            slot = self._waiting.popleft()
            if not slot.done():
                slot.set_result(None)
                break

    def close(self) -> None:
        self._closed = True
        for conn in list(self._open) + list(self._idle):
            conn.abort()
        self._open.clear()
        self._idle.clear()


def _expire(future: asyncio.Future[Response]) -> None:
    if not future.done():
        future.set_exception(TimeoutError("no answer before the request's deadline"))
