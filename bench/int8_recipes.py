"""FP32 against two builds' INT8 variants of the same models (e.g. `--int8-recipe modelopt`, the recipe every
CPU build took before issue 22, and `auto`, the recipe chosen by runtime and model class), measured the way the
build's speed check measures them (builder/steps/speed.py: ONNX Runtime on this CPU, the served intra-op threads,
one feed at the opt shape, short rounds taken in turn), over several repeats with fresh sessions, with the load
average before and after each.

    python bench/int8_recipes.py --old REPO_OLD --new REPO_NEW MODEL [MODEL ...]
                                 [--repeats 3] [--rounds 5] [--seconds 0.5] [--json PATH]

REPO_NEW holds MODEL_fp32 and MODEL_int8, REPO_OLD MODEL_int8 (each with its build.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import onnx

from builder.repository.model_folder import RECORD
from builder.runtimes.onnxruntime import ort_rounds
from builder.spec.shapes import ModelShapes, ValueRange
from builder.steps import onnx_model, speed

VARIANTS = ("fp32", "int8 old", "int8 new")


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def paths(name: str, old: Path, new: Path) -> dict[str, Path]:
    found = {"fp32": new / f"{name}_fp32", "int8 old": old / f"{name}_int8", "int8 new": new / f"{name}_int8"}
    return {k: folder / "1" / "model.onnx" for k, folder in found.items()}


def recipe(folder: Path) -> str:
    """The recipe that made the variant (and the guard's nodes kept in float) and its gate figures, from build.json."""
    record = json.loads((folder / RECORD).read_text())
    settings = record["precision_settings"]
    made = "as given" if settings.get("as_given") else str(settings.get("recipe", "?"))
    if settings.get("instead_of"):
        made += f" (instead of {settings['instead_of']})"
    guard = record.get("guard") or {}
    if guard.get("excluded"):
        made += f", guard: {len(guard['excluded'])} nodes in float"
    figures = record.get("accuracy") or {}
    shown = [f"{k} {figures[k]:.4g}" for k in ("cosine_min", "top1_agreement") if figures.get(k) is not None]
    return f"{made}; {', '.join(shown)}"


def measure(name: str, old: Path, new: Path, *, repeats: int, rounds: int, seconds: float) -> dict[str, Any]:
    files = paths(name, old, new)
    record = json.loads((new / f"{name}_int8" / RECORD).read_text())
    shapes = ModelShapes.from_json(record["shapes"])
    ranges = {k: ValueRange(*v) for k, v in record["samples"]["input_ranges"].items()}
    inputs = onnx_model.signature(onnx.load(str(files["fp32"]), load_external_data=False), name).inputs
    feed, batch = speed.opt_feed(inputs, shapes, ranges)
    figures: dict[str, list[float]] = {v: [] for v in VARIANTS}
    loads = []
    for _ in range(repeats):
        before = load()
        found = ort_rounds([files[v] for v in VARIANTS], feed, batch=batch, threads=0, rounds=rounds, seconds=seconds)
        loads.append(f"{before} -> {load()}")
        for variant, values in zip(VARIANTS, found, strict=True):
            figures[variant].extend(values)
    return {"model": name, "batch": batch, "repeats": repeats, "rounds": rounds, "seconds": seconds, "loads": loads,
            "recipes": {v: recipe(files[v].parents[1]) for v in VARIANTS[1:]},
            "figures": {v: [round(f, 1) for f in values] for v, values in figures.items()}}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | batch | variant | recipe; gate figures | median infer/s | range | vs FP32 (medians) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        base = statistics.median(row["figures"]["fp32"])
        for variant in VARIANTS:
            values = row["figures"][variant]
            median = statistics.median(values)
            lines.append(f"| {row['model']} | {row['batch']} | {variant} | {row['recipes'].get(variant, '-')} | "
                         f"{median:.1f} | {min(values):.1f}–{max(values):.1f} | {median / base:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+")
    p.add_argument("--old", type=Path, required=True, help="repository with the old INT8 variants")
    p.add_argument("--new", type=Path, required=True, help="repository with FP32 and the new INT8 variants")
    p.add_argument("--repeats", type=int, default=3, help="fresh sessions each time")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per repeat")
    p.add_argument("--seconds", type=float, default=0.5, help="per round")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rows = []
    for name in args.models:
        if not all(path.is_file() for path in paths(name, args.old, args.new).values()):
            print(f"bench: error: {name}: a variant is missing from {args.old} or {args.new}", file=sys.stderr)
            return 1
        rows.append(measure(name, args.old, args.new, repeats=args.repeats, rounds=args.rounds, seconds=args.seconds))
        print(f"{name}: loads {'; '.join(rows[-1]['loads'])}", file=sys.stderr)
    print(f"ONNX Runtime CPU, default intra-op threads (as served), {args.repeats} repeats x {args.rounds} alternating "
          f"rounds of {args.seconds:g} s, one feed at the opt shape; {os.cpu_count()} CPUs")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
