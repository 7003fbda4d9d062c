"""`trtbuild tune` against Triton Model Analyzer on the same server, model, search space and load.

Installs triton-model-analyzer 1.58 in its own virtualenv (.cache/bench/ma-venv) on first use, starts
one bundled Triton with explicit model control over a copy of the model, then:

1. Model Analyzer profiles it in remote mode (`cpu_only`, brute search over exactly the space below,
   one concurrency), with the perf_analyzer binary of the tritonclient 2.50 wheel;
   Both tools measure in time windows of the same length, at most the same number of windows
   (perf_analyzer discards a measurement that is not stable within --ma-stability; perfclient keeps
   it, marked unstable);
2. `trtbuild tune` tunes the same server in attach mode (load with a config override, measure,
   unload) over the same space and concurrency;
3. each tool's pick is the highest-throughput point that meets the p99 budget among the points it
   measured; both picks are re-measured alternately on the same server (perfclient, same windows),
   and the medians are printed with each tool's number of measurements and wall time.

The base config's preferred batch sizes are cleared for both tools (Model Analyzer keeps them, and a
preferred size above a smaller max_batch_size makes its config illegal).

    python bench/tune_vs_model_analyzer.py [--repository .cache/bench/repository]
        [--model efficientnet_lite0_fp32] [--max-batch 1,4,8,16] [--queue-delay-us 0,1000,4000]
        [--instances 1,2] [--concurrency 32] [--p99-budget-ms 150] [--search tpe] [--trials 10]
        [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from perf_compare import perf_analyzer_env  # bench/ is the script's folder, first on sys.path
from tritonclient.grpc import model_config_pb2

from builder.repository import triton_config
from builder.serving.triton_server import ModelControl, Ports, TritonServer, free_ports
from builder.tuning.control import Endpoints
from builder.tuning.measure import Tuner
from builder.tuning.objective import Goal, Objective
from builder.tuning.points import Point, Space, point_of
from builder.tuning.run import TuneConfig, tune
from builder.tuning.strategies import Search
from builder.tuning.targets import RemoteTarget

MA_VERSION = "1.58.0"
MA_TIMEOUT_S = 3600


def ensure_model_analyzer(venv: Path) -> Path:
    binary = venv / "bin" / "model-analyzer"
    if binary.is_file():
        return binary
    print(f"installing triton-model-analyzer {MA_VERSION} into {venv} ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"triton-model-analyzer=={MA_VERSION}"],
                   check=True, timeout=1800)
    return binary


def ints(value: str) -> list[int]:
    return [int(v) for v in value.split(",") if v.strip()]


def ma_config(tmp: Path, repository: Path, model: str, ports: Ports, args: argparse.Namespace,
              perf_analyzer: Path) -> str:
    budget = f"\n    constraints:\n      perf_latency_p99:\n        max: {args.p99_budget_ms:g}" \
        if args.p99_budget_ms else ""
    return f"""
model_repository: {repository}
triton_launch_mode: remote
triton_http_endpoint: 127.0.0.1:{ports.http}
triton_grpc_endpoint: 127.0.0.1:{ports.grpc}
triton_metrics_url: http://127.0.0.1:{ports.metrics}/metrics
perf_analyzer_path: {perf_analyzer}
output_model_repository_path: {tmp / 'ma_models'}
override_output_model_repository: true
export_path: {tmp / 'ma_export'}
checkpoint_directory: {tmp / 'ma_checkpoints'}
run_config_search_mode: brute
skip_summary_reports: true
perf_analyzer_max_auto_adjusts: {args.ma_auto_adjusts}
perf_analyzer_flags:
  measurement-mode: time_windows
  measurement-interval: {args.interval_ms}
  max-trials: {args.max_trials}
  stability-percentage: {args.ma_stability:g}
profile_models:
  {model}:
    cpu_only: true{budget}
    parameters:
      concurrency: [{args.concurrency}]
    model_config_parameters:
      max_batch_size: [{args.max_batch}]
      dynamic_batching:
        max_queue_delay_microseconds: [{args.queue_delay_us}]
      instance_group:
        - kind: KIND_CPU
          count: [{args.instances}]
