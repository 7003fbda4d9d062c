"""bench_ort.py's served figures with and without CUDA MPS, alternating, on one GPU.

    python bench/gpu/mps_compare.py --out DIR [--rounds 2] -- BENCH_ORT_ARGS...

Why: the python runner's instances are separate processes (python stubs), each with its own CUDA context, and
without MPS the GPU time-slices between contexts instead of running their kernels side by side; the timers
(docs/results/gpu.md) show ONNX Runtime's run of a batch taking 1.75-1.85x its in-process time with four stubs,
and Triton's input copies growing with the instance count. MPS (NVIDIA's Multi-Process Service) lets the
processes of one user share the GPU at once. It is a user-space daemon: it changes none of the card's settings
(compute mode, clocks, power limit). This script starts it as `trtbuild serve --mps` does (builder.serving.mps,
private pipe and log folders under DIR/on-N/mps) and quits it after each run, also an interrupted one. Unlike
`serve --mps`, the whole bench_ort.py process runs under the daemon: its in-process ceiling and its perfclient
(which sends CUDA shared memory) are MPS clients too.

Rounds alternate off, on, on, off, ... (`--first on`: on, off, off, on, ...; `--only on`: on-1, on-2, ...; each
round is one whole `bench_ort.py BENCH_ORT_ARGS --out DIR/MODE-N` run: its own in-process ceiling and its own
server). Written to DIR:
mps-compare.md and .json (per mode and level the median (range) over the rounds of infer/s, x the run's own FP16
ceiling, p99/p50, J/inference and Triton's compute_input per batch; the on/off ratio of the same round),
runs.tar.gz (every run's ort_gpu_bench.json/.md, its log and the MPS daemon's logs). Exit status 0 when every run
ended with 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from builder.errors import ServerError
from builder.serving import mps, triton_server

HERE = Path(__file__).resolve().parent


def run_mps_on(out: Path) -> dict[str, str]:
    """The product's daemon handling (builder.serving.mps) with `out` as its state folder (daemon in out/mps)."""
    return mps.start(out, triton_server.gpu_ids() or [0])


