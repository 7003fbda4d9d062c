"""grpc-core's client (grpc.aio) on the load path: `--grpc-client aio`, the fallback where our own HTTP/2 client
(client.grpc_h2) misbehaves against some server, and the channel that carries `--streaming`'s bidirectional calls.

The unary adapter has the surface client.protocol.Connection uses of client.grpc_h2.Channel: `send`, `infer`,
`retries`, `aclose`. Its multicallable has no serializers: the request goes out as the bytes Connection.prepare
serialized once, and the answer comes back as bytes. Compression is grpc-core's own (`compression=`), so a
message handed over already compressed (`encoding`) is inflated first; Connection does not compress for it.
"""

from __future__ import annotations

from typing import Any

import grpc

from client.compression import ALGORITHMS, decompress
from client.errors import PerfClientError
from client.tls import Tls
from common.choices import Choice

# As tritonclient's: a large tensor must not fail on grpc-core's default 4 MiB limit.
MAX_MESSAGE = 2**31 - 1
_COMPRESSION = {None: grpc.Compression.NoCompression, "gzip": grpc.Compression.Gzip,
                "deflate": grpc.Compression.Deflate}


class GrpcClient(Choice):
    """Which client carries gRPC inference requests (`--grpc-client`)."""

    NATIVE = "native"  # client.grpc_h2: our own HTTP/2 client, about a fifth of grpc.aio's CPU per request
    AIO = "aio"  # grpc-core through grpc.aio


def open_channel(url: str, *, tls: Tls | None, compression: str | None = None) -> Any:
    """A grpc.aio channel to `url` (HOST:PORT): over TLS with `tls`'s files (the name checked is
    `tls.server_name` when given), compressing every message with `compression` (gzip, deflate)."""
    if compression is not None and compression not in ALGORITHMS:
        raise PerfClientError(f"--grpc-compression-algorithm {compression}: expected one of {', '.join(ALGORITHMS)}")
    options: list[tuple[str, Any]] = [("grpc.max_send_message_length", MAX_MESSAGE),
                                      ("grpc.max_receive_message_length", MAX_MESSAGE)]
    if tls is None:
        return grpc.aio.insecure_channel(url, options=options, compression=_COMPRESSION[compression])
    ca, key, chain = tls.read()
    if tls.server_name is not None:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=chain)
    return grpc.aio.secure_channel(url, credentials, options=options, compression=_COMPRESSION[compression])


class AioChannel:
    """Unary calls of one method on one grpc.aio channel, raw bytes in and out (client.grpc_h2.Channel's surface).

    Errors are grpc-core's: grpc.aio.AioRpcError (a grpc.RpcError with `code()`, so client.protocol.error_kind
    labels it as it labels our own client's), DEADLINE_EXCEEDED on the deadline."""

    def __init__(self, url: str, *, method: str, timeout_s: float, tls: Tls | None = None,
                 compression: str | None = None) -> None:
        """Call from a running event loop (grpc.aio binds to it)."""
        self.timeout_s = timeout_s
        self.channel = open_channel(url, tls=tls, compression=compression)
        self._call = self.channel.unary_unary(method)  # no serializers: bytes in, bytes out
        # grpc-core retries transparently and does not say how often: none counted.
        self.retries = 0

    async def send(self, body: bytes, encoding: str | None = None) -> None:
        await self.infer(body, encoding)

    async def infer(self, body: bytes, encoding: str | None = None) -> bytes:
        """The answer's message bytes (grpc-core inflated a compressed one)."""
        if encoding is None:  # the channel's own compression, if any
            answer: bytes = await self._call(body, timeout=self.timeout_s)
            return answer
        answer = await self._call(decompress(body, encoding), timeout=self.timeout_s,
                                  compression=_COMPRESSION[encoding])
        return answer

    async def aclose(self) -> None:
        await self.channel.close(grace=None)
