"""`perfclient`: load a Triton model and report latency, throughput, watts and joules per inference."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from client.engine import LevelResult, LoadLevel, LoadRun, Measurement, ProgressFn, validate_levels
from client.errors import PerfClientError, RunAborted
from client.inputs import build_payloads, parse_shapes
from client.power import SOURCES, open_cross_checks, open_meter
from client.protocol import DEFAULT_PORTS, PROTOCOLS, Connection, Prepared
from client.report import document, plot, table, write_csv, write_json
from client.stats import Window

log = logging.getLogger("client")


@dataclass(frozen=True)
class PerfConfig:
    """Everything one invocation needs, validated once."""

    models: tuple[str, ...]
    url: str
    protocol: str
    levels: tuple[LoadLevel, ...]
    batch: int
    input_data: str
    shapes: dict[str, tuple[int, ...]]
    measurement: Measurement
    metrics_url: str
    power_source: str
    json_path: Path | None = None
    csv_path: Path | None = None
    plot_path: Path | None = None
    progress: bool = True
    extra: dict[str, str] = field(default_factory=dict)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="perfclient", description=__doc__)
    p.add_argument("-m", "--model", action="append", required=True,
                   help="model name (repeat to compare several models under the same load)")
    p.add_argument("-u", "--url", default=None, help="HOST:PORT (default localhost:8001 for grpc, :8000 for http)")
    p.add_argument("-i", "--protocol", default="grpc", help="grpc | http")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="closed loop: N requests in flight")
    load.add_argument("--concurrency-range", help="closed-loop sweep START:END[:STEP]")
    load.add_argument("--request-rate", type=float, help="open loop: requests per second")
    p.add_argument("--distribution", default="constant", help="open-loop arrivals: constant | poisson")
    p.add_argument("-b", "--batch-size", type=int, default=1)
    p.add_argument("--input-data", default="random", help="random | zero | FILE.npz | DIR of NAME.npy")
    p.add_argument("--shape", action="append", default=[], help="NAME:D1,D2 for dynamic dims (no batch dim)")
    p.add_argument("--measurement-interval", type=int, default=5000, help="window length in ms")
    p.add_argument("--request-count", type=int, default=0, help="close each window after N requests instead")
    p.add_argument("--stability-percentage", type=float, default=10.0)
    p.add_argument("--max-trials", type=int, default=10, help="at most N windows per load level")
    p.add_argument("--warmup", type=int, default=20, help="requests completed before measuring")
    p.add_argument("--power-source", default="auto", help=f"{' | '.join(SOURCES)}")
    p.add_argument("--metrics-url", default=None, help="Triton metrics (default http://HOST:8002/metrics)")
    p.add_argument("--json", type=Path)
    p.add_argument("--csv", type=Path)
    p.add_argument("--plot", type=Path, help="PNG: latency vs throughput, power over time")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.add_argument("-q", "--quiet", action="store_true")
    return p


def _levels(args: argparse.Namespace) -> tuple[LoadLevel, ...]:
    if args.request_rate is not None:
        levels = [LoadLevel(request_rate=args.request_rate, distribution=args.distribution)]
    elif args.concurrency_range:
        parts = args.concurrency_range.split(":")
        if len(parts) not in (2, 3) or not all(x.isdigit() for x in parts):
            raise PerfClientError(f"--concurrency-range {args.concurrency_range!r}: expected START:END[:STEP]")
        start, end, step = int(parts[0]), int(parts[1]), int(parts[2]) if len(parts) == 3 else 1
        if start < 1 or end < start or step < 1:
            raise PerfClientError(
                f"--concurrency-range {args.concurrency_range!r}: expected 1 <= START <= END, STEP >= 1"
            )
        levels = [LoadLevel(concurrency=c) for c in range(start, end + 1, step)]
    else:
        levels = [LoadLevel(concurrency=args.concurrency if args.concurrency is not None else 1)]
    validate_levels(levels)
    return tuple(levels)


def parse_config(argv: Sequence[str] | None) -> tuple[PerfConfig, argparse.Namespace]:
    args = _parser().parse_args(argv)
    if args.protocol not in PROTOCOLS:
        raise PerfClientError(f"-i {args.protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    url = args.url or f"localhost:{DEFAULT_PORTS[args.protocol]}"
    host, sep, port = url.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise PerfClientError(f"-u {url!r}: expected HOST:PORT")
    for flag, value, low in (("--measurement-interval", args.measurement_interval, 1),
                             ("--max-trials", args.max_trials, 1), ("--warmup", args.warmup, 0),
                             ("--request-count", args.request_count, 0)):
        if value < low:
            raise PerfClientError(f"{flag} {value}: expected an integer >= {low}")
    if not 0 < args.stability_percentage <= 100:
        raise PerfClientError(f"--stability-percentage {args.stability_percentage}: expected 0 < P <= 100")
    if args.power_source not in SOURCES:
        raise PerfClientError(f"--power-source {args.power_source!r}: expected one of {', '.join(SOURCES)}")
    config = PerfConfig(
        models=tuple(args.model), url=url, protocol=args.protocol, levels=_levels(args), batch=args.batch_size,
        input_data=args.input_data, shapes=parse_shapes(args.shape),
        measurement=Measurement(args.measurement_interval, args.stability_percentage, args.max_trials,
                                args.warmup, args.request_count),
        metrics_url=args.metrics_url or f"http://{host}:8002/metrics", power_source=args.power_source,
        json_path=args.json, csv_path=args.csv, plot_path=args.plot,
        progress=not args.no_progress and not args.quiet,
    )
    return config, args


def _progress(model: str) -> ProgressFn:
    tty = sys.stderr.isatty()

    def show(level: LoadLevel, index: int, w: Window) -> None:
        line = (f"{model} {level.label} window {index}: {w.throughput:.1f} infer/s, "
                f"p50 {w.latency_us['p50'] / 1e3:.2f} ms, p99 {w.latency_us['p99'] / 1e3:.2f} ms, "
                f"errors {sum(w.errors.values())}")
        print(("\r\033[K" if tty else "") + line, end="" if tty else "\n", file=sys.stderr, flush=True)

    return show


async def measure(config: PerfConfig) -> list[tuple[str, LevelResult]]:
    """Run every model at every load level; RunAborted carries what was measured before a failure."""
    rows: list[tuple[str, LevelResult]] = []
    conn = Connection(config.protocol, config.url)
    try:
        metas = [await conn.model(model) for model in config.models]
        known = {t.name for meta in metas for t in meta.inputs}
        unknown = sorted(set(config.shapes) - known)
        if unknown:
            raise PerfClientError(f"--shape {', '.join(unknown)}: not an input of {', '.join(config.models)}")
        prepared: list[tuple[str, list[Prepared]]] = []
        for meta in metas:
            shapes = {k: v for k, v in config.shapes.items() if k in {t.name for t in meta.inputs}}
            arrays = build_payloads(meta, config.batch, config.input_data, shapes)
            datatypes = {t.name: t.datatype for t in meta.inputs}
            inputs = [conn.prepare(a, datatypes) for a in arrays]
            # One request first: wrong names, shapes or dtypes fail here with the server's reason.
            try:
                await conn.infer(meta.name, inputs[0])
            except Exception as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise PerfClientError(f"-m {meta.name}: the server rejected the request: {first}") from exc
            prepared.append((meta.name, [conn.serialize(meta.name, i) for i in inputs]))
        meter = open_meter(config.power_source, config.metrics_url)
        cross_checks = open_cross_checks(meter, config.metrics_url)
        try:
            for model, requests in prepared:
                for level in config.levels:
                    run = LoadRun(conn, model, requests, config.batch, meter, config.measurement,
                                  _progress(model) if config.progress else None, cross_checks)
                    try:
                        result = await run.run(level)
                    except RunAborted as exc:
                        for r in exc.partial:
                            if r.windows:
                                r.summary = r.summary or r.windows[-1]
                                rows.append((model, r))
                        raise RunAborted(str(exc), rows) from None
                    rows.append((model, result))
                    if config.progress and sys.stderr.isatty():
                        print("\r\033[K", end="", file=sys.stderr)
        finally:
            meter.close()
            for extra in cross_checks:
                extra.close()
    finally:
        await conn.close()
    return rows


def _write_outputs(config: PerfConfig, rows: list[tuple[str, LevelResult]], error: str | None = None) -> None:
    docs = [document(m, config.protocol, config.url, config.batch, [r for mm, r in rows if mm == m], error)
            for m in dict.fromkeys(m for m, _ in rows)] or [document(config.models[0], config.protocol,
                                                                      config.url, config.batch, [], error)]
    if config.json_path:
        write_json(config.json_path, docs)
    if config.csv_path:
        write_csv(config.csv_path, [r for _, r in rows])
    if config.plot_path and rows:
        plot(config.plot_path, rows)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config, args = parse_config(argv)
    except PerfClientError as exc:
        print(f"perfclient: error: {exc}", file=sys.stderr)
        return 1
    level = logging.WARNING if args.quiet else logging.DEBUG if args.verbose > 1 else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        rows = asyncio.run(measure(config))
    except RunAborted as exc:
        rows = exc.partial
        _write_outputs(config, rows, str(exc))
        if rows:
            print(table(rows))
        print(f"perfclient: error: {exc}", file=sys.stderr)
        return 1
    except PerfClientError as exc:
        print(f"perfclient: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("perfclient: interrupted", file=sys.stderr)
        return 130
    _write_outputs(config, rows)
    print(table(rows))
    unstable = [f"{m} {r.level.label}" for m, r in rows if not r.stable]
    if unstable:
        print(f"note: not stable within ±{config.measurement.stability_percentage:g} % after "
              f"{config.measurement.max_trials} windows: {', '.join(unstable)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
