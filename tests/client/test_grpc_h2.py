"""client.grpc_h2: framing edge cases against a scripted HTTP/2 peer on loopback (CONTINUATION, padding,
flow-control stalls, resets, GOAWAY, deadlines, a dropped connection, the server's HPACK dynamic table),
then the real bundled Triton: answers byte-equal to grpc.aio's, and failures labelled as grpc.aio's are."""

from __future__ import annotations

import asyncio
import shutil
import struct
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import pytest
import uvloop
from hpack import Decoder, Encoder
from onnx import TensorProto, helper

from builder.repository.triton_config import BackendConfig, ConfigInputs, TritonBackend, build, to_text
from builder.serving.triton_server import Ports, TritonServer, free_ports
from builder.spec import DimRange, ServingSpec, TensorSpec
from client.compression import compress, decompress
from client.grpc_h2 import (
    CANCEL,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    Channel,
    ConnectionLostError,
    GrpcError,
    grpc_timeout,
)
from client.protocol import TRANSPORT_ERRORS, error_kind
from client.wire import GRPC_INFER_METHOD, grpc_infer_outputs, grpc_infer_request
from tests.helpers.addresses import resolve_every_name_to
from tests.helpers.waiting import wait_until_async

ACK = 0x1


# --- a scripted HTTP/2 peer ------------------------------------------------------------------------------
@dataclass
class Frame:
    kind: int
    flags: int
    sid: int
    payload: bytes


@dataclass
class Request:
    sid: int
    headers: dict[str, str]
    message: bytes


@dataclass
class Peer:
    """The server's side of one connection: reads the client's frames, checking that its DATA never
    exceeds the credit we gave nor our frame size, and writes whatever frames the test scripts."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    initial_window: int = 65_535
    max_frame: int = 16_384
    encoder: Encoder = field(default_factory=Encoder)
    decoder: Decoder = field(default_factory=Decoder)
    conn_credit: int = 65_535
    stream_credit: dict[int, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    seen: list[Frame] = field(default_factory=list)  # every frame read, in order
    _bodies: dict[int, bytearray] = field(default_factory=dict)
    _headers: dict[int, dict[str, str]] = field(default_factory=dict)

    async def frame(self) -> Frame:
        head = await self.reader.readexactly(9)
        length = int.from_bytes(head[:3], "big")
        frame = Frame(head[3], head[4], int.from_bytes(head[5:], "big") & 0x7FFFFFFF,
                      await self.reader.readexactly(length))
        self.seen.append(frame)
        if frame.kind == DATA:
            if length > self.max_frame:
                self.violations.append(f"{length}-byte DATA frame above MAX_FRAME_SIZE {self.max_frame}")
            self.conn_credit -= length
            self.stream_credit[frame.sid] = self.stream_credit.get(frame.sid, self.initial_window) - length
            if self.conn_credit < 0 or self.stream_credit[frame.sid] < 0:
                self.violations.append(f"DATA beyond the window (connection {self.conn_credit}, "
                                       f"stream {self.stream_credit[frame.sid]})")
        return frame

    def send(self, kind: int, flags: int, sid: int, payload: bytes = b"") -> None:
        self.writer.write(len(payload).to_bytes(3, "big") + bytes([kind, flags]) + sid.to_bytes(4, "big") + payload)

    async def handshake(self, settings: dict[int, int] | None = None) -> None:
        """Read the preface and the client's SETTINGS, send ours and acknowledge theirs."""
        assert await self.reader.readexactly(len(PREFACE)) == PREFACE
        first = await self.frame()
        assert (first.kind, first.flags) == (SETTINGS, 0)
        settings = settings or {}
        self.initial_window = settings.get(0x4, self.initial_window)
        self.max_frame = settings.get(0x5, self.max_frame)
        self.send(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in settings.items()))
        self.send(SETTINGS, ACK, 0)
        await self.writer.drain()

    def grant(self, sid: int, increment: int) -> None:
        self.send(WINDOW_UPDATE, 0, sid, struct.pack(">I", increment))
        if sid:
            self.stream_credit[sid] = self.stream_credit.get(sid, self.initial_window) + increment
        else:
            self.conn_credit += increment

    async def request(self) -> Request:
        """Frames until one request is complete (its DATA with END_STREAM); others are kept in `seen`."""
        while True:
            frame = await self.frame()
            if frame.kind == HEADERS:
                block = frame.payload
                while not (frame.flags & END_HEADERS):
                    frame = await self.frame()
                    assert frame.kind == CONTINUATION
                    block += frame.payload
                self._headers[frame.sid] = {k.decode(): v.decode() for k, v in self.decoder.decode(block, raw=True)}
                self._bodies[frame.sid] = bytearray()
                self.stream_credit.setdefault(frame.sid, self.initial_window)
            elif frame.kind == DATA and frame.sid in self._bodies:  # else: of a request the script read itself
                self._bodies[frame.sid] += frame.payload
                if frame.flags & END_STREAM:
                    body = bytes(self._bodies.pop(frame.sid))
                    assert body[0] == 0 and int.from_bytes(body[1:5], "big") == len(body) - 5
                    return Request(frame.sid, self._headers.pop(frame.sid), body[5:])

    def headers(self, sid: int, fields: list[tuple[str, str]], *, end_stream: bool = False) -> None:
        self.send(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), sid, self.encoder.encode(fields))

    def respond(self, sid: int, message: bytes, *, status: int = 0, details: str = "") -> None:
        self.headers(sid, [(":status", "200"), ("content-type", "application/grpc")])
        self.send(DATA, 0, sid, b"\x00" + len(message).to_bytes(4, "big") + message)
        trailers = [("grpc-status", str(status))] + ([("grpc-message", details)] if details else [])
        self.headers(sid, trailers, end_stream=True)


Script = Callable[[Peer, dict[str, Any]], Awaitable[None]]


