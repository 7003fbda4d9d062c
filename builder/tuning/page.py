"""The HTML page of a tuning run: one self-contained file."""

from __future__ import annotations

import base64
import html

from builder.tuning.report import MeasuredPoint, TuneReport, energy_gaps


def html_report(report: TuneReport, png: bytes | None) -> str:
    """One self-contained page: the pick and why, the side-by-side, the plot (inline) and every point."""
    e = html.escape

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    objective = report.objective
    constraints = [f"p99 ≤ {objective.p99_budget_us / 1e3:g} ms"] if objective.p99_budget_us is not None else []
    if objective.min_throughput is not None:
        constraints.append(f"throughput ≥ {objective.min_throughput:g}/s")
    front = set(report.pareto)
    gaps = {m.label for m in energy_gaps(report)}

    def per_joule(m: MeasuredPoint) -> str:
        figure = "-" if m.infer_per_joule is None else f"{m.infer_per_joule:.2f}"
        return figure if m.label not in gaps else e(f"{figure}; {m.energy}" if m.infer_per_joule else str(m.energy))

    rows = "".join(
        f"<tr class='{'win' if report.winner == m.point else 'front' if m.label in front else ''}'>"
        f"<td>{e(m.label)}</td><td>{m.throughput:.1f}</td><td>{ms(m.p99_ms)}</td><td>{per_joule(m)}</td>"
        f"<td>{'yes' if m.feasible else 'no'}</td><td>{'yes' if m.label in front else ''}</td>"
        f"<td>{e('; '.join(filter(None, [m.failure, *m.restarts])))}</td></tr>" for m in report.points)
    compared = "".join(f"<tr><td>{e(str(c.config))}</td><td>{e(c.label)}</td><td>{c.throughput:.1f}</td>"
                       f"<td>{ms(c.p99_ms)}</td><td>{'meets' if c.feasible else 'misses'}</td></tr>"
                       for c in report.comparison)
    image = "" if png is None else ("<img alt='points and Pareto front' src='data:image/png;base64,"
                                    f"{base64.b64encode(png).decode()}'>")
    mps = (", under CUDA MPS" if report.mps else
           f", without CUDA MPS: {e(report.mps_note)}" if report.mps_note else "")
    where = (f", on {e(report.attached)}" if report.attached else "") + mps
    partial = f"<p class='partial'>Partial run: {e(report.partial)}</p>" if report.partial else ""
    winner = e(report.winner.label()) if report.winner else "none"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>trtbuild tune: {winner}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:70em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:right}}td:first-child{{text-align:left}}
tr.win{{background:#fdd}}tr.front{{background:#def}}.partial{{color:#a00;font-weight:bold}}img{{max-width:100%}}</style>
</head><body>
<h1>trtbuild tune</h1>{partial}
<p>Objective: {e(str(objective.goal))}{' under ' + e(', '.join(constraints)) if constraints else ''};
{e(str(report.search))} search, {report.measurements} measurements ({report.failed} failed) in \
{report.seconds:.0f} s{where}.</p>
<h2>Pick: {winner}</h2><p>{e(report.why)}</p>
{'<h2>Side by side (re-measured in this run)</h2><table><tr><th>configuration</th><th>point</th><th>infer/s</th>'
 '<th>p99 ms</th><th>constraints</th></tr>' + compared + '</table>' if compared else ''}
{image}
<h2>Measured points</h2><p>Red: the pick; blue: on the Pareto front (throughput against worst p99).</p>
<table><tr><th>point</th><th>infer/s</th><th>p99 ms</th><th>infer/J</th><th>feasible</th><th>Pareto</th>
<th>failure</th></tr>
{rows}</table>
</body></html>
"""
