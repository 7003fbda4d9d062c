"""A lean gRPC unary client over HTTP/2 (cleartext with prior knowledge, or TLS with ALPN h2) for perfclient's
load path.

Request bytes in (a serialized ModelInferRequest, client.wire), status out; `infer` also returns the
response message's bytes for decoding. Written on asyncio.Protocol like client.http1, for the same
reason: a load generator's own CPU per request bounds the rate it can drive, and grpc.aio costs about
130 us of client CPU per call on this project's 2-core machines. Control calls (metadata, statistics)
still go through tritonclient.

What it does of HTTP/2 (RFC 9113) and gRPC's HTTP/2 mapping:
- one connection carries many concurrent streams (odd, client-initiated ids); `connections` spreads
  requests over several, round-robin; a connection whose ids run out or that got GOAWAY is replaced;
- request headers are encoded once per connection as HPACK literals without indexing (our encoder keeps
  no dynamic table, so nothing can go out of step); the server's header blocks go through one `hpack`
  Decoder per connection, every block in order (CONTINUATION included), also for streams we no longer
  track, since the server's dynamic table depends on all of them;
- calls beyond the server's MAX_CONCURRENT_STREAMS wait in arrival order (a freed slot is held for the
  first waiter, so a closed loop re-sending at once cannot starve the calls already waiting);
- sending respects the server's MAX_FRAME_SIZE, MAX_CONCURRENT_STREAMS and both flow-control windows
  (a request larger than the window waits for WINDOW_UPDATE); receiving advertises a large window and
  returns credit with WINDOW_UPDATE as DATA arrives; PING is answered, SETTINGS acknowledged;
- the status is the trailers' `grpc-status` (`grpc-message` percent-decoded), or, with no gRPC status,
  derived from the HTTP status as gRPC's spec does; RST_STREAM and GOAWAY fail the streams they affect;
- each request has a deadline (also sent as `grpc-timeout`); on expiry the stream is reset (CANCEL)
  and the call raises TimeoutError; losing the connection fails every stream on it with ConnectionError.

Streams the server refused unprocessed (above a GOAWAY's last stream id, RST_STREAM REFUSED_STREAM), and a
stream sent on an idle connection as the server closed it, go once more, transparently, within their deadline
(counted in `Channel.retries`), as grpc-core retries them; `aclose()` lets draining connections finish.

Errors: GrpcError (a grpc.RpcError with `code()` and `details()`, so client.protocol.error_kind labels it
by status), TimeoutError, ConnectionError/OSError. TLS with `ssl` (ALPN h2). Compressed requests
(`encoding`: gzip, deflate) and answers. Not supported: streaming calls.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
from collections.abc import Callable
from ssl import SSLContext
from typing import cast
from urllib.parse import unquote

import grpc
from hpack import Decoder, HPACKError

from client.compression import decompress
from client.connecting import connect

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types and flags (RFC 9113 §6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
# Error codes (§7).
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0x5, 0x6, 0x7, 0x8
ENHANCE_YOUR_CALM, INADEQUATE_SECURITY = 0xB, 0xC
# Settings (§6.5.2).
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

MAX_WINDOW = 2**31 - 1
MAX_STREAM_ID = 2**31 - 1
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME = 16_384

# What we advertise. Large receive windows so that a response (EfficientNet's ~600 KB, or larger) never
# waits for our credit; large frames so that it arrives in few frames, each parsed in Python.
RECV_STREAM_WINDOW = 1 << 24
RECV_CONN_WINDOW = 1 << 30
RECV_MAX_FRAME = 1 << 20
# Credit goes back once half a window is consumed: few WINDOW_UPDATEs, and the sender never stalls.
_CONN_UPDATE_AT = RECV_CONN_WINDOW // 2
_STREAM_UPDATE_AT = RECV_STREAM_WINDOW // 2
# A header list larger than this is not Triton's: refuse it rather than buffer without bound.
MAX_HEADER_LIST = 64 * 1024

_FRAME = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id: the 9-byte frame header
_DATA_HEAD = struct.Struct(">IBIBI")  # a DATA frame header followed by gRPC's 5-byte message prefix
_U32 = struct.Struct(">I")
_RST = struct.Struct(">IBII")
_WINDOW = struct.Struct(">IBII")
_SETTING = struct.Struct(">HI")

# Header bytes that, every one of them, are a one-byte HPACK indexed field (0x80-0xFE): a block made only
# of those neither changes the decoder's dynamic table nor depends on anything but it (see _decode).
_INDEXED_ONLY = bytes(range(0x80, 0xFF))

_CODES = {code.value[0]: code for code in grpc.StatusCode}
# gRPC's mapping of HTTP statuses when a response carries no grpc-status (doc/http-grpc-status-mapping.md).
_HTTP_CODES = {400: grpc.StatusCode.INTERNAL, 401: grpc.StatusCode.UNAUTHENTICATED,
               403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.UNIMPLEMENTED,
               429: grpc.StatusCode.UNAVAILABLE, 502: grpc.StatusCode.UNAVAILABLE,
               503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.UNAVAILABLE}
# And of RST_STREAM codes (doc/PROTOCOL-HTTP2.md, "Errors").
_RST_CODES = {REFUSED_STREAM: grpc.StatusCode.UNAVAILABLE, CANCEL: grpc.StatusCode.CANCELLED,
              ENHANCE_YOUR_CALM: grpc.StatusCode.RESOURCE_EXHAUSTED,
              INADEQUATE_SECURITY: grpc.StatusCode.PERMISSION_DENIED}


class GrpcError(grpc.RpcError):  # type: ignore[misc]  # grpc is untyped here (pyproject's mypy overrides)
    """A call that ended with a non-OK gRPC status; `code()` and `details()` as grpc.aio.AioRpcError's."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class ConnectionLostError(ConnectionResetError):
    """The connection closed (or the channel was closed) before the stream's answer was complete."""


