"""Why did MiniLM's FP16 variant serve slower than its FP32 on a GPU (H200 make demo, 2026-11-28: 1568 vs 5521
infer/s at concurrency 32; the NHWC layout, see docs/results/gpu.md)? In-process, through the served runner
itself (builder/repository/python_model.py's
make_runner with the config's parameters), one variant after another:

- time per run at one batch size repeated, and over a sequence of batch sizes as dynamic batching makes them
  (each size seen once before the timed pass);
- the same with prefer_nhwc forced to 1 (what `auto` resolved to for every FP16 graph before it asked for a
  convolution) and forced to 0;
- which execution provider ran each node (ONNX Runtime's profiler), and the node counts by op type.

    python bench/gpu/text_fp16.py --repository REPO [--model minilm_l6_v2] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from numpy.typing import NDArray

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from builder.repository import python_model  # the runner copied into each model folder (untyped)

RUNNER: Any = python_model

BATCHES = (1, 3, 8, 13, 21, 32, 5, 17, 32, 8)


def feed(session: ort.InferenceSession, batch: int, seq: int) -> dict[str, NDArray[Any]]:
    rng = np.random.default_rng(0)
    out = {}
    for node in session.get_inputs():
        if "int" in node.type:
            out[node.name] = (rng.integers(1000, 2000, (batch, seq)) if "ids" in node.name
                              else np.ones((batch, seq))).astype(np.int64)
        else:
            out[node.name] = rng.standard_normal((batch, seq)).astype(np.float32)
    return out


def timed(runner: Any, feeds: list[dict[str, NDArray[Any]]], repeat: int) -> list[float]:
    for f in feeds:  # every shape once before the timed pass
        runner.run(f)
    times = []
    for _ in range(repeat):
        for f in feeds:
            t0 = time.perf_counter()
            runner.run(f)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def providers(path: Path, options: dict[str, str], sample: dict[str, NDArray[Any]], out: Path) -> dict[str, Any]:
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(out / path.parent.parent.name)
    s = ort.InferenceSession(str(path), sess_options=so, providers=[("CUDAExecutionProvider", options),
                                                                     "CPUExecutionProvider"])
    for _ in range(3):
        s.run(None, sample)
    events = json.loads(Path(s.end_profiling()).read_text())
    by: collections.Counter[str] = collections.Counter()
    cpu_ops: collections.Counter[str] = collections.Counter()
    for e in events:
        args = e.get("args", {})
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            by[args.get("provider", "?")] += 1
            if args.get("provider") == "CPUExecutionProvider":
                cpu_ops[args.get("op_name", "?")] += 1
    return {"kernel_events_by_provider": dict(by), "cpu_ops": dict(cpu_ops)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repository", type=Path, required=True)
    p.add_argument("--model", default="minilm_l6_v2")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("reports/gpu"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    doc: dict[str, Any] = {"onnxruntime": ort.__version__, "rows": []}
    for precision in ("fp32", "fp16"):
        path = args.repository / f"{args.model}_{precision}" / "1" / "model.onnx"
        import onnx
        graph = onnx.load(str(path), load_external_data=False).graph
        ops = collections.Counter(n.op_type for n in graph.node)
        doc["rows"].append({"precision": precision, "ops": dict(ops.most_common(12))})
        for forced in ({}, {"prefer_nhwc": "1"}, {"prefer_nhwc": "0"}):
            params = {"provider": "cuda", "graph_kind": precision} | forced
            runner = RUNNER.make_runner(str(path), params, 32)
            sess = runner.session
            one = [feed(sess, 8, args.seq)]
            mixed = [feed(sess, b, args.seq) for b in BATCHES]
            same = timed(runner, one, args.repeat * len(BATCHES))
            varied = timed(runner, mixed, args.repeat)
            rows_per_s = sum(BATCHES) * args.repeat / (sum(varied) / 1e3)
            row = {"precision": precision, "forced": forced, "provider_options": runner.describe(),
                   "batch8_ms_median": round(statistics.median(same), 3),
                   "mixed_ms_median": round(statistics.median(varied), 3), "mixed_ms_max": round(max(varied), 3),
                   "mixed_rows_per_s": round(rows_per_s, 1)}
            if not forced:
                row |= providers(path, runner.provider_options, one[0], args.out)
            print(json.dumps(row), flush=True)
            doc["rows"].append(row)
            del runner, sess
    (args.out / "text_fp16.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