"""


def ma_measurements(checkpoint: Path, model: str) -> list[tuple[Point, float, float]]:
    """(point, throughput infer/s, p99 ms) of every configuration Model Analyzer measured."""
    data = json.loads(checkpoint.read_text())
    rows = []
    for run_config, measurements in data["ResultManager.results"]["_results"][model].values():
        config_json = run_config["_model_run_configs"][0]["_model_config_variant"]["model_config"]
        config = json_format.ParseDict(config_json, model_config_pb2.ModelConfig())
        point = point_of(model, triton_config.to_text(config))
        for measurement in measurements.values():
            values = dict((name, entry["_value"]) for name, entry in
                          measurement["_model_config_measurements"][0]["_non_gpu_data"])
            rows.append((point, float(values["perf_throughput"]), float(values["perf_latency_p99"])))
    return rows


def pick(rows: list[tuple[Point, float, float | None]], budget_ms: float | None) -> Point | None:
    ok = [r for r in rows if r[2] is not None and (budget_ms is None or r[2] <= budget_ms)]
    return max(ok, key=lambda r: r[1])[0] if ok else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", type=Path, default=Path("model_repository"))
    p.add_argument("--model", default="efficientnet_lite0_fp32")
    p.add_argument("--max-batch", default="1,4,8,16")
    p.add_argument("--queue-delay-us", default="0,1000,4000")
    p.add_argument("--instances", default="1,2")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--p99-budget-ms", type=float, default=150.0)
    p.add_argument("--search", default="tpe", help="ours: tpe | hill | exhaustive")
    p.add_argument("--trials", type=int, default=10, help="ours, with --search tpe")
    p.add_argument("--interval-ms", type=int, default=1500, help="window length, both tools (time windows)")
    p.add_argument("--max-trials", type=int, default=6, help="windows per measurement at most, both tools")
    p.add_argument("--ma-auto-adjusts", type=int, default=2,
                   help="Model Analyzer: perf_analyzer relaunches with a longer window when unstable (its default 10)")
    p.add_argument("--ma-stability", type=float, default=25.0,
                   help="Model Analyzer: perf_analyzer's ±%% stability rule (it discards an unstable measurement; "
                        "perfclient keeps one, marked unstable)")
    p.add_argument("--rounds", type=int, default=3, help="alternating re-measurements of each pick")
    p.add_argument("--ma-venv", type=Path, default=Path(".cache/bench/ma-venv"))
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    try:
        search = Search.parse(args.search, "--search", error=ValueError)
    except ValueError as exc:
        print(f"tune_vs_model_analyzer: error: {exc}", file=sys.stderr)
        return 1
    source = args.repository / args.model
    if not (source / "config.pbtxt").is_file():
        print(f"tune_vs_model_analyzer: error: {source} is not built; run `make engines`", file=sys.stderr)
        return 1
    perf_analyzer = Path(sys.executable).parent / "perf_analyzer"
    if not perf_analyzer.is_file():
        print(f"tune_vs_model_analyzer: error: {perf_analyzer} not found (it comes with tritonclient 2.50)",
              file=sys.stderr)
        return 1
    analyzer = ensure_model_analyzer(args.ma_venv.resolve())
    budget_ms = args.p99_budget_ms or None
    space = Space((args.model,), tuple(ints(args.max_batch)), tuple(ints(args.queue_delay_us)),
                  tuple(ints(args.instances)))
    with tempfile.TemporaryDirectory(prefix="tune-vs-ma-") as tmp_name:
        tmp = Path(tmp_name)
        repository = tmp / "repository"
        repository.mkdir()
        shutil.copytree(source, repository / args.model)
        base = triton_config.parse((repository / args.model / "config.pbtxt").read_text())
        del base.dynamic_batching.preferred_batch_size[:]
        (repository / args.model / "config.pbtxt").write_text(triton_config.to_text(base))
        http, grpc, metrics = free_ports(3)
        ports = Ports(http, grpc, metrics)
        endpoints = Endpoints(f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics")
        with TritonServer(repository, tmp / "state", ports, model_control=ModelControl.EXPLICIT):
            # 1. Model Analyzer.
            (tmp / "ma.yaml").write_text(ma_config(tmp, repository, args.model, ports, args, perf_analyzer))
            pa_env = perf_analyzer_env(tmp)  # LD_LIBRARY_PATH for the binary's libb64 and libcudart
            env = {**os.environ, **pa_env, "PATH": f"{pa_env['PATH']}:{os.environ.get('PATH', '')}"}
            started = time.perf_counter()
            proc = subprocess.run([str(analyzer), "profile", "-f", str(tmp / "ma.yaml")], env=env,
                                  capture_output=True, text=True, timeout=MA_TIMEOUT_S)
            ma_seconds = time.perf_counter() - started
            (Path(".cache/bench") / "model_analyzer.log").parent.mkdir(parents=True, exist_ok=True)
            (Path(".cache/bench") / "model_analyzer.log").write_text(proc.stdout + proc.stderr)
            checkpoints = sorted((tmp / "ma_checkpoints").glob("*.ckpt"))
            if proc.returncode != 0 or not checkpoints:
                print(f"tune_vs_model_analyzer: error: model-analyzer exited {proc.returncode}; "
                      "see .cache/bench/model_analyzer.log", file=sys.stderr)
                return 1
            ma_rows = ma_measurements(checkpoints[-1], args.model)
            ma_pick = pick([(pt, t, p99) for pt, t, p99 in ma_rows], budget_ms)

            # 2. trtbuild tune, attached to the same server.
            started = time.perf_counter()
            objective = Objective(Goal.THROUGHPUT, budget_ms * 1e3 if budget_ms else None)
            report = tune(TuneConfig(repository, space, objective, search=search,
                          concurrencies=[args.concurrency],
                          measurement_ms=args.interval_ms, max_trials=args.max_trials, default_variant=args.model,
                          report_path=tmp / "tune.json", plot_path=None, write=False, compare=False,
                          attach=endpoints, trials=args.trials))
            ours_seconds = time.perf_counter() - started
            our_pick = report.winner
            print(f"Model Analyzer: {len(ma_rows)} measurements in {ma_seconds:.0f} s, pick "
                  f"{ma_pick.label() if ma_pick else '-'}")
            print(f"trtbuild tune ({args.search}): {report.measurements} measurements in {ours_seconds:.0f} s, pick "
                  f"{our_pick.label() if our_pick else '-'}")
            if ma_pick is None or our_pick is None:
                print("tune_vs_model_analyzer: a tool found no point within the p99 budget", file=sys.stderr)
                return 1

            # 3. Both picks, alternately, on the same server (ours first in odd rounds, MA's in even ones).
            # A re-measurement that failed (no load, no completed request) is None, never a 0 in a median.
            runs: dict[str, list[tuple[float | None, float | None]]] = {"ours": [], "ma": []}
            picks = {"ours": our_pick, "ma": ma_pick}
            with RemoteTarget(endpoints, repository, [args.model]) as target:
                tuner = Tuner(target, [args.concurrency], measurement_ms=args.interval_ms,
                              max_trials=args.max_trials)
                for round_index in range(args.rounds):
                    order = ["ours", "ma"] if round_index % 2 == 0 else ["ma", "ours"]
                    for who in order:
                        results = tuner.remeasure(picks[who])
                        r = results[0] if results else None
                        runs[who].append((r.throughput if r and r.completed else None,
                                          r.p99_us / 1e3 if r and r.p99_us is not None else None))
    rows: list[dict[str, Any]] = []
    for who, label, count, seconds in (("ours", f"trtbuild tune ({args.search})", report.measurements, ours_seconds),
                                       ("ma", "Model Analyzer 1.58 (brute)", len(ma_rows), ma_seconds)):
        throughputs = [t for t, _ in runs[who]]
        measured = [t for t in throughputs if t is not None]
        p99s = [q for _, q in runs[who] if q is not None]
        rows.append({"tool": label, "pick": picks[who].label(), "measurements": count,
                     "seconds": round(seconds, 1),
                     "throughput_median": round(statistics.median(measured), 1) if measured else None,
                     "failed_remeasurements": len(throughputs) - len(measured),
                     "p99_ms_median": round(statistics.median(p99s), 1) if p99s else None,
                     "throughputs": throughputs, "p99s_ms": p99s})
    print(f"\nre-measured alternately, {args.rounds} rounds each, c={args.concurrency}, "
          f"p99 budget {budget_ms} ms, {args.model}:")
    print("| tool | pick | infer/s (median) | p99 ms (median) | measurements | wall time s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['tool']} | {row['pick']} | {row['throughput_median']} | {row['p99_ms_median']} | "
              f"{row['measurements']} | {row['seconds']} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                         "model_analyzer": [{"point": pt.label(), "throughput": t, "p99_ms": q}
                                                            for pt, t, q in ma_rows],
                                         "ours": [{"point": e.label, "throughput": e.throughput,
                                                   "p99_ms": e.p99_ms, "failure": e.failure}
                                                  for e in report.points]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
