"""The PNG of a tuning run: throughput against p99 (Pareto front, winner), and inferences per joule."""

from __future__ import annotations

import io
import math

from builder.tuning.points import Point, Result, mean_throughput, worst_p99


def plot_png(measured: dict[Point, list[Result]], front: list[Point], winner: Point | None) -> bytes:
    """Drawn on a Figure of its own (no pyplot): no process-wide backend is chosen, nothing is left open."""
    from matplotlib.figure import Figure  # imported here: only --plot and --html pay for matplotlib

    shown = {p: rs for p, rs in measured.items() if math.isfinite(worst_p99(rs))}
    energy = bool(shown) and all(r.infer_per_joule is not None for rs in shown.values() for r in rs)
    fig = Figure(figsize=(12 if energy else 7, 4.5))
    axes = fig.subplots(1, 2 if energy else 1, squeeze=False)
    ax = axes[0][0]
    for p, rs in shown.items():
        ax.scatter(mean_throughput(rs), worst_p99(rs) / 1e3, zorder=3,
                   c="tab:red" if p == winner else "tab:blue" if p in front else "lightgray")
    line = sorted((mean_throughput(measured[p]), worst_p99(measured[p]) / 1e3) for p in front)
    ax.plot([x for x, _ in line], [y for _, y in line], "b--", lw=1)
    ax.set_xlabel("throughput (inferences/s)")
    ax.set_ylabel("p99 latency (ms)")
    ax.set_title("measured points; blue: Pareto front, red: winner")
    ax.grid(True, alpha=0.3)
    if energy:
        ax2 = axes[0][1]
        for p, rs in shown.items():
            ax2.scatter(mean_throughput(rs), sum(r.infer_per_joule or 0.0 for r in rs) / len(rs),
                        c="tab:red" if p == winner else "tab:green")
        ax2.set_xlabel("throughput (inferences/s)")
        ax2.set_ylabel("inferences per joule")
        ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=110, format="png")
    return buffer.getvalue()