async def _serve(script: Script, test: Callable[[Channel, dict[str, Any]], Awaitable[None]], *,
                 timeout_s: float = 5.0, connections: int = 1) -> dict[str, Any]:
    """Run `script` for every connection the channel opens, and `test` against the channel."""
    state: dict[str, Any] = {"connections": 0, "peers": []}

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state["connections"] += 1
        peer = Peer(reader, writer)
        state["peers"].append(peer)
        try:
            await script(peer, state)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away: the test checks what it saw
        finally:
            writer.close()

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    channel = Channel("127.0.0.1", port, method=GRPC_INFER_METHOD, timeout_s=timeout_s, connections=connections)
    try:
        await asyncio.wait_for(test(channel, state), 20)
    finally:
        channel.close()
        server.close()
        await server.wait_closed()
    return state


async def _echo(peer: Peer, state: dict[str, Any]) -> None:
    await peer.handshake()
    while True:
        request = await peer.request()
        state.setdefault("headers", []).append(request.headers)
        peer.respond(request.sid, b"echo:" + request.message)
        await peer.writer.drain()


# --- framing against the scripted peer -------------------------------------------------------------------
def test_concurrent_calls_share_one_connection_and_each_gets_its_own_answer() -> None:
    async def test(channel: Channel, state: dict[str, Any]) -> None:
        answers = await asyncio.gather(*[channel.infer(b"m%d" % i) for i in range(40)])
        assert answers == [b"echo:m%d" % i for i in range(40)]
        await channel.send(b"again")  # the server's HPACK table is in use by now: still decoded in step
        assert state["connections"] == 1
        headers = state["headers"][0]
        assert (headers[":method"], headers[":path"], headers["content-type"], headers["te"]) == (
            "POST", GRPC_INFER_METHOD, "application/grpc", "trailers")
        assert headers["grpc-timeout"] == grpc_timeout(5.0)

    asyncio.run(_serve(_echo, test))


def test_continuation_padding_and_priority_fields_are_read() -> None:
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake()
        request = await peer.request()
        sid = request.sid
        peer.send(PING, 0, 0, b"12345678")
        block = peer.encoder.encode([(":status", "200"), ("content-type", "application/grpc"),
                                     ("x-filler", "y" * 40)])
        # HEADERS padded and with priority fields, its block split over two CONTINUATIONs.
        peer.send(HEADERS, PADDED | PRIORITY_FLAG, sid, bytes([3]) + b"\x00\x00\x00\x00\x10" + block[:5] + b"\0" * 3)
        peer.send(CONTINUATION, 0, sid, block[5:10])
        peer.send(CONTINUATION, END_HEADERS, sid, block[10:])
        message = b"\x00" + (len(request.message) + 4).to_bytes(4, "big") + b"pad:" + request.message
        peer.send(DATA, PADDED, sid, bytes([7]) + message[:6] + b"\0" * 7)  # split across two DATA frames
        peer.send(DATA, 0, sid, message[6:])
        trailers = peer.encoder.encode([("grpc-status", "0")])
        peer.send(HEADERS, END_STREAM, sid, trailers[:1])
        peer.send(CONTINUATION, END_HEADERS, sid, trailers[1:])
        await peer.writer.drain()
        while (frame := await peer.frame()).kind != PING:
            pass
        state["ping_ack"] = frame

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        assert await channel.infer(b"hello") == b"pad:hello"
        await wait_until_async(lambda: "ping_ack" in state, what="the PING acknowledged")

    state = asyncio.run(_serve(script, test))
    assert (state["ping_ack"].flags, state["ping_ack"].payload) == (ACK, b"12345678")


