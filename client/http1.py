"""A lean HTTP/1.1 client for perfclient's load path: keep-alive connections, requests sent as bytes
built once, answers parsed only as far as status, length and body.

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
from typing import cast

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
    """One keep-alive connection; parses one answer at a time as its bytes arrive."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[Response] | None = None
        self.reusable = True
        self.answered = 0  # answers completed on this connection
        self.heard = False  # whether any byte of the current request's answer arrived
        self._buf = bytearray()
        self._head: tuple[int, dict[str, str]] | None = None
        self._length = -1  # body length when known (Content-Length); -2: chunked; -3: until close
        self._body_at = 0

    # asyncio.Protocol -------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # bytes nobody asked for: this connection can no longer be trusted
            self.reusable = False
            self.abort()
            return
        self.heard = True
        self._buf += data
        try:
            response = self._parse()
        except ResponseFormatError as exc:
            self._fail(exc)
            return
        if response is not None:
            self._finish(response)

    def eof_received(self) -> bool | None:
        self.reusable = False
        if self.waiter is not None and self._head is not None and self._length == -3:
            status, headers = self._head
            self._finish(Response(status, headers, bytes(self._buf[self._body_at:])))
        return None  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self.transport = None
        if self.waiter is not None:
            self._fail(ConnectionClosedError("connection closed by the server before its answer was complete")
                       if exc is None else exc)

    # our side ---------------------------------------------------------------------------------------
    def send(self, data: bytes) -> asyncio.Future[Response]:
        assert self.waiter is None and self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self._buf.clear()
        self.heard = False
        self._head, self._length, self._body_at = None, -1, 0
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

    def _finish(self, response: Response) -> None:
        self.answered += 1
        waiter, self.waiter = self.waiter, None
        if len(self._buf) > self._consumed:  # more bytes than the answer: nothing may follow it
            self.reusable = False
        if waiter is not None and not waiter.done():
            waiter.set_result(response)

    def _parse(self) -> Response | None:
        buf = self._buf
        while self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD_BYTES:
                    raise ResponseFormatError(f"answer's head exceeds {_MAX_HEAD_BYTES} bytes")
                return None
            head = _parse_head(bytes(buf[:end]))
            if 100 <= head[0] < 200:
                # An interim answer (100 Continue, 102, 103) has no body and is not the request's answer
                # (RFC 9110 15.2: parsed and skipped even when unasked); 101 would switch protocols, unasked.
                if head[0] == 101:
                    raise ResponseFormatError("101 Switching Protocols, though no upgrade was asked for")
                del buf[:end + 4]
                continue
            self._head = head
            self._body_at = end + 4
            headers = self._head[1]
            if headers.get("connection", "").lower() == "close":
                self.reusable = False
            if "chunked" in headers.get("transfer-encoding", "").lower():
                self._length = -2
            elif "content-length" in headers:
                text = headers["content-length"]
                # Digits only: int() would take "-1" (a body never complete, or this parser's own markers
                # below), "+3", "1_0" or " 3 ".
                if not (text.isascii() and text.isdigit()):
                    raise ResponseFormatError(f"bad Content-Length {text[:20]!r}")
                self._length = int(text)
            elif self._head[0] in (204, 304):
                self._length = 0
            else:
                self._length = -3
                self.reusable = False
        status, headers = self._head
        if self._length >= 0:
            self._consumed = self._body_at + self._length
            if len(buf) < self._consumed:
                return None
            return Response(status, headers, bytes(buf[self._body_at:self._consumed]))
        if self._length == -2:
            body = self._dechunk()
            return None if body is None else Response(status, headers, body)
        return None  # until the server closes (eof_received)

    def _dechunk(self) -> bytes | None:
        """The body of a complete chunked answer, or None while chunks are still arriving."""
        buf, at = self._buf, self._body_at
        parts: list[bytes] = []
        while True:
            line_end = buf.find(b"\r\n", at)
            if line_end < 0:
                return None
            size_text = bytes(buf[at:line_end]).split(b";", 1)[0].strip()
            # Hex digits only: int(_, 16) would take "-1", "0x3" or "1_0".
            if not size_text or size_text.strip(b"0123456789abcdefABCDEF"):
                raise ResponseFormatError(f"bad chunk size {size_text[:20]!r}")
            size = int(size_text, 16)
            start = line_end + 2
            if size == 0:
                end = buf.find(b"\r\n\r\n", line_end)  # trailers (usually none) end with an empty line
                if end < 0:
                    return None
                self._consumed = end + 4
                return b"".join(parts)
            if len(buf) < start + size + 2:
                return None
            if buf[start + size:start + size + 2] != b"\r\n":  # the chunk is not the size it announced
                raise ResponseFormatError(f"chunk of {size} bytes not followed by CRLF")
            parts.append(bytes(buf[start:start + size]))
            at = start + size + 2

    _consumed = 0


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.split(b"\r\n")
    status_line = lines[0]
    if not status_line.startswith(b"HTTP/1.") or len(status_line) < 12:
        raise ResponseFormatError(f"not an HTTP/1.x answer: {status_line[:40]!r}")
    try:
        status = int(status_line[9:12])
    except ValueError:
        raise ResponseFormatError(f"bad status line {status_line[:40]!r}") from None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    if status_line.startswith(b"HTTP/1.0") and headers.get("connection", "").lower() != "keep-alive":
        headers.setdefault("connection", "close")
    return status, headers


class Pool:
    """Keep-alive connections to one host:port, at most `limit` open; idle ones are reused first."""

    def __init__(self, host: str, port: int, *, limit: int, timeout_s: float) -> None:
        self.host, self.port = host, port
        self.limit = limit
        self.timeout_s = timeout_s
        self._idle: collections.deque[_Connection] = collections.deque()
        self._open: set[_Connection] = set()
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False

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
                conn = await connect(_Connection, self.host, self.port)
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
