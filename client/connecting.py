"""Opening a TCP connection for the load path's own clients (client.http1, client.grpc_h2)."""

from __future__ import annotations

import asyncio
import ssl as _ssl
from collections.abc import Callable
from typing import TypeVar

P = TypeVar("P", bound=asyncio.BaseProtocol)


class ConnectFailedError(ConnectionError):
    """No address of the server's name accepted a connection."""


async def connect(factory: Callable[[], P], host: str, port: int, *, ssl: _ssl.SSLContext | None = None,
                  server_hostname: str | None = None) -> P:
    """`loop.create_connection`, whose failures are all errors a request can be counted under.

    With `ssl`, over TLS (`server_hostname`: the SNI name and the name checked; None: `host`); a failed handshake
    (certificate refused, no common protocol) is a ConnectFailedError too, never an errno-less OSError.

    When every address of a name fails (`localhost` as ::1 and 127.0.0.1, on a plain asyncio loop) asyncio
    raises a bare OSError("Multiple exceptions: ...") with no errno left to classify by; the server could
    not be reached, so it becomes a ConnectionError (counted `unavailable`).
    """
    try:
        if ssl is None:
            _, protocol = await asyncio.get_running_loop().create_connection(factory, host, port)
        else:
            _, protocol = await asyncio.get_running_loop().create_connection(
                factory, host, port, ssl=ssl, server_hostname=server_hostname or host)
    except _ssl.SSLError as exc:
        raise ConnectFailedError(f"TLS with {host}:{port} failed: {exc}") from exc
    except OSError as exc:
        if type(exc) is OSError and exc.errno is None:
            raise ConnectFailedError(f"cannot connect to {host}:{port}: {exc}") from exc
        raise
    return protocol