class RefusedStreamError(GrpcError):
    """The server refused the stream before processing it (a GOAWAY whose last stream id is below it, or
    RST_STREAM REFUSED_STREAM): safe to send again. The channel does, once, as grpc-core's transparent retry
    does; a second refusal is the call's outcome, UNAVAILABLE."""

    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, details)


class IdleClosedError(ConnectionLostError):
    """The stream went out on a connection that was idle (no other stream open, one answered before), and
    the connection closed before any byte of its answer: the server's idle timeout racing our request, which
    the channel sends once more on a new connection, as client.http1 does."""


class _ProtocolError(Exception):
    """The server broke HTTP/2: the connection is torn down (GOAWAY with `code`)."""

    def __init__(self, message: str, code: int = PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


def _hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 §5.1) in a `prefix_bits` prefix, `first` holding the byte's other bits."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing, new name, no Huffman (RFC 7541 §6.2.2)."""
    return b"\x00" + _hpack_int(len(name), 7, 0) + name + _hpack_int(len(value), 7, 0) + value


def grpc_timeout(seconds: float) -> str:
    """`grpc-timeout`'s value: at most 8 digits and a unit, rounded up so the server never cuts it shorter."""
    for unit, scale in (("u", 1e6), ("m", 1e3), ("S", 1.0), ("M", 1 / 60), ("H", 1 / 3600)):
        amount = -int(-seconds * scale // 1)  # ceil
        if amount < 100_000_000:
            return f"{max(amount, 1)}{unit}"
    return "99999999H"


def request_header_block(path: str, authority: str, timeout_s: float | None, scheme: str = "http",
                         encoding: str | None = None) -> bytes:
    """The HPACK block of every request's HEADERS: literals only, so it never depends on table state.
    `encoding`: the request message is compressed so (`grpc-encoding`); the answer may be too."""
    fields = [(b":method", b"POST"), (b":scheme", scheme.encode("ascii")), (b":path", path.encode("ascii")),
              (b":authority", authority.encode("ascii")), (b"content-type", b"application/grpc"),
              (b"te", b"trailers"), (b"user-agent", b"perfclient-grpc-h2")]
    if timeout_s is not None:
        fields.append((b"grpc-timeout", grpc_timeout(timeout_s).encode("ascii")))
    if encoding is not None:
        fields += [(b"grpc-encoding", encoding.encode("ascii")), (b"grpc-accept-encoding", b"gzip,deflate,identity")]
    return b"".join(_literal(name, value) for name, value in fields)


class _Stream:
    __slots__ = ("deadline", "encoding", "future", "http_status", "id", "message", "on_idle", "pending", "recv",
                 "response_started", "want", "window")

    def __init__(self, stream_id: int, future: asyncio.Future[bytes | None], want: bool, window: int,
                 deadline: float) -> None:
        self.id = stream_id
        self.future = future
        self.want = want  # keep the response message (infer) or only its status (send)
        self.window = window  # what we may still send on this stream
        self.deadline = deadline
        self.message: list[bytes | bytearray] = []
        self.pending: memoryview | None = None  # request bytes (prefix + message) not yet sent
        self.recv = 0  # DATA bytes received since our last WINDOW_UPDATE for this stream
        self.response_started = False
        self.http_status = 0
        self.on_idle = False  # opened on a connection that was idle: see IdleClosedError
        self.encoding: bytes | None = None  # the answer's grpc-encoding


class H2Connection(asyncio.Protocol):
    """One HTTP/2 connection: many concurrent unary gRPC streams, frames parsed as bytes arrive."""

    def __init__(self, *, path: str, authority: str, timeout_s: float | None, scheme: str = "http") -> None:
        self.transport: asyncio.Transport | None = None
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # the server's SETTINGS
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # set by connection_lost
        self.answered = 0  # streams the server answered (a status, OK or not) on this connection
        self.closed = False
        self.draining = False  # GOAWAY received (or ids ran out): no new streams here
        self.streams: dict[int, _Stream] = {}
        self._loop = asyncio.get_running_loop()
        self._buf = bytearray()
        self._out: list[bytes | memoryview] = []
        self._decoder = Decoder(max_header_list_size=MAX_HEADER_LIST)
        self._decoded: dict[bytes, dict[bytes, bytes]] = {}  # indexed-only blocks, while the table is unchanged
        block = request_header_block(path, authority, timeout_s, scheme)
        self._block = block
        self._header_args = (path, authority, timeout_s, scheme)
        self._encoded_blocks: dict[str, bytes] = {}  # compressed requests' blocks, by grpc-encoding
        # The first block starts with a dynamic table size update to 0: we never index, and whatever
        # SETTINGS_HEADER_TABLE_SIZE the server announces later, our (empty) table is within it.
        self._first_block: bytes | None = b"\x20"
        self._next_id = 1
        self._send_window = DEFAULT_WINDOW  # connection-level credit the server gave us
        self._peer_window = DEFAULT_WINDOW  # SETTINGS_INITIAL_WINDOW_SIZE of the server
        self._peer_frame = DEFAULT_FRAME
        self.max_streams = MAX_STREAM_ID  # SETTINGS_MAX_CONCURRENT_STREAMS; unlimited until the server says
        self._blocked: collections.deque[_Stream] = collections.deque()  # streams with request bytes unsent
        self._recv = 0  # DATA bytes since our last connection WINDOW_UPDATE
        self._continuation: tuple[int, int, list[bytes]] | None = None  # stream id, HEADERS flags, fragments
        # Calls waiting for a stream slot, first come first served: a woken one (True) holds a reserved slot
        # until it runs, so that a call arriving meanwhile cannot take it and send it back to wait again.
        self._slot_waiters: collections.deque[asyncio.Future[bool]] = collections.deque()
        self._reserved = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._timeout_s = timeout_s

    # asyncio.Protocol -------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        settings = b"".join(_SETTING.pack(key, value) for key, value in (
            (S_ENABLE_PUSH, 0), (S_INITIAL_WINDOW_SIZE, RECV_STREAM_WINDOW), (S_MAX_FRAME_SIZE, RECV_MAX_FRAME),
            (S_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST)))
        self.transport.write(PREFACE + _FRAME.pack(len(settings) << 8 | SETTINGS, 0, 0) + settings
                             + _WINDOW.pack(4 << 8 | WINDOW_UPDATE, 0, 0, RECV_CONN_WINDOW - DEFAULT_WINDOW))

    def data_received(self, data: bytes) -> None:
        if self._buf:
            self._buf += data
            buf: bytes | bytearray = self._buf
        else:
            buf = data
        end = len(buf)
        at = 0
        try:
            while end - at >= 9:
                head, flags, sid = _FRAME.unpack_from(buf, at)
                length = head >> 8
                if length > RECV_MAX_FRAME:
                    raise _ProtocolError(f"{length}-byte frame exceeds our MAX_FRAME_SIZE {RECV_MAX_FRAME}",
                                         FRAME_SIZE_ERROR)
                stop = at + 9 + length
                if stop > end:
                    break
                kind = head & 0xFF
                sid &= MAX_STREAM_ID
                if self._continuation is not None and kind != CONTINUATION:
                    raise _ProtocolError(f"frame type {kind} inside a header block (CONTINUATION expected)")
                if kind == DATA:
                    self._on_data(buf, at + 9, stop, flags, sid)
                elif kind == HEADERS:
                    self._on_headers(buf, at + 9, stop, flags, sid)
                elif kind == CONTINUATION:
                    self._on_continuation(buf, at + 9, stop, flags, sid)
                elif kind == WINDOW_UPDATE:
                    self._on_window_update(buf, at + 9, stop, sid)
                elif kind == SETTINGS:
                    self._on_settings(buf, at + 9, stop, flags, sid)
                elif kind == PING:
                    if length != 8 or sid:
                        raise _ProtocolError("malformed PING", FRAME_SIZE_ERROR if length != 8 else PROTOCOL_ERROR)
                    if not flags & ACK:
                        self._write(_FRAME.pack(8 << 8 | PING, ACK, 0) + bytes(buf[at + 9:stop]))
                elif kind == RST_STREAM:
                    self._on_rst(buf, at + 9, stop, sid)
                elif kind == GOAWAY:
                    self._on_goaway(buf, at + 9, stop)
                elif kind == PUSH_PROMISE:
                    raise _ProtocolError("PUSH_PROMISE though we disabled push")
                # PRIORITY and unknown frame types are ignored (§5.5, §6.3).
                at = stop
        except _ProtocolError as exc:
            self._connection_error(str(exc), exc.code)
            return
        if buf is self._buf:
            del self._buf[:at]
        elif at < end:
            self._buf += memoryview(buf)[at:]
        if self._blocked:
            self._flush_blocked()

    def eof_received(self) -> bool | None:
        return None  # let the transport close itself; connection_lost fails what is left

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        reason = f": {exc}" if exc is not None else ""
        for stream in self.streams.values():
            if stream.on_idle and not stream.response_started and not stream.future.done():
                stream.future.set_exception(IdleClosedError(
                    f"HTTP/2 connection closed, idle, as the request went out{reason}"))
        self._fail_all(lambda: ConnectionLostError(f"HTTP/2 connection closed before the answer{reason}"))
        if not self.lost.done():
            self.lost.set_result(None)
        if not self.ready.done():
            self.ready.set_exception(ConnectionLostError(f"HTTP/2 connection closed during its set-up{reason}"))
            self.ready.exception()  # retrieved: nobody may be waiting on it any more

    # our side ---------------------------------------------------------------------------------------
    def usable(self) -> bool:
        """Whether a new call may open a stream here now (not ahead of calls already waiting for a slot)."""
        return (not self.closed and not self.draining and self.ready.done() and not self._slot_waiters
                and len(self.streams) + self._reserved < self.max_streams)

    def start(self, body: bytes, want: bool, deadline: float, encoding: str | None = None) -> _Stream:
        """Open a stream sending `body` (one gRPC message, compressed by `encoding` when given); its future gets
        the response message (decompressed) or None."""
        sid = self._next_id
        self._next_id = sid + 2
        if self._next_id > MAX_STREAM_ID:
            self.draining = True  # the channel opens another connection for the next request
        future: asyncio.Future[bytes | None] = self._loop.create_future()
        stream = _Stream(sid, future, want, self._peer_window, deadline)
        stream.on_idle = not self.streams and self.answered > 0
        self.streams[sid] = stream
        if self._timer is None or deadline < self._timer_at:
            self._arm(deadline)
        if encoding is None:
            block = self._block
        else:
            block = self._encoded_blocks.get(encoding) or self._encoded_blocks.setdefault(
                encoding, request_header_block(*self._header_args, encoding=encoding))
        if self._first_block is not None:
            block = self._first_block + block
            self._first_block = None
        flag = 0 if encoding is None else 1
        out = self._out
        if not out:
            self._loop.call_soon(self._flush_out)
        out.append(_FRAME.pack(len(block) << 8 | HEADERS, END_HEADERS, sid))
        out.append(block)
        size = len(body) + 5
        if (size <= self._send_window and size <= stream.window and size <= self._peer_frame
                and not self._blocked):
            # The common case: the whole message in one DATA frame, sent at once.
            self._send_window -= size
            stream.window -= size
            out.append(_DATA_HEAD.pack(size << 8 | DATA, END_STREAM, sid, flag, len(body)))
            out.append(body)
        else:
            stream.pending = memoryview(bytes([flag]) + _U32.pack(len(body)) + body)
            self._blocked.append(stream)
            self._flush_blocked()
        return stream

    def cancel(self, stream: _Stream, error: BaseException | None) -> None:
        """Stop a stream of ours (deadline, or its caller gave up): RST_STREAM CANCEL, fail its future."""
        if self.streams.pop(stream.id, None) is None:
            return
        self._forget(stream)
        if self.transport is not None:
            self._write(_RST.pack(4 << 8 | RST_STREAM, 0, stream.id, CANCEL))
        if error is not None and not stream.future.done():
            stream.future.set_exception(error)
        self._released()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    async def slot(self) -> bool:
        """Wait for a stream slot (SETTINGS_MAX_CONCURRENT_STREAMS): True when the caller may open its stream
        here at once (synchronously, before it yields), False when it must look again (connection going)."""
        waiter: asyncio.Future[bool] = self._loop.create_future()
        self._slot_waiters.append(waiter)
        try:
            granted = await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self._reserved -= 1
                self._wake_slots()  # woken for a free slot but gone (cancelled, deadline): pass it on
            raise
        finally:
            if waiter in self._slot_waiters:
                self._slot_waiters.remove(waiter)
        if granted:
            self._reserved -= 1
        return (granted and not self.closed and not self.draining
                and len(self.streams) + self._reserved < self.max_streams)

    # frames -----------------------------------------------------------------------------------------
    def _on_data(self, buf: bytes | bytearray, start: int, stop: int, flags: int, sid: int) -> None:
        if sid == 0:
            raise _ProtocolError("DATA on stream 0")
        size = stop - start
        self._recv += size  # flow control counts the whole payload, padding included
        if self._recv >= _CONN_UPDATE_AT:
            self._write(_WINDOW.pack(4 << 8 | WINDOW_UPDATE, 0, 0, self._recv))
            self._recv = 0
        if flags & PADDED:
            start, stop = _unpad(buf, start, stop)
        stream = self.streams.get(sid)
        if stream is None:
            if sid >= self._next_id:
                raise _ProtocolError(f"DATA on idle stream {sid}")
            return  # a stream we reset or finished: its bytes still counted for the connection above
        if not stream.response_started:
            # UNKNOWN, INTERNAL below, as grpc-core (grpc.aio) labels these: errors count as they did with it.
            self._end(stream, GrpcError(grpc.StatusCode.UNKNOWN, "DATA before the response's HEADERS"), reset=True)
            return
        if stream.want:
            stream.message.append(buf[start:stop])
        if flags & END_STREAM:
            self._finish(stream, None)
            return
        stream.recv += size
        if stream.recv >= _STREAM_UPDATE_AT:
            self._write(_WINDOW.pack(4 << 8 | WINDOW_UPDATE, 0, sid, stream.recv))
            stream.recv = 0

    def _on_headers(self, buf: bytes | bytearray, start: int, stop: int, flags: int, sid: int) -> None:
        if sid == 0:
            raise _ProtocolError("HEADERS on stream 0")
        if flags & PADDED:
            start, stop = _unpad(buf, start, stop)
        if flags & PRIORITY_FLAG:
            start += 5
            if start > stop:
                raise _ProtocolError("HEADERS too short for its priority fields", FRAME_SIZE_ERROR)
        fragment = bytes(buf[start:stop])
        if flags & END_HEADERS:
            self._on_header_block(sid, flags, fragment)
        else:
            self._continuation = (sid, flags, [fragment])

    def _on_continuation(self, buf: bytes | bytearray, start: int, stop: int, flags: int, sid: int) -> None:
        if self._continuation is None or self._continuation[0] != sid:
            raise _ProtocolError(f"CONTINUATION on stream {sid} outside its header block")
        fragments = self._continuation[2]
        fragments.append(bytes(buf[start:stop]))
        if sum(len(f) for f in fragments) > MAX_HEADER_LIST:
            raise _ProtocolError(f"header block over {MAX_HEADER_LIST} bytes", ENHANCE_YOUR_CALM)
        if flags & END_HEADERS:
            _, first_flags, _ = self._continuation
            self._continuation = None
            self._on_header_block(sid, first_flags, b"".join(fragments))

    def _on_header_block(self, sid: int, flags: int, block: bytes) -> None:
        headers = self._decode(block)  # always: the table must follow every block, ours or not
        stream = self.streams.get(sid)
        if stream is None:
            if sid >= self._next_id or not sid & 1:
                raise _ProtocolError(f"HEADERS on stream {sid}, which we never opened")
            return
        if not stream.response_started:
            stream.response_started = True
            stream.encoding = headers.get(b"grpc-encoding")
            status = headers.get(b":status")
            if status == b"200":
                stream.http_status = 200
            else:
                stream.http_status = int(status) if status is not None and status.isdigit() else 0
            if flags & END_STREAM:  # trailers-only: the gRPC status is in this block
                self._finish(stream, headers)
            elif stream.http_status != 200:
                self._end(stream, _http_error(stream.http_status), reset=True)
            return
        if not flags & END_STREAM:
            self._end(stream, GrpcError(grpc.StatusCode.UNKNOWN, "a second HEADERS block without END_STREAM"),
                      reset=True)
            return
        self._finish(stream, headers)

    def _on_window_update(self, buf: bytes | bytearray, start: int, stop: int, sid: int) -> None:
        if stop - start != 4:
            raise _ProtocolError("WINDOW_UPDATE of the wrong size", FRAME_SIZE_ERROR)
        increment = _U32.unpack_from(buf, start)[0] & MAX_WINDOW
        if sid == 0:
            if increment == 0:
                raise _ProtocolError("connection WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise _ProtocolError("connection window above 2^31-1", FLOW_CONTROL_ERROR)
            return
        stream = self.streams.get(sid)
        if stream is None:
            return
        if increment == 0:
            self._end(stream, GrpcError(grpc.StatusCode.INTERNAL, "stream WINDOW_UPDATE of 0"), reset=True,
                      code=PROTOCOL_ERROR)
            return
        stream.window += increment
        if stream.window > MAX_WINDOW:
            self._end(stream, GrpcError(grpc.StatusCode.INTERNAL, "stream window above 2^31-1"), reset=True,
                      code=FLOW_CONTROL_ERROR)

    def _on_settings(self, buf: bytes | bytearray, start: int, stop: int, flags: int, sid: int) -> None:
        if sid:
            raise _ProtocolError("SETTINGS on a stream")
        if flags & ACK:
            if stop != start:
                raise _ProtocolError("SETTINGS ACK with a payload", FRAME_SIZE_ERROR)
            return
        if (stop - start) % 6:
            raise _ProtocolError("SETTINGS payload not a multiple of 6", FRAME_SIZE_ERROR)
        for at in range(start, stop, 6):
            key, value = _SETTING.unpack_from(buf, at)
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ProtocolError(f"INITIAL_WINDOW_SIZE {value}", FLOW_CONTROL_ERROR)
                delta = value - self._peer_window
                self._peer_window = value
                for stream in self.streams.values():  # §6.9.2: open streams' windows move by the change
                    stream.window += delta
                    if stream.window > MAX_WINDOW:
                        raise _ProtocolError(f"INITIAL_WINDOW_SIZE {value} takes stream {stream.id}'s window "
                                             "above 2^31-1", FLOW_CONTROL_ERROR)
            elif key == S_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= 2**24 - 1:
                    raise _ProtocolError(f"MAX_FRAME_SIZE {value}")
                self._peer_frame = value
            elif key == S_MAX_CONCURRENT_STREAMS:
                self.max_streams = value
        self._write(_FRAME.pack(0 << 8 | SETTINGS, ACK, 0))
        if not self.ready.done():
            self.ready.set_result(None)
        self._wake_slots()

    def _on_rst(self, buf: bytes | bytearray, start: int, stop: int, sid: int) -> None:
        if stop - start != 4:
            raise _ProtocolError("RST_STREAM of the wrong size", FRAME_SIZE_ERROR)
        if sid == 0:
            raise _ProtocolError("RST_STREAM on stream 0")
        code = _U32.unpack_from(buf, start)[0]
        stream = self.streams.get(sid)
        if stream is None:
            return
        # A server may reset with NO_ERROR after its whole answer (§8.1); such a stream is already finished
        # and not found above. Before the answer is complete, any reset fails the call.
        error: GrpcError
        if code == REFUSED_STREAM and not stream.response_started:
            error = RefusedStreamError("stream refused by the server (RST_STREAM REFUSED_STREAM)")
        else:
            error = GrpcError(_RST_CODES.get(code, grpc.StatusCode.INTERNAL),
                              f"stream reset by the server (HTTP/2 error code {code})")
        self._end(stream, error, reset=False, gone=True)

    def _on_goaway(self, buf: bytes | bytearray, start: int, stop: int) -> None:
        if stop - start < 8:
            raise _ProtocolError("GOAWAY too short", FRAME_SIZE_ERROR)
        last, code = struct.unpack_from(">II", buf, start)
        last &= MAX_STREAM_ID
        debug = bytes(buf[start + 8:stop])[:200].decode("utf-8", "replace")
        self.draining = True
        log.debug("GOAWAY (code %d, last stream %d): %s", code, last, debug)
        # Streams up to `last` the server took (it may have run them): never sent again, even if the
        # connection then closes unanswered (not the idle-close race: the server has seen them).
        for sid, stream in self.streams.items():
            if sid <= last:
                stream.on_idle = False
        # Streams above `last` were never processed: refused, safe to send again (the channel does, once).
        for stream in [s for sid, s in self.streams.items() if sid > last]:
            self._end(stream, RefusedStreamError(f"server going away (code {code}{': ' + debug if debug else ''})"),
                      reset=False, gone=True)
        self._wake_all_slots()  # callers waiting for a stream slot here go to a new connection
        if not self.streams and self.transport is not None:
            self._flush_out()
            self.transport.close()

    # helpers ----------------------------------------------------------------------------------------
    def _decode(self, block: bytes) -> dict[bytes, bytes]:
        """The header block as a dict (a repeated name keeps its last value).

        A block of one-byte indexed fields only (steady state: the server's repeated `:status 200`,
        content-type and `grpc-status 0` all come from its table) cannot change the table, and decodes to
        the same headers until another block changes it; those are memoized, and any other block clears
        the memo. This keeps hpack's per-byte Python loop off most responses.
        """
        cached = self._decoded.get(block)
        if cached is not None:
            return cached
        try:
            headers = {bytes(name): bytes(value) for name, value in self._decoder.decode(block, raw=True)}
        except HPACKError as exc:
            raise _ProtocolError(f"header block does not decode: {exc}", 0x9) from exc  # COMPRESSION_ERROR
        if block and not block.translate(None, _INDEXED_ONLY):
            if len(self._decoded) >= 64:
                self._decoded.clear()
            self._decoded[block] = headers
        else:
            self._decoded.clear()
        return headers

    def _finish(self, stream: _Stream, trailers: dict[bytes, bytes] | None) -> None:
        """The server ended the stream: its status (trailers), else the HTTP status's mapping."""
        self.answered += 1
        if trailers is None or b"grpc-status" not in trailers:
            if stream.http_status != 200:
                self._end(stream, _http_error(stream.http_status), reset=False)
            else:
                # UNKNOWN, as grpc-core (grpc.aio) reports it: "No status received".
                self._end(stream, GrpcError(grpc.StatusCode.UNKNOWN, "stream ended without grpc-status"),
                          reset=False)
            return
        raw = trailers[b"grpc-status"]
        if raw != b"0":
            try:
                code = _CODES.get(int(raw), grpc.StatusCode.UNKNOWN)
            except ValueError:
                code = grpc.StatusCode.INTERNAL  # not a number: grpc-core fails parsing it
            details = unquote(trailers.get(b"grpc-message", b"").decode("ascii", "replace"))
            self._end(stream, GrpcError(code, details), reset=False)
            return
        message: bytes | None = None
        if stream.want:
            whole = b"".join(stream.message)
            if len(whole) < 5 or whole[0] > 1 or _U32.unpack_from(whole, 1)[0] != len(whole) - 5:
                problem = f"{len(whole)} bytes that are not one length-prefixed message"
                self._end(stream, GrpcError(grpc.StatusCode.INTERNAL, f"response holds {problem}"), reset=False)
                return
            message = whole[5:]
            if whole[0] == 1:  # compressed, by the answer's grpc-encoding
                try:
                    if stream.encoding is None:
                        raise ValueError("a compressed message without grpc-encoding")
                    message = decompress(message, stream.encoding.decode("ascii", "replace"))
                except ValueError as exc:
                    self._end(stream, GrpcError(grpc.StatusCode.INTERNAL, f"response does not decompress: {exc}"),
                              reset=False)
                    return
        self._end(stream, message, reset=False)

    def _end(self, stream: _Stream, outcome: bytes | BaseException | None, *, reset: bool,
             gone: bool = False, code: int = CANCEL) -> None:
        """Close a stream with a result or an error; reset it when the server's side may still be open,
        or when our request is not all sent (the server answered before reading it), unless the server
        already closed it entirely (`gone`: its RST_STREAM, which is never answered with another, §5.4.2;
        or a GOAWAY that did not take it)."""
        if self.streams.pop(stream.id, None) is None:
            return
        unsent = self._forget(stream)
        if (reset or unsent) and not gone and self.transport is not None:
            self._write(_RST.pack(4 << 8 | RST_STREAM, 0, stream.id, code))
        future = stream.future
        if not future.done():
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
        self._released()

    def _released(self) -> None:
        """A stream closed, by either side: its slot goes to a waiting call; a draining connection with
        nothing left open closes."""
        if self._slot_waiters:
            self._wake_slots()
        if self.draining and not self.streams and self.transport is not None:
            self._flush_out()  # first: what this iteration queued (the stream's RST_STREAM) still goes out
            self.transport.close()

    def _forget(self, stream: _Stream) -> bool:
        """Drop a closed stream's unsent request bytes; True when there were some."""
        if stream.pending is None:
            return False
        stream.pending = None
        if stream in self._blocked:
            self._blocked.remove(stream)
        return True

    def _flush_blocked(self) -> None:
        """Send what the windows allow of the requests waiting for credit, oldest first."""
        blocked = self._blocked
        skipped: list[_Stream] = []
        while blocked and self._send_window > 0:
            stream = blocked.popleft()
            pending = stream.pending
            assert pending is not None
            while pending and self._send_window > 0 and stream.window > 0:
                size = min(len(pending), self._send_window, stream.window, self._peer_frame)
                last = size == len(pending)
                self._write(_FRAME.pack(size << 8 | DATA, END_STREAM if last else 0, stream.id), pending[:size])
                pending = pending[size:]
                self._send_window -= size
                stream.window -= size
            if pending:
                stream.pending = pending
                skipped.append(stream)  # waits for its stream's (or the connection's) credit
            else:
                stream.pending = None
        blocked.extendleft(reversed(skipped))

    def _write(self, *frames: bytes | memoryview) -> None:
        out = self._out
        if not out:
            self._loop.call_soon(self._flush_out)
        out.extend(frames)

    def _flush_out(self) -> None:
        """Write what this loop iteration queued in one go: one system call for many requests' frames."""
        out, self._out = self._out, []
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(out)

    def _wake_slots(self) -> None:
        free = self.max_streams - len(self.streams) - self._reserved
        while self._slot_waiters and free > 0:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)
                self._reserved += 1
                free -= 1

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._expire)
        self._timer_at = when

    def _expire(self) -> None:
        """Fail the streams past their deadline; re-arm for the earliest left."""
        self._timer = None
        now = self._loop.time() + 0.001  # timers may fire up to a clock tick early
        expired = [s for s in self.streams.values() if s.deadline <= now]
        for stream in expired:
            self.cancel(stream, TimeoutError(f"no answer within the request's deadline ({self._timeout_s:g} s)"))
        if self.streams:
            self._arm(min(s.deadline for s in self.streams.values()))

    def _fail_all(self, make: Callable[[], BaseException]) -> None:
        streams, self.streams = self.streams, {}
        self._blocked.clear()
        for stream in streams.values():
            stream.pending = None
            if not stream.future.done():
                stream.future.set_exception(make())
        self._wake_all_slots()

    def _wake_all_slots(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(False)  # the waiter looks again and moves on (to a new connection)

    def _connection_error(self, message: str, code: int) -> None:
        log.debug("HTTP/2 connection error %d: %s", code, message)
        self.closed = True
        if self.transport is not None:
            self._flush_out()
            # Last stream id 0: we process no server-initiated streams.
            self.transport.write(_FRAME.pack(8 << 8 | GOAWAY, 0, 0) + struct.pack(">II", 0, code))
        self._fail_all(lambda: GrpcError(grpc.StatusCode.INTERNAL, f"HTTP/2 protocol error: {message}"))
        if self.transport is not None:
            self.transport.close()  # not abort(): the GOAWAY above goes out first


def _unpad(buf: bytes | bytearray, start: int, stop: int) -> tuple[int, int]:
    if start >= stop:
        raise _ProtocolError("PADDED frame without its pad length", FRAME_SIZE_ERROR)
    pad = buf[start]
    start += 1
    if pad > stop - start:
        raise _ProtocolError("padding longer than the frame")
    return start, stop - pad


def _http_error(status: int) -> GrpcError:
    code = _HTTP_CODES.get(status, grpc.StatusCode.UNKNOWN)
    return GrpcError(code, f"HTTP status {status} without a gRPC status" if status else "no :status in response")


class Channel:
    """Unary calls of one gRPC method to one server over `connections` HTTP/2 connections, opened lazily
    and replaced when lost. Use from one event loop; `close()` at the end."""

    def __init__(self, host: str, port: int, *, method: str, timeout_s: float, connections: int = 1,
                 authority: str | None = None, ssl: SSLContext | None = None,
                 server_hostname: str | None = None) -> None:
        """`ssl`: over TLS (client.tls; its ALPN must offer h2), `server_hostname` the SNI name (None: `host`)."""
        if connections < 1:
            raise ValueError(f"connections={connections}: expected at least 1")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: expected a positive number of seconds")
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self._method = method
        self._ssl, self._server_hostname = ssl, server_hostname
        self._authority = authority or (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        self._conns: list[H2Connection | None] = [None] * connections
        self._connecting: list[asyncio.Future[H2Connection] | None] = [None] * connections
        self._turn = 0
        self._closed = False
        self._replaced: set[H2Connection] = set()  # draining connections a new one replaced, until they close
        self.retries = 0  # calls sent again: refused unprocessed (GOAWAY, REFUSED_STREAM) or the idle-close race

    async def send(self, body: bytes, encoding: str | None = None) -> None:
        """One call with `body` as the request message (compressed by `encoding` when given: client.compression);
        raise on any failure, the answer is not kept."""
        await self._call(body, False, encoding)

    async def infer(self, body: bytes, encoding: str | None = None) -> bytes:
        """One call with `body` as the request message; the response message's bytes (decompressed)."""
        message = await self._call(body, True, encoding)
        assert message is not None
        return message

    async def _call(self, body: bytes, want: bool, encoding: str | None = None) -> bytes | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        index = self._turn
        self._turn = index + 1 if index + 1 < len(self._conns) else 0
        retried = False
        while True:
            conn = self._conns[index]
            if conn is None or not conn.usable():
                conn = await self._usable(index, deadline)
            stream = conn.start(body, want, deadline, encoding)
            try:
                return await stream.future
            except (RefusedStreamError, IdleClosedError):
                # Never processed by the server: sent once more (on a new connection when this one is going),
                # within the same deadline, as grpc-core's transparent retry does; a second failure is the outcome.
                if retried or self._closed or loop.time() >= deadline:
                    raise
                retried = True
                self.retries += 1
            except asyncio.CancelledError:
                conn.cancel(stream, None)
                raise

    async def _usable(self, index: int, deadline: float) -> H2Connection:
        """Connection `index` once it may open a stream: connect (shared by concurrent callers) or wait
        for a free stream slot, within the request's deadline."""
        try:
            async with asyncio.timeout_at(deadline):
                while True:
                    if self._closed:
                        raise ConnectionLostError("the channel is closed")
                    conn = self._conns[index]
                    if conn is not None and conn.usable():
                        return conn
                    if conn is not None and not conn.closed and not conn.draining and conn.ready.done():
                        if await conn.slot():  # at the server's MAX_CONCURRENT_STREAMS
                            return conn
                        continue
                    pending = self._connecting[index]
                    if pending is None:
                        pending = asyncio.ensure_future(self._connect(index))
                        # Retrieved here: when every caller gave up first, nobody else reads its failure.
                        pending.add_done_callback(_retrieve)
                        self._connecting[index] = pending
                    # Shielded: a caller that gives up must not cancel the set-up others wait for.
                    try:
                        await asyncio.shield(pending)
                    except asyncio.CancelledError:
                        task = asyncio.current_task()
                        if pending.cancelled() and self._closed and task is not None and not task.cancelling():
                            continue  # close() cancelled the set-up, not this caller: fail as a closed channel
                        raise
        except TimeoutError:
            raise TimeoutError(f"no connection or stream slot within the request's deadline "
                               f"({self.timeout_s:g} s)") from None

    async def _connect(self, index: int) -> H2Connection:
        conn: H2Connection | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                scheme = "http" if self._ssl is None else "https"
                conn = await connect(
                    lambda: H2Connection(path=self._method, authority=self._authority, timeout_s=self.timeout_s,
                                         scheme=scheme),
                    self.host, self.port, ssl=self._ssl, server_hostname=self._server_hostname)
                await conn.ready
        except BaseException:
            if conn is not None:  # connected, but no SETTINGS in time (or cancelled): not left open
                conn.abort()
            raise
        finally:
            self._connecting[index] = None
        old = self._conns[index]
        if old is not None and old.draining and not old.closed:
            if old.streams:  # still answering what it took: close() waits for it
                self._replaced.add(old)
                old.lost.add_done_callback(lambda _: self._replaced.discard(old))
            else:
                old.abort()
        if self._closed:
            conn.abort()
            raise ConnectionLostError("the channel is closed")
        self._conns[index] = conn
        return conn

    def close(self) -> None:
        """Drop every connection, draining ones included; calls in flight fail with ConnectionLostError."""
        self._closed = True
        for conn in [*self._conns, *self._replaced]:
            if conn is not None:
                conn.abort()
        for pending in self._connecting:
            if pending is not None:
                pending.cancel()

    async def aclose(self, drain_s: float = 5.0) -> None:
        """Close, but first let the draining (replaced) connections finish the streams they took, at most
        `drain_s`; then drop everything (as close()) and wait until every connection has closed."""
        self._closed = True
        draining = [conn for conn in self._replaced if not conn.closed]
        if draining:
            await asyncio.wait([asyncio.ensure_future(asyncio.shield(conn.lost)) for conn in draining],
                               timeout=drain_s)
        every = [conn for conn in [*self._conns, *draining] if conn is not None]
        self.close()
        if every:
            await asyncio.wait([asyncio.ensure_future(asyncio.shield(conn.lost)) for conn in every], timeout=drain_s)


def _retrieve(future: asyncio.Future[H2Connection]) -> None:
    if not future.cancelled():
        future.exception()
