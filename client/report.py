"""Results as a table, JSON and perf_analyzer-compatible CSV.

The typed results become plain dicts only here, at the edge; the JSON keys and shape are the
documented ones (a measurement that is missing is null, or absent where it always was).
"""

from __future__ import annotations

import csv
import dataclasses
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from client.engine import LevelResult
from client.grpc_aio import GrpcClient
from client.power import PowerFigures
from client.server_stats import ServerBreakdown
from client.session import ModelResult, SessionConfig
from client.stats import Latency, StreamFigures
from common import files

# perf_analyzer's `-f FILE --verbose-csv` columns (its default CSV is the first 13), so existing tooling reads it.
CSV_COLUMNS = [
    "Concurrency", "Inferences/Second", "Client Send", "Network+Server Send/Recv", "Server Queue",
    "Server Compute Input", "Server Compute Infer", "Server Compute Output", "Client Recv",
    "p50 latency", "p90 latency", "p95 latency", "p99 latency", "Avg latency", "request/response",
    "response wait",
]
# Appended with --streaming (perf_analyzer has no such columns): µs, and the mean responses per request.
STREAM_CSV_COLUMNS = ["p50 first response", "p99 first response", "p50 inter response", "p99 inter response",
                      "Responses/Request"]


def latency_dict(latency: Latency | None) -> dict[str, float] | None:
    return dataclasses.asdict(latency) if latency is not None else None


def stream_dict(stream: StreamFigures | None) -> dict[str, Any]:
    """--streaming's figures: first-response and inter-response latency (µs), responses per request (mean)."""
    if stream is None:
        return {"first_response_us": None, "inter_response_us": None, "responses_per_request": None}
    return {"first_response_us": latency_dict(stream.first_response_us),
            "inter_response_us": latency_dict(stream.inter_response_us),
            "responses_per_request": stream.responses_per_request}


def server_dict(server: ServerBreakdown) -> dict[str, float | None]:
    """Per-request server times and the achieved batch (the request count stays internal)."""
    return {k: v for k, v in dataclasses.asdict(server).items() if k != "requests"}


def power_dict(power: PowerFigures) -> dict[str, Any]:
    """`source`; `reason` when there is no energy; the energy figures when there is; each cross-check
    as `energy_j_from_<source>` and the integrated samples as `energy_j_from_samples` when present."""
    out: dict[str, Any] = {"source": str(power.source)}
    if power.reason is not None:
        out["reason"] = power.reason
    if power.energy_j is not None:
        out.update(avg_w=power.avg_w, energy_j=power.energy_j, j_per_infer=power.j_per_infer,
                   infer_per_j=power.infer_per_j)
    if power.energy_j_from_samples is not None:
        out["energy_j_from_samples"] = power.energy_j_from_samples
    for source, energy in power.cross_checks.items():
        if energy is not None:
            out[f"energy_j_from_{source}"] = energy
    if power.gpu_selection is not None:
        out["gpu_selection"] = power.gpu_selection  # which GPUs `energy_j` totals, and who chose them
    if power.gpus:
        out["gpus"] = [{"gpu": g.gpu, "avg_w": g.avg_w, "energy_j": g.energy_j} for g in power.gpus]
    return out


def result_dict(result: LevelResult, streaming: bool = False) -> dict[str, Any]:
    s = result.summary
    out: dict[str, Any] = {}
    if result.level.concurrency is not None:
        out["concurrency"] = result.level.concurrency
    else:
        out["request_rate"] = result.level.request_rate
        if result.level.intervals is not None:  # --request-intervals: the file replaced the distribution
            out["request_intervals"] = str(result.level.intervals.path)
        else:
            out["distribution"] = str(result.level.distribution)
        out["max_inflight"] = result.level.max_inflight
        out["late_sends"] = s.late_sends  # left a whole mean inter-arrival gap after their scheduled time
        out["dropped_sends"] = s.dropped_sends  # not sent: --max-inflight requests were already out
        out["max_send_lag_us"] = s.max_send_lag_us
    out.update({
        "throughput": s.throughput,
        "latency_us": latency_dict(s.latency_us),
        "requests": s.requests,
        "errors": dict(s.errors),
        "retries": s.retries,  # sent once more by the transport (GOAWAY, REFUSED_STREAM, idle close): not errors
        **({"streaming": stream_dict(s.stream)} if streaming else {}),
        "stable": result.stable,
        "partial": not result.complete,
        "windows": len(result.windows),
        "window_seconds": [round(w.seconds, 3) for w in result.windows],
        "server": server_dict(result.server),
        "power": power_dict(result.power),
    })
    if result.stop_reason is not None:
        out["stop_reason"] = result.stop_reason
    return out