def test_a_frame_inside_a_header_block_is_a_connection_error() -> None:
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake()
        request = await peer.request()
        block = peer.encoder.encode([(":status", "200")])
        peer.send(HEADERS, 0, request.sid, block)  # no END_HEADERS: CONTINUATION must follow
        peer.send(DATA, 0, request.sid, b"\x00\x00\x00\x00\x00")
        await peer.writer.drain()
        while True:
            frame = await peer.frame()
            if frame.kind == GOAWAY:
                state["goaway"] = struct.unpack(">II", frame.payload[:8])
                return

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        with pytest.raises(GrpcError) as caught:
            await channel.send(b"x")
        assert caught.value.code() is grpc.StatusCode.INTERNAL
        assert error_kind(caught.value) == "internal"

    state = asyncio.run(_serve(script, test))
    assert state["goaway"][1] == PROTOCOL_ERROR


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_a_request_larger_than_the_windows_waits_for_window_updates(run: Callable[[Any], Any]) -> None:
    size = 200_000  # above the connection's 65,535 and far above each stream's 1,000

    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake({0x4: 1_000})  # SETTINGS_INITIAL_WINDOW_SIZE
        stalls = 0
        bodies: dict[int, int] = {}
        done = 0
        while done < 2:
            frame = await peer.frame()
            if frame.kind == HEADERS:
                peer.decoder.decode(frame.payload)
                bodies[frame.sid] = 0
            elif frame.kind == DATA:
                bodies[frame.sid] += len(frame.payload)
                if frame.flags & END_STREAM:
                    done += 1
                    state.setdefault("sizes", []).append(bodies[frame.sid])
                    peer.respond(frame.sid, str(bodies[frame.sid]).encode())
                    continue
                # Give credit only once the client spent all it had on this stream: it must have stopped.
                if peer.stream_credit[frame.sid] == 0:
                    stalls += 1
                    peer.grant(frame.sid, 3_000)
                if peer.conn_credit < 3_000:
                    peer.grant(0, 20_000)
                await peer.writer.drain()
        state["stalls"] = stalls
        await peer.writer.drain()
        await peer.reader.read()  # open until the client goes: closing with its frames unread would reset it

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        answers = await asyncio.gather(channel.infer(b"a" * size), channel.infer(b"b" * size))
        assert answers == [str(size + 5).encode()] * 2

    state = run(_serve(script, test))
    assert state["sizes"] == [size + 5] * 2
    assert state["peers"][0].violations == []
    assert state["stalls"] >= 2 * (size // 3_000)  # every stream stalled at each exhausted window


def test_no_more_streams_open_than_the_server_allows() -> None:
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake({0x3: 2})  # SETTINGS_MAX_CONCURRENT_STREAMS
        for _ in range(3):
            requests = [await peer.request() for _ in range(2)]
            try:  # with two streams open, the client must send nothing until one closes
                head = await asyncio.wait_for(peer.reader.readexactly(9), 0.2)
                state["third"] = head[3]
                return
            except TimeoutError:
                pass
            for request in requests:
                peer.respond(request.sid, request.message)
            await peer.writer.drain()
        await peer.frame()

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        answers = await asyncio.gather(*[channel.infer(b"%d" % i) for i in range(6)])
        assert answers == [b"%d" % i for i in range(6)]

    state = asyncio.run(_serve(script, test))
    assert "third" not in state


def test_error_statuses_map_to_error_kinds() -> None:
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake()
        request = await peer.request()  # trailers-only answer, as a server gives for an unknown model
        peer.headers(request.sid, [(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "5"),
                                   ("grpc-message", "Request for unknown model: %27nope%27 is not found")],
                     end_stream=True)
        request = await peer.request()  # an HTTP error without any gRPC status (a proxy's)
        peer.headers(request.sid, [(":status", "503")], end_stream=True)
        for _ in range(2):  # refused, and refused again when sent once more: the call's outcome is UNAVAILABLE
            request = await peer.request()
            peer.send(RST_STREAM, 0, request.sid, struct.pack(">I", REFUSED_STREAM))
        request = await peer.request()
        peer.respond(request.sid, b"", status=4, details="deadline")
        await peer.writer.drain()
        await peer.frame()

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        errors: list[BaseException] = []
        for _ in range(4):
            try:
                await channel.send(b"x")
            except TRANSPORT_ERRORS as exc:
                errors.append(exc)
        assert [error_kind(e) for e in errors] == ["unknown_model", "unavailable", "unavailable", "timeout"]
        assert channel.retries == 1
        assert isinstance(errors[0], GrpcError)
        assert errors[0].code() is grpc.StatusCode.NOT_FOUND
        assert errors[0].details() == "Request for unknown model: 'nope' is not found"

    asyncio.run(_serve(script, test))


def test_goaway_streams_it_did_not_take_go_again_on_a_new_connection_counted_as_retries() -> None:
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        if state["connections"] == 1:
            await peer.handshake()
            first, second = await peer.request(), await peer.request()
            low = min(first.sid, second.sid)
            peer.send(GOAWAY, 0, 0, struct.pack(">II", low, 0) + b"restarting")
            peer.respond(low, b"low")  # a stream at or below last-stream-id still completes
            await peer.writer.drain()
            await peer.frame()
            return
        await _echo(peer, state)

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        results = await asyncio.gather(channel.infer(b"1"), channel.infer(b"2"), return_exceptions=True)
        assert list(results) == [b"low", b"echo:2"]  # before issue 27: GrpcError UNAVAILABLE for the second
        assert channel.retries == 1
        assert await channel.infer(b"3") == b"echo:3"
        assert state["connections"] == 2

    asyncio.run(_serve(script, test))


def test_a_deadline_resets_the_stream_and_a_late_answer_is_ignored() -> None:
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake()
        late = await peer.request()
        while (frame := await peer.frame()).kind != RST_STREAM:
            pass
        state["reset"] = (frame.sid, struct.unpack(">I", frame.payload)[0], late.sid)
        peer.respond(late.sid, b"too late")  # its header blocks still go through the client's decoder
        await peer.writer.drain()
        request = await peer.request()
        peer.respond(request.sid, b"in time")
        await peer.writer.drain()
        await peer.frame()

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        with pytest.raises(TimeoutError) as caught:
            await channel.infer(b"slow")
        assert error_kind(caught.value) == "timeout"
        assert await channel.infer(b"next") == b"in time"
        assert state["connections"] == 1

    state = asyncio.run(_serve(script, test, timeout_s=0.3))
    reset_sid, code, late_sid = state["reset"]
    assert (reset_sid, code) == (late_sid, CANCEL)


def test_a_lost_connection_fails_streams_in_flight_and_the_next_call_reconnects() -> None:
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        if state["connections"] == 1:
            await peer.handshake()
            await peer.request()
            await peer.request()
            peer.writer.transport.abort()
            return
        await _echo(peer, state)

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        results = await asyncio.gather(channel.send(b"1"), channel.send(b"2"), return_exceptions=True)
        assert all(isinstance(r, ConnectionError) for r in results), results
        assert [error_kind(r) for r in results if isinstance(r, BaseException)] == ["unavailable"] * 2
        assert await channel.infer(b"3") == b"echo:3"

    asyncio.run(_serve(script, test))


@pytest.mark.parametrize("every_address", [False, True], ids=["one address", "every address of a name"])
def test_nothing_listening_is_unavailable(every_address: bool) -> None:
    # Every address: `localhost` as ::1 and 127.0.0.1 with nobody listening, on a plain asyncio loop (trtbuild
    # tune's): asyncio raises a bare OSError("Multiple exceptions: ...") without errno, which error_kind can
    # only call os_error.
    async def main() -> None:
        port = free_ports(1)[0]
        host = "127.0.0.1"
        if every_address:
            resolve_every_name_to("127.0.0.1", "127.0.0.2")
            host = "localhost"
        channel = Channel(host, port, method=GRPC_INFER_METHOD, timeout_s=2)
        try:
            with pytest.raises(ConnectionError) as caught:
                await channel.send(b"x")
            assert error_kind(caught.value) == "unavailable"
        finally:
            channel.close()

    asyncio.run(main())


def _literal_indexed(name: bytes, value: bytes) -> bytes:
    """A literal with incremental indexing, new name, no Huffman (RFC 7541 §6.2.1): enters the table."""
    return b"\x40" + bytes([len(name)]) + name + bytes([len(value)]) + value


async def _answer_each_with(peer: Peer, head: bytes, blocks: list[bytes]) -> None:
    """After the handshake, one answer per request: `head` as headers, one message, each block as trailers."""
    await peer.handshake()
    for block in blocks:
        request = await peer.request()
        peer.send(HEADERS, END_HEADERS, request.sid, head)
        peer.send(DATA, 0, request.sid, b"\x00\x00\x00\x00\x01!")
        peer.send(HEADERS, END_HEADERS | END_STREAM, request.sid, block)
        await peer.writer.drain()


async def _outcomes(channel: Channel, count: int) -> list[str]:
    """`count` calls in turn: "ok", or the error kind each failed with."""
    outcomes = []
    for _ in range(count):
        try:
            await channel.send(b"x")
            outcomes.append("ok")
        except GrpcError as exc:
            outcomes.append(error_kind(exc))
    return outcomes


def test_repeated_indexed_only_blocks_follow_the_servers_table_as_it_changes() -> None:
    # The trailers block 0xBE ("dynamic entry 62") is byte-identical each time, but what entry 62 holds changes
    # when the server indexes a new field: a decoder (or a memo of decoded blocks) out of step would read the
    # wrong grpc-status.
    head = b"\x88"  # :status 200, static entry 8
    blocks = [
        _literal_indexed(b"grpc-status", b"0"),  # entry 62 = grpc-status 0
        b"\xbe",  # -> OK
        b"\xbe",  # -> OK (memoized)
        _literal_indexed(b"grpc-status", b"5"),  # entry 62 = grpc-status 5, 63 = grpc-status 0
        b"\xbe",  # -> NOT_FOUND now
        b"\xbf",  # -> OK
        b"\xbe",  # -> NOT_FOUND
    ]

    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await _answer_each_with(peer, head, blocks)
        await peer.frame()

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        outcomes = await _outcomes(channel, len(blocks))
        assert outcomes == ["ok", "ok", "ok", "unknown_model", "unknown_model", "ok", "unknown_model"]

    asyncio.run(_serve(script, test))


# --- against the real Triton -----------------------------------------------------------------------------
LARGE = 3 * 224 * 224  # float32: 602,112 bytes, an EfficientNet input's size
SLOW_MODEL = '''
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        answers = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            time.sleep(float(x.flat[0]))  # seconds to wait, from the request itself
            answers.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", (x + x).astype(np.float32))]))
        return answers
'''


def _add_model(repository: Path, name: str, features: int, model_py: str | None = None) -> None:
    """A python-backend model running y = x + x on [batch, features] floats (bench/perf_compare.py's trivial
    model, any width); `model_py` replaces the runner."""
    folder = repository / name
    (folder / "1").mkdir(parents=True)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])], name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", features])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(folder / "1" / "model.onnx"))
    runner = Path(__file__).resolve().parents[2] / "builder" / "repository" / "python_model.py"
    if model_py is None:
        shutil.copyfile(runner, folder / "1" / "model.py")
    else:
        (folder / "1" / "model.py").write_text(model_py)
    config = build(ConfigInputs(name=name, inputs=(TensorSpec("x", "float32", (-1, features)),),
                                outputs=(TensorSpec("y", "float32", (-1, features)),), batch=DimRange(1, 1, 8),
                                serving=ServingSpec(instances=1, max_queue_delay_us=0),
                                backend=BackendConfig(TritonBackend.PYTHON, "model.onnx")))
    (folder / "config.pbtxt").write_text(to_text(config))


