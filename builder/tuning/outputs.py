"""The files a tuning run leaves: the JSON report, the PNG plot and the HTML page."""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

from builder.tuning.page import html_report
from builder.tuning.plot import plot_png
from builder.tuning.points import Point, Result
from builder.tuning.report import TuneReport
from common.files import write_atomic, write_json

log = logging.getLogger(__name__)


def write_outputs(report: TuneReport, report_path: Path | None, plot_path: Path | None,
                   measured: dict[Point, list[Result]], front: list[Point],
                   html_path: Path | None = None) -> str | None:
    """Write the report, the plot and the HTML page; a file that cannot be written is a line returned (and logged), so
    that it neither hides an error already on its way nor stops the server's and folder's clean-up."""
    png = plot_png(measured, front, report.winner) if plot_path is not None or html_path is not None else None
    for flag, path in (("--report", report_path), ("--plot", plot_path), ("--html", html_path)):
        if path is None:
            continue
        try:
            if flag == "--report":
                write_json(path, asdict(report))
            elif flag == "--plot":
                write_atomic(path, png or b"")
            else:
                write_atomic(path, html_report(report, png))
        except OSError as exc:
            line = f"{flag} {path}: cannot write ({exc.strerror or exc})"
            log.error("tune: %s", line)
            return line
    return None