def document(model: str, config: SessionConfig, results: Sequence[LevelResult],
             error: str | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"model": model, "protocol": str(config.protocol), "url": config.url,
                           "batch_size": config.batch, "seed": config.seed,
                           "results": [result_dict(r, config.streaming) for r in results]}
    if config.grpc_client is not GrpcClient.NATIVE:  # --grpc-client aio
        doc["grpc_client"] = str(config.grpc_client)
    if config.streaming:  # every result has its "streaming" figures
        doc["streaming"] = True
    if config.sequence is not None:  # the sequence flags given (a sequence model without them: their defaults)
        seq = config.sequence
        doc["sequence"] = {"length": seq.length, "length_variation_pct": seq.variation_pct,
                           "id_range": [seq.id_start, seq.id_end], "num_of_sequences": seq.num_sequences}
    if config.validate is not None:
        doc["validate"] = str(config.validate)  # answers checked; mismatches are counted in "errors"
    if error:
        doc["error"] = error
    return doc


def documents(config: SessionConfig, rows: Sequence[ModelResult], error: str | None = None) -> list[dict[str, Any]]:
    """One document per model measured (the first model's, empty, when nothing was)."""
    models = list(dict.fromkeys(row.model for row in rows)) or [config.models[0]]
    return [document(m, config, [row.result for row in rows if row.model == m], error) for m in models]


def write_json(path: Path, docs: Sequence[dict[str, Any]]) -> None:
    """One model: its document; several: {"runs": [...]}."""
    files.write_json(path, docs[0] if len(docs) == 1 else {"runs": list(docs)})


def _us(value: float | None) -> int | str:
    # perf_analyzer writes whole microseconds, truncated (ns / 1000 in integer arithmetic).
    return int(value) if value is not None else ""


def write_csv(path: Path, rows: Sequence[ModelResult], *, streaming: bool = False) -> None:
    """perf_analyzer's verbose CSV, rows in increasing throughput as it sorts them; a figure that was
    not measured is an empty cell.

    One model: exactly perf_analyzer's columns, which tools parse. Several (`-m A -m B`): a leading
    `Model` column, each model's rows together in the order measured, sorted by throughput within it.
    """
    models = list(dict.fromkeys(row.model for row in rows))
    named = len(models) > 1
    handle = io.StringIO()
    writer = csv.writer(handle)
    open_loop = {row.result.level.concurrency is None for row in rows}
    # Models at a concurrency and models at a rate in one file: each load under its own name, the other
    # cell empty (one shared column would call a concurrency a request rate).
    mixed = named and len(open_loop) > 1
    load_columns = (["Concurrency", "Request Rate"] if mixed
                    else ["Request Rate"] if True in open_loop else ["Concurrency"])
    # The run's --streaming decides (as the JSON's): a streamed run with no successful request keeps its columns.
    streaming = streaming or any(row.result.summary.stream is not None for row in rows)
    writer.writerow([*(["Model"] if named else []), *load_columns, *CSV_COLUMNS[1:],
                     *(STREAM_CSV_COLUMNS if streaming else [])])
    for model in models:
        results = [row.result for row in rows if row.model == model]
        for r in sorted(results, key=lambda r: r.summary.throughput):
            load, *rest = _csv_row(r)
            loads = ([load, ""] if r.level.concurrency is not None else ["", load]) if mixed else [load]
            writer.writerow([*([model] if named else []), *loads, *rest, *(_stream_cells(r) if streaming else [])])
    files.write_atomic(path, handle.getvalue())


