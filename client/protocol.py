"""gRPC and HTTP connections to Triton behind one small async interface.

Control calls (liveness, metadata, config, statistics) go through tritonclient's public asyncio
clients. The hot path does not: each payload is serialized once (client.wire) and sent as raw
bytes, on our own gRPC-over-HTTP/2 connections (client.grpc_h2: about a fifth of grpc.aio's CPU per
request) or HTTP/1.1 keep-alive connections (client.http1: about a third of aiohttp's), and the response
is checked for an error but not decoded, as perf_analyzer does. Only `infer` (used by `--validate`)
decodes the outputs.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import aiohttp
import grpc
from numpy.typing import NDArray
from tritonclient.utils import InferenceServerException

from client.compression import ALGORITHMS, compress, decompress
from client.errors import PerfClientError
from client.grpc_aio import AioChannel, GrpcClient, open_channel
from client.grpc_h2 import Channel as GrpcH2Channel
from client.http1 import Pool, request_bytes
from client.sequences import Flags
from client.server_stats import ServerStats, parse_statistics
from client.shared_memory import SharedMemory, SharedMemoryPool
from client.streaming import Stream, stream_parameters
from client.tls import Tls
from client.wire import (
    GRPC_INFER_METHOD,
    HTTP_HEADER_LENGTH,
    ResponseFormatError,
    grpc_infer_outputs,
    grpc_infer_request,
    grpc_sequence_parameters,
    http_error_message,
    http_infer_outputs,
    http_infer_request,
    http_sequence_header,
)
from common.choices import Choice

if TYPE_CHECKING:  # client.validate imports this module
    from client.validate import Check

log = logging.getLogger(__name__)

# A request that takes longer is recorded as a timeout (tritonclient's own aio default is 60 s too).
REQUEST_TIMEOUT_S = 60.0
# Control calls (metadata, statistics) between windows: short, so a dying server cannot stall a run.
CONTROL_TIMEOUT_S = 10.0
# Connection pool for the HTTP hot path; above any concurrency we drive, as tritonclient's conn_limit.
HTTP_CONNECTIONS = 1024


class Protocol(Choice):
    GRPC = "grpc"
    HTTP = "http"

    @property
    def default_port(self) -> int:
        return 8001 if self is Protocol.GRPC else 8000


@dataclass(frozen=True)
class TensorMeta:
    name: str
    datatype: str
    shape: tuple[int, ...]  # without the batch axis when the model batches


@dataclass(frozen=True)
class ModelMeta:
    name: str
    max_batch_size: int
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    sequence: bool = False  # served by Triton's sequence batcher (its config has sequence_batching)
    decoupled: bool = False  # model_transaction_policy { decoupled: true }: any number of answers per request


@dataclass(frozen=True)
class Prepared:
    """A request serialized once and sent many times: the load loop does no per-request encoding.

    `body` is what goes on the wire: over gRPC the serialized ModelInferRequest, over HTTP the whole
    request (request line, headers, body: client.http1.request_bytes). `expected` (with `--validate`): the
    outputs every answer to it must match; None sends without decoding.
    """

    model: str
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    expected: Check | None = None
    encoding: str | None = None  # gRPC: the message is compressed so (HTTP says it in its own headers)


class HttpStatusError(Exception):
    """A non-200 answer to an HTTP inference request, with the server's reason."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(http_error_message(status, body))
        self.status = status


