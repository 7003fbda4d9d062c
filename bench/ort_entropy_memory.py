"""Peak memory and time of ONNX Runtime's INT8 entropy calibration: ONNX Runtime's one-shot collection against the
product's streamed one (builder/steps/ort_calibration.py), each in a process of its own (ru_maxrss is per
process), alternating, and whether the two Q/DQ graphs are the same.

    python bench/ort_entropy_memory.py MODEL.onnx DATA.npz [--rounds 3] [--samples N]

DATA.npz holds the samples keyed by input name (a corpus .npz: `.cache/corpus/data/NAME.npz` after `make corpus`).
Each run is the product's quantizer subprocess (`python -m builder.steps.precision JOB`) as an INT8 build starts
it with the CPU runtime; "one-shot" is the same worker without the streamed ranges, so that quantize_static
calibrates by itself with ONNX Runtime's own calibrator (every sample's activations held until the last has run),
as the worker did before. Prints one line per round and mode, then the medians.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from builder.steps import int8_recipe, precision

_CHILD = r"""
import json, resource, sys, time
from pathlib import Path
from builder.steps import ort_calibration, precision

mode, job = sys.argv[1], sys.argv[2]
if mode == "one-shot":
    # The worker as it was before the streamed calibration: no ranges file, so quantize_static calibrates by
    # itself with ONNX Runtime's own HistogramCalibrater (and only then writes the file).
    ort_calibration.entropy_ranges = lambda *args, **kwargs: None
    ort_calibration.save_ranges = lambda *args, **kwargs: None
started = time.perf_counter()
precision._ort_quantize_worker(job)
print(json.dumps({"seconds": time.perf_counter() - started,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run(mode: str, model: Path, samples: Path, whole: bool, work: Path) -> dict[str, object]:
    tmp = Path(tempfile.mkdtemp(dir=work))
    out = tmp / "int8.onnx"
    job = tmp / "job.json"
    job.write_text(json.dumps({"fp32": str(model), "samples": str(samples), "tmp": str(tmp), "out": str(out),
                               "method": "entropy", "op_types_to_quantize": [], "dynamic": False,
                               "form": asdict(precision.ort_form(int8_recipe.CPU_RUNTIME)),
                               "nodes_to_exclude": [], "nodes_to_quantize": [], "external": False,
                               "whole": whole}))
    proc = subprocess.run([sys.executable, "-c", _CHILD, mode, str(job)], capture_output=True, text=True,
                          check=False, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        sys.exit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    figures: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    figures["graph_sha256"] = hashlib.sha256(out.read_bytes()).hexdigest()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("data", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=None, help="use only the first N samples")
    args = parser.parse_args()
    model = args.model.resolve()
    with np.load(args.data) as archive:
        calibration = {k: archive[k][: args.samples] for k in archive.files}
    count = len(next(iter(calibration.values())))
    whole = precision._whole_samples(model, calibration)
    with tempfile.TemporaryDirectory(prefix="ort-entropy-bench-") as work:
        samples = Path(work) / "calibration.npz"
        np.savez(samples, **calibration)
        print(f"{model.name}: {count} samples ({'whole' if whole else 'batch 1'}), "
              f"{model.stat().st_size / 2**20:.1f} MiB", flush=True)
        results: dict[str, list[dict[str, object]]] = {"one-shot": [], "streamed": []}
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        for r in range(args.rounds):
            for mode in (("one-shot", "streamed") if r % 2 == 0 else ("streamed", "one-shot")):
                figures = run(mode, model, samples, whole, Path(work))
                results[mode].append(figures)
                print(f"round {r + 1} {mode:9s} peak {figures['peak_mib']:8.0f} MiB  {figures['seconds']:7.1f} s  "
                      f"graph {str(figures['graph_sha256'])[:12]}", flush=True)
        for mode, rows in results.items():
            peaks = [float(str(f["peak_mib"])) for f in rows]
            secs = [float(str(f["seconds"])) for f in rows]
            print(f"{mode:9s} median peak {statistics.median(peaks):8.0f} MiB ({min(peaks):.0f}-{max(peaks):.0f}), "
                  f"median {statistics.median(secs):.1f} s ({min(secs):.1f}-{max(secs):.1f})")
        graphs = {str(f["graph_sha256"]) for rows in results.values() for f in rows}
        print(f"same Q/DQ graph in every run: {'yes' if len(graphs) == 1 else 'NO'}; started {started}")


if __name__ == "__main__":
    main()