@pytest.fixture(scope="module")
def h2_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repository = tmp_path_factory.mktemp("h2") / "repository"
    repository.mkdir()
    _add_model(repository, "add_small", 16)
    _add_model(repository, "add_large", LARGE)
    _add_model(repository, "sleepy", 1, SLOW_MODEL)
    return repository


@pytest.fixture(scope="module")
def h2_server(h2_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    server = TritonServer(h2_repository, tmp_path_factory.mktemp("h2-state"), Ports(*free_ports(3)))
    server.start(timeout=180)
    yield server
    server.stop()


async def _aio(port: int, body: bytes, timeout_s: float = 30.0) -> bytes | BaseException:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
        ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
    try:
        return bytes(await channel.unary_unary(GRPC_INFER_METHOD)(body, timeout=timeout_s))
    except grpc.RpcError as exc:
        return exc
    finally:
        await channel.close()


async def _h2(port: int, body: bytes, timeout_s: float = 30.0, *, send: bool = False) -> bytes | BaseException:
    channel = Channel("127.0.0.1", port, method=GRPC_INFER_METHOD, timeout_s=timeout_s)
    try:
        if send:
            await channel.send(body)
            return b""
        return await channel.infer(body)
    except TRANSPORT_ERRORS as exc:
        return exc
    finally:
        channel.close()


@pytest.mark.parametrize(("model", "features"), [("add_small", 16), ("add_large", LARGE)])
def test_answers_are_byte_equal_to_grpc_aio(h2_server: TritonServer, model: str, features: int) -> None:
    x = np.random.default_rng(1).standard_normal((1, features)).astype(np.float32)
    body = grpc_infer_request(model, {"x": x})
    port = h2_server.ports.grpc
    ours, theirs = asyncio.run(_h2(port, body)), asyncio.run(_aio(port, body))
    assert isinstance(ours, bytes) and isinstance(theirs, bytes), (ours, theirs)
    assert ours == theirs
    np.testing.assert_array_equal(grpc_infer_outputs(ours)["y"], x + x)
    assert asyncio.run(_h2(port, body, send=True)) == b""


def test_many_large_requests_in_flight_on_one_connection(h2_server: TritonServer) -> None:
    # Under uvloop, perfclient's loop: the parts of a request larger than the window go out as memoryviews.
    xs = [np.full((1, LARGE), i, np.float32) for i in range(6)]

    async def main() -> list[bytes]:
        channel = Channel("127.0.0.1", h2_server.ports.grpc, method=GRPC_INFER_METHOD, timeout_s=60)
        try:
            return await asyncio.gather(*[channel.infer(grpc_infer_request("add_large", {"x": x})) for x in xs])
        finally:
            channel.close()

    for x, answer in zip(xs, uvloop.run(main()), strict=True):
        np.testing.assert_array_equal(grpc_infer_outputs(answer)["y"], x + x)


def test_an_unknown_model_is_not_found_as_with_grpc_aio(h2_server: TritonServer) -> None:
    body = grpc_infer_request("no_such_model", {"x": np.ones((1, 16), np.float32)})
    ours, theirs = asyncio.run(_h2(h2_server.ports.grpc, body)), asyncio.run(_aio(h2_server.ports.grpc, body))
    assert isinstance(ours, GrpcError) and isinstance(theirs, grpc.RpcError)
    assert ours.code() is theirs.code() is grpc.StatusCode.NOT_FOUND
    assert ours.details() == theirs.details()
    assert error_kind(ours) == "unknown_model"


def test_a_request_past_its_deadline_is_a_timeout(h2_server: TritonServer) -> None:
    body = grpc_infer_request("sleepy", {"x": np.full((1, 1), 1.5, np.float32)})
    outcome = asyncio.run(_h2(h2_server.ports.grpc, body, timeout_s=0.3))
    assert isinstance(outcome, BaseException) and error_kind(outcome) == "timeout"
    fine = grpc_infer_request("sleepy", {"x": np.zeros((1, 1), np.float32)})
    assert isinstance(asyncio.run(_h2(h2_server.ports.grpc, fine, timeout_s=10)), bytes)


@pytest.mark.server
def test_a_killed_server_fails_requests_in_flight_as_unavailable(h2_repository: Path, tmp_path: Path) -> None:
    server = TritonServer(h2_repository, tmp_path / "state", Ports(*free_ports(3)))
    server.start(timeout=180)
    try:
        body = grpc_infer_request("sleepy", {"x": np.full((1, 1), 5.0, np.float32)})

        async def main() -> list[BaseException | None]:
            channel = Channel("127.0.0.1", server.ports.grpc, method=GRPC_INFER_METHOD, timeout_s=30)
            try:
                calls = [asyncio.ensure_future(channel.send(body)) for _ in range(3)]

                def all_sent() -> bool:
                    conn = channel._conns[0]
                    return conn is not None and len(conn.streams) == 3 and not conn._out and not conn._blocked

                await wait_until_async(all_sent, what="all three requests sent", timeout_s=60)
                assert server.process is not None
                server.process.kill()
                return await asyncio.gather(*calls, return_exceptions=True)
            finally:
                channel.close()

        outcomes = asyncio.run(main())
    finally:
        server.stop()
    assert all(isinstance(o, BaseException) for o in outcomes), outcomes
    assert [error_kind(o) for o in outcomes if isinstance(o, BaseException)] == ["unavailable"] * 3


# --- stream slots, given-up calls, close() -----------------------------------------------------------------
@pytest.mark.parametrize("how", ["cancelled", "deadline"])
def test_a_stream_given_up_frees_its_slot_for_a_waiting_call(how: str) -> None:
    # With MAX_CONCURRENT_STREAMS 1, a call waiting for the slot must get it as soon as the stream holding it
    # is given up (its caller cancelled, or its deadline passed), not only when some other stream ends.
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake({0x3: 1})
        held = await peer.request()
        state.setdefault("held", asyncio.Event()).set()
        while (frame := await peer.frame()).kind != RST_STREAM:
            pass
        state["reset"] = (frame.sid, struct.unpack(">I", frame.payload)[0], held.sid)
        request = await peer.request()
        peer.respond(request.sid, b"echo:" + request.message)
        await peer.writer.drain()
        await peer.frame()

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        first = asyncio.create_task(channel.infer(b"held"))
        await state.setdefault("held", asyncio.Event()).wait()
        channel.timeout_s = 30.0  # the waiting call's deadline: far beyond the held one's
        waiting = asyncio.create_task(channel.infer(b"waiting"))
        conn = channel._conns[0]
        assert conn is not None
        await wait_until_async(lambda: len(conn._slot_waiters) == 1, what="the call queued for the slot")
        assert not waiting.done()
        if how == "cancelled":
            first.cancel()
        results = await asyncio.gather(first, waiting, return_exceptions=True)
        expected = asyncio.CancelledError if how == "cancelled" else TimeoutError
        assert isinstance(results[0], expected), results
        assert results[1] == b"echo:waiting", results

    state = asyncio.run(_serve(script, test, timeout_s=30.0 if how == "cancelled" else 2.0))
    reset_sid, code, held_sid = state["reset"]
    assert (reset_sid, code) == (held_sid, CANCEL)


def test_a_woken_slot_waiter_that_gives_up_passes_the_slot_on() -> None:
    # Two calls wait for the one slot; the first one woken is cancelled before it runs. The slot must go to the
    # other waiter, which otherwise sits out its deadline while the connection has nothing open.
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake({0x3: 1})
        while True:
            request = await peer.request()
            if request.message == b"held":
                await state.setdefault("release", asyncio.Event()).wait()
            peer.respond(request.sid, b"echo:" + request.message)
            await peer.writer.drain()

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        held = asyncio.create_task(channel.infer(b"held"))
        while (conn := channel._conns[0]) is None or not conn.streams:
            await asyncio.sleep(0.01)  # connected, the held stream open
        woken = asyncio.create_task(channel.infer(b"woken"))
        other = asyncio.create_task(channel.infer(b"other"))
        await wait_until_async(lambda: len(conn._slot_waiters) == 2, what="both calls queued for the slot")
        assert not woken.done() and not other.done()
        # Runs right after the held stream ends, before the woken waiter's task resumes.
        next(iter(conn.streams.values())).future.add_done_callback(lambda _: woken.cancel())
        state.setdefault("release", asyncio.Event()).set()
        results = await asyncio.gather(held, woken, other, return_exceptions=True)
        assert results[0] == b"echo:held" and isinstance(results[1], asyncio.CancelledError), results
        assert results[2] == b"echo:other", results

    asyncio.run(_serve(script, test))


def test_close_while_connecting_fails_the_waiting_calls_as_connection_errors() -> None:
    # The server accepts but has not sent its SETTINGS when the channel is closed: the calls waiting for the
    # connection fail as a lost connection (counted 'unavailable'), not as if their own tasks were cancelled.
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        assert await peer.reader.readexactly(len(PREFACE)) == PREFACE
        state.setdefault("accepted", asyncio.Event()).set()
        await peer.frame()
        await peer.reader.read()  # until the client goes

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        calls = [asyncio.create_task(channel.send(b"x")) for _ in range(2)]
        await state.setdefault("accepted", asyncio.Event()).wait()
        channel.close()
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, ConnectionError) for r in results), results
        assert [error_kind(r) for r in results if isinstance(r, BaseException)] == ["unavailable"] * 2

    asyncio.run(_serve(script, test))


