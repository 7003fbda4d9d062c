"""`--html PATH`: one self-contained HTML page per run, to mail or attach to a ticket.

The results table (the JSON report's figures, so both always agree), the latency-vs-throughput and
power-over-time plots embedded as base64 PNG, the run's settings and the tool versions. Nothing is
fetched when the page opens: inline CSS, no scripts, no external links. Written atomically.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import platform
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from client.plot import latency_figure, power_figure
from client.report import result_dict
from client.session import ModelResult, SessionConfig
from common.files import write_atomic

# Packages whose versions decide what perfclient measured (the transport, the event loop, the numbers).
PACKAGES = ("trt-serve-kit", "tritonclient", "grpcio", "aiohttp", "hpack", "uvloop", "numpy", "nvidia-ml-py",
            "matplotlib")
MISSING = "–"

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f3f3f3; } td.text, th.text { text-align: left; }
.partial { color: #a00; font-weight: bold; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
"""


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any, spec: str) -> str:
    return MISSING if value is None else format(value, spec)


def _table(head: Sequence[str], rows: Iterable[Sequence[str]], *, text_columns: int = 1) -> str:
    def cell(tag: str, index: int, value: str) -> str:
        klass = ' class="text"' if index < text_columns else ""
        return f"<{tag}{klass}>{value}</{tag}>"

    lines = ["<table>", "<tr>" + "".join(cell("th", i, _esc(h)) for i, h in enumerate(head)) + "</tr>"]
    for row in rows:
        lines.append("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>")
    lines.append("</table>")
    return "\n".join(lines)


def _errors(errors: dict[str, int]) -> str:
    return _esc(", ".join(f"{kind} {count}" for kind, count in sorted(errors.items()))) if errors else "0"


def _stable(doc: dict[str, Any]) -> str:
    return "partial" if doc.get("partial") else "yes" if doc.get("stable") else "no"


def _results(rows: Sequence[ModelResult]) -> str:
    head = ["model", "load", "infer/s", "p50 ms", "p90 ms", "p95 ms", "p99 ms", "avg ms", "requests", "errors",
            "avg W", "J/infer", "batch", "stable", "windows"]
    body = []
    for row in rows:
        doc = result_dict(row.result)
        lat = doc.get("latency_us") or {}
        power = doc.get("power") or {}
        server = doc.get("server") or {}
        body.append([
            _esc(row.model), _esc(row.result.level.label), _num(doc.get("throughput"), ".1f"),
            *(_num(lat[k] / 1e3 if k in lat else None, ".2f") for k in ("p50", "p90", "p95", "p99", "avg")),
            _num(doc.get("requests"), "d"), _errors(doc.get("errors") or {}), _num(power.get("avg_w"), ".1f"),
            _num(power.get("j_per_infer"), ".4f"), _num(server.get("avg_batch"), ".1f"), _esc(_stable(doc)),
            _num(doc.get("windows"), "d"),
        ])
    return _table(head, body, text_columns=2)


def _server(rows: Sequence[ModelResult]) -> str:
    """Where a request's time went, per Triton's own statistics (µs per request)."""
    keys = sorted({key for row in rows for key in result_dict(row.result).get("server", {})})
    body = [[_esc(row.model), _esc(row.result.level.label),
             *(_num(result_dict(row.result)["server"].get(k), ".1f") for k in keys)] for row in rows]
    return _table(["model", "load", *keys], body, text_columns=2)


def _gpus(rows: Sequence[ModelResult]) -> str:
    """Each metered GPU's W and J per row, and the total over them (what avg W and J/infer above use)."""
    body = []
    for row in rows:
        power = result_dict(row.result).get("power") or {}
        for gpu in power.get("gpus") or []:
            body.append([_esc(row.model), _esc(row.result.level.label), _esc(gpu["gpu"]), _num(gpu["avg_w"], ".1f"),
                         _num(gpu["energy_j"], ".2f")])
        if power.get("gpus"):
            body.append([_esc(row.model), _esc(row.result.level.label), "<b>total</b>", _num(power.get("avg_w"), ".1f"),
                         _num(power.get("energy_j"), ".2f")])
    selections = dict.fromkeys(str(r.result.power.gpu_selection) for r in rows if r.result.power.gpu_selection)
    return (f"<p>Metered: {_esc('; '.join(selections))}.</p>\n" if selections else "") + _table(
        ["model", "load", "GPU", "avg W", "J"], body, text_columns=3)


def _figure(title: str, png: bytes) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<h2>{_esc(title)}</h2>\n<img alt="{_esc(title)}" src="data:image/png;base64,{data}">'


def _setting(value: object) -> str:
    if isinstance(value, tuple) and value and all(hasattr(v, "label") for v in value):
        return "; ".join(v.label for v in value)  # load levels
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ", ".join(f"{f.name}={getattr(value, f.name)}" for f in dataclasses.fields(value))
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or MISSING
    return MISSING if value is None else str(value)


def _settings(config: SessionConfig) -> str:
    body = [[_esc(f.name), _esc(_setting(getattr(config, f.name)))] for f in dataclasses.fields(config)]
    body.append(["metrics endpoint", _esc(config.metrics_endpoint)])
    return _table(["setting", "value"], body, text_columns=2)


def tool_versions() -> dict[str, str]:
    """Python, the platform, and each of PACKAGES' installed version (or "not installed")."""
    versions = {"python": platform.python_version(), "platform": platform.platform()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def render(config: SessionConfig, rows: Sequence[ModelResult], error: str | None = None,
           *, created: datetime | None = None) -> str:
    """The page as a string (`write_html` writes it)."""
    created = created or datetime.now(timezone.utc)
    models = ", ".join(dict.fromkeys(row.model for row in rows)) or ", ".join(config.models)
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f"<title>perfclient: {_esc(models)}</title>", f"<style>{_STYLE}</style>", "</head>", "<body>",
        f"<h1>perfclient: {_esc(models)}</h1>",
        f"<p>{_esc(created.isoformat(timespec='seconds'))} · {_esc(config.protocol)} to {_esc(config.url)}</p>",
    ]
    if error or any(not row.result.complete for row in rows):
        parts.append(f'<p class="partial">Partial run: {_esc(error or "a level was cut short")}. The figures '
                     "cover the windows that completed.</p>")
    parts += ["<h2>Results</h2>", _results(rows) if rows else "<p>No load level completed a window.</p>"]
    if rows:
        parts.append(_figure("Latency vs throughput", latency_figure(rows)))
        power = power_figure(rows)
        parts.append(_figure("Power over time", power) if power is not None else
                     "<h2>Power over time</h2><p>No power samples in this run (source: "
                     f"{_esc(', '.join(dict.fromkeys(str(r.result.power.source) for r in rows)))}).</p>")
        if any(row.result.power.gpus for row in rows):
            parts += ["<h2>Energy per GPU</h2>", _gpus(rows)]
        parts += ["<h2>Server time per request (µs)</h2>", _server(rows)]
    parts += ["<h2>Settings</h2>", _settings(config), "<h2>Tool versions</h2>",
              _table(["tool", "version"], [[_esc(k), _esc(v)] for k, v in tool_versions().items()], text_columns=2),
              "</body>", "</html>", ""]
    return "\n".join(parts)


def write_html(path: Path, config: SessionConfig, rows: Sequence[ModelResult], error: str | None = None) -> None:
    """Write the page to `path` atomically (OSError propagates: the caller names the flag)."""
    write_atomic(path, render(config, rows, error))
