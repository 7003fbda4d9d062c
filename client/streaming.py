"""Streaming gRPC for decoupled models (`--streaming`): Triton's bidirectional ModelStreamInfer call.

A decoupled model (`model_transaction_policy { decoupled: true }`) answers a request with any number of
responses. Each closed-loop worker holds one stream (grpc.aio, raw bytes: the serialized ModelInferRequest in,
ModelStreamInferResponse out) and sends one request at a time on it, asking for an empty final response
(`triton_enable_empty_final_response`), so that the request's end is the response whose parameters carry
`triton_final_response` = true even when the model's last answer did not say so. Each request gets an id
(echoed by Triton in every response), and a response naming another id is skipped: a request that times out
drops its call (the next opens a new one), so such a response can only come after an error response that did
not end its request.

Per request: the time to the first response, the times between responses, the number of responses (the empty
final one not counted) and, as perf_analyzer counts it, the latency up to the last response that carried an
answer (not the empty final one). A request whose only response is the empty final one has no latency: it is
counted as error kind "no_response" (perf_analyzer leaves such requests out). A response with an
`error_message` ends the request as an error (kind "response_error").
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from client.wire import ResponseFormatError

STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
# The error kind of a response that carries an error_message (the stream itself stays up).
RESPONSE_ERROR = "response_error"
# The error kind of a request answered by the empty final response alone.
NO_RESPONSE = "no_response"


def stream_parameters() -> bytes:
    """Serialized request `parameters` asking for the empty final response; appended to a serialized
    ModelInferRequest they merge into it (as client.wire.grpc_sequence_parameters)."""
    request = service_pb2.ModelInferRequest()
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return bytes(request.SerializeToString())


def _request_id(number: int) -> bytes:
    return bytes(service_pb2.ModelInferRequest(id=str(number)).SerializeToString())


@dataclass(frozen=True)
class StreamTiming:
    """One streamed request: `error` kind or None; ns from its send to the first response (None when no response
    came before the final one) and between consecutive responses; the number of responses."""

    error: str | None
    first_ns: int | None = None
    gaps_ns: tuple[int, ...] = ()
    responses: int = 0
    detail: str = ""  # the server's error_message
    last_ns: int | None = None  # monotonic ns of the last response that carried an answer: the latency's end


class Stream:
    """One bidirectional ModelStreamInfer call on a grpc.aio channel, one request at a time.

    `request` raises what the transport raises (client.protocol.TRANSPORT_ERRORS; TimeoutError past the request
    timeout); after that the call is dropped and the next request opens a new one. A response with an
    error_message is no transport error: the StreamTiming's `error` says RESPONSE_ERROR."""

    def __init__(self, channel: Any, *, timeout_s: float) -> None:
        self._multicallable = channel.stream_stream(STREAM_METHOD)  # no serializers: bytes in, bytes out
        self._call: Any = None
        self._timeout_s = timeout_s
        self._number = 0

    async def request(self, message: bytes) -> StreamTiming:
        """Send `message` (a serialized ModelInferRequest with stream_parameters()) and read its responses up to
        the final one, within the request timeout."""
        self._number += 1
        try:
            return await asyncio.wait_for(self._exchange(message + _request_id(self._number), str(self._number)),
                                          self._timeout_s)
        except BaseException:  # a transport error, the timeout, a cancellation: the call's state is unknown
            self._drop()
            raise

    async def _exchange(self, message: bytes, request_id: str) -> StreamTiming:
        if self._call is None or self._call.done():  # the server may end a call between two requests
            self._call = self._multicallable()
        call = self._call
        start = time.monotonic_ns()
        try:
            await call.write(message)
        except asyncio.InvalidStateError as exc:  # grpc.aio: "RPC already finished" (ended as we wrote)
            raise ConnectionResetError(f"the stream ended before the request went out ({exc})") from exc
        first: int | None = None
        last = start
        gaps: list[int] = []
        count = 0
        while True:
            raw = await call.read()
            if raw is grpc.aio.EOF:
                code = await call.code()
                raise ConnectionResetError(f"the stream ended ({code}) before the final response")
            try:
                response = service_pb2.ModelStreamInferResponse.FromString(raw)
            except DecodeError as exc:
                raise ResponseFormatError(f"a stream response that does not decode: {exc}") from exc
            answer = response.infer_response
            if answer.id and answer.id != request_id:
                continue  # an earlier request's, which timed out
            if response.error_message:
                return StreamTiming(RESPONSE_ERROR, detail=response.error_message)
            params = answer.parameters
            final = "triton_final_response" in params and params["triton_final_response"].bool_param
            if not (final and not answer.outputs):  # the empty final response is no answer of the model's
                now = time.monotonic_ns()
                if first is None:
                    first = now - start
                else:
                    gaps.append(now - last)
                last = now
                count += 1
            if final:
                if count == 0:
                    return StreamTiming(NO_RESPONSE, detail="only the empty final response came")
                return StreamTiming(None, first, tuple(gaps), count, last_ns=last)

    def _drop(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def aclose(self, grace_s: float = 2.0) -> None:
        """End the call: no more requests, the server's end of it awaited up to `grace_s`, then cancelled."""
        call, self._call = self._call, None
        if call is None:
            return
        try:
            await asyncio.wait_for(_finish(call), grace_s)
        except (asyncio.TimeoutError, grpc.RpcError, OSError):
            call.cancel()


async def _finish(call: Any) -> None:
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass
