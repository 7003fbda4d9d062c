"""Build time and peak memory per step for every model of a corpus run, against issue 23's goals, and against
an earlier run where one is given: each variant's steps as its build.json records them (seconds, the build
process's peak RSS when the step ended), the model's whole build and peak RSS as corpus.py measured them.

    python bench/corpus_steps.py REPORTS_DIR [--before OLD_CORPUS_JSON] [--out FILE.md]

REPORTS_DIR is what `make corpus` writes (reports/corpus: corpus.json and repository/). Goals (issue 23), for a
model under 20 MB: all three precisions in at most 300 s, and a peak RSS of at most 4x the model plus 2 GB.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

GOAL_SECONDS = 300.0
SMALL_MB = 20.0


def memory_goal_mb(model_mb: float) -> float:
    return 4 * model_mb + 2048


def steps_line(record: dict[str, Any]) -> str:
    """`MakePrecision 2 s, Guard 30 s, ...`: the steps that took a second or more, in order (Gate's time includes
    the guard it ran)."""
    parts = [f"{s['step']} {s['seconds']:.0f} s" for s in record.get("steps", []) if s.get("seconds", 0) >= 1]
    return ", ".join(parts) or "all under 1 s"


def peak_step(record: dict[str, Any]) -> str:
    steps = record.get("steps", [])
    if not steps:
        return "-"
    top = max(steps, key=lambda s: s.get("peak_rss_mib", 0))
    return f"{top['peak_rss_mib']:.0f} MiB ({top['step']})"


def rows(reports: Path, before: dict[str, dict[str, Any]]) -> list[str]:
    doc = json.loads((reports / "corpus.json").read_text())
    out = ["| model | FP32 MB | build s (before) | peak RSS MB (before) | goals: ≤300 s, ≤4x+2 GB | "
           "FP16 steps ≥1 s | INT8 steps ≥1 s | highest step RSS |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for model in doc["models"]:
        name = model["name"]
        variants = {v["precision"]: v for v in model["variants"]}
        size = (variants.get("fp32") or {}).get("size_mb")
        old = before.get(name)
        seconds = model.get("build_seconds")
        rss = model.get("peak_rss_mb")
        was_s = f" ({old['build_seconds']:.0f})" if old and old.get("build_seconds") is not None else ""
        was_rss = f" ({old['peak_rss_mb']:.0f})" if old and old.get("peak_rss_mb") is not None else ""
        if size is None or seconds is None or rss is None:
            goals = "-"
        elif size >= SMALL_MB:
            memory = "met" if rss <= memory_goal_mb(size) else "missed"
            goals = f"over {SMALL_MB:.0f} MB: time goal n/a; memory {memory}"
        else:
            time_ok = seconds <= GOAL_SECONDS and all(v["state"] == "built" for v in model["variants"])
            goals = (f"time {'met' if time_ok else 'missed'}, memory "
                     f"{'met' if rss <= memory_goal_mb(size) else 'missed'} (limit {memory_goal_mb(size):.0f})")
        records = {}
        for precision in ("fp16", "int8"):
            path = reports / "repository" / f"{name}_{precision}" / "build.json"
            records[precision] = json.loads(path.read_text()) if path.is_file() else None
        fp16 = steps_line(records["fp16"]) if records["fp16"] else variants.get("fp16", {}).get("state", "-")
        int8 = steps_line(records["int8"]) if records["int8"] else variants.get("int8", {}).get("state", "-")
        highest = max((peak_step(r) for r in records.values() if r), key=lambda t: float(t.split()[0])
                      if t != "-" else 0.0, default="-")
        shown = (f"{size if size is not None else '-'} | {seconds if seconds is not None else '-'}{was_s} | "
                 f"{f'{rss:.0f}' if rss is not None else '-'}{was_rss}")
        out.append(f"| {name} | {shown} | {goals} | {fp16} | {int8} | {highest} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", type=Path)
    p.add_argument("--before", type=Path, help="an earlier run's corpus.json")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not (args.reports / "corpus.json").is_file():
        print(f"corpus_steps: {args.reports}: no corpus.json (expected what `make corpus` writes)", file=sys.stderr)
        return 2
    before = {m["name"]: m for m in json.loads(args.before.read_text())["models"]} if args.before else {}
    text = "\n".join(rows(args.reports, before)) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