def test_an_initial_window_change_that_overflows_a_stream_window_is_a_flow_control_error() -> None:
    # RFC 9113 §6.9.2: a SETTINGS_INITIAL_WINDOW_SIZE change that takes an open stream's window above 2^31-1 is
    # a connection error of type FLOW_CONTROL_ERROR.
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake()
        request = await peer.request()
        window = 65_535 - (len(request.message) + 5)
        peer.grant(request.sid, 2**31 - 1 - window)  # the stream's window is now exactly 2^31-1
        peer.send(SETTINGS, 0, 0, struct.pack(">HI", 0x4, 65_536))  # one more
        await peer.writer.drain()
        while (frame := await peer.frame()).kind != GOAWAY:
            pass
        state["goaway"] = struct.unpack(">II", frame.payload[:8])

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        with pytest.raises(GrpcError) as caught:
            await channel.send(b"x")
        assert error_kind(caught.value) == "internal"

    state = asyncio.run(_serve(script, test, timeout_s=2.0))
    assert state["goaway"][1] == 0x3  # FLOW_CONTROL_ERROR


def test_a_lowered_initial_window_leaves_a_stream_owing_credit_before_it_sends_again() -> None:
    # RFC 9113 §6.9.2: lowering SETTINGS_INITIAL_WINDOW_SIZE mid-connection can make an open stream's window
    # negative; the client then sends nothing more on it until WINDOW_UPDATEs bring it above zero.
    size = 100_000

    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake()
        sent = 0
        sid = 0
        while sent < 65_535:  # the client uses the whole default window
            frame = await peer.frame()
            if frame.kind == DATA:
                sent, sid = sent + len(frame.payload), frame.sid
        peer.send(SETTINGS, 0, 0, struct.pack(">HI", 0x4, 16_384))
        peer.stream_credit[sid] += 16_384 - peer.initial_window  # -49,151: the stream owes credit
        peer.initial_window = 16_384
        peer.grant(0, 1 << 20)
        peer.grant(sid, 49_151 + 100)  # the stream may send 100 bytes, no more
        await peer.writer.drain()
        while sent < 65_535 + 100:
            frame = await peer.frame()
            if frame.kind == DATA:
                sent += len(frame.payload)
        try:
            await asyncio.wait_for(peer.frame(), 0.2)
            state["more"] = True
        except TimeoutError:
            pass
        peer.grant(sid, size)
        body = bytearray()
        while True:  # the rest of the request
            frame = await peer.frame()
            if frame.kind == DATA:
                body += frame.payload
                if frame.flags & END_STREAM:
                    break
        peer.respond(sid, b"done")
        await peer.writer.drain()
        await peer.frame()

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        assert await channel.infer(b"\x07" * size) == b"done"

    state = asyncio.run(_serve(script, test))
    assert state["peers"][0].violations == []
    assert "more" not in state


