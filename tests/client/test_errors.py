"""client.protocol's error classification without a server: the transport's and the server's failures get
a kind, anything else is a bug of ours and comes back out of error_kind as it went in, traceback and all."""

from __future__ import annotations

import asyncio
import errno
import socket
import traceback

import aiohttp
import grpc
import pytest

from client.protocol import TRANSPORT_ERRORS, HttpStatusError, error_kind, is_transport_error
from client.wire import ResponseFormatError


class _SyncRpcError(grpc.RpcError):  # type: ignore[misc]  # grpc has no type stubs here
    """What the synchronous gRPC channel raises: an RpcError that is also a grpc.Call with a code()."""

    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__()
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


def _aio(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "details")


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (_aio(grpc.StatusCode.UNAVAILABLE), "unavailable"),
        (_SyncRpcError(grpc.StatusCode.NOT_FOUND), "unknown_model"),
        (grpc.RpcError(), "rpc_error"),
        (HttpStatusError(404, b'{"error":"unknown model"}'), "unknown_model"),
        (HttpStatusError(418, b""), "http_418"),
        # A ValueError, but the wire format's own: a garbled answer, not a bug.
        (ResponseFormatError("not a ModelInferResponse"), "bad_response"),
        (TimeoutError(), "timeout"),
        (asyncio.TimeoutError(), "timeout"),
        (aiohttp.ServerTimeoutError("read timed out"), "timeout"),  # also a connection error: timeout wins
        (aiohttp.ServerDisconnectedError(), "unavailable"),
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), "unavailable"),
        (ConnectionResetError(errno.ECONNRESET, "reset"), "unavailable"),
        (aiohttp.ClientResponseError(None, (), status=502), "unavailable"),  # type: ignore[arg-type]
        (OSError(errno.EMFILE, "Too many open files"), "os_emfile"),
        (OSError("no errno"), "os_error"),
        (socket.gaierror(socket.EAI_NONAME, "Name or service not known"), "unresolvable"),
        (aiohttp.ClientPayloadError("truncated body"), "ClientPayloadError"),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value),
)
def test_transport_and_server_errors_have_a_kind(exc: Exception, kind: str) -> None:
    assert is_transport_error(exc) and isinstance(exc, TRANSPORT_ERRORS)
    assert error_kind(exc) == kind


class _OurBug(Exception):
    pass


@pytest.mark.parametrize(
    "exc",
    [TypeError("unsupported operand"), AttributeError("'NoneType' object has no attribute 'send'"),
     KeyError("x"), ValueError("bad"), IndexError("list index out of range"), RuntimeError("Session is closed"),
     AssertionError(), _OurBug()],
    ids=lambda exc: type(exc).__name__,
)
def test_anything_else_is_raised_again_unchanged(exc: Exception) -> None:
    assert not is_transport_error(exc)
    with pytest.raises(type(exc)) as raised:
        error_kind(exc)
    assert raised.value is exc  # the same object: its type and message, not a wrapper


def test_a_bug_raised_again_keeps_its_own_traceback() -> None:
    def send_with_a_bug() -> None:
        payload: dict[str, bytes] = {}
        payload["missing"]  # the bug under test: a KeyError

    def request() -> str | None:
        # How engine._request used it: every exception through error_kind.
        try:
            send_with_a_bug()
        except Exception as exc:  # noqa: BLE001 - the pattern under test
            return error_kind(exc)
        return None

    with pytest.raises(KeyError) as raised:
        request()
    frames = [frame.name for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert "send_with_a_bug" in frames  # where the bug is, not only where it was classified


def test_grpc_channel_misuse_is_a_bug() -> None:
    # grpc.aio.UsageError (a call on a closed channel) is our lifecycle's fault, not the server's.
    exc = grpc.aio.UsageError("Channel is closed")
    assert not is_transport_error(exc)
    with pytest.raises(grpc.aio.UsageError):
        error_kind(exc)