class Connection:
    """One connection to one server; `prepare` serializes a payload once, `send` sends it as it is.

    Use `async with await Connection.open(...)`, or call `close()`.
    """

    def __init__(self, protocol: Protocol, url: str, *, timeout_s: float = REQUEST_TIMEOUT_S,
                 shared_memory: SharedMemory | None = None, tls: Tls | None = None,
                 compression: str | None = None, grpc_client: GrpcClient = GrpcClient.NATIVE) -> None:
        """Call from a running event loop (aiohttp and grpc.aio bind to it). `tls`: every connection over TLS.
        `compression` (gzip, deflate): requests prepared compressed (with grpc.aio: compressed by grpc-core as
        they go), compressed answers asked for. `grpc_client`: which client carries gRPC inference requests."""
        if compression is not None and compression not in ALGORITHMS:
            flag = "--grpc-compression-algorithm" if protocol is Protocol.GRPC else "--http-compression-algorithm"
            raise PerfClientError(f"{flag} {compression}: expected one of {', '.join(ALGORITHMS)}")
        self.compression = compression
        self.protocol = protocol
        self.url = url
        self.grpc_client = GrpcClient.parse(grpc_client, "--grpc-client", error=PerfClientError)
        self._timeout_s = timeout_s
        self._tls = tls
        self._stream_channel: Any = None  # grpc.aio's, opened by the first open_stream()
        # A bad -u is refused before anything is opened (a control session left unclosed otherwise).
        address = host_port(url)
        # --shared-memory: payloads' tensors go through registered regions, released by close().
        self._shm = (SharedMemoryPool(shared_memory, protocol=str(protocol), url=url)
                     if shared_memory is not None and shared_memory.enabled else None)
        log.debug("connecting to %s over %s (request timeout %g s)", url, protocol, timeout_s)
        self._control: Any
        if protocol is Protocol.GRPC:
            import tritonclient.grpc.aio as grpc_aio

            self._control = grpc_aio.InferenceServerClient(url=url, **_grpc_tls(tls))
            # The hot path's own HTTP/2 client (or grpc-core's with --grpc-client aio): the request goes out as
            # the bytes given, the response comes back as bytes.
            self._h2: GrpcH2Channel | AioChannel
            if self.grpc_client is GrpcClient.AIO:
                self._h2 = AioChannel(url, method=GRPC_INFER_METHOD, timeout_s=timeout_s, tls=tls,
                                      compression=compression)
            else:
                self._h2 = GrpcH2Channel(*address, method=GRPC_INFER_METHOD, timeout_s=timeout_s, authority=url,
                                         ssl=tls.context("h2") if tls is not None else None,
                                         server_hostname=tls.server_name if tls is not None else None)
        else:
            import tritonclient.http.aio as http_aio

            self._control = http_aio.InferenceServerClient(
                url=url, conn_timeout=CONTROL_TIMEOUT_S,
                **({"ssl": True, "ssl_context": tls.context("http/1.1")} if tls is not None else {}))
            self._pool = Pool(*address, limit=HTTP_CONNECTIONS, timeout_s=timeout_s,
                              ssl=tls.context("http/1.1") if tls is not None else None,
                              server_hostname=tls.server_name if tls is not None else None)
            self._host = url  # the Host header, as given

    @classmethod
    async def open(cls, protocol: Protocol, url: str, *, timeout_s: float = REQUEST_TIMEOUT_S,
                   shared_memory: SharedMemory | None = None, tls: Tls | None = None,
                   compression: str | None = None, grpc_client: GrpcClient = GrpcClient.NATIVE) -> Connection:
        return cls(protocol, url, timeout_s=timeout_s, shared_memory=shared_memory, tls=tls, compression=compression,
                   grpc_client=grpc_client)

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        if self._shm is not None:
            # First: whatever happens below, no region outlives the run. Off the event loop: a blocking
            # control call per region, each up to CONTROL_TIMEOUT_S.
            await asyncio.to_thread(self._shm.close)
        await self._control.close()
        if self.protocol is Protocol.GRPC:
            await self._h2.aclose()  # draining connections finish the streams they took first
            if self._stream_channel is not None and not isinstance(self._h2, AioChannel):
                await self._stream_channel.close(grace=None)
        else:
            self._pool.close()

    @property
    def retries(self) -> int:
        """Requests the transport sent once more (refused unprocessed, or the idle-close race), so far."""
        return self._h2.retries if self.protocol is Protocol.GRPC else self._pool.retries

    async def live(self) -> bool:
        try:
            return bool(await _bounded(self._control.is_server_live()))
        except Exception:  # noqa: BLE001 - any failure means "not live"
            return False

    async def model(self, name: str) -> ModelMeta:
        # Liveness, not server readiness: with explicit model control another model may be loading
        # or unloading, which makes the whole server "not ready" while this model serves.
        try:
            live = await _bounded(self._control.is_server_live())
        except Exception as exc:
            if not is_unreachable(exc):  # a bug (ours or a library's) keeps its type and traceback
                raise
            raise PerfClientError(f"-u {self.url}: cannot reach Triton over {self.protocol} ({describe(exc)})") from exc
        if not live:
            raise PerfClientError(f"-u {self.url}: server is up but not live")
        try:
            if self.protocol is Protocol.GRPC:
                meta = await _bounded(self._control.get_model_metadata(name, as_json=True))
                config = (await _bounded(self._control.get_model_config(name, as_json=True)))["config"]
            else:
                meta = await _bounded(self._control.get_model_metadata(name))
                config = await _bounded(self._control.get_model_config(name))
            ready = await _bounded(self._control.is_model_ready(name))
        except Exception as exc:
            raise PerfClientError(f"-m {name}: model is not served at {self.url} ({describe(exc)})") from exc
        if not ready:
            raise PerfClientError(f"-m {name}: model is not ready at {self.url}")
        max_batch = int(config.get("max_batch_size") or 0)

        def tensors(items: list[dict[str, Any]]) -> tuple[TensorMeta, ...]:
            out = []
            for item in items:
                shape = tuple(int(d) for d in item.get("shape", []))
                out.append(TensorMeta(item["name"], item["datatype"], shape[1:] if max_batch > 0 else shape))
            return tuple(out)

        policy = config.get("model_transaction_policy") or {}
        return ModelMeta(name, max_batch, tensors(meta.get("inputs", [])), tensors(meta.get("outputs", [])),
                         sequence="sequence_batching" in config, decoupled=bool(policy.get("decoupled", False)))

    async def model_config(self, name: str) -> dict[str, Any]:
        """The model's configuration as the server serves it (Triton's JSON form: `instance_group`, ...)."""
        try:
            if self.protocol is Protocol.GRPC:
                return dict((await _bounded(self._control.get_model_config(name, as_json=True)))["config"])
            return dict(await _bounded(self._control.get_model_config(name)))
        except Exception as exc:
            raise PerfClientError(f"-m {name}: no model configuration from {self.url} ({describe(exc)})") from exc

    async def loaded_models(self) -> list[str]:
        """The models the server has loaded (READY in its repository index)."""
        try:
            if self.protocol is Protocol.GRPC:
                index = (await _bounded(self._control.get_model_repository_index(as_json=True))).get("models", [])
            else:
                index = await _bounded(self._control.get_model_repository_index())
        except Exception as exc:
            raise PerfClientError(f"-u {self.url}: no repository index ({describe(exc)})") from exc
        return list(dict.fromkeys(str(m["name"]) for m in index if m.get("state") == "READY"))

    async def prepare(self, model: str, arrays: Mapping[str, Any],
                      expected: Check | None = None) -> Prepared:
        """Serialize one payload (input name -> array, full shape) in this connection's wire format."""
        # A validated payload's outputs come back in the answer, to be compared; others' go to shared memory,
        # whose regions are registered by blocking control calls: off the event loop.
        shm = (await asyncio.to_thread(self._shm.layout, model, arrays, outputs=expected is None)
               if self._shm is not None else None)
        if self.protocol is Protocol.GRPC:
            message = grpc_infer_request(model, arrays, shm)
            if self.compression is not None and self.grpc_client is GrpcClient.NATIVE:  # grpc.aio compresses itself
                return Prepared(model, compress(message, self.compression), expected=expected,
                                encoding=self.compression)
            return Prepared(model, message, expected=expected)
        body, headers = http_infer_request(arrays, shm)
        if self.compression is not None:
            body = compress(body, self.compression)
            headers = {**headers, "Content-Encoding": self.compression, "Accept-Encoding": self.compression}
        # The whole request, request line and headers included: the hot path writes it as it is.
        return Prepared(model, request_bytes(self._host, f"/v2/models/{quote(model)}/infer", body, headers),
                        headers, expected)

    def flagged(self, prepared: Prepared, flags: Flags) -> Prepared:
        """`prepared` as one step of a sequence: its correlation id and start/end flags added (a new request;
        the payload itself is not serialized again)."""
        if self.protocol is Protocol.GRPC:
            extra = grpc_sequence_parameters(flags.sequence_id, start=flags.start, end=flags.end)
            if prepared.encoding is None:
                return replace(prepared, body=prepared.body + extra)
            message = decompress(prepared.body, prepared.encoding) + extra
            return replace(prepared, body=compress(message, prepared.encoding))
        _, _, body = prepared.body.partition(b"\r\n\r\n")
        encoding = prepared.headers.get("Content-Encoding")
        if encoding is not None:
            body = decompress(body, encoding)
        split = int(prepared.headers[HTTP_HEADER_LENGTH])
        header = http_sequence_header(body[:split], flags.sequence_id, start=flags.start, end=flags.end)
        body = header + body[split:]
        if encoding is not None:
            body = compress(body, encoding)
        headers = {**prepared.headers, HTTP_HEADER_LENGTH: str(len(header))}
        return replace(prepared, body=request_bytes(self._host, f"/v2/models/{quote(prepared.model)}/infer", body,
                                                    headers), headers=headers)

    async def send(self, prepared: Prepared) -> None:
        """Send a prepared request; raise on any error the server or the transport reports."""
        if self.protocol is Protocol.GRPC:
            await self._h2.send(prepared.body, prepared.encoding)
            return
        response = await self._pool.request(prepared.body)
        if response.status != 200:
            raise HttpStatusError(response.status, response.body)

    async def infer(self, prepared: Prepared) -> dict[str, NDArray[Any]]:
        """Send a prepared request and decode the outputs of the answer (ResponseFormatError if garbled)."""
        if self.protocol is Protocol.GRPC:
            return grpc_infer_outputs(await self._h2.infer(prepared.body, prepared.encoding))
        # The request asks for plain bytes (wire.http_infer_request), or for --http-compression-algorithm's.
        response = await self._pool.request(prepared.body)
        if response.status != 200:
            raise HttpStatusError(response.status, response.body)
        body, encoding = response.body, response.headers.get("content-encoding", "identity")
        if encoding != "identity":
            asked = prepared.headers.get("Accept-Encoding", "identity")
            if encoding != asked:
                raise ResponseFormatError(f"answer is {encoding}-encoded, though {asked} was asked for")
            try:
                body = decompress(body, encoding)
            except ValueError as exc:
                raise ResponseFormatError(f"answer does not decompress: {exc}") from exc
        return http_infer_outputs(body, response.headers.get(HTTP_HEADER_LENGTH.lower()))

    def stream_message(self, prepared: Prepared) -> bytes:
        """`prepared` as a --streaming request: its ModelInferRequest (inflated if it was prepared compressed: the
        stream's channel compresses as it sends) asking for the empty final response."""
        if self.protocol is not Protocol.GRPC:
            raise PerfClientError(f"--streaming: not with -i {self.protocol} (streaming is gRPC's)")
        message = decompress(prepared.body, prepared.encoding) if prepared.encoding is not None else prepared.body
        return message + stream_parameters()

    def open_stream(self) -> Stream:
        """A new ModelStreamInfer call (opened by its first request) on this connection's grpc.aio channel: the
        --grpc-client aio channel itself, else one opened for the streams (TLS and compression as the others)."""
        if self.protocol is not Protocol.GRPC:
            raise PerfClientError(f"--streaming: not with -i {self.protocol} (streaming is gRPC's)")
        if self._stream_channel is None:
            self._stream_channel = (self._h2.channel if isinstance(self._h2, AioChannel)
                                    else open_channel(self.url, tls=self._tls, compression=self.compression))
        return Stream(self._stream_channel, timeout_s=self._timeout_s)

    async def statistics(self, model: str) -> ServerStats | None:
        """The model's cumulative counters; None when the server does not answer (best effort mid-run)."""
        try:
            if self.protocol is Protocol.GRPC:
                call = self._control.get_inference_statistics(model, as_json=True)
            else:
                call = self._control.get_inference_statistics(model)
            payload = await _bounded(call)
        except Exception as exc:  # noqa: BLE001 - a missing snapshot leaves the breakdown None
            log.debug("statistics of %s unavailable: %s", model, describe(exc))
            return None
        return parse_statistics(payload, model)