def test_a_reset_from_the_server_is_not_answered_with_a_reset() -> None:
    # RFC 9113 §5.4.2: never RST_STREAM in response to RST_STREAM, even when part of our request is unsent.
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake()
        refused: list[int] = []
        for _ in range(2):  # the request, then the channel's one transparent retry of it
            while (frame := await peer.frame()).kind != DATA or frame.sid in refused:
                pass
            refused.append(frame.sid)  # a request larger than the window: most of it still waits for credit
            peer.send(RST_STREAM, 0, frame.sid, struct.pack(">I", REFUSED_STREAM))
            peer.grant(0, 1 << 20)  # the connection's credit back, for the next call
            await peer.writer.drain()
        request = await peer.request()  # the next call, sent after the client read the reset
        state["rst_sids"] = [f.sid for f in peer.seen if f.kind == RST_STREAM]
        state["refused"] = refused
        peer.respond(request.sid, b"next")
        await peer.writer.drain()
        await peer.frame()

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        with pytest.raises(GrpcError) as caught:
            await channel.send(b"\x01" * 200_000)
        assert error_kind(caught.value) == "unavailable"
        assert await channel.infer(b"n") == b"next"

    state = asyncio.run(_serve(script, test))
    assert not set(state["refused"]) & set(state["rst_sids"])


@pytest.mark.parametrize(("increment", "code"), [(2**31 - 1, 0x3), (0, PROTOCOL_ERROR)],
                         ids=["overflow", "zero"])
def test_a_bad_stream_window_update_resets_the_stream_with_its_error_code(increment: int, code: int) -> None:
    # RFC 9113 §6.9.1: a stream window above 2^31-1 is a stream error FLOW_CONTROL_ERROR; §6.9: an increment
    # of 0 on a stream is a stream error PROTOCOL_ERROR.
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake()
        request = await peer.request()
        peer.send(WINDOW_UPDATE, 0, request.sid, struct.pack(">I", increment))
        await peer.writer.drain()
        while (frame := await peer.frame()).kind != RST_STREAM:
            pass
        state["reset"] = (frame.sid, struct.unpack(">I", frame.payload)[0], request.sid)

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        with pytest.raises(GrpcError) as caught:
            await channel.send(b"x")
        assert error_kind(caught.value) == "internal"

    state = asyncio.run(_serve(script, test))
    reset_sid, reset_code, sid = state["reset"]
    assert (reset_sid, reset_code) == (sid, code)


