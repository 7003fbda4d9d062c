"""The accuracy guard on a real model: plain INT8 vs guarded INT8 vs FP32 under a stricter INT8
tolerance than models.toml's, with agreement, size and batch-1 CPU throughput of each.

    python bench/guard_real.py [--model efficientnet_lite0] [--top1 0.85] [--cosine-mean 0.98] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from builder.pipeline import BuildOptions, build_all
from builder.runtimes import OnnxRuntimeCPU
from builder.spec import Precision, Tolerance, default_cache_dir, load_manifest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manifest", type=Path, default=Path("models.toml"))
    p.add_argument("--model", default="efficientnet_lite0")
    p.add_argument("--top1", type=float, default=None, help="top1_agreement_min for int8")
    p.add_argument("--cosine-mean", type=float, default=None, help="cosine_mean_min for int8")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    spec = {s.name: s for s in load_manifest(args.manifest)}[args.model]
    tolerance = Tolerance(top1_agreement_min=args.top1, cosine_mean_min=args.cosine_mean)
    spec = replace(spec, precisions=(Precision.FP32, Precision.INT8),
                   tolerances={**spec.tolerances, Precision.INT8: tolerance})
    with tempfile.TemporaryDirectory() as tmp:
        options = BuildOptions(repository=Path(tmp) / "repo", runtime=OnnxRuntimeCPU(),
                               cache_dir=default_cache_dir(), force=True)
        (result,) = build_all([spec], options, None, ["bench/guard_real.py"])
    int8 = result.variants[1]
    guard = int8.guard
    print(f"{spec.name}: INT8 tolerance {tolerance}")
    if guard is None:
        print("plain INT8 already meets it; nothing to guard")
        return 0
    speed, size = guard.throughput_b1_cpu, guard.size_bytes
    before = guard.before
    reference = replace(before, cosine_mean=1.0, top1_agreement=None if before.top1_agreement is None else 1.0)
    rows = [("fp32", reference, speed.fp32, size.fp32),
            ("int8 plain", before, speed.int8_plain, size.int8_plain),
            ("int8 guarded" if not guard.fallback else "fp16 fallback", int8.accuracy, speed.int8_guarded,
             size.int8_guarded)]
    print(f"{'variant':<16} {'cos mean':>8} {'top1 agr':>8} {'b1 inf/s':>9} {'MB':>6}")
    for label, acc, per_s, size_bytes in rows:
        top1_text = "-" if acc.top1_agreement is None else f"{acc.top1_agreement:.3f}"
        print(f"{label:<16} {acc.cosine_mean:>8.4f} {top1_text:>8} {per_s:>9.1f} {size_bytes / 1e6:>6.1f}")
    print(f"kept in higher precision ({len(guard.excluded)}): {', '.join(guard.excluded) or '-'}")
    print(f"quantizations built: {guard.quantizations}, candidates derived from the plain INT8: {guard.derived} "
          f"({len(guard.most_sensitive)} shown most sensitive), "
          f"search steps: {[(s.excluded, s.passes) for s in guard.search]}, {guard.seconds:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(asdict(guard), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