def _csv_row(r: LevelResult) -> list[Any]:
    lat, srv = r.summary.latency_us, r.server
    total = srv.total_us
    network = max(lat.avg - total, 0.0) if lat is not None and total is not None else None
    load = r.level.concurrency if r.level.concurrency is not None else r.level.request_rate
    # Client send/recv (and gRPC's request/response marshalling, response wait) are not timed
    # apart from the whole request: empty, and the network column holds what the server's own
    # times do not explain (perf_analyzer subtracts its client send/recv there too).
    return [
        load, round(r.summary.throughput, 3), "", _us(network), _us(srv.queue_us), _us(srv.compute_input_us),
        _us(srv.compute_infer_us), _us(srv.compute_output_us), "",
        *(_us(getattr(lat, k)) if lat is not None else "" for k in ("p50", "p90", "p95", "p99", "avg")),
        "", "",
    ]


def _stream_cells(r: LevelResult) -> list[Any]:
    stream = r.summary.stream
    first = stream.first_response_us if stream is not None else None
    gaps = stream.inter_response_us if stream is not None else None
    mean = stream.responses_per_request if stream is not None else None
    return [_us(first.p50 if first else None), _us(first.p99 if first else None), _us(gaps.p50 if gaps else None),
            _us(gaps.p99 if gaps else None), round(mean, 3) if mean is not None else ""]


MISSING = "–"  # a figure that was not measured, in the table


def _fmt(value: float | None, spec: str) -> str:
    return MISSING if value is None else format(value, spec)


def _ms(latency: Latency | None, key: str) -> float | None:
    return getattr(latency, key) / 1e3 if latency is not None else None


def _stable(result: LevelResult) -> str:
    return "partial" if not result.complete else "yes" if result.stable else "no"


def table(rows: Sequence[ModelResult]) -> str:
    head = f"{'model':<28} {'load':>18} {'infer/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'avg W':>7} " \
           f"{'J/infer':>9} {'stable':>7} {'batch':>5} {'errors':>6}"
    lines = [head, "-" * len(head)]
    for row in rows:
        r = row.result
        lines.append(
            f"{row.model:<28} {r.level.label:>18} {r.summary.throughput:>9.1f} "
            f"{_fmt(_ms(r.summary.latency_us, 'p50'), '.2f'):>8} {_fmt(_ms(r.summary.latency_us, 'p99'), '.2f'):>8} "
            f"{_fmt(r.power.avg_w, '.1f'):>7} {_fmt(r.power.j_per_infer, '.4f'):>9} "
            f"{_stable(r):>7} {_fmt(r.server.avg_batch, '.1f'):>5} {sum(r.summary.errors.values()):>6}"
        )
    sources = dict.fromkeys(str(row.result.power.source) for row in rows)
    reasons = sorted({row.result.power.reason for row in rows if row.result.power.reason})
    lines.append(f"power source: {', '.join(sources)}" + (f" ({'; '.join(reasons)})" if reasons else ""))
    lines += gpu_lines(rows)
    lines += stream_lines(rows)
    return "\n".join(lines)


def stream_lines(rows: Sequence[ModelResult]) -> list[str]:
    """One line per streamed row: first-response and inter-response p50/p99 (ms), responses per request."""
    lines = []
    for row in rows:
        stream = row.result.summary.stream
        if stream is None:
            continue
        first, gaps = stream.first_response_us, stream.inter_response_us
        lines.append(f"  {row.model} {row.result.level.label} streaming: first response p50 "
                     f"{_fmt(_ms(first, 'p50'), '.2f')} p99 {_fmt(_ms(first, 'p99'), '.2f')} ms, between responses "
                     f"p50 {_fmt(_ms(gaps, 'p50'), '.2f')} p99 {_fmt(_ms(gaps, 'p99'), '.2f')} ms, "
                     f"{_fmt(stream.responses_per_request, '.2f')} responses/request")
    return lines


def gpu_lines(rows: Sequence[ModelResult]) -> list[str]:
    """Per row with GPUs metered apart: each GPU's W and J, then their total (what avg W and J/infer use)."""
    selections = dict.fromkeys(r.result.power.gpu_selection for r in rows if r.result.power.gpu_selection)
    lines = [f"GPUs metered: {s}" for s in selections]
    for row in rows:
        p = row.result.power
        if p.gpus and p.avg_w is not None and p.energy_j is not None:
            each = ", ".join(f"{g.gpu} {g.avg_w:.1f} W {g.energy_j:.1f} J" for g in p.gpus)
            lines.append(f"  {row.model} {row.result.level.label}: {each}; total {p.avg_w:.1f} W {p.energy_j:.1f} J")
    return lines
