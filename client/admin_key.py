"""The header that opens a Triton's restricted APIs (model repository, shared memory, logging, trace).

`trtbuild serve --listen`, the docker compose file and the Kubernetes Deployment restrict them with
`--http-restricted-api=...:triton-admin-key=<key>` and `--grpc-restricted-protocol=...`. Over HTTP Triton
checks the header `triton-admin-key`; over gRPC it checks `triton-grpc-protocol-triton-admin-key` (its
gRPC frontend prefixes the name; seen on 2.51). Clients take the key from $TRITON_ADMIN_KEY (never from
their command line, which every local user can read), or a header given perf_analyzer's way, `-H NAME:VALUE`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from client.errors import PerfClientError

KEY_ENV = "TRITON_ADMIN_KEY"
KEY_HEADER = "triton-admin-key"
GRPC_KEY_HEADER = f"triton-grpc-protocol-{KEY_HEADER}"
_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def key_header(protocol: str) -> str:
    return GRPC_KEY_HEADER if protocol == "grpc" else KEY_HEADER


def parse_header(text: str, flag: str = "-H") -> tuple[str, str]:
    """perf_analyzer's `-H 'NAME:VALUE'`: a token name, a value without line breaks."""
    name, sep, value = text.partition(":")
    name, value = name.strip(), value.strip()
    if not sep or not name or not set(name) <= _TOKEN or "\r" in value or "\n" in value or "\0" in value:
        raise PerfClientError(f"{flag} {name or text!r}: expected NAME:VALUE, NAME letters, digits and -_.")
    return name.lower(), value


def request_headers(protocol: str, given: Sequence[str] = (), environ: Mapping[str, str] | None = None,
                    flag: str = "-H") -> tuple[tuple[str, str], ...]:
    """The headers for control requests: each `-H`, and the admin key of $TRITON_ADMIN_KEY under the
    protocol's header name unless a -H already sets that name."""
    headers = dict(parse_header(text, flag) for text in given)
    key = (os.environ if environ is None else environ).get(KEY_ENV, "").strip()
    if key:
        headers.setdefault(key_header(protocol), key)
    return tuple(headers.items())
