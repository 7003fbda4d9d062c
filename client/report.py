"""Results as a table, JSON, perf_analyzer-compatible CSV and PNG plots."""

from __future__ import annotations

import csv
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from client.engine import LevelResult

# perf_analyzer's `-f FILE --verbose-csv` columns (its default CSV is the first 13), so existing tooling reads it.
CSV_COLUMNS = [
    "Concurrency", "Inferences/Second", "Client Send", "Network+Server Send/Recv", "Server Queue",
    "Server Compute Input", "Server Compute Infer", "Server Compute Output", "Client Recv",
    "p50 latency", "p90 latency", "p95 latency", "p99 latency", "Avg latency", "request/response",
    "response wait",
]


def result_dict(result: LevelResult) -> dict[str, Any]:
    assert result.summary is not None
    s = result.summary
    out: dict[str, Any] = {}
    if result.level.concurrency is not None:
        out["concurrency"] = result.level.concurrency
    else:
        out["request_rate"] = result.level.request_rate
        out["distribution"] = result.level.distribution
        out["late_sends"] = s.late_sends
    out.update({
        "throughput": s.throughput,
        "latency_us": s.latency_us,
        "requests": s.requests,
        "errors": s.errors,
        "stable": result.stable,
        "windows": len(result.windows),
        "window_seconds": [round(w.seconds, 3) for w in result.windows],
        "server": {k: v for k, v in result.server.items() if k != "requests"},
        "power": result.power,
    })
    return out


def document(model: str, protocol: str, url: str, batch: int, results: Sequence[LevelResult],
             error: str | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"model": model, "protocol": protocol, "url": url, "batch_size": batch,
                           "results": [result_dict(r) for r in results if r.summary is not None]}
    if error:
        doc["error"] = error
    return doc


def _atomic_write(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
        write(handle)
    os.replace(tmp, path)


def write_json(path: Path, docs: list[dict[str, Any]]) -> None:
    payload: Any = docs[0] if len(docs) == 1 else {"runs": docs}
    def write(handle: Any) -> None:
        json.dump(payload, handle, indent=2)
        handle.write("\n")

    _atomic_write(path, write)


def write_csv(path: Path, results: Sequence[LevelResult]) -> None:
    def write(handle: Any) -> None:
        writer = csv.writer(handle)
        open_loop = any(r.level.concurrency is None for r in results)
        writer.writerow(["Request Rate" if open_loop else "Concurrency", *CSV_COLUMNS[1:]])
        for r in results:
            if r.summary is None:
                continue
            lat, srv = r.summary.latency_us, r.server
            server_total = sum(srv.get(k, 0.0) for k in ("queue_us", "compute_input_us", "compute_infer_us",
                                                          "compute_output_us"))
            load = r.level.concurrency if r.level.concurrency is not None else r.level.request_rate
            # Client send/recv are not timed apart from the whole request: they stay 0, and the
            # network column holds what the server's own times do not explain.
            writer.writerow([
                load, round(r.summary.throughput, 3), 0, round(max(lat["avg"] - server_total, 0.0)),
                round(srv.get("queue_us", 0.0)), round(srv.get("compute_input_us", 0.0)),
                round(srv.get("compute_infer_us", 0.0)), round(srv.get("compute_output_us", 0.0)), 0,
                round(lat["p50"]), round(lat["p90"]), round(lat["p95"]), round(lat["p99"]), round(lat["avg"]),
                0, 0,
            ])

    _atomic_write(path, write)


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: Sequence[tuple[str, LevelResult]]) -> str:
    head = f"{'model':<28} {'load':>18} {'infer/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'avg W':>7} " \
           f"{'J/infer':>9} {'stable':>6} {'batch':>5} {'errors':>6}"
    lines = [head, "-" * len(head)]
    for model, r in rows:
        if r.summary is None:
            continue
        p = r.power
        lines.append(
            f"{model:<28} {r.level.label:>18} {r.summary.throughput:>9.1f} {r.summary.latency_us['p50'] / 1e3:>8.2f} "
            f"{r.summary.latency_us['p99'] / 1e3:>8.2f} {_fmt(p.get('avg_w'), '.1f'):>7} "
            f"{_fmt(p.get('j_per_infer'), '.4f'):>9} {'yes' if r.stable else 'no':>6} "
            f"{r.server.get('avg_batch', 0.0):>5.1f} {sum(r.summary.errors.values()):>6}"
        )
    sources = {r.power.get("source") for _, r in rows}
    reasons = {str(r.power.get("reason")) for _, r in rows if r.power.get("reason")}
    lines.append(f"power source: {', '.join(str(s) for s in sources)}"
                 + (f" ({'; '.join(sorted(reasons))})" if reasons else ""))
    return "\n".join(lines)


def plot(path: Path, rows: Sequence[tuple[str, LevelResult]]) -> None:
    """Latency (p50, p99) against throughput per model; power over time when samples exist."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = [(m, r) for m, r in rows if r.power_trace]
    fig, axes = plt.subplots(1, 2 if traces else 1, figsize=(12 if traces else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    models = dict.fromkeys(m for m, _ in rows)
    for model in models:
        points = [r for m, r in rows if m == model and r.summary is not None]
        x = [r.summary.throughput for r in points if r.summary]
        ax.plot(x, [r.summary.latency_us["p50"] / 1e3 for r in points if r.summary], "o-", label=f"{model} p50")
        ax.plot(x, [r.summary.latency_us["p99"] / 1e3 for r in points if r.summary], "s--", label=f"{model} p99")
    ax.set_xlabel("throughput (inferences/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title("latency vs throughput")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    if traces:
        ax2 = axes[0][1]
        for model, r in traces:
            t0 = r.power_trace[0][0]
            ax2.plot([t - t0 for t, _ in r.power_trace], [w for _, w in r.power_trace],
                     label=f"{model} {r.level.label}")
        ax2.set_xlabel("seconds")
        ax2.set_ylabel("watts")
        ax2.set_title("power over time")
        ax2.grid(True, alpha=0.3)
        ax2.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
