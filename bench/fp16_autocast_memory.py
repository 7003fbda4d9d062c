"""Peak memory and time of one FP16 conversion (ModelOpt autocast) by how many samples autocast sees, each in a
process of its own (ru_maxrss is per process).

    python bench/fp16_autocast_memory.py MODEL.onnx DATA.npz [--plan 8x8,16x1,8x1,4x1] [--runners streaming,modelopt]
        [--rounds 1]

A plan entry FEEDSxBATCH gives autocast at most FEEDS feeds of BATCH samples (precision.autocast_feeds; BATCH w:
whole samples, for a model that does not batch, e.g. a fixed 1x3x800x608 input); DATA.npz
holds the samples keyed by input name (a corpus .npz). `--runners`: the reference run autocast decides by, ours one
feed at a time (builder.steps.fp16_ranges, the product's) or ModelOpt's own (every feed's tensors held at once);
each round runs every runner in turn. Prints one line per entry, runner and round.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from builder.steps import fp16_ranges, precision


def one(model: Path, data: Path, feeds: int, batch: int | None, out: Path, runner: str) -> dict[str, object]:
    if runner == "modelopt":
        fp16_ranges.streaming = contextlib.nullcontext  # type: ignore[assignment]  # ModelOpt's own runner
    with np.load(data) as archive:
        samples = {k: archive[k] for k in archive.files}
    chosen = precision.autocast_feeds([samples], batch, limit=feeds)
    started = time.perf_counter()
    precision.to_fp16(model, out, feeds=chosen, what=model.stem, log_file=None)
    return {"runner": runner, "feeds": len(chosen), "batch": batch,
            "samples": sum(len(next(iter(f.values()))) for f in chosen),
            "peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            # Which nodes autocast kept in FP32 shows in the graph: the same ranges give the same graph.
            "graph_sha256": hashlib.sha256(out.read_bytes()).hexdigest()[:12],
            "seconds": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("data", type=Path)
    p.add_argument("--plan", default="8x8,16x1,8x1,4x1")
    p.add_argument("--runners", default="streaming,modelopt")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        entry, runner = args.child.split(":")
        count, size = entry.split("x")
        feeds, batch = int(count), (None if size == "w" else int(size))
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(one(args.model, args.data, feeds, batch, Path(tmp) / "fp16.onnx", runner)))
        return 0
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for round_ in range(1, args.rounds + 1):
        for entry in args.plan.split(","):
            for runner in args.runners.split(","):
                done = subprocess.run([sys.executable, __file__, str(args.model), str(args.data),
                                       "--child", f"{entry}:{runner}"], capture_output=True, text=True, check=False)
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                failed = "failed: " + (done.stderr.strip().splitlines() or ["?"])[-1]
                print(f"round {round_} {entry} {runner}: {lines[-1] if lines else failed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
