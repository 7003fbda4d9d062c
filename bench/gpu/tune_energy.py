"""Does `trtbuild tune --objective infer_per_joule` pick differently from the throughput objective on a
GPU? One exhaustive tuning run over the EfficientNet-Lite0 variants served by the GPU runtime (the
bundled Triton's python backend, the bucket runner with provider cuda), then both picks from its one
set of measurements (the same p99 budget for both).

    python bench/gpu/tune_energy.py --models DIR --out DIR [--provider cuda|cpu] [--precisions fp32,fp16,int8]
        [--max-batch 16,64] [--queue-delay-us 0] [--instances 1] [--concurrency 64] [--p99-budget-ms 50]
        [--objective infer_per_joule] [--measurement-interval 1500] [--max-trials 4]

DIR (--models) holds efficientnet_lite0_{PRECISION}/1/model.onnx (a `trtbuild engines` output). Each
variant gets the config `--runtime onnxruntime-cuda` writes (KIND_GPU, provider cuda, HEURISTIC cuDNN
search, CUDA graphs; `--provider cpu`: KIND_CPU and the CPU runner, to rehearse where no GPU is) and
the current runner as 1/model.py. The search is `builder.tuning.run.tune`, the function behind
`trtbuild tune` (exhaustive, dry run: nothing written back, no side-by-side re-measurement); its report
goes to OUT/tune_report.json. The picks are `builder.tuning.objective.best` over that report's points, once
per objective, so both come from the same windows: OUT/tune_energy.json and OUT/tune_energy.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from builder.errors import BuilderError
from builder.repository import python_model, triton_config
from builder.repository.triton_config import BackendConfig, ConfigInputs, InstanceKind, TritonBackend
from builder.runtimes.onnxruntime_cuda import CudaOptions, cuda_backend_config
from builder.spec import DimRange, ServingSpec, TensorSpec
from builder.spec.enums import ServingBackend
from builder.tuning.objective import Goal, Objective, best
from builder.tuning.points import Point, Result, Space
from builder.tuning.run import TuneConfig, tune
from builder.tuning.strategies import Search

MODEL = "efficientnet_lite0"
INPUT = TensorSpec("input", "float32", (-1, 3, 224, 224))
OUTPUT = TensorSpec("logits", "float32", (-1, 1000))
GOALS = (Goal.THROUGHPUT, Goal.INFER_PER_JOULE, Goal.P99)


def ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 0:
        raise SystemExit(f"{flag} {text!r}: expected non-negative integers")
    return values


def delays(text: str) -> tuple[int | None, ...]:
    return tuple(None if v == "off" else ints(v, "--queue-delay-us")[0] for v in text.split(","))


def backend(provider: str) -> BackendConfig:
    if provider == "cuda":  # exactly what `trtbuild engines --runtime onnxruntime-cuda` writes
        return cuda_backend_config(ServingBackend.PYTHON, CudaOptions())
    return BackendConfig(TritonBackend.PYTHON, "model.onnx", InstanceKind.CPU, parameters=(("provider", "cpu"),))


def write_variant(root: Path, precision: str, onnx: Path, *, provider: str, max_batch: int) -> str:
    """One variant folder; its max_batch_size is the tuner's upper bound on the max batch axis."""
    name = f"{MODEL}_{precision}"
    config = triton_config.build(ConfigInputs(
        name=name, inputs=(INPUT,), outputs=(OUTPUT,), batch=DimRange(1, min(8, max_batch), max_batch),
        serving=ServingSpec(instances=1, dynamic_batching=True, max_queue_delay_us=0), backend=backend(provider)))
    version = root / name / "1"
    version.mkdir(parents=True)
    shutil.copyfile(onnx, version / "model.onnx")
    shutil.copyfile(Path(python_model.__file__), version / "model.py")
    (root / name / "config.pbtxt").write_text(triton_config.to_text(config), encoding="utf-8")
    return name


