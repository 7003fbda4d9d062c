"""TLS for perfclient's connections: the load path's own clients (client.http1, client.grpc_h2) and the control
calls (tritonclient). perf_analyzer's flag names: `--ssl-grpc-*` over gRPC, `--ssl-https-*` over HTTP."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from client.errors import PerfClientError


@dataclass(frozen=True)
class Tls:
    """A TLS connection's settings.

    `ca_file`: the CAs the server's certificate must chain to (None: the system's). `cert_file`/`key_file`: a
    client certificate and its key (mutual TLS; the key may sit in `cert_file`). `server_name`: the name sent as
    SNI and checked against the server's certificate (None: the host of -u). `verify` False (perf_analyzer's
    `--ssl-https-verify-peer 0`) accepts any certificate. `flags`: the options these came from, for messages.
    """

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None
    verify: bool = True
    flags: tuple[str, str, str] = ("--ssl-ca", "--ssl-cert", "--ssl-key")

    def __post_init__(self) -> None:
        for flag, path in zip(self.flags, (self.ca_file, self.cert_file, self.key_file), strict=True):
            if path is not None and not Path(path).is_file():
                raise PerfClientError(f"{flag} {path}: no such file")
        if self.key_file is not None and self.cert_file is None:
            raise PerfClientError(f"{self.flags[2]}: a private key needs its certificate ({self.flags[1]})")

    def context(self, alpn: str) -> ssl.SSLContext:
        """A client context offering `alpn` ("h2" for gRPC, "http/1.1"); with `server_name`, every connection
        made with it sends that name and checks the certificate against it, whatever host it was opened to
        (the HTTP control calls' aiohttp session has no other way to be told)."""
        try:
            context = (ssl.create_default_context if self.server_name is None else _named(self.server_name))(
                cafile=str(self.ca_file) if self.ca_file is not None else None)
            if not self.verify:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            if self.cert_file is not None:
                context.load_cert_chain(str(self.cert_file), str(self.key_file) if self.key_file is not None else None)
        except (ssl.SSLError, OSError) as exc:
            raise PerfClientError(f"{' / '.join(self.flags)}: cannot load the TLS files ({exc})") from exc
        context.set_alpn_protocols([alpn])
        return context

    def read(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """The CA, key and certificate chain as bytes (grpc.ssl_channel_credentials' arguments)."""
        def load(path: Path | None) -> bytes | None:
            return Path(path).read_bytes() if path is not None else None
        return load(self.ca_file), load(self.key_file), load(self.cert_file)


class _NamedContext(ssl.SSLContext):
    """A client context whose connections use `server_name` for SNI and the certificate check."""

    server_name: str

    def wrap_bio(self, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO, server_side: bool = False,
                 server_hostname: str | bytes | None = None, session: ssl.SSLSession | None = None) -> ssl.SSLObject:
        return super().wrap_bio(incoming, outgoing, server_side, self.server_name, session)

    def wrap_socket(self, sock: Any, server_side: bool = False, do_handshake_on_connect: bool = True,
                    suppress_ragged_eofs: bool = True, server_hostname: str | bytes | None = None,
                    session: ssl.SSLSession | None = None) -> ssl.SSLSocket:
        return super().wrap_socket(sock, server_side, do_handshake_on_connect, suppress_ragged_eofs,
                                   self.server_name, session)


def _named(server_name: str) -> Callable[..., ssl.SSLContext]:
    def make(cafile: str | None) -> ssl.SSLContext:
        context = _NamedContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the name, as the default does
        context.server_name = server_name
        if cafile is not None:
            context.load_verify_locations(cafile)
        else:
            context.load_default_certs(ssl.Purpose.SERVER_AUTH)
        return context
    return make
