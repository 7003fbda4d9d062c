"""perfclient --html: one self-contained page (it parses, holds the figures as embedded PNGs, links to
nothing), whose table says what the JSON says, with the run's settings and tool versions."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from html.parser import HTMLParser
from importlib import metadata
from pathlib import Path

import pytest

from client.cli import main
from client.html_report import render
from client.session import LoadLevel, ModelResult, SessionConfig, run
from tests.helpers.servers import Endpoints

PNG = b"\x89PNG\r\n\x1a\n"
VOID = {"meta", "img", "br", "hr", "link", "input"}


class Page(HTMLParser):
    """Tags, attributes, table rows and text of a page; fails on a closing tag that does not match."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.rows: list[list[str]] = []
        self.text: list[str] = []
        self._cell: list[str] | None = None
        self.feed(text)
        self.close()
        assert self.stack == [], f"unclosed: {self.stack}"

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag not in VOID:
            self.stack.append(tag)
        if tag == "tr":
            self.rows.append([])
        if tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)

    def images(self) -> list[bytes]:
        out = []
        for tag, attrs in self.tags:
            if tag == "img":
                src = attrs.get("src") or ""
                assert src.startswith("data:image/png;base64,"), src[:60]
                out.append(base64.b64decode(src.split(",", 1)[1], validate=True))
        return out


def assert_self_contained(page: Page, raw: str) -> None:
    for tag, attrs in page.tags:
        assert tag not in ("script", "link", "iframe", "object", "embed"), tag
        assert "href" not in attrs, (tag, attrs)
        src = attrs.get("src")
        assert src is None or src.startswith("data:"), (tag, src)
    assert "http://" not in raw.replace("http://127.0.0.1", "") and "https://" not in raw
    assert "url(" not in raw  # no CSS that fetches anything


def test_the_page_parses_holds_the_figures_and_agrees_with_the_json(
    endpoints: Endpoints, quick_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    page_path, json_path = tmp_path / "report.html", tmp_path / "report.json"
    code = main(["-m", "mlp_fp32", "-m", "seq_fp32", "-u", endpoints.grpc, "--concurrency-range", "1:2",
                 "--shape", "ids:12", "--power-source", "none", "--html", str(page_path), "--json", str(json_path),
                 *quick_args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    raw = page_path.read_text(encoding="utf-8")
    page = Page(raw)
    assert_self_contained(page, raw)
    assert [p.name for p in tmp_path.iterdir()] != [] and not list(tmp_path.glob(".report.html.*"))  # atomic
    (latency,) = page.images()  # no power samples here: one figure, and the page says why
    assert latency.startswith(PNG)
    import matplotlib.pyplot as plt

    assert plt.imread(io.BytesIO(latency), format="png").shape[0] > 100
    assert "No power samples in this run (source: none)" in raw
    # The results table: one row per model and level, the JSON's throughput and p99.
    docs = json.loads(json_path.read_text())["runs"]
    results = {(doc["model"], f"concurrency {r['concurrency']}"): r for doc in docs for r in doc["results"]}
    head = next(row for row in page.rows if row[:2] == ["model", "load"] and "infer/s" in row)
    start = page.rows.index(head) + 1  # the results table's rows follow its head (the server table's come later)
    table = [dict(zip(head, row, strict=True)) for row in page.rows[start : start + len(results)]]
    assert {(row["model"], row["load"]) for row in table} == set(results) and len(results) == 4
    for row in table:
        want = results[(row["model"], row["load"])]
        assert row["infer/s"] == f"{want['throughput']:.1f}"
        assert row["p99 ms"] == f"{want['latency_us']['p99'] / 1e3:.2f}"
        assert row["errors"] == "0" and row["stable"] in ("yes", "no")
    # Settings and versions.
    text = " ".join(page.text)
    assert endpoints.grpc in text and "concurrency 1; concurrency 2" in text
    versions = {row[0]: row[1] for row in page.rows if len(row) == 2}
    assert versions["tritonclient"] == metadata.version("tritonclient")
    assert versions["numpy"] == metadata.version("numpy") and versions["python"].count(".") == 2


def test_a_power_trace_becomes_a_second_figure_and_a_partial_run_says_so(endpoints: Endpoints) -> None:
    from client.engine import Measurement

    config = SessionConfig(models=("mlp_fp32",), url=endpoints.grpc, levels=(LoadLevel(concurrency=1),),
                           measurement=Measurement(measurement_ms=300, stability_percentage=100, max_trials=1),
                           power_source="none")
    (row,) = run(config)
    # The run's own result, with the instant-power samples a GPU meter would have added.
    traced = ModelResult(row.model, dataclasses.replace(row.result, power_trace=((10.0, 80.0), (10.5, 120.0),
                                                                                 (11.0, 95.0))))
    raw = render(config, [traced], error="-u x: the server stopped answering")
    page = Page(raw)
    assert_self_contained(page, raw)
    latency, power = page.images()
    assert latency.startswith(PNG) and power.startswith(PNG) and latency != power
    assert "Partial run: -u x: the server stopped answering" in raw
    empty = render(config, [], error="no window completed")
    assert "No load level completed a window." in empty and not Page(empty).images()


def test_an_unwritable_html_path_is_one_line(endpoints: Endpoints, quick_args: list[str], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code = main(["-m", "mlp_fp32", "-u", endpoints.grpc, "--power-source", "none",
                 "--html", str(blocker / "report.html"), *quick_args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith(f"perfclient: error: --html {blocker / 'report.html'}")
