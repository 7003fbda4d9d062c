"""Client CPU per request of each transport perfclient could use, on a trivial model.

Starts the bundled Triton over the trivial model of bench/perf_compare.py (one ONNX Add on 16 floats),
then runs the bare closed loop of each transport (no statistics, no windows: only the requests) for
`--seconds`, alternating the order between rounds, and prints requests/s and the client's CPU time per
request (getrusage: user + system of this process, uvloop), with how many times lighter than grpc.aio:

- grpc-aio: a serializer-less grpc.aio channel, request bytes built once (perfclient's gRPC path before
  client.grpc_h2);
- h2: client.grpc_h2.Channel, one HTTP/2 connection (perfclient's gRPC path); h2x2: the same over two;
- http1: client.http1.Pool, whole request bytes built once (perfclient's HTTP path);
- aiohttp: an aiohttp session posting the same body (perfclient's HTTP path before client.http1).

    python bench/client_cost.py [--transports grpc-aio,h2,h2x2,http1,aiohttp] [--concurrency 16]
                                [--seconds 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import uvloop
from perf_compare import trivial_model  # bench/ is sys.path[0] when run as a script

from builder.serving.triton_server import Ports, TritonServer, free_ports
from client.grpc_h2 import Channel
from client.http1 import Pool, request_bytes
from client.wire import GRPC_INFER_METHOD, grpc_infer_request, http_infer_request

Loop = Callable[[], Coroutine[Any, Any, int]]
TRANSPORTS = ("grpc-aio", "h2", "h2x2", "http1", "aiohttp")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _closed_loop(concurrency: int, seconds: float, one: Callable[[], Awaitable[None]]) -> int:
    done = 0
    stop = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < stop:
            await one()
            done += 1

    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return done


def loops(model: str, http_port: int, grpc_port: int, concurrency: int, seconds: float) -> dict[str, Loop]:
    arrays = {"x": np.ones((1, 16), np.float32)}
    grpc_body = grpc_infer_request(model, arrays)
    body, headers = http_infer_request(arrays)
    host = f"127.0.0.1:{http_port}"
    path = f"/v2/models/{model}/infer"

    async def grpc_aio() -> int:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}", options=[
            ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
        call = channel.unary_unary(GRPC_INFER_METHOD)

        async def one() -> None:
            await call(grpc_body, timeout=10)

        try:
            return await _closed_loop(concurrency, seconds, one)
        finally:
            await channel.close()

    def h2(connections: int) -> Loop:
        async def run() -> int:
            channel = Channel("127.0.0.1", grpc_port, method=GRPC_INFER_METHOD, timeout_s=10,
                              connections=connections)
            try:
                return await _closed_loop(concurrency, seconds, lambda: channel.send(grpc_body))
            finally:
                channel.close()

        return run

    async def http1() -> int:
        pool = Pool("127.0.0.1", http_port, limit=1024, timeout_s=10)
        data = request_bytes(host, path, body, headers)

        async def one() -> None:
            if (await pool.request(data)).status != 200:
                raise RuntimeError("http1: non-200 answer")

        try:
            return await _closed_loop(concurrency, seconds, one)
        finally:
            pool.close()

    async def with_aiohttp() -> int:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024), auto_decompress=False) as s:
            url = f"http://{host}{path}"

            async def one() -> None:
                async with s.post(url, data=body, headers=headers) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError("aiohttp: non-200 answer")

            return await _closed_loop(concurrency, seconds, one)

    return {"grpc-aio": grpc_aio, "h2": h2(1), "h2x2": h2(2), "http1": http1, "aiohttp": with_aiohttp}


def _transports(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in TRANSPORTS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of {','.join(TRANSPORTS)}")
    return names


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transports", type=_transports, default=list(TRANSPORTS))
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    for flag, value in (("--concurrency", args.concurrency), ("--rounds", args.rounds)):
        if value < 1:
            print(f"client_cost: error: {flag} {value}: expected a positive integer", file=sys.stderr)
            return 2
    if args.seconds <= 0:
        print(f"client_cost: error: --seconds {args.seconds:g}: expected a positive number", file=sys.stderr)
        return 2
    names: list[str] = args.transports
    with tempfile.TemporaryDirectory(prefix="client-cost-") as tmp_name:
        tmp = Path(tmp_name)
        repository = tmp / "repository"
        repository.mkdir()
        model = trivial_model(repository)
        http, grpc_port, metrics = free_ports(3)
        server = TritonServer(repository, tmp / "state", Ports(http, grpc_port, metrics))
        server.start(timeout=120)
        results: dict[str, list[tuple[float, float]]] = {}
        try:
            runs = loops(model, http, grpc_port, args.concurrency, args.seconds)
            uvloop.run(runs[names[0]]())  # warm the server's instance up
            for round_index in range(args.rounds):
                for name in names if round_index % 2 == 0 else names[::-1]:
                    cpu0, wall0 = _cpu_s(), time.monotonic()
                    done = uvloop.run(runs[name]())
                    wall, cpu = time.monotonic() - wall0, _cpu_s() - cpu0
                    results.setdefault(name, []).append((done / wall, cpu / done * 1e6))
                    print(f"round {round_index + 1} {name:<9} {done / wall:8.0f} req/s  {cpu / done * 1e6:6.1f} us "
                          "client CPU per request", flush=True)
        finally:
            server.stop()
    print(f"\nmedians of {args.rounds} rounds, c={args.concurrency}, {args.seconds:g} s each:")
    base = statistics.median(r[1] for r in results["grpc-aio"]) if "grpc-aio" in results else None
    for name, rows in results.items():
        cpu = statistics.median(r[1] for r in rows)
        lighter = f"  ({base / cpu:.2f}x lighter than grpc-aio)" if base is not None else ""
        print(f"{name:<9} {statistics.median(r[0] for r in rows):8.0f} req/s  {cpu:6.1f} us client CPU per request"
              f"{lighter}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
