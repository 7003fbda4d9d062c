"""Compression on the load path (client.compression) against the bundled Triton: gRPC requests compressed with
`grpc-encoding`, HTTP requests with Content-Encoding and answers asked for with Accept-Encoding; the outputs
equal those of uncompressed requests. (A compressed gRPC answer: test_grpc_h2.py, scripted peer.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client.cli import main, parse_config
from client.compression import compress, decompress
from client.errors import PerfClientError
from client.inputs import InputData, build_payloads
from client.protocol import Connection, Protocol
from tests.helpers.servers import Endpoints

MODEL = "mlp_fp32"


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("protocol", [Protocol.GRPC, Protocol.HTTP])
def test_compressed_requests_answer_as_plain_ones(endpoints: Endpoints, protocol: Protocol, algorithm: str) -> None:
    async def go() -> tuple[dict[str, Any], dict[str, Any], str | None]:
        url = endpoints.url(str(protocol))
        async with await Connection.open(protocol, url) as plain, \
                await Connection.open(protocol, url, compression=algorithm) as packed:
            meta = await plain.model(MODEL)
            arrays = build_payloads(meta, 1, InputData(), {})[0]
            expected = await plain.infer(await plain.prepare(MODEL, arrays))
            prepared = await packed.prepare(MODEL, arrays)
            await packed.send(prepared)
            answer_encoding = None
            if protocol is Protocol.HTTP:  # the server compressed its answer as asked
                response = await packed._pool.request(prepared.body)
                answer_encoding = response.headers.get("content-encoding")
            else:
                assert prepared.encoding == algorithm
            return expected, await packed.infer(prepared), answer_encoding

    expected, got, answer_encoding = asyncio.run(go())
    assert expected.keys() == got.keys()
    for name in expected:
        np.testing.assert_array_equal(expected[name], got[name])
    if protocol is Protocol.HTTP:
        assert answer_encoding == algorithm


def test_round_trip_and_refusals() -> None:
    data = b"perfclient" * 100
    for algorithm in ("gzip", "deflate"):
        packed = compress(data, algorithm)
        assert len(packed) < len(data) and decompress(packed, algorithm) == data
        with pytest.raises(ValueError):
            decompress(packed[:-4], algorithm)  # truncated
    with pytest.raises(ValueError):
        decompress(compress(data, "gzip"), "deflate")  # not its format
    with pytest.raises(ValueError):
        decompress(data, "br")


def test_an_unknown_algorithm_names_its_flag() -> None:
    async def go() -> None:
        await Connection.open(Protocol.GRPC, "127.0.0.1:1", compression="br")

    with pytest.raises(PerfClientError, match="--grpc-compression-algorithm br: expected one of gzip, deflate"):
        asyncio.run(go())


@pytest.mark.parametrize(("protocol", "flag"), [("grpc", "--grpc-compression-algorithm"),
                                                ("http", "--http-compression-algorithm")])
def test_perfclient_measures_with_compression(endpoints: Endpoints, protocol: str, flag: str,
                                              quick_args: list[str], tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    code = main(["-m", MODEL, "-u", endpoints.url(protocol), "-i", protocol, "--concurrency", "2", flag, "gzip",
                 "--validate-fraction", "1", "--power-source", "none", "--json", str(out), *quick_args])
    assert code == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["requests"] > 0 and result["errors"] == {}


def test_the_other_protocols_compression_flag_is_refused() -> None:
    with pytest.raises(PerfClientError, match="--http-compression-algorithm: not with -i grpc"):
        parse_config(["-m", "a", "--http-compression-algorithm", "gzip"])
    assert parse_config(["-m", "a", "-i", "http", "--http-compression-algorithm", "deflate"]).session.compression \
        == "deflate"