def measured_from(report: dict[str, Any]) -> dict[Point, list[Result]]:
    """The tune report's points and results as the tuner held them (a failed point has no results)."""
    out: dict[Point, list[Result]] = {}
    for entry in report["points"]:
        point = Point(**entry["point"])
        out[point] = [Result(**(r | {"point": Point(**r["point"])})) for r in entry["results"]]
    return out


def figures(point: Point, results: list[Result], failure: str | None, budget_us: float | None) -> dict[str, Any]:
    """One row: the mean over the concurrencies (one here), J/inference and average watts from inf/J."""
    n = len(results)
    row: dict[str, Any] = {"variant": point.variant, "precision": point.variant.rsplit("_", 1)[-1],
                           "max_batch_size": point.max_batch_size, "queue_delay_us": point.queue_delay_us,
                           "instances": point.instances, "label": point.label(), "failure": failure}
    if not n:
        return row | {"feasible": False}
    throughput = sum(r.throughput for r in results) / n
    # A concurrency that completed nothing has no latency: the row's worst-case figure is then unknown
    # (None), never 0 or the worst of the others.
    p50s, p99s = [r.p50_us for r in results], [r.p99_us for r in results]
    p50 = None if None in p50s else max(v for v in p50s if v is not None)
    p99 = None if None in p99s else max(v for v in p99s if v is not None)
    per_j = [r.infer_per_joule for r in results]
    inf_j = sum(v for v in per_j if v is not None) / n if all(v is not None for v in per_j) else None
    return row | {
        "infer_per_s": round(throughput, 1),
        "p50_ms": None if p50 is None else round(p50 / 1e3, 2),
        "p99_ms": None if p99 is None else round(p99 / 1e3, 2),
        "infer_per_joule": None if inf_j is None else round(inf_j, 3),
        "j_per_infer": None if not inf_j else round(1 / inf_j, 5),
        "avg_w": None if not inf_j else round(throughput / inf_j, 1),
        "avg_batch": None if results[0].avg_batch is None else round(results[0].avg_batch, 1),
        "stable": all(r.stable for r in results), "errors": sum(r.errors for r in results),
        "feasible": Objective(Goal.THROUGHPUT, budget_us).feasible(results)}


def picks(measured: dict[Point, list[Result]], budget_us: float | None) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for goal in GOALS:
        try:
            winner = best(measured, Objective(goal, budget_us))
        except BuilderError as exc:  # infer_per_joule where no power source was read (the CPU rehearsal)
            out[str(goal)] = None
            log.info("no %s pick: %s", goal, exc)
            continue
        out[str(goal)] = None if winner is None else winner.label()
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def compare(rows: list[dict[str, Any]], chosen: dict[str, str | None]) -> dict[str, Any] | None:
    """What the energy pick costs against the throughput pick, and the reverse."""
    by_label = {r["label"]: r for r in rows}
    t, e = chosen.get(str(Goal.THROUGHPUT)), chosen.get(str(Goal.INFER_PER_JOULE))
    if t is None or e is None:
        return None
    a, b = by_label[t], by_label[e]
    return {"same_point": t == e, "throughput_pick": t, "energy_pick": e,
            "energy_over_throughput": {k: ratio(b.get(k), a.get(k))
                                       for k in ("infer_per_s", "p99_ms", "j_per_infer", "avg_w")}}


