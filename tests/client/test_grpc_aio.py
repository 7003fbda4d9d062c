"""`--grpc-client aio` (client.grpc_aio): grpc-core's client on the load path, against the bundled Triton. Its
answers equal our own client's for the same prepared requests (plain and compressed), its failures get the same
error kinds, and perfclient measures with it. (Over TLS: tests/client/test_tls.py, parametrized over both.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from client.cli import main, parse_config
from client.errors import PerfClientError
from client.grpc_aio import GrpcClient
from client.inputs import InputData, build_payloads
from client.protocol import TRANSPORT_ERRORS, Connection, Protocol, error_kind
from tests.helpers.servers import Endpoints

MODEL = "mlp_fp32"
X = np.random.default_rng(0).standard_normal((2, 4, 32)).astype(np.float32)


async def _answers(url: str, client: GrpcClient, compression: str | None = None) -> list[dict[str, NDArray[Any]]]:
    async with await Connection.open(Protocol.GRPC, url, grpc_client=client, compression=compression) as conn:
        meta = await conn.model(MODEL)
        answers = []
        for arrays in build_payloads(meta, 2, InputData(), {}, np.random.SeedSequence(3)):
            prepared = await conn.prepare(MODEL, arrays)
            await conn.send(prepared)
            answers.append(await conn.infer(prepared))
        return answers


@pytest.mark.parametrize("compression", [None, "gzip", "deflate"])
def test_aio_answers_equal_the_native_clients(endpoints: Endpoints, compression: str | None) -> None:
    native = asyncio.run(_answers(endpoints.grpc, GrpcClient.NATIVE))
    aio = asyncio.run(_answers(endpoints.grpc, GrpcClient.AIO, compression))
    assert len(native) == len(aio) > 1
    for expected, got in zip(native, aio, strict=True):
        assert expected.keys() == got.keys()
        for name in expected:
            np.testing.assert_array_equal(expected[name], got[name])


async def _kind(url: str, client: GrpcClient, model: str, arrays: dict[str, NDArray[Any]]) -> str | None:
    async with await Connection.open(Protocol.GRPC, url, grpc_client=client, timeout_s=5) as conn:
        try:
            await conn.send(await conn.prepare(model, arrays))
        except TRANSPORT_ERRORS as exc:
            return error_kind(exc)
    return None


@pytest.mark.parametrize(("model", "arrays", "kind"), [
    ("no_such_model", {"x": X}, "unknown_model"),
    (MODEL, {"x": X.astype(np.int32)}, "invalid_argument"),
    (MODEL, {"x": X}, None),
])
def test_failures_get_the_native_clients_kinds(endpoints: Endpoints, dead_url: str, model: str,
                                               arrays: dict[str, NDArray[Any]], kind: str | None) -> None:
    for client in GrpcClient:
        assert asyncio.run(_kind(endpoints.grpc, client, model, arrays)) == kind, client
    assert asyncio.run(_kind(dead_url, GrpcClient.AIO, MODEL, {"x": X})) == "unavailable"


@pytest.mark.parametrize("extra", [[], ["--grpc-compression-algorithm", "gzip"]])
def test_perfclient_measures_with_the_aio_client(endpoints: Endpoints, quick_args: list[str], tmp_path: Path,
                                                 extra: list[str]) -> None:
    out = tmp_path / "r.json"
    code = main(["-m", MODEL, "-u", endpoints.grpc, "--grpc-client", "aio", "--concurrency", "2", *extra,
                 "--power-source", "none", "--json", str(out), *quick_args])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["grpc_client"] == "aio"
    (result,) = doc["results"]
    assert result["requests"] > 0 and result["errors"] == {}


def test_the_aio_client_is_refused_where_it_does_not_apply(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_config(["-m", "a"]).session.grpc_client is GrpcClient.NATIVE
    assert parse_config(["-m", "a", "--grpc-client", "aio"]).session.grpc_client is GrpcClient.AIO
    with pytest.raises(PerfClientError, match=r"^--grpc-client aio: not with -i http \(expected -i grpc\)$"):
        parse_config(["-m", "a", "-i", "http", "--grpc-client", "aio"])
    with pytest.raises(PerfClientError, match="--grpc-client aio: not with --processes 2"):
        parse_config(["-m", "a", "--grpc-client", "aio", "--processes", "2", "--concurrency", "2"])
    with pytest.raises(SystemExit) as usage:  # argparse's choices: a usage error naming both values
        main(["-m", "a", "--grpc-client", "grpcio"])
    assert usage.value.code == 2
    assert "--grpc-client: invalid choice: 'grpcio' (choose from 'native', 'aio')" in capsys.readouterr().err
