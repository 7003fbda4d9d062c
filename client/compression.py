"""Message compression on the load path: gRPC's `grpc-encoding` and HTTP's Content-Encoding, gzip or deflate
(both protocols' "deflate" is the zlib format, RFC 1950). A request is compressed once, when prepared, and sent
as it is; answers are decompressed only where they are decoded (--validate)."""

from __future__ import annotations

import zlib

ALGORITHMS = ("gzip", "deflate")
# Bounded: an answer that inflates beyond this is refused rather than exhausting memory.
MAX_INFLATED = 1 << 31


def compress(data: bytes, algorithm: str) -> bytes:
    if algorithm == "gzip":
        stream = zlib.compressobj(6, zlib.DEFLATED, 31)  # wbits 31: the gzip wrapper
        return stream.compress(data) + stream.flush()
    if algorithm == "deflate":
        return zlib.compress(data, 6)
    raise ValueError(f"compression {algorithm!r}: expected one of {', '.join(ALGORITHMS)}")


def decompress(data: bytes, algorithm: str) -> bytes:
    """Raise ValueError when `data` is not `algorithm`'s format, or the algorithm is unknown."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{algorithm!r}-encoded, which we do not decode")
    stream = zlib.decompressobj(31 if algorithm == "gzip" else 15)
    try:
        out = stream.decompress(data, MAX_INFLATED)
    except zlib.error as exc:
        raise ValueError(f"not {algorithm} data: {exc}") from exc
    if stream.unconsumed_tail or not stream.eof:
        raise ValueError(f"{algorithm} data truncated or inflating beyond {MAX_INFLATED} bytes")
    return out