def markdown(doc: dict[str, Any]) -> str:
    def cell(value: Any, spec: str = "") -> str:
        return "-" if value is None else format(value, spec)

    env = doc["environment"]
    lines = [f"{env.get('gpu', 'no GPU')} (driver {env.get('driver', '-')}), onnxruntime {env['onnxruntime']}, "
             f"provider {doc['provider']}, numpy {env['numpy']}", "",
             f"Command: `{doc['command']}`", "",
             f"Objective run: {doc['objective']} under p99 <= {doc['p99_budget_ms']} ms, concurrency "
             f"{doc['concurrency']}, {doc['measurement_interval_ms']} ms windows (at most {doc['max_trials']}), "
             f"exhaustive search, {doc['tune']['measurements']} points in {doc['tune']['seconds']} s", "",
             "| point | infer/s | p50 ms | p99 ms | inf/J | J/inf | avg W | avg batch | within budget | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["points"]:
        note = "; ".join(filter(None, [f"{g} pick" for g, lab in doc["picks"].items() if lab == r["label"]]
                                + [r.get("failure")] + ([] if r.get("stable", True) else ["unstable"])))
        lines.append(f"| {r['label']} | {cell(r.get('infer_per_s'), '.1f')} | {cell(r.get('p50_ms'), '.2f')} | "
                     f"{cell(r.get('p99_ms'), '.2f')} | {cell(r.get('infer_per_joule'), '.2f')} | "
                     f"{cell(r.get('j_per_infer'), '.4f')} | {cell(r.get('avg_w'), '.0f')} | "
                     f"{cell(r.get('avg_batch'), '.1f')} | {'yes' if r['feasible'] else 'no'} | {note} |")
    lines.append("")
    lines += [f"- {goal} pick: {label or 'none'}" for goal, label in doc["picks"].items()]
    if doc.get("comparison"):
        c = doc["comparison"]
        lines.append(f"- energy pick / throughput pick: {json.dumps(c['energy_over_throughput'])}"
                     + (" (same point)" if c["same_point"] else ""))
    for ms, other in doc.get("picks_at_other_budgets_ms", {}).items():
        budget = f"p99 <= {ms} ms" if ms != "0" else "no p99 budget"
        line = ", ".join(f"{goal}: {label or 'none'}" for goal, label in other["picks"].items())
        ratios = other["comparison"]["energy_over_throughput"] if other["comparison"] else None
        lines.append(f"- same points, {budget}: {line}" + (f"; energy/throughput pick {json.dumps(ratios)}"
                                                           if ratios and not other["comparison"]["same_point"] else ""))
    if doc.get("tune_error"):
        lines.append(f"- tune ended with: {doc['tune_error']}")
    return "\n".join(lines) + "\n"


def environment(provider: str) -> dict[str, Any]:
    import numpy
    import onnxruntime

    env: dict[str, Any] = {"onnxruntime": onnxruntime.__version__, "numpy": numpy.__version__,
                           "providers": onnxruntime.get_available_providers()}
    for dist in ("nvidia-pytriton", "tritonclient"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = None
    if provider == "cuda":
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        env |= {"gpu": str(pynvml.nvmlDeviceGetName(handle)), "driver": str(pynvml.nvmlSystemGetDriverVersion()),
                "power_limit_w": pynvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000}
        pynvml.nvmlShutdown()
    return env


def can_plot() -> str | None:
    """None when matplotlib imports here; else why (the tune report is then written without a plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot
    except Exception as exc:  # noqa: BLE001 - any import failure only drops the plot
        return f"{type(exc).__name__}: {exc}"
    return None


log = logging.getLogger("tune_energy")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--precisions", default="fp32,fp16,int8")
    p.add_argument("--max-batch", default="16,64")
    p.add_argument("--queue-delay-us", default="0")
    p.add_argument("--instances", default="1")
    p.add_argument("--concurrency", default="64")
    p.add_argument("--p99-budget-ms", type=float, default=50.0)
    p.add_argument("--objective", choices=[str(g) for g in Goal], default=str(Goal.INFER_PER_JOULE),
                   help="the tuning run's own objective")
    p.add_argument("--measurement-interval", type=int, default=1500)
    p.add_argument("--max-trials", type=int, default=4)
    p.add_argument("--other-budgets-ms", default="25,100,0",
                   help="p99 budgets (0: none) to rank the same points by too, for the record")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # tune's one line per measured point, timestamped: where the time of a run went (a slow load shows).
    logging.getLogger("builder.tuning").setLevel(logging.DEBUG)
    goal = Goal(args.objective)
    precisions = [v for v in args.precisions.split(",") if v]
    max_batches = ints(args.max_batch, "--max-batch")
    concurrencies = ints(args.concurrency, "--concurrency")
    budget_us = args.p99_budget_ms * 1000 if args.p99_budget_ms > 0 else None
    args.out.mkdir(parents=True, exist_ok=True)
    report_path = args.out / "tune_report.json"
    plot_problem = can_plot()
    if plot_problem:
        log.warning("no plot: matplotlib does not import (%s)", plot_problem)
    doc: dict[str, Any] = {
        "what": "trtbuild tune's search (builder.tuning.run.tune) on the GPU runtime; both picks from one run",
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "provider": args.provider,
        "environment": environment(args.provider), "objective": str(goal), "p99_budget_ms": args.p99_budget_ms,
        "concurrency": list(concurrencies), "measurement_interval_ms": args.measurement_interval,
        "max_trials": args.max_trials, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    # As `trtbuild tune` does: SIGTERM (a `timeout` around this run) ends the search like Ctrl-C, so the
    # private server is stopped and the report of the points measured so far is written.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with tempfile.TemporaryDirectory(prefix="tune-energy-") as tmp:
        repository = Path(tmp) / "repository"
        variants = []
        for precision in precisions:
            onnx = args.models / f"{MODEL}_{precision}" / "1" / "model.onnx"
            if not onnx.is_file():
                raise SystemExit(f"--models {args.models}: {onnx} missing (expected {MODEL}_PRECISION/1/model.onnx)")
            variants.append(write_variant(repository, precision, onnx, provider=args.provider,
                                          max_batch=max(max_batches)))
        space = Space(tuple(variants), max_batches, delays(args.queue_delay_us), ints(args.instances, "--instances"))
        t0 = time.perf_counter()
        try:
            tune(TuneConfig(repository, space, Objective(goal, budget_us), search=Search.EXHAUSTIVE,
                 concurrencies=concurrencies, measurement_ms=args.measurement_interval, default_variant=variants[0],
                 report_path=report_path, plot_path=None if plot_problem else args.out / "tune.png",
                 html_path=None if plot_problem else args.out / "tune.html", write=False, compare=False,
                 max_trials=args.max_trials))
        except BuilderError as exc:  # e.g. no point within the budget: the report was written all the same
            doc["tune_error"] = str(exc)
            log.error("tune: %s", exc)
        except KeyboardInterrupt:  # SIGTERM from `timeout` too: tune wrote what it measured so far
            doc["tune_error"] = "interrupted (SIGTERM or Ctrl-C); the points measured before are kept"
            log.error("tune: interrupted")
        doc["tune_wall_s"] = round(time.perf_counter() - t0, 1)
    if not report_path.is_file():  # tune stopped before measuring (no power source, a bad repository)
        print(f"tune_energy: no tune report: {doc.get('tune_error', 'tune wrote none')}", file=sys.stderr)
        return 1
    report = json.loads(report_path.read_text(encoding="utf-8"))
    doc["tune"] = {"measurements": report["measurements"], "failed": report["failed"], "seconds": report["seconds"],
                   "winner": None if report["winner"] is None else Point(**report["winner"]).label(),
                   "why": report["why"], "partial": report["partial"]}
    measured = measured_from(report)
    failures = {e["label"]: e["failure"] for e in report["points"]}
    doc["points"] = [figures(pt, rs, failures.get(pt.label()), budget_us)
                     for pt, rs in sorted(measured.items(), key=lambda kv: kv[0].sort_key())]
    doc["picks"] = picks(measured, budget_us)
    doc["comparison"] = compare(doc["points"], doc["picks"])
    # The same windows ranked under other budgets (no new measurement): where the budget itself moves a pick.
    doc["picks_at_other_budgets_ms"] = {}
    for ms in ints(args.other_budgets_ms, "--other-budgets-ms"):
        if ms != args.p99_budget_ms:
            other = picks(measured, ms * 1000 if ms > 0 else None)
            doc["picks_at_other_budgets_ms"][str(ms)] = {"picks": other, "comparison": compare(doc["points"], other)}
    (args.out / "tune_energy.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    table = markdown(doc)
    (args.out / "tune_energy.md").write_text(table, encoding="utf-8")
    print(table, flush=True)
    return 0 if "tune_error" not in doc else 1


if __name__ == "__main__":
    sys.exit(main())