def _grpc_tls(tls: Tls | None) -> dict[str, Any]:
    """tritonclient.grpc.aio's arguments for TLS: credentials, and the name checked when --ssl-server-name."""
    if tls is None:
        return {}
    import tritonclient.grpc as grpc_client

    ca, key, chain = tls.read()
    options: list[tuple[str, Any]] = [("grpc.max_send_message_length", grpc_client.MAX_GRPC_MESSAGE_SIZE),
                                      ("grpc.max_receive_message_length", grpc_client.MAX_GRPC_MESSAGE_SIZE)]
    if tls.server_name is not None:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return {"creds": grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain),
            "channel_args": options}


def host_port(url: str) -> tuple[str, int]:
    """`-u`'s `HOST:PORT` (IPv6 as `[ADDR]:PORT`) as the socket layer wants them."""
    if "://" in url:  # tritonclient's HTTP client raised NameError on one; TLS is the --ssl-* flags' business
        raise PerfClientError(f"-u {url!r}: expected HOST:PORT without a scheme (TLS: the --ssl-grpc-* or "
                              "--ssl-https-* flags)")
    host, sep, port = url.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise PerfClientError(f"-u {url!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


async def _bounded(call: Awaitable[Any]) -> Any:
    """A control call under CONTROL_TIMEOUT_S (tritonclient's gRPC calls have no deadline by default)."""
    return await asyncio.wait_for(call, CONTROL_TIMEOUT_S)


def describe(exc: BaseException) -> str:
    """The first line of an error's own message (gRPC: the server's details), at most 200 characters."""
    text = str(exc).strip()
    if isinstance(exc, grpc.aio.AioRpcError):  # its str() is a multi-line repr; the server's words are details()
        text = f"{exc.code().name}: {exc.details() or ''}"
    lines = text.splitlines()
    if not lines:
        return type(exc).__name__
    # A long line keeps its end too: grpc-core puts the reason last (a TLS handshake's
    # '... CERTIFICATE_VERIFY_FAILED: self signed certificate' came after the first 200 characters).
    return lines[0] if len(lines[0]) <= 200 else f"{lines[0][:100]} … {lines[0][-99:]}"


# What a failed inference request raises: the transport's and the server's errors, and an answer that does
# not decode. Anything else (TypeError, KeyError, AttributeError, grpc.aio.UsageError on a closed channel…)
# is a bug of ours, never a request's outcome: callers catch only these, so a bug keeps its traceback.
# OSError covers ConnectionError and aiohttp's ClientOSError; grpc.RpcError covers grpc.aio.AioRpcError.
TRANSPORT_ERRORS: tuple[type[Exception], ...] = (
    grpc.RpcError, HttpStatusError, ResponseFormatError, aiohttp.ClientError, asyncio.TimeoutError, TimeoutError,
    OSError)


# gRPC statuses that mean no answer came from a server: none listening, or none in time.
_NO_ANSWER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def is_unreachable(exc: BaseException) -> bool:
    """Whether a control call failed to reach the server at all (refused, reset, unresolvable, timed out), as
    each transport says so: the socket layer's OSError, aiohttp's connection errors, a gRPC UNAVAILABLE or
    DEADLINE_EXCEEDED (tritonclient's gRPC client raises these as InferenceServerException)."""
    if isinstance(exc, OSError | TimeoutError | asyncio.TimeoutError | aiohttp.ClientConnectionError):
        return True
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        return code in _NO_ANSWER_CODES
    if isinstance(exc, InferenceServerException):
        return exc.status() in {str(code) for code in _NO_ANSWER_CODES}
    return False


def is_transport_error(exc: BaseException) -> bool:
    """Whether `exc` is a failed request's (error_kind labels it), not a bug in our own code."""
    return isinstance(exc, TRANSPORT_ERRORS)


# Error kinds by gRPC status and by HTTP status: the labels results count errors under.
# Every gRPC status code has its kind (Triton: NOT_FOUND = no such model, RESOURCE_EXHAUSTED = queue
# full or message too large, UNAVAILABLE = server not ready or not reachable).
_GRPC_KINDS = {
    grpc.StatusCode.UNAVAILABLE: "unavailable", grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.NOT_FOUND: "unknown_model", grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted", grpc.StatusCode.INTERNAL: "internal",
    grpc.StatusCode.UNKNOWN: "unknown", grpc.StatusCode.CANCELLED: "cancelled",
    grpc.StatusCode.UNIMPLEMENTED: "unimplemented", grpc.StatusCode.FAILED_PRECONDITION: "failed_precondition",
    grpc.StatusCode.ABORTED: "aborted", grpc.StatusCode.OUT_OF_RANGE: "out_of_range",
    grpc.StatusCode.ALREADY_EXISTS: "already_exists", grpc.StatusCode.PERMISSION_DENIED: "permission_denied",
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated", grpc.StatusCode.DATA_LOSS: "data_loss",
    grpc.StatusCode.OK: "ok_without_answer",
}
# HTTP statuses Triton (or a proxy in front of it) answers with; any other is counted as http_<status>.
_HTTP_KINDS = {400: "invalid_argument", 404: "unknown_model", 408: "timeout", 429: "resource_exhausted",
               500: "internal", 501: "unimplemented", 502: "unavailable", 503: "unavailable", 504: "timeout"}


def error_kind(exc: BaseException) -> str:
    """A short, stable label for counting a failed request, by the exception's type and status.

    Only for TRANSPORT_ERRORS: anything else is raised again as it is, with its traceback, so that a bug
    in our own code is never counted as a request error.
    """
    if not isinstance(exc, TRANSPORT_ERRORS):
        raise exc
    if isinstance(exc, grpc.RpcError):
        # grpc.aio.AioRpcError and the sync channel's errors have a code(); a bare RpcError has none.
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        if not isinstance(code, grpc.StatusCode):
            return "rpc_error"
        return _GRPC_KINDS.get(code, str(code.name).lower())
    if isinstance(exc, HttpStatusError):
        return _HTTP_KINDS.get(exc.status, f"http_{exc.status}")
    if isinstance(exc, ResponseFormatError):  # with --validate: an answer that does not decode
        return "bad_response"
    # aiohttp's ServerTimeoutError is also a connection error: test for the timeout first.
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, socket.gaierror):  # the server's name does not resolve (DNS down, pod gone)
        return "unresolvable"
    if isinstance(exc, aiohttp.ClientConnectionError | ConnectionError):
        return "unavailable"
    if isinstance(exc, aiohttp.ClientResponseError):  # an answer aiohttp itself refused (bad status line…)
        return _HTTP_KINDS.get(exc.status, f"http_{exc.status}")
    if isinstance(exc, OSError):  # the client's own system limit (EMFILE, ENOBUFS…): named by its errno
        name = errno.errorcode.get(exc.errno) if exc.errno is not None else None
        return f"os_{name.lower()}" if name else "os_error"
    return type(exc).__name__  # another aiohttp.ClientError (ClientPayloadError…): by its class
