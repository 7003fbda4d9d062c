"""perfclient against perf_analyzer on the same server, model and load.

Starts the bundled Triton on free loopback ports over the built repository, then for each
concurrency runs perf_analyzer and perfclient alternately (perf_analyzer, perfclient, perfclient,
perf_analyzer, ...) and compares throughput and p50 latency. A trivial model (a tiny ONNX Add,
generated here) measures the highest rate each client sustains on this machine.

perf_analyzer is the binary inside the tritonclient 2.50 wheel; it needs libb64 and libcudart,
which are copied from the nvidia-pytriton wheel's libraries.

    python bench/perf_compare.py [--repository model_repository] [--model efficientnet_lite0_fp32]
                                 [--concurrency 8,32] [--interval-ms 4000] [--rounds 3] [--json PATH]

The last lines hold the issue's targets against the medians: throughput within 5 % and p50 within
10 % at each concurrency, and the trivial model's drive-rate ratio (perfclient / perf_analyzer) >= 1.0.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto, helper

from builder.repository.triton_config import BackendConfig, ConfigInputs, TritonBackend, build, to_text
from builder.serving.triton_server import Ports, TritonServer, free_ports, library_dir
from builder.spec import DimRange, ServingSpec, TensorSpec
from client.engine import LoadLevel, Measurement
from client.power import PowerSource
from client.protocol import Protocol
from client.session import SessionConfig, run


def perf_analyzer_env(tmp: Path) -> dict[str, str]:
    libs = tmp / "palibs"
    libs.mkdir(exist_ok=True)
    source = library_dir()
    for pattern, name in (("libb64-*.so.0d", "libb64.so.0d"), ("libcudart-*.so.12*", "libcudart.so.12")):
        found = sorted(source.glob(pattern))
        if not found:
            raise SystemExit(f"perf_compare: {pattern} not found in {source}")
        shutil.copyfile(found[0], libs / name)
    return {"LD_LIBRARY_PATH": str(libs), "PATH": str(Path(sys.executable).parent)}


def run_perf_analyzer(binary: Path, env: dict[str, str], model: str, protocol: str, port: int, concurrency: int,
                      interval_ms: int, stability: float, out: Path) -> dict[str, float]:
    cmd = [str(binary), "-m", model, "-u", f"127.0.0.1:{port}", "-i", protocol,
           "--concurrency-range", f"{concurrency}:{concurrency}", "--measurement-interval", str(interval_ms),
           "--stability-percentage", f"{stability:g}", "--max-trials", "10", "-f", str(out), "--verbose-csv"]
    out.unlink(missing_ok=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"perf_analyzer did not finish stable: {proc.stdout.strip().splitlines()[-1:]}")
    with out.open() as handle:
        row = next(csv.DictReader(handle))
    return {"throughput": float(row["Inferences/Second"]), "p50_us": float(row["p50 latency"]),
            "p99_us": float(row["p99 latency"]), "avg_us": float(row["Avg latency"])}


def run_perfclient(model: str, protocol: str, port: int, concurrency: int, interval_ms: int,
                   stability: float, processes: int = 1) -> dict[str, float]:
    config = SessionConfig(
        models=(model,), url=f"127.0.0.1:{port}", protocol=Protocol(protocol),
        levels=(LoadLevel(concurrency=concurrency),),
        measurement=Measurement(measurement_ms=interval_ms, max_trials=10, stability_percentage=stability,
                                warmup_requests=20),
        power_source=PowerSource.NONE, processes=processes,
    )
    (row,) = run(config)
    summary = row.result.summary
    if summary.latency_us is None:
        raise RuntimeError(f"perfclient: no successful request at concurrency {concurrency}: {summary.errors}")
    return {"throughput": summary.throughput, "p50_us": summary.latency_us.p50, "p99_us": summary.latency_us.p99,
            "avg_us": summary.latency_us.avg, "stable": float(row.result.stable)}


def trivial_model(repository: Path) -> str:
    """A python-backend model running a one-node ONNX graph on 16 floats: server cost near zero."""
    name = "trivial_add"
    folder = repository / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])], "trivial",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(folder / "1" / "model.onnx"))
    src = Path(__file__).resolve().parents[1] / "builder" / "repository" / "python_model.py"
    shutil.copyfile(src, folder / "1" / "model.py")
    config = build(ConfigInputs(name=name, inputs=(TensorSpec("x", "float32", (-1, 16)),),
                                outputs=(TensorSpec("y", "float32", (-1, 16)),), batch=DimRange(1, 8, 32),
                                serving=ServingSpec(instances=1, max_queue_delay_us=0),
                                backend=BackendConfig(TritonBackend.PYTHON, "model.onnx")))
    (folder / "config.pbtxt").write_text(to_text(config))
    return name


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", type=Path, default=Path("model_repository"))
    p.add_argument("--model", default="efficientnet_lite0_fp32")
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--trivial-concurrency", type=int, default=16)
    p.add_argument("--interval-ms", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per tool; medians are compared")
    p.add_argument("--stability", type=float, default=10.0, help="±%% for both tools (trivial model: 2x)")
    p.add_argument("--processes", type=int, default=1, help="perfclient --processes N (default 1)")
    p.add_argument("--protocols", default="grpc,http", help="both tools over each (default grpc,http)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    binary = Path(sys.executable).parent / "perf_analyzer"
    if not binary.is_file():
        print(f"perf_compare: error: {binary} not found (it comes with tritonclient 2.50)", file=sys.stderr)
        return 1
    if not (args.repository / args.model / "config.pbtxt").is_file():
        print(f"perf_compare: error: {args.repository / args.model} is not built; run `make engines`", file=sys.stderr)
        return 1
    levels = [int(c) for c in args.concurrency.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="perf-compare-") as tmp_name:
        tmp = Path(tmp_name)
        repository = tmp / "repository"
        repository.mkdir()
        shutil.copytree(args.repository / args.model, repository / args.model)
        trivial = trivial_model(repository)
        env = perf_analyzer_env(tmp)
        http, grpc, metrics = free_ports(3)
        server = TritonServer(repository, tmp / "state", Ports(http, grpc, metrics))
        server.start(timeout=120)
        try:
            protocols = args.protocols.split(",")
            cases = [(m, c, proto) for proto in protocols
                     for m, c in [(args.model, c) for c in levels] + [(trivial, args.trivial_concurrency)]]
            for model, concurrency, protocol in cases:
                port = grpc if protocol == "grpc" else http
                # The trivial model's rate swings more on a shared 2-core machine.
                stability = args.stability * (2 if model == trivial else 1)
                pa_runs, pc_runs = [], []
                for round_index in range(args.rounds):
                    order = ["pa", "pc"] if round_index % 2 == 0 else ["pc", "pa"]
                    for tool in order:
                        if tool == "pa":
                            try:
                                pa_runs.append(run_perf_analyzer(binary, env, model, protocol, port, concurrency,
                                                                 args.interval_ms, stability, tmp / "pa.csv"))
                            except RuntimeError as exc:
                                print(f"{model} c={concurrency}: {exc}", file=sys.stderr)
                        else:
                            pc_runs.append(run_perfclient(model, protocol, port, concurrency, args.interval_ms,
                                                          stability, args.processes))
                if not pa_runs:
                    print(f"{model} c={concurrency}: no stable perf_analyzer run; skipped", file=sys.stderr)
                    continue
                pa = {k: statistics.median(r[k] for r in pa_runs) for k in pa_runs[0]}
                pa["stable_runs"] = float(len(pa_runs))
                pc = {k: statistics.median(r[k] for r in pc_runs) for k in pc_runs[0]}
                rows.append({"model": model, "protocol": protocol, "concurrency": concurrency,
                             "perf_analyzer": pa, "perfclient": pc,
                             "throughput_ratio": pc["throughput"] / pa["throughput"],
                             "p50_ratio": pc["p50_us"] / pa["p50_us"], "runs": {"pa": pa_runs, "pc": pc_runs}})
        finally:
            server.stop()
    print(f"same server, model and load; medians of {args.rounds} alternating runs per tool; "
          f"{args.interval_ms} ms windows, ±{args.stability:g} % stability (trivial model ±{2 * args.stability:g} %)")
    head = (f"{'model':<24} {'proto':<5} {'conc':>4} {'PA infer/s':>10} {'PC infer/s':>10} {'ratio':>6} "
            f"{'PA p50 ms':>9} {'PC p50 ms':>9} {'ratio':>6} {'PA p99 ms':>9} {'PC p99 ms':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        pa, pc = r["perf_analyzer"], r["perfclient"]
        print(f"{r['model']:<24} {r['protocol']:<5} {r['concurrency']:>4} "
              f"{pa['throughput']:>10.1f} {pc['throughput']:>10.1f} "
              f"{r['throughput_ratio']:>6.3f} {pa['p50_us'] / 1e3:>9.2f} {pc['p50_us'] / 1e3:>9.2f} "
              f"{r['p50_ratio']:>6.3f} {pa['p99_us'] / 1e3:>9.2f} {pc['p99_us'] / 1e3:>9.2f}")
    print()
    for line in verdicts(rows, trivial="trivial_add"):
        print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def verdicts(rows: list[dict[str, Any]], *, trivial: str) -> list[str]:
    """The issue's targets, one line each, as measured (medians)."""
    lines = []
    for r in rows:
        if r["model"] == trivial:
            ratio = r["throughput_ratio"]
            lines.append(f"drive rate ({trivial}, {r['protocol']}, c={r['concurrency']}): perfclient/perf_analyzer "
                         f"{ratio:.3f}x (target >= 1.0x): {'met' if ratio >= 1.0 else 'NOT met'}")
            continue
        t_ok, p_ok = abs(r["throughput_ratio"] - 1) <= 0.05, abs(r["p50_ratio"] - 1) <= 0.10
        lines.append(f"{r['model']} {r['protocol']} c={r['concurrency']}: "
                     f"throughput ratio {r['throughput_ratio']:.3f} "
                     f"(target within 5 %: {'met' if t_ok else 'NOT met'}), p50 ratio {r['p50_ratio']:.3f} "
                     f"(target within 10 %: {'met' if p_ok else 'NOT met'})")
    return lines


if __name__ == "__main__":
    sys.exit(main())
