"""bench/corpus_steps.py: per-step build time and peak memory of a corpus run, judged against issue 23's goals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.helpers.scripts import loaded_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def script() -> Iterator[ModuleType]:
    with loaded_script("corpus_steps", ROOT / "bench" / "corpus_steps.py") as module:
        yield module


def _variant(precision: str, state: str = "built", size: float | None = 5.0) -> dict[str, Any]:
    return {"precision": precision, "state": state, "size_mb": size}


def _reports(tmp_path: Path, models: list[dict[str, Any]]) -> Path:
    (tmp_path / "repository" / "fast_int8").mkdir(parents=True)
    (tmp_path / "corpus.json").write_text(json.dumps({"models": models}))
    steps = [{"step": "MakePrecision", "seconds": 12.4, "peak_rss_mib": 900.0},
             {"step": "Guard", "seconds": 30.2, "peak_rss_mib": 1500.0}, {"step": "Gate", "seconds": 0.1,
                                                                         "peak_rss_mib": 1500.0}]
    (tmp_path / "repository" / "fast_int8" / "build.json").write_text(json.dumps({"steps": steps}))
    return tmp_path


def test_each_model_is_judged_by_time_memory_and_every_variant_built(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], script: ModuleType) -> None:
    models = [
        {"name": "fast", "build_seconds": 60.0, "peak_rss_mb": 1500.0,
         "variants": [_variant("fp32"), _variant("fp16"), _variant("int8")]},
        {"name": "hungry", "build_seconds": 60.0, "peak_rss_mb": 2100.0,  # limit 4 x 5 MB + 2048 = 2068
         "variants": [_variant("fp32"), _variant("fp16"), _variant("int8")]},
        {"name": "failed", "build_seconds": 10.0, "peak_rss_mb": 500.0,
         "variants": [_variant("fp32"), _variant("fp16"), _variant("int8", "failed", None)]},
        {"name": "large", "build_seconds": 900.0, "peak_rss_mb": 2000.0,
         "variants": [_variant("fp32", size=50.0), _variant("fp16"), _variant("int8")]},
    ]
    before = tmp_path / "before.json"
    before.write_text(json.dumps({"models": [{"name": "fast", "build_seconds": 600.0, "peak_rss_mb": 7000.0}]}))
    assert script.main([str(_reports(tmp_path / "run", models)), "--before", str(before)]) == 0
    lines = {line.split(" | ")[0].strip("| "): line for line in capsys.readouterr().out.splitlines()[2:]}
    assert "60.0 (600)" in lines["fast"] and "1500 (7000)" in lines["fast"]
    assert "time met, memory met (limit 2068)" in lines["fast"]
    assert "MakePrecision 12 s, Guard 30 s" in lines["fast"] and "Gate" not in lines["fast"].split(" | ")[6]
    assert "1500 MiB (Guard)" in lines["fast"]
    assert "memory missed" in lines["hungry"]
    assert "time missed" in lines["failed"]  # a variant not built misses the goal whatever the time
    assert "over 20 MB: time goal n/a; memory met" in lines["large"]


def test_a_folder_without_a_corpus_run_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   script: ModuleType) -> None:
    assert script.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no corpus.json" in err and str(tmp_path) in err