def levels(doc: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """One run's served levels: `model@concurrency` -> the figures compared."""
    ceiling = doc.get("in_process", {}).get("fp16", {}).get("ceiling_iobinding", {}).get("infer_per_s")
    out: dict[str, dict[str, float | None]] = {}
    for r in doc.get("served", []):
        if "model" not in r or not r.get("latency_us") or r.get("shared_memory") != "cuda":
            continue
        key = f"{r['model']}@{r['concurrency']}"
        if key in out:  # bench_ort's own rounds: the first one (this script alternates whole runs)
            continue
        server = r.get("server", {})
        out[key] = {"infer_per_s": r["throughput"],
                    "x_ceiling": r["throughput"] / ceiling if ceiling else None,
                    "p99_p50": r["latency_us"]["p99"] / r["latency_us"]["p50"],
                    "j_per_infer": r.get("power", {}).get("j_per_infer"),
                    "input_us": server.get("compute_input_us"),
                    "ceiling": ceiling}
    return out


def spread(values: list[float], spec: str) -> str:
    if not values:
        return "-"
    med = format(statistics.median(values), spec)
    return med if len(values) == 1 else f"{med} ({format(min(values), spec)}-{format(max(values), spec)})"


def markdown(runs: list[dict[str, Any]]) -> str:
    keys = list(dict.fromkeys(k for run in runs for k in run["levels"]))
    lines = ["# Served with and without CUDA MPS (alternating whole runs)", "",
             "| level | MPS | runs | infer/s | x own FP16 ceiling | p99/p50 | J/inference | "
             "compute_input us per batch |",
             "|" + "---|" * 8]
    for key in keys:
        for mode in ("off", "on"):
            got = [run["levels"][key] for run in runs if run["mode"] == mode and key in run["levels"]]

            def col(name: str, spec: str, got: list[dict[str, float | None]] = got) -> str:
                return spread([v for g in got if (v := g[name]) is not None], spec)

            lines.append(f"| {key} | {mode} | {len(got)} | {col('infer_per_s', '.0f')} | {col('x_ceiling', '.2f')} | "
                         f"{col('p99_p50', '.2f')} | {col('j_per_infer', '.4f')} | {col('input_us', '.0f')} |")
    lines += ["", "On/off in the same round (infer/s, J/inference):", ""]
    for key in keys:
        ratios = []
        for round_ in sorted({run["round"] for run in runs}):
            pair = {run["mode"]: run["levels"].get(key) for run in runs if run["round"] == round_}
            if pair.get("on") and pair.get("off"):
                on, off = pair["on"], pair["off"]
                j = (f"{on['j_per_infer'] / off['j_per_infer']:.2f}"
                     if on["j_per_infer"] and off["j_per_infer"] else "-")
                ratios.append(f"{on['infer_per_s'] / off['infer_per_s']:.2f}x, J {j}x")
        lines.append(f"- {key}: " + ("; ".join(ratios) or "no pair"))
    ceilings = [f"{run['mode']}-{run['round']}: {c:.0f}" for run in runs
                if run["levels"] and (c := next(iter(run["levels"].values()))["ceiling"])]
    lines += ["", "FP16 in-process ceilings (img/s): " + (", ".join(ceilings) or "-"), "",
              "Runs: " + ", ".join(f"{run['mode']}-{run['round']} exit {run['exit']} ({run['seconds']:.0f} s"
                                   + (f", MPS clients {run['mps']['clients']}" + (" (NONE: this run did not use MPS)"
                                                                  if not run["mps"]["clients"] else "")
                                     if run["mps"] is not None else "") + ")"
                                   for run in runs)]
    return "\n".join(lines) + "\n"


def write(out: Path, runs: list[dict[str, Any]]) -> str:
    """The table, the runs and their files so far: rewritten after every run, so a device call cut short by its
    time limit still returns the runs that ended."""
    text = markdown(runs)
    (out / "mps-compare.md").write_text(text)
    (out / "mps-compare.json").write_text(json.dumps(runs, indent=2) + "\n")
    with tarfile.open(out / "runs.tar.gz", "w:gz") as tar:
        for run in runs:
            name = f"{run['mode']}-{run['round']}"
            tar.add(out / name, arcname=name)
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=2,
                   help="pairs of runs, alternating off/on then on/off (with --only: runs)")
    order_group = p.add_mutually_exclusive_group()
    order_group.add_argument("--first", choices=("off", "on"), default="off",
                             help="the mode of the first run (a later call can start with the other, to balance "
                                  "the order)")
    order_group.add_argument("--only", choices=("off", "on"), default=None,
                             help="every run in this mode (--rounds runs, no on/off pairs): e.g. a diagnosis "
                                  "under MPS")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then bench_ort.py's arguments (no --out)")
    args = p.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if "--out" in bench_args:
        p.error("--out after --: this script gives each run its own")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: expected 1 or more")
    if args.only != "off" and shutil.which(mps.CONTROL) is None:
        print(f"mps_compare: {mps.CONTROL} not on PATH: no CUDA MPS on this machine", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    pair = ("off", "on") if args.first == "off" else ("on", "off")
    order = [(r, mode) for r in range(1, args.rounds + 1) for mode in (pair if r % 2 else pair[::-1])]
    if args.only is not None:
        order = [(r, args.only) for r in range(1, args.rounds + 1)]
    for round_, mode in order:
        out = args.out / f"{mode}-{round_}"
        out.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if mode == "on":
            try:
                env |= run_mps_on(out)
            except ServerError as e:
                print(f"mps_compare: {e}", file=sys.stderr)
                write(args.out, runs)
                return 1
        t0 = time.monotonic()
        try:
            with open(out / "run.log", "wb") as log:
                code = subprocess.run([sys.executable, str(HERE / "bench_ort.py"), *bench_args, "--out", str(out)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        finally:  # an interrupted run leaves no daemon
            seen = {"clients": mps.clients(out), "quit": mps.stop(out)} if mode == "on" else None
        seconds = time.monotonic() - t0
        result = out / "ort_gpu_bench.json"
        doc = json.loads(result.read_text()) if result.is_file() else {}
        run = {"mode": mode, "round": round_, "exit": code, "seconds": seconds, "levels": levels(doc),
               "mps": seen}
        runs.append(run)
        print(json.dumps({k: v for k, v in run.items() if k != "levels"} | {"levels": len(doc.get("served", []))}),
              flush=True)
        text = write(args.out, runs)
    print(text, flush=True)
    return 0 if all(run["exit"] == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
