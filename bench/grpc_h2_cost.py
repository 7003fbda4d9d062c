"""Client CPU per request of perfclient's gRPC transports, on a trivial model: grpc.aio against client.grpc_h2.

bench/client_cost.py's method: the bundled Triton over bench/perf_compare.py's trivial model (one ONNX Add on
16 floats), the bare closed loop of each transport (no statistics, no windows) for `--seconds`, the order
alternating between rounds, requests/s and the client's CPU per request (getrusage: user + system of this
process, uvloop). The same prepared request bytes go to both.

- grpc-aio: a serializer-less grpc.aio channel (perfclient's gRPC path today);
- h2: client.grpc_h2.Channel, one HTTP/2 connection; h2x2: the same over two connections.

    python bench/grpc_h2_cost.py [--concurrency 16] [--seconds 5] [--rounds 3]
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

import grpc
import numpy as np
import uvloop
from perf_compare import trivial_model  # bench/ is sys.path[0] when run as a script

from builder.serving.triton_server import Ports, TritonServer, free_ports
from client.grpc_h2 import Channel
from client.wire import GRPC_INFER_METHOD, grpc_infer_request

Loop = Callable[[], Coroutine[Any, Any, int]]


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


def loops(body: bytes, grpc_port: int, concurrency: int, seconds: float) -> dict[str, Loop]:
    async def grpc_aio() -> int:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}", options=[
            ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
        call = channel.unary_unary(GRPC_INFER_METHOD)

        async def one() -> None:
            await call(body, timeout=10)

        try:
            return await _closed_loop(concurrency, seconds, one)
        finally:
            await channel.close()

    def h2(connections: int) -> Loop:
        async def run() -> int:
            channel = Channel("127.0.0.1", grpc_port, method=GRPC_INFER_METHOD, timeout_s=10,
                              connections=connections)
            try:
                return await _closed_loop(concurrency, seconds, lambda: channel.send(body))
            finally:
                channel.close()

        return run

    return {"grpc-aio": grpc_aio, "h2": h2(1), "h2x2": h2(2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    for flag, value in (("--concurrency", args.concurrency), ("--rounds", args.rounds)):
        if value < 1:
            print(f"grpc_h2_cost: error: {flag} {value}: expected a positive integer", file=sys.stderr)
            return 2
    if args.seconds <= 0:
        print(f"grpc_h2_cost: error: --seconds {args.seconds:g}: expected a positive number", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="grpc-h2-cost-") as tmp_name:
        tmp = Path(tmp_name)
        repository = tmp / "repository"
        repository.mkdir()
        model = trivial_model(repository)
        http, grpc_port, metrics = free_ports(3)
        server = TritonServer(repository, tmp / "state", Ports(http, grpc_port, metrics))
        server.start(timeout=120)
        body = grpc_infer_request(model, {"x": np.ones((1, 16), np.float32)})
        results: dict[str, list[tuple[float, float]]] = {}
        try:
            runs = loops(body, grpc_port, args.concurrency, args.seconds)
            uvloop.run(runs["grpc-aio"]())  # warm the server's instance up
            names = list(runs)
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
    base = statistics.median(r[1] for r in results["grpc-aio"])
    for name, rows in results.items():
        cpu = statistics.median(r[1] for r in rows)
        print(f"{name:<9} {statistics.median(r[0] for r in rows):8.0f} req/s  {cpu:6.1f} us client CPU per request"
              f"  ({base / cpu:.2f}x lighter than grpc-aio)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
