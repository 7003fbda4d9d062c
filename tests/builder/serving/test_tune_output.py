"""`trtbuild tune`'s terminal output stays compact: a long search lists the Pareto front, the winner and
the failed points, and says how many more the report holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.cli import main
from tests.helpers.tiny_models import mlp_onnx

MANIFEST = '''[[model]]
name = "mlp"
onnx = "mlp.onnx"
precisions = ["fp32"]
batch = { min = 1, opt = 4, max = 8 }
'''


@pytest.mark.server
def test_a_long_search_lists_the_front_the_winner_and_says_how_many_more(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mlp_onnx(tmp_path / "mlp.onnx")
    manifest = tmp_path / "models.toml"
    manifest.write_text(MANIFEST)
    repository = tmp_path / "repository"
    assert main(["-q", "engines", "--manifest", str(manifest), "--repository", str(repository),
                 "--log", str(tmp_path / "b.log")]) == 0
    capsys.readouterr()
    report = tmp_path / "t.json"
    assert main(["tune", "mlp", "--manifest", str(manifest), "--repository", str(repository), "--report", str(report),
                 "--plot", str(tmp_path / "t.png"), "--html", str(tmp_path / "t.html"), "--precisions", "fp32",
                 "--max-batch", "1,2,4,8", "--queue-delay-us", "off,0", "--instances", "1,2", "--search",
                 "exhaustive", "--concurrency", "1", "--measurement-interval", "200", "--max-trials", "1",
                 "--no-compare", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    doc = json.loads(report.read_text())
    assert len(doc["points"]) == 16
    end = out.index(next(ln for ln in out if " search: " in ln))
    listed = [ln[:58].strip() for ln in out[1:end]]
    failed = {p["label"] for p in doc["points"] if p["failure"]}
    winner = next(ln for ln in out if ln.startswith("winner: ")).split(" not written")[0].removeprefix("winner: ")
    assert set(doc["pareto"]) | {winner} | failed == set(listed), (listed, doc["pareto"])
    assert len(listed) < 16
    assert f"({16 - len(listed)} points off it not listed)" in out[end], out[end]
