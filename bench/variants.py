"""Benchmark every built variant on this CPU under ONNX Runtime: throughput at batch 1 and 16,
size on disk, and the accuracy figures from the build; optionally both INT8 recipes side by side.

Measurements interleave the variants round by round and report the median round, because these
machines are shared and noisy: compare ratios from one run, not figures across runs.

    python bench/variants.py [--manifest models.toml] [--repository model_repository]
                             [--threads 2] [--seconds 1.5] [--rounds 3] [--int8-recipes] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from builder.errors import BuilderError
from builder.repository import onnx_files
from builder.repository.model_folder import RECORD, read_record
from builder.runtimes.onnxruntime import OnnxRuntimeReference, ort_session, ort_throughput, run_session
from builder.spec import (
    CalibrationMethod,
    Int8Recipe,
    ModelSpec,
    Precision,
    default_cache_dir,
    load_manifest,
    variant_name,
)
from builder.steps import accuracy, cleanup, precision
from builder.steps import samples as data


def feeds(samples: dict[str, NDArray[Any]], batch: int) -> dict[str, NDArray[Any]]:
    count = len(next(iter(samples.values())))
    index = np.arange(batch) % count
    return {k: np.ascontiguousarray(v[index]) for k, v in samples.items()}


def measure(paths: dict[str, Path], samples: dict[str, NDArray[Any]], threads: int, seconds: float,
            rounds: int) -> dict[str, dict[int, float]]:
    results: dict[str, dict[int, list[float]]] = {n: {1: [], 16: []} for n in paths}
    for _ in range(rounds):
        for batch in (1, 16):
            feed = feeds(samples, batch)
            for name, path in paths.items():
                results[name][batch].append(ort_throughput(path, feed, threads, seconds))
    return {n: {b: statistics.median(v) for b, v in per.items()} for n, per in results.items()}


def recipe_comparison(spec: ModelSpec, samples: dict[str, NDArray[Any]], threads: int, seconds: float,
                      rounds: int) -> list[dict[str, Any]]:
    """Build the model's INT8 variant with each recipe and measure both beside FP32."""
    from builder.steps.export import export

    assert spec.calibration is not None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fp32 = work / "fp32.onnx"
        if spec.source:
            export(spec, fp32)
        else:
            assert spec.onnx is not None
            fp32.write_bytes(spec.onnx.read_bytes())
        cleanup.slim(fp32, data.take(samples, 0, 4), executor=OnnxRuntimeReference())  # as the build does
        calib = data.load(spec.calibration.data, "calibration")
        reference = run_session(ort_session(fp32), samples, 16)
        paths = {"fp32": fp32}
        failures = []
        for recipe in (r for r in Int8Recipe if r is not Int8Recipe.AUTO):  # "auto" is one of the others
            # Dynamic quantization calibrates nothing: one method is enough.
            for method in (CalibrationMethod if recipe is not Int8Recipe.ONNXRUNTIME_DYNAMIC else
                           [CalibrationMethod.MAX]):
                cal_spec = replace(spec.calibration, recipe=recipe, method=method)
                out = work / f"int8_{recipe}_{method}.onnx"
                try:
                    precision.to_int8(fp32, fp32_sha=onnx_files.sha256_file(fp32), calibration=calib,
                                      data_digest=data.digest(calib), spec=cal_spec, out_path=out,
                                      cache_dir=default_cache_dir(), log_file=None)
                except BuilderError as exc:
                    failures.append({"model": spec.name, "variant": f"int8 ({recipe}, {method})",
                                     "error": str(exc).split(": ", 1)[-1][:160]})
                    continue
                paths[f"int8 ({recipe}, {method})"] = out
        speed = measure(paths, samples, threads, seconds, rounds)
        rows = []
        for name, path in paths.items():
            metrics = accuracy.compare(reference, run_session(ort_session(path), samples, 16), spec.task)
            rows.append({"model": spec.name, "variant": name, "b1": speed[name][1], "b16": speed[name][16],
                         "mb": path.stat().st_size / 1e6, **asdict(metrics)})
        return rows + failures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manifest", type=Path, default=Path("models.toml"))
    p.add_argument("--repository", type=Path, default=Path("model_repository"))
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    p.add_argument("--seconds", type=float, default=1.5, help="per measurement")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    p.add_argument("--int8-recipes", action="store_true", help="also compare ModelOpt and ORT INT8 recipes")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    try:
        specs = load_manifest(args.manifest)
    except BuilderError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 1
    rows: list[dict[str, Any]] = []
    print(f"ONNX Runtime CPU, {args.threads} intra-op threads, median of {args.rounds} interleaved rounds "
          f"of {args.seconds:g} s; inputs: held-out evaluation samples")
    header = (f"{'variant':<26} {'b1 inf/s':>9} {'b16 inf/s':>9} {'vs fp32 b1':>10} {'vs fp32 b16':>11} "
              f"{'MB':>6} {'cos mean':>8} {'cos min':>8} {'top1 agr':>8} {'max abs':>8}")
    print(header)
    print("-" * len(header))
    for spec in specs:
        if spec.evaluation is None:
            continue
        samples = data.load(spec.evaluation, "evaluation")
        paths = {}
        records = {}
        for prec in spec.precisions:
            name = variant_name(spec.name, prec)
            record = read_record(args.repository / name)
            if record is None or record.runtime != "onnxruntime":
                print(f"bench: error: {args.repository / name}: expected an ONNX Runtime build; run `make engines`",
                      file=sys.stderr)
                return 1
            paths[name] = args.repository / record.artifact
            records[name] = json.loads((args.repository / name / RECORD).read_text())  # accuracy, as recorded
        speed = measure(paths, samples, args.threads, args.seconds, args.rounds)
        base = speed[variant_name(spec.name, Precision.FP32)]
        for name, per in speed.items():
            acc = records[name]["accuracy"]
            size = paths[name].stat().st_size / 1e6
            top1 = f"{acc['top1_agreement']:.3f}" if acc.get("top1_agreement") is not None else "-"
            print(f"{name:<26} {per[1]:>9.1f} {per[16]:>9.1f} {per[1] / base[1]:>9.2f}x {per[16] / base[16]:>10.2f}x "
                  f"{size:>6.1f} {acc['cosine_mean']:>8.4f} {acc['cosine_min']:>8.4f} {top1:>8} {acc['max_abs']:>8.3g}")
            rows.append({"variant": name, "b1": per[1], "b16": per[16], "mb": size, **acc})
    recipes: list[dict[str, Any]] = []
    if args.int8_recipes:
        print("\nINT8 recipes side by side (built here from the same calibration data):")
        for spec in specs:
            if spec.calibration is None or spec.evaluation is None:
                continue
            samples = data.load(spec.evaluation, "evaluation")
            for row in recipe_comparison(spec, samples, args.threads, args.seconds, args.rounds):
                if "error" in row:
                    print(f"{spec.name + ' ' + row['variant']:<44} failed: {row['error']}")
                    recipes.append(row)
                    continue
                top1 = f"{row['top1_agreement']:.3f}" if row.get("top1_agreement") is not None else "-"
                print(f"{spec.name + ' ' + row['variant']:<44} b1 {row['b1']:>7.1f}/s  b16 {row['b16']:>7.1f}/s  "
                      f"{row['mb']:>5.1f} MB  cos mean {row['cosine_mean']:.4f}  top1 {top1}")
                recipes.append(row)
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "variants": rows, "int8_recipes": recipes},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
