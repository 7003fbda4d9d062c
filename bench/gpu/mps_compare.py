"""bench_ort.py's served figures with and without CUDA MPS, alternating, on one GPU.

    python bench/gpu/mps_compare.py --out DIR [--rounds 2] -- BENCH_ORT_ARGS...

Why: the python runner's instances are separate processes (python stubs), each with its own CUDA context, and
without MPS the GPU time-slices between contexts instead of running their kernels side by side; the timers
(docs/results/gpu.md) show ONNX Runtime's run of a batch taking 1.75-1.85x its in-process time with four stubs,
and Triton's input copies growing with the instance count. MPS (NVIDIA's Multi-Process Service) lets the
processes of one user share the GPU at once. It is a user-space daemon: it changes none of the card's settings
(compute mode, clocks, power limit), and this script starts it with private pipe and log folders, so only the
processes this script starts with those folders in their environment use it, and quits it after each run.

Rounds alternate off, on, on, off, ... (each round is one whole `bench_ort.py BENCH_ORT_ARGS --out DIR/MODE-N`
run: its own in-process ceiling and its own server). Written to DIR: mps-compare.md and .json (per mode and
level the median (range) over the rounds of infer/s, x the run's own FP16 ceiling, p99/p50, J/inference and
Triton's compute_input per request; the on/off ratio of the same round), runs.tar.gz (every run's
ort_gpu_bench.json/.md, its log and the MPS daemon's logs). Exit status 0 when every run ended with 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONTROL = "nvidia-cuda-mps-control"


def mps_env(folder: Path) -> dict[str, str]:
    return {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}


def start_mps(folder: Path) -> dict[str, str]:
    """The control daemon with private folders; its environment for the processes that should use it."""
    env = mps_env(folder)
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    subprocess.run([CONTROL, "-d"], env=os.environ | env, check=True, timeout=30)
    return env


def stop_mps(env: dict[str, str]) -> dict[str, Any]:
    """Quit the daemon (it stops its server first). A CUDA program that cannot reach the daemon runs without
    MPS and says nothing, so what the daemon saw is recorded: its servers and the clients its log names."""
    seen: dict[str, Any] = {}
    try:
        listed = subprocess.run([CONTROL], input=b"get_server_list\n", env=os.environ | env, timeout=60,
                                capture_output=True, check=False)
        seen["servers"] = listed.stdout.decode(errors="replace").split()
        subprocess.run([CONTROL], input=b"quit\n", env=os.environ | env, timeout=60, check=False)
    except subprocess.TimeoutExpired as e:
        seen["error"] = str(e)
    log = Path(env["CUDA_MPS_LOG_DIRECTORY"]) / "control.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    seen["clients"] = len(re.findall(r"new.client", text, flags=re.IGNORECASE))
    return seen


def levels(doc: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """One run's served levels: `model@concurrency` -> the figures compared."""
    ceiling = doc.get("in_process", {}).get("fp16", {}).get("ceiling_iobinding", {}).get("infer_per_s")
    out: dict[str, dict[str, float | None]] = {}
    for r in doc.get("served", []):
        if "model" not in r or "throughput" not in r or r.get("shared_memory") != "cuda":
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
             "| level | MPS | runs | infer/s | x own FP16 ceiling | p99/p50 | J/inference | compute_input us/req |",
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
                                   + (f", MPS {run['mps']}" if run["mps"] is not None else "") + ")"
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
    p.add_argument("--rounds", type=int, default=2, help="pairs of runs, alternating off/on then on/off")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then bench_ort.py's arguments (no --out)")
    args = p.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if "--out" in bench_args:
        p.error("--out after --: this script gives each run its own")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: expected 1 or more")
    if shutil.which(CONTROL) is None:
        print(f"mps_compare: {CONTROL} not on PATH: no CUDA MPS on this machine", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    order = [(r, mode) for r in range(1, args.rounds + 1)
             for mode in (("off", "on") if r % 2 else ("on", "off"))]
    for round_, mode in order:
        out = args.out / f"{mode}-{round_}"
        out.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        mps: dict[str, str] = {}
        if mode == "on":
            try:
                mps = start_mps(out / "mps")
            except (OSError, subprocess.SubprocessError) as e:
                print(f"mps_compare: {CONTROL} -d did not start the daemon: {e}", file=sys.stderr)
                write(args.out, runs)
                return 1
            env |= mps
        t0 = time.monotonic()
        with open(out / "run.log", "wb") as log:
            code = subprocess.run([sys.executable, str(HERE / "bench_ort.py"), *bench_args, "--out", str(out)],
                                  env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        seconds = time.monotonic() - t0
        seen = stop_mps(mps) if mps else None
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