@pytest.mark.parametrize("shape", ["data_ends_stream", "trailers_without_status", "trailers_only_without_status"])
def test_an_answer_without_grpc_status_is_unknown_as_with_grpc_aio(shape: str) -> None:
    # grpc.aio (grpc-core) reports UNKNOWN ("No status received") for an HTTP 200 answer whose stream ends with
    # no grpc-status, in each of these shapes (checked against grpc.aio with this scripted peer).
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake()
        sid = (await peer.request()).sid
        start = [(":status", "200"), ("content-type", "application/grpc")]
        if shape == "trailers_only_without_status":
            peer.headers(sid, start, end_stream=True)
        else:
            peer.headers(sid, start)
            peer.send(DATA, END_STREAM if shape == "data_ends_stream" else 0, sid, b"\x00\x00\x00\x00\x00")
            if shape == "trailers_without_status":
                peer.headers(sid, [("x-other", "1")], end_stream=True)
        await peer.writer.drain()
        await peer.frame()

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        with pytest.raises(GrpcError) as caught:
            await channel.infer(b"x")
        assert error_kind(caught.value) == "unknown"

    asyncio.run(_serve(script, test))


def test_the_last_stream_of_a_draining_connection_is_reset_before_the_connection_closes() -> None:
    # After a GOAWAY that took our stream, its deadline passes: the server must get the RST_STREAM (so it stops
    # the work) before the connection, now with nothing open, closes.
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake()
        request = await peer.request()
        peer.send(GOAWAY, 0, 0, struct.pack(">II", request.sid, 0))
        await peer.writer.drain()
        state["sid"] = request.sid
        state["resets"] = []
        try:
            while True:
                frame = await peer.frame()
                if frame.kind == RST_STREAM:
                    state["resets"].append((frame.sid, struct.unpack(">I", frame.payload)[0]))
        except asyncio.IncompleteReadError:
            state["eof"] = True

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        with pytest.raises(TimeoutError):
            await channel.send(b"x")
        while "eof" not in state:
            await asyncio.sleep(0.01)

    state = asyncio.run(_serve(script, test, timeout_s=0.3))
    assert state["resets"] == [(state["sid"], CANCEL)]


def test_a_connection_whose_stream_ids_run_out_is_replaced() -> None:
    # Stream ids are odd and at most 2^31-1: the call that takes the last one completes on its connection, the
    # next goes to a new connection, and the old one closes once its last stream has ended.
    async def test(channel: Channel, state: dict[str, Any]) -> None:
        assert await channel.infer(b"a") == b"echo:a"
        first = channel._conns[0]
        assert first is not None
        first._next_id = 2**31 - 1
        assert await channel.infer(b"last") == b"echo:last"
        assert await channel.infer(b"b") == b"echo:b"
        assert state["connections"] == 2 and channel._conns[0] is not first
        while not first.closed:
            await asyncio.sleep(0.01)

    asyncio.run(_serve(_echo, test))


def test_a_call_waiting_for_a_stream_slot_is_not_overtaken_by_later_calls() -> None:
    # MAX_CONCURRENT_STREAMS 1 and a closed loop that sends its next call as soon as its last one is answered:
    # a call already waiting for the slot gets it next, instead of waiting until the loop stops (a load
    # generator at a concurrency above the server's limit would time out its waiting calls).
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake({0x3: 1})
        while True:
            request = await peer.request()
            peer.respond(request.sid, request.message)
            await peer.writer.drain()

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        answered: list[bytes] = []

        async def loop() -> None:
            for i in range(10):
                answered.append(await channel.infer(b"loop%d" % i))

        looping = asyncio.create_task(loop())
        await wait_until_async(lambda: answered, what="the loop's first answer")
        # However far the loop got meanwhile (the poll is not instant on a loaded machine), one of its calls
        # holds the slot now: the waiter must be answered right after it, not after the loop's later calls.
        issued_at = len(answered)
        answered.append(await channel.infer(b"waiter"))
        await looping
        assert answered.index(b"waiter") <= issued_at + 2, (issued_at, answered)

    asyncio.run(_serve(script, test))


@pytest.mark.parametrize(("shape", "kind"), [
    ("data_before_headers", "unknown"), ("headers_twice", "unknown"), ("grpc_status_not_a_number", "internal"),
    ("grpc_status_out_of_range", "unknown")])
def test_malformed_answers_are_labelled_as_grpc_aio_labels_them(shape: str, kind: str) -> None:
    # The kinds grpc.aio (grpc-core) gives these answers, checked against it with this scripted peer: results
    # must count errors as they did before the switch.
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake()
        sid = (await peer.request()).sid
        start = [(":status", "200"), ("content-type", "application/grpc")]
        if shape == "data_before_headers":
            peer.send(DATA, END_STREAM, sid, b"\x00\x00\x00\x00\x00")
        elif shape == "headers_twice":
            peer.headers(sid, start)
            peer.headers(sid, start)
        else:
            status = "abc" if shape == "grpc_status_not_a_number" else "99"
            peer.headers(sid, [*start, ("grpc-status", status)], end_stream=True)
        await peer.writer.drain()
        await peer.frame()

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        with pytest.raises(GrpcError) as caught:
            await channel.infer(b"x")
        assert error_kind(caught.value) == kind

    asyncio.run(_serve(script, test))


