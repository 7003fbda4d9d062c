"""Property-based fuzzing (hypothesis) of both load-path clients' protocol entry points, `data_received`:
valid answers cut into arbitrary pieces parse to the same answer; garbage, and valid answers with bytes
mutated, never raise out of `data_received`, and once the connection ends every call is settled with an
answer or with one of our error kinds (client.protocol.TRANSPORT_ERRORS, labelled by error_kind): never a
hang, never another exception.

Budget: 200 examples per property (derandomized, so CI runs the same cases), no per-example deadline.
Found (2026-11-25): nothing, neither at that budget nor in a one-off run of 3000 random examples per
property, against the llhttp-based HTTP/1.1 parser and the hand-written HTTP/2 frame parser.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
from typing import Any

from hpack import Encoder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client.grpc_h2 import CONTINUATION, DATA, END_HEADERS, END_STREAM, HEADERS, PADDED, PING, SETTINGS, H2Connection
from client.http1 import Response, _Connection
from client.protocol import TRANSPORT_ERRORS, error_kind

BUDGET = settings(max_examples=200, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class _Transport:
    def __init__(self) -> None:
        self.closing = False

    def write(self, data: Any) -> None:
        pass

    def writelines(self, data: Any) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True


def _pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    """`data` cut at the given offsets (taken modulo its length); no piece empty."""
    points = sorted({c % len(data) for c in cuts if len(data)} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


def _settled_by_our_kinds(future: asyncio.Future[Any]) -> None:
    assert future.done(), "a call left pending after its connection ended"
    exc = future.exception()
    if exc is not None:
        assert isinstance(exc, TRANSPORT_ERRORS), repr(exc)
        assert not error_kind(exc).startswith("os_"), repr(exc)


cuts = st.lists(st.integers(min_value=0, max_value=1 << 16), max_size=12)


# --- HTTP/1.1 (client.http1, llhttp through httptools) ----------------------------------------------------
@st.composite
def http1_answers(draw: st.DrawFn) -> tuple[bytes, int, bytes, bool]:
    """(wire bytes, status, body, framed by close)"""
    status = draw(st.sampled_from([200, 400, 404, 500, 503]))
    body = draw(st.binary(max_size=300))
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    head = f"HTTP/1.1 {status} Whatever\r\n"
    head += "".join(f"X-{i}: {v}\r\n" for i, v in enumerate(draw(st.lists(
        st.text(alphabet="abc ;=/0123456789", max_size=20), max_size=3))))
    interim = draw(st.sampled_from([b"", b"HTTP/1.1 100 Continue\r\n\r\n",
                                    b"HTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n"]))
    if framing == "length":
        wire = (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    elif framing == "chunked":
        sizes = draw(st.lists(st.integers(min_value=1, max_value=64), max_size=8))
        chunks, at = [], 0
        for size in sizes:
            if at >= len(body):
                break
            part = body[at:at + size]
            at += size
            ext = draw(st.sampled_from(["", ";ext=1"]))
            chunks.append(f"{len(part):x}{ext}\r\n".encode() + part + b"\r\n")
        if at < len(body):
            chunks.append(f"{len(body) - at:X}\r\n".encode() + body[at:] + b"\r\n")
        wire = (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + b"".join(chunks) + b"0\r\n\r\n"
    else:
        wire = (head.replace("HTTP/1.1", "HTTP/1.0", 1) + "\r\n").encode() + body
    return interim + wire, status, body, framing == "close"


def _http1_feed(pieces: list[bytes], *, end: bool) -> tuple[_Connection, asyncio.Future[Response]]:
    conn = _Connection()
    conn.transport = _Transport()  # type: ignore[assignment]
    future = conn.send(b"request")
    for piece in pieces:
        conn.data_received(piece)  # must never raise
        if future.done():
            break
    if end:
        conn.eof_received()
        conn.connection_lost(None)
    return conn, future


@BUDGET
@given(answer=http1_answers(), cut_at=cuts)
def test_http1_a_valid_answer_in_any_pieces_parses_the_same(answer: tuple[bytes, int, bytes, bool],
                                                            cut_at: list[int]) -> None:
    wire, status, body, by_close = answer

    async def go() -> None:
        conn, future = _http1_feed(_pieces(wire, cut_at), end=by_close)
        response = future.result()
        assert (response.status, response.body) == (status, body)
        assert conn.reusable is not by_close

    asyncio.run(go())


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[bytes]) -> bytes:
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        if not data:
            break
        at = draw(st.integers(min_value=0, max_value=len(data) - 1))
        op = draw(st.sampled_from(["flip", "delete", "insert"]))
        if op == "flip":
            data[at] = draw(st.integers(min_value=0, max_value=255))
        elif op == "delete":
            del data[at]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


http1_garbage = st.one_of(st.binary(min_size=1, max_size=400),
                          mutated(http1_answers().map(lambda a: a[0])),
                          http1_answers().map(lambda a: a[0]).flatmap(
                              lambda w: st.binary(min_size=1, max_size=50).map(lambda g: w + g)))


@BUDGET
@given(data=http1_garbage, cut_at=cuts)
def test_http1_garbage_never_raises_nor_hangs(data: bytes, cut_at: list[int]) -> None:
    async def go() -> None:
        _, future = _http1_feed(_pieces(data, cut_at), end=True)
        _settled_by_our_kinds(future)

    asyncio.run(go())


# --- gRPC over HTTP/2 (client.grpc_h2) --------------------------------------------------------------------
def _frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", sid) + payload


@st.composite
def h2_answers(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """(the server's bytes: SETTINGS then one answer to stream 1, the response message)"""
    message = draw(st.binary(max_size=300))
    encoder = Encoder()
    frames = [_frame(SETTINGS, 0, 0, struct.pack(">HI", 0x3, draw(st.integers(min_value=1, max_value=100))))]
    head = encoder.encode([(":status", "200"), ("content-type", "application/grpc")])
    if draw(st.booleans()) and len(head) > 1:  # the header block split over CONTINUATION
        frames += [_frame(HEADERS, 0, 1, head[:1]), _frame(CONTINUATION, END_HEADERS, 1, head[1:])]
    else:
        frames.append(_frame(HEADERS, END_HEADERS, 1, head))
    if draw(st.booleans()):
        frames.append(_frame(PING, 0, 0, b"12345678"))
    payload = b"\x00" + struct.pack(">I", len(message)) + message
    split = draw(st.integers(min_value=0, max_value=len(payload)))
    for part in (payload[:split], payload[split:]):
        pad = draw(st.integers(min_value=0, max_value=3))
        if pad:
            frames.append(_frame(DATA, PADDED, 1, bytes([pad]) + part + b"\x00" * pad))
        else:
            frames.append(_frame(DATA, 0, 1, part))
    trailers = encoder.encode([("grpc-status", "0")])
    frames.append(_frame(HEADERS, END_HEADERS | END_STREAM, 1, trailers))
    return b"".join(frames), message


def _h2_feed(pieces: list[bytes], *, end: bool) -> asyncio.Future[bytes | None]:
    loop = asyncio.get_running_loop()
    conn = H2Connection(path="/inference.GRPCInferenceService/ModelInfer", authority="h:1", timeout_s=60.0)
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    stream = conn.start(b"request", True, loop.time() + 60.0)
    for piece in pieces:
        conn.data_received(piece)  # must never raise
    if end:
        conn.connection_lost(None)
    return stream.future


@BUDGET
@given(answer=h2_answers(), cut_at=cuts)
def test_grpc_h2_a_valid_answer_in_any_pieces_parses_the_same(answer: tuple[bytes, bytes],
                                                              cut_at: list[int]) -> None:
    wire, message = answer

    async def go() -> None:
        future = _h2_feed(_pieces(wire, cut_at), end=False)
        assert future.result() == message

    asyncio.run(go())


h2_garbage = st.one_of(
    st.binary(min_size=1, max_size=400),
    mutated(h2_answers().map(lambda a: a[0])),
    # a valid SETTINGS first, then random frames: type, flags and stream id drawn, payload random
    st.lists(st.tuples(st.integers(min_value=0, max_value=12), st.integers(min_value=0, max_value=255),
                       st.sampled_from([0, 1, 2, 3, 5]), st.binary(max_size=40)), min_size=1, max_size=8).map(
        lambda fs: _frame(SETTINGS, 0, 0, b"") + b"".join(_frame(k, f, s, p) for k, f, s, p in fs)),
)


@BUDGET
@given(data=h2_garbage, cut_at=cuts)
def test_grpc_h2_garbage_never_raises_nor_hangs(data: bytes, cut_at: list[int]) -> None:
    async def go() -> None:
        future = _h2_feed(_pieces(data, cut_at), end=True)
        _settled_by_our_kinds(future)

    asyncio.run(go())
