"""PNG plots: latency (p50, p99) against throughput per model; power over time where sampled."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from client.files import write_atomic
from client.session import ModelResult


def plot(path: Path, rows: Sequence[ModelResult]) -> None:
    import matplotlib  # imported here: only --plot pays for matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = [row for row in rows if row.result.power_trace]
    fig, axes = plt.subplots(1, 2 if traces else 1, figsize=(12 if traces else 7, 4.5), squeeze=False)
    ax = axes[0][0]
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
    if traces:
        ax2 = axes[0][1]
        for row in traces:
            trace = row.result.power_trace
            t0 = trace[0][0]
            ax2.plot([t - t0 for t, _ in trace], [w for _, w in trace], label=f"{row.model} {row.result.level.label}")
        ax2.set_xlabel("seconds")
        ax2.set_ylabel("watts")
        ax2.set_title("power over time")
        ax2.grid(True, alpha=0.3)
        ax2.legend(fontsize=7)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, image.getvalue())
