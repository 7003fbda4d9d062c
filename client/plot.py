"""Plots: latency (p50, p99) against throughput per model; power over time where sampled.

`plot` writes both side by side as one PNG (`--plot`); `latency_figure` and `power_figure` render each
alone, as PNG or SVG bytes, for the HTML report (`--html`).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from client.session import ModelResult
from common.files import write_atomic


def _figure(width: float) -> Any:
    """A Figure of its own (no pyplot): no process-wide backend is chosen, nothing is left open."""
    from matplotlib.figure import Figure  # imported here: only --plot and --html pay for matplotlib

    return Figure(figsize=(width, 4.5))


def _traced(rows: Sequence[ModelResult]) -> list[ModelResult]:
    return [row for row in rows if row.result.power_trace]


def _draw_latency(ax: Any, rows: Sequence[ModelResult]) -> None:
    for model in dict.fromkeys(row.model for row in rows):
        points = [(row.result.summary.throughput, row.result.summary.latency_us) for row in rows
                  if row.model == model and row.result.summary.latency_us is not None]
        x = [t for t, _ in points]
        ax.plot(x, [lat.p50 / 1e3 for _, lat in points if lat], "o-", label=f"{model} p50")
        ax.plot(x, [lat.p99 / 1e3 for _, lat in points if lat], "s--", label=f"{model} p99")
    ax.set_xlabel("throughput (inferences/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title("latency vs throughput")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def _draw_power(ax: Any, traces: Sequence[ModelResult]) -> None:
    for row in traces:
        trace = row.result.power_trace
        t0 = trace[0][0]
        ax.plot([t - t0 for t, _ in trace], [w for _, w in trace], label=f"{row.model} {row.result.level.label}")
    ax.set_xlabel("seconds")
    ax.set_ylabel("watts")
    ax.set_title("power over time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def _render(fig: Any, fmt: str) -> bytes:
    fig.tight_layout()
    image = io.BytesIO()
    # SVG: no creation date in the metadata, so the same run renders the same bytes.
    fig.savefig(image, format=fmt, dpi=110, metadata={"Date": None} if fmt == "svg" else None)
    return image.getvalue()


def latency_figure(rows: Sequence[ModelResult], fmt: str = "png") -> bytes:
    """Latency vs throughput alone, as `fmt` ("png" or "svg") bytes."""
    fig = _figure(7)
    ax = fig.subplots()
    _draw_latency(ax, rows)
    return _render(fig, fmt)


def power_figure(rows: Sequence[ModelResult], fmt: str = "png") -> bytes | None:
    """Power over time alone; None when no row sampled power."""
    traces = _traced(rows)
    if not traces:
        return None
    fig = _figure(7)
    ax = fig.subplots()
    _draw_power(ax, traces)
    return _render(fig, fmt)


def plot(path: Path, rows: Sequence[ModelResult]) -> None:
    traces = _traced(rows)
    fig = _figure(12 if traces else 7)
    axes = fig.subplots(1, 2 if traces else 1, squeeze=False)
    _draw_latency(axes[0][0], rows)
    if traces:
        _draw_power(axes[0][1], traces)
    write_atomic(path, _render(fig, "png"))
