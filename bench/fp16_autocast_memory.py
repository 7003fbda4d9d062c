"""Peak memory and time of one FP16 conversion (ModelOpt autocast) by how many samples autocast sees, each in a
process of its own (ru_maxrss is per process).

    python bench/fp16_autocast_memory.py MODEL.onnx DATA.npz [--plan 8x8,16x1,8x1,4x1] [--out DIR]

A plan entry FEEDSxBATCH gives autocast at most FEEDS feeds of BATCH samples (precision.autocast_feeds); DATA.npz
holds the samples keyed by input name (a corpus .npz). Prints one line per entry.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from builder.steps import precision


def one(model: Path, data: Path, feeds: int, batch: int, out: Path) -> dict[str, object]:
    with np.load(data) as archive:
        samples = {k: archive[k] for k in archive.files}
    chosen = precision.autocast_feeds([samples], batch, limit=feeds)
    started = time.perf_counter()
    precision.to_fp16(model, out, feeds=chosen, what=model.stem, log_file=None)
    return {"feeds": len(chosen), "batch": batch, "samples": sum(len(next(iter(f.values()))) for f in chosen),
            "peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "seconds": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("data", type=Path)
    p.add_argument("--plan", default="8x8,16x1,8x1,4x1")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        feeds, batch = (int(n) for n in args.child.split("x"))
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(one(args.model, args.data, feeds, batch, Path(tmp) / "fp16.onnx")))
        return 0
    for entry in args.plan.split(","):
        done = subprocess.run([sys.executable, __file__, str(args.model), str(args.data), "--child", entry],
                              capture_output=True, text=True, check=False)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        print(f"{entry}: {lines[-1] if lines else 'failed: ' + done.stderr.strip().splitlines()[-1:][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