def test_a_table_size_update_empties_the_memo_of_indexed_only_blocks() -> None:
    # The server shrinks its dynamic table to 0 (an HPACK dynamic table size update): entry 62 is gone, so the
    # block 0xBE that decoded (and was memoized) before must now fail to decode, a connection error, not give
    # the earlier answer.
    head = b"\x88"
    blocks = [
        _literal_indexed(b"grpc-status", b"0"),  # entry 62 = grpc-status 0
        b"\xbe",  # -> OK (memoized from here)
        b"\x20" + b"\x00\x0bgrpc-status\x010",  # size update to 0, then a literal not indexed: OK, table empty
        b"\xbe",  # no entry 62 any more: COMPRESSION_ERROR
    ]

    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await _answer_each_with(peer, head, blocks)
        while (frame := await peer.frame()).kind != GOAWAY:
            pass
        state["goaway"] = struct.unpack(">II", frame.payload[:8])

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        outcomes = await _outcomes(channel, len(blocks))
        assert outcomes == ["ok", "ok", "ok", "internal"]
        while "goaway" not in state:
            await asyncio.sleep(0.01)

    state = asyncio.run(_serve(script, test))
    assert state["goaway"][1] == 0x9  # COMPRESSION_ERROR


# --- transparent retries and draining (issue 27) -----------------------------------------------------------
def test_a_refused_stream_is_sent_again_once_and_counted() -> None:
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake()
        request = await peer.request()
        peer.send(RST_STREAM, 0, request.sid, struct.pack(">I", REFUSED_STREAM))  # e.g. over its stream limit
        await peer.writer.drain()
        again = await peer.request()
        state["messages"] = [request.message, again.message]
        peer.respond(again.sid, b"answered")
        await peer.writer.drain()
        await peer.frame()

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        assert await channel.infer(b"q") == b"answered"  # before: GrpcError UNAVAILABLE
        assert channel.retries == 1 and state["connections"] == 1

    state = asyncio.run(_serve(script, test))
    assert state["messages"] == [b"q", b"q"]


def test_a_request_sent_as_an_idle_connection_closes_is_sent_once_more_on_a_new_one() -> None:
    # The server answers the first call, then closes the connection as the second arrives, unanswered (its
    # idle timeout racing our request): the second goes again on a new connection, once, as http1 does.
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        if state["connections"] == 1:
            await peer.handshake()
            request = await peer.request()
            peer.respond(request.sid, b"first")
            await peer.writer.drain()
            await peer.request()
            state["dropped"] = True
            return  # closes the connection without an answer
        await _echo(peer, state)

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        assert await channel.infer(b"1") == b"first"
        assert await channel.infer(b"2") == b"echo:2"  # before: ConnectionLostError (unavailable)
        assert state["connections"] == 2 and state["dropped"] and channel.retries == 1

    asyncio.run(_serve(script, test))


def test_a_stream_a_goaway_took_is_not_sent_again_when_the_connection_then_closes() -> None:
    # The server answers the first call; the second arrives on the idle connection, a GOAWAY says the server
    # took it (last stream id = its id: it may have run it), then the connection closes unanswered. Sending it
    # again could run it twice: it fails (unavailable), no retry.
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        if state["connections"] == 1:
            await peer.handshake()
            request = await peer.request()
            peer.respond(request.sid, b"first")
            await peer.writer.drain()
            request = await peer.request()
            peer.send(GOAWAY, 0, 0, struct.pack(">II", request.sid, 0))
            await peer.writer.drain()
            return  # closes the connection without an answer
        await _echo(peer, state)

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        assert await channel.infer(b"1") == b"first"
        with pytest.raises(ConnectionLostError):
            await channel.infer(b"2")
        assert state["connections"] == 1 and channel.retries == 0

    asyncio.run(_serve(script, test))


def test_close_lets_a_replaced_draining_connection_finish_its_streams() -> None:
    # A GOAWAY that took stream A; the next call opens a new connection, the old one drains. aclose() waits for
    # A's answer (the server promised it) before dropping everything; before, close() left that connection open.
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        if state["connections"] == 1:
            await peer.handshake()
            request = await peer.request()
            peer.send(GOAWAY, 0, 0, struct.pack(">II", request.sid, 0))
            await peer.writer.drain()
            await state["release"].wait()
            peer.respond(request.sid, b"drained")
            await peer.writer.drain()
            await peer.reader.read()  # until the client closes it
            state["old_closed"] = True
            return
        await _echo(peer, state)

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        state["release"] = asyncio.Event()
        first_call = asyncio.create_task(channel.infer(b"A"))
        await wait_until_async(lambda: channel._conns[0] is not None and channel._conns[0].draining,
                               what="the GOAWAY read")
        old = channel._conns[0]
        assert await channel.infer(b"B") == b"echo:B"  # on a new connection
        assert channel._conns[0] is not old and old is not None and not old.closed
        closing = asyncio.create_task(channel.aclose())
        await asyncio.sleep(0)  # aclose runs up to its wait for the draining connection
        assert not closing.done()
        state["release"].set()
        await closing
        assert await first_call == b"drained"
        assert old.closed and all(conn is None or conn.closed for conn in channel._conns)
        await wait_until_async(lambda: state.get("old_closed", False), what="the server to see the old one close")

    asyncio.run(_serve(script, test))


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_a_compressed_request_says_so_and_a_compressed_answer_is_decompressed(algorithm: str) -> None:
    async def script(peer: Peer, state: dict[str, Any]) -> None:
        await peer.handshake()
        while (frame := await peer.frame()).kind != HEADERS:
            pass
        state["headers"] = {k.decode(): v.decode() for k, v in peer.decoder.decode(frame.payload, raw=True)}
        while (data := await peer.frame()).kind != DATA:
            pass
        state["flag"], state["message"] = data.payload[0], decompress(data.payload[5:], algorithm)
        answer = compress(b"answer", algorithm)
        peer.headers(frame.sid, [(":status", "200"), ("content-type", "application/grpc"),
                                 ("grpc-encoding", algorithm)])
        peer.send(DATA, 0, frame.sid, b"\x01" + len(answer).to_bytes(4, "big") + answer)
        peer.headers(frame.sid, [("grpc-status", "0")], end_stream=True)
        await peer.writer.drain()
        await peer.frame()

    async def test(channel: Channel, state: dict[str, Any]) -> None:
        assert await channel.infer(compress(b"question", algorithm), algorithm) == b"answer"

    state = asyncio.run(_serve(script, test))
    assert state["flag"] == 1 and state["message"] == b"question"
    assert state["headers"]["grpc-encoding"] == algorithm
