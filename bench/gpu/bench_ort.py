"""The product's EfficientNet-Lite0 variants on an NVIDIA GPU through ONNX Runtime's CUDA provider:
the in-process ceiling and the served figures from one script in one run.

    python bench/gpu/bench_ort.py --models REPOSITORY [--out DIR] [--interval-ms 3000]

REPOSITORY is a `trtbuild engines` output holding efficientnet_lite0_{fp32,fp16,int8}/1/model.onnx.
Steps, each printed as one JSON line and gathered in DIR/ort_gpu_bench.json and .md:
1. the shape-change stall: one FP16 session fed alternating batch sizes vs the runner's bucket sessions;
2. in-process, per precision at batch 64: the ceiling (IO binding, input and output on the GPU, no
   copies) and the runner's own path (host buffer -> device -> host), NVML energy over each;
3. served by the bundled Triton through the python-backend runner (builder/repository/python_model.py,
   provider cuda), loaded by perfclient over gRPC with CUDA shared memory (--shared-memory): each precision
   at concurrency 32 and 256 with dynamic batching, FP16 at 32 without it, FP16 at 32 and 256 with system
   shared memory and with none;
   NVML energy per window cross-checked against Triton's nv_energy_consumption; CPU seconds of the
   client, the Triton server and the python stubs per second of load.
   With --runner-timers the served models run with the runner's phase timers on (config parameter
   runner_timers, files under DIR/runner_timers) and each level gets a table of where a request's time
   goes: Triton's queue / compute_input / compute_infer / compute_output beside the runner's phases over the
   same measured windows, and what of compute_infer the phases leave unexplained.
   With --runner-batches N (and --runner-timers) the runner also writes a line per batch and each level gets
   its batches' run times by rows and by how many other instances' batches were running at their start.
   With --trace-rate N Triton traces 1 in N requests (its trace API, timestamps only) and each level gets its
   server-side p50 and p99 and the phases (receive, queue, compute_input, infer, output, send) of its median
   requests beside those of its slowest 1 %: which phase makes the tail.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import gzip
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from builder.repository import python_model  # the runner copied into each model folder (untyped)
from builder.repository.triton_config import ConfigInputs, build, to_text
from builder.runtimes.onnxruntime_cuda import GPU_RUNNER_INSTANCES, CudaOptions, CudnnSearch, cuda_backend_config
from builder.serving.triton_server import Ports, TritonServer, free_ports, library_dir
from builder.spec import DimRange, ServingBackend, ServingSpec, TensorSpec
from client.engine import LevelResult, LoadLevel, Measurement
from client.power import PowerSource
from client.report import result_dict
from client.session import SessionConfig, run
from client.shared_memory import SharedMemory, SharedMemoryKind

PRECISIONS = ("fp32", "fp16", "int8")
MAX_BATCH = 64
INPUT = TensorSpec("input", "float32", (-1, 3, 224, 224))
OUTPUT = TensorSpec("logits", "float32", (-1, 1000))
SEARCH = "HEURISTIC"  # --search; the committed H100 results ran EXHAUSTIVE (recorded in their JSON)
RUNNER: Any = python_model  # untyped: it is copied into model folders, where Triton imports it
RUNNER_BATCHES = 0  # --runner-batches: the runner's timers also write this many batch lines per period
PROVIDER_OPTIONS: dict[str, str] = {}  # --provider-option: extra CUDA provider options for every runner


class Nvml:
    """The energy counter (mJ) of GPU 0, and its name and driver."""

    def __init__(self) -> None:
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.gpu = str(pynvml.nvmlDeviceGetName(self.handle))
        self.driver = str(pynvml.nvmlSystemGetDriverVersion())

    def energy_j(self) -> float:
        return float(self.nv.nvmlDeviceGetTotalEnergyConsumption(self.handle)) / 1000.0


def onnx_path(models: Path, precision: str) -> Path:
    path = models / f"efficientnet_lite0_{precision}" / "1" / "model.onnx"
    if not path.is_file():
        raise SystemExit(f"--models {models}: {path} missing (build with trtbuild engines --only efficientnet_lite0)")
    return path


def timed(fn: Any, *, seconds: float, nvml: Nvml, per_call: int) -> dict[str, float]:
    """fn() repeated for `seconds` after warm-up: inferences/s, avg W and J/inference from NVML's counter."""
    for _ in range(5):
        fn()
    calls, e0, t0 = 0, nvml.energy_j(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
    elapsed, joules = time.perf_counter() - t0, nvml.energy_j() - e0
    n = calls * per_call
    return {"infer_per_s": n / elapsed, "avg_w": joules / elapsed, "j_per_infer": joules / n,
            "ms_per_call": 1000 * elapsed / calls}


def shape_change(models: Path) -> dict[str, Any]:
    """Per-run seconds when consecutive batches differ: one session vs one session per bucket."""
    import onnxruntime as ort

    ort.preload_dlls()
    path = str(onnx_path(models, "fp16"))
    sizes = [21, 32, 64, 21, 32]
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"sizes": sizes}
    for search in ("HEURISTIC", "DEFAULT"):
        session = ort.InferenceSession(path, providers=[("CUDAExecutionProvider", {"cudnn_conv_algo_search": search})])
        for b in sorted(set(sizes)):  # every shape seen once before timing
            session.run(None, {"input": rng.standard_normal((b, 3, 224, 224), dtype=np.float32)})
        times = []
        for b in sizes:
            x = rng.standard_normal((b, 3, 224, 224), dtype=np.float32)
            t0 = time.perf_counter()
            session.run(None, {"input": x})
            times.append(round(time.perf_counter() - t0, 4))
        out[f"one_session_{search}_s"] = times
        del session
    runner = RUNNER.CudaBucketRunner(path, max_batch=MAX_BATCH,
                                           provider_options={"cudnn_conv_algo_search": SEARCH})
    times = []
    for b in sizes:
        x = rng.standard_normal((b, 3, 224, 224), dtype=np.float32)
        t0 = time.perf_counter()
        runner.run({"input": x})
        times.append(round(time.perf_counter() - t0, 4))
    out["bucket_runner_s"] = times
    out["bucket_runner"] = runner.describe()
    return out


def in_process(models: Path, nvml: Nvml, seconds: float, variants: list[dict[str, str]]) -> dict[str, Any]:
    """Each precision's ceiling and runner path with the run's provider options, then the ceiling again
    under each variant (extra CUDA provider options such as prefer_nhwc=1), side by side in one run."""
    rows: dict[str, Any] = {}
    x = np.random.default_rng(1).standard_normal((MAX_BATCH, 3, 224, 224), dtype=np.float32)
    for precision in PRECISIONS:
        try:
            rows[precision] = in_process_one(onnx_path(models, precision), nvml, seconds, x)
        except Exception as exc:  # noqa: BLE001 - one precision's failure is a result; the others still run
            rows[precision] = {"error": str(exc).strip().splitlines()[-1][:300]}
        print(json.dumps({"in_process": precision} | rows[precision]), flush=True)
        for extra in variants:
            label = ",".join(f"{k}={v}" for k, v in extra.items())
            try:
                row = in_process_one(onnx_path(models, precision), nvml, seconds, x, extra=extra, copies=False)
            except Exception as exc:  # noqa: BLE001 - an option ONNX Runtime refuses is a result
                row = {"error": str(exc).strip().splitlines()[-1][:300]}
            rows.setdefault("variants", {}).setdefault(label, {})[precision] = row
            print(json.dumps({"in_process": precision, "variant": label} | row), flush=True)
    return rows


def in_process_one(path: Path, nvml: Nvml, seconds: float, x: Any, *, extra: dict[str, str] | None = None,
                   copies: bool = True) -> dict[str, Any]:
    # The options the product's runner takes for this graph (layout auto resolved), then the run's own.
    product = CudaOptions(cudnn_conv_algo_search=CudnnSearch(SEARCH)).provider_options(path)
    runner = RUNNER.CudaBucketRunner(str(path), max_batch=MAX_BATCH, sizes=None if copies else [MAX_BATCH],
                                     provider_options={**product, **PROVIDER_OPTIONS, **(extra or {})})
    bucket = runner.buckets[MAX_BATCH]
    bucket.run({"input": x}, MAX_BATCH)
    ceiling = timed(lambda: bucket.session.run_with_iobinding(bucket.binding), seconds=seconds, nvml=nvml,
                    per_call=MAX_BATCH)
    if not copies:
        return {"ceiling_iobinding": ceiling, "runner": runner.describe()}
    with_copies = timed(lambda: runner.run({"input": x}), seconds=seconds, nvml=nvml, per_call=MAX_BATCH)
    one = runner.buckets[1]  # what a server without batching can reach at best: batch 1, no copies
    batch1 = timed(lambda: one.session.run_with_iobinding(one.binding), seconds=seconds, nvml=nvml, per_call=1)
    return {"ceiling_iobinding": ceiling, "runner_with_copies": with_copies, "ceiling_batch1": batch1,
            "runner": runner.describe()}


ABLATION: dict[str, dict[str, Any]] = {  # one change from the runner's defaults each
    "as configured (graphs, pinned, --search)": {},
    "no CUDA graphs": {"cuda_graphs": False},
    "pageable staging buffers": {"pin": False},
    "EXHAUSTIVE search": {"search": "EXHAUSTIVE"},
}


def ablation(models: Path, seconds: float) -> dict[str, Any]:
    """What each runner choice pays: ms per run (host copies included) at buckets 8 and 64, and load s."""
    out: dict[str, Any] = {}
    rng = np.random.default_rng(2)
    feeds = {b: {"input": rng.standard_normal((b, 3, 224, 224), dtype=np.float32)} for b in (8, 64)}
    for precision in ("fp32", "fp16"):
        for label, change in ABLATION.items():
            try:
                runner = RUNNER.CudaBucketRunner(
                    str(onnx_path(models, precision)), max_batch=MAX_BATCH, sizes=[8, 64],
                    provider_options={"cudnn_conv_algo_search": change.get("search", SEARCH)},
                    cuda_graphs=change.get("cuda_graphs", True), pin=change.get("pin", True))
                row: dict[str, Any] = {"load_s": round(runner.load_seconds, 2)}
                for b, feed in feeds.items():
                    for _ in range(5):
                        runner.run(feed)
                    n, t0 = 0, time.perf_counter()
                    while time.perf_counter() - t0 < seconds:
                        runner.run(feed)
                        n += 1
                    row[f"ms_per_run_b{b}"] = round(1000 * (time.perf_counter() - t0) / n, 3)
                row["runner"] = runner.describe()
                del runner
            except Exception as exc:  # noqa: BLE001 - a failed variant is a result
                row = {"error": str(exc).strip().splitlines()[-1][:300]}
            out[f"{precision}: {label}"] = row
            print(json.dumps({"ablation": f"{precision}: {label}"} | {k: v for k, v in row.items() if k != "runner"}),
                  flush=True)
    return out


Variant = tuple[str, str, tuple[int, ...] | None]  # (name, the runner's batch_buckets, preferred sizes; None: default)
TAKEN = re.compile(r"^(nodelay|x\d+|d\d+us)$")  # fp16_batched_<these> are the script's own models


def batching_variant(value: str) -> Variant:
    """NAME=BUCKETS[/PREFERRED] of --batching-variant: the runner's batch_buckets (pow2, fine or sizes) and Triton's
    preferred batch sizes (`default`: the product's, `buckets`: every bucket above 1, or sizes 1..max batch)."""
    name, sep, rest = value.partition("=")
    sizes, _, preferred = rest.partition("/")
    if not sep or not name.isidentifier() or TAKEN.match(name) or not sizes:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=BUCKETS[/PREFERRED] (NAME an identifier other "
                                         "than nodelay, xN or dNus), e.g. fine=1,2,4,8/buckets")
    try:
        buckets = python_model.parse_buckets(sizes, MAX_BATCH)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: {exc}") from None
    if preferred in ("", "default"):
        return name, sizes, None
    if preferred == "buckets":
        return name, sizes, tuple(b for b in buckets if b > 1)
    try:
        chosen = tuple(int(p) for p in preferred.split(","))
    except ValueError:
        chosen = ()
    if not chosen or not all(1 <= p <= MAX_BATCH for p in chosen):
        raise argparse.ArgumentTypeError(f"{value!r}: preferred batch sizes {preferred!r}: expected default, buckets "
                                         f"or whole numbers 1..{MAX_BATCH}")
    return name, sizes, tuple(sorted(set(chosen)))


def write_model(root: Path, name: str, onnx: Path, *, batching: bool, instances: int | None, delay_us: int,
                graphs: bool = True, timers: Path | None = None,
                batch_buckets: str | None = None, preferred: tuple[int, ...] | None = None) -> None:
    serving = ServingSpec(instances=instances, dynamic_batching=batching, max_queue_delay_us=delay_us)
    # The config `trtbuild --runtime onnxruntime-cuda` writes (python runner, provider cuda, GPU inputs kept).
    options = CudaOptions(cudnn_conv_algo_search=CudnnSearch(SEARCH), cuda_graphs=graphs)
    backend = cuda_backend_config(ServingBackend.PYTHON, options)
    if PROVIDER_OPTIONS:
        backend = replace(backend, parameters=(*backend.parameters, *PROVIDER_OPTIONS.items()))
    if timers is not None:  # the runner's phase timers, one JSON file per instance in this folder
        backend = replace(backend, parameters=(*backend.parameters, ("runner_timers", str(timers)),
                                               *((("runner_timers_period_s", "0.25"),
                                                  ("runner_timers_batches", str(RUNNER_BATCHES)))
                                                 if RUNNER_BATCHES else ())))
    if batch_buckets is not None:
        backend = replace(backend, parameters=(*backend.parameters, ("batch_buckets", batch_buckets)))
    config = build(ConfigInputs(name=name, inputs=(INPUT,), outputs=(OUTPUT,), batch=DimRange(1, 32, MAX_BATCH),
                                serving=serving, backend=backend))
    if batching and preferred is not None:
        del config.dynamic_batching.preferred_batch_size[:]
        config.dynamic_batching.preferred_batch_size.extend(preferred)
    version = root / name / "1"
    version.mkdir(parents=True)
    shutil.copyfile(onnx, version / "model.onnx")
    shutil.copyfile(Path(python_model.__file__), version / "model.py")
    (root / name / "config.pbtxt").write_text(to_text(config))


def stub_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().startswith("triton_python"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def window_checks(level: LevelResult) -> list[dict[str, float | None]]:
    rows: list[dict[str, float | None]] = []
    for w in level.windows:
        p = w.power
        nvml_j = p.energy_j if p else None
        triton_j = p.cross_checks.get(PowerSource.TRITON) if p else None
        rows.append({"seconds": round(w.seconds, 3), "nvml_j": nvml_j, "triton_j": triton_j,
                     "triton_vs_nvml": triton_j / nvml_j if triton_j and nvml_j else None})
    return rows


def served(models: Path, *, interval_ms: int, delay_us: int, tmp: Path, instances: int | None = None,
           shm: str = "cuda", compare_shm: bool = True,
           precisions: tuple[str, ...] = PRECISIONS, also_instances: tuple[int, ...] = (),
           rounds: int = 1, pa_rounds: int = 0, timers: Path | None = None,
           variants: tuple[Variant, ...] = (), unbatched: bool = True,
           delays: tuple[int, ...] = (), trace_rate: int = 0, trace_keep: Path | None = None
           ) -> list[dict[str, Any]]:
    """Every model on one server, each load level measured in turn. `shm` is the shared memory of the
    main rows (cuda: inputs reach the runner as device tensors); FP16 is also measured with system
    shared memory and with none, to show what each host copy costs. `timers`: a folder for the runner's
    phase timers (each row then gets `runner_timers`, the runner's figures over its measured windows).
    `trace_rate`: Triton traces 1 in this many requests (0: none) and each row gets `trace`, the phases of the
    traced requests inside its measured windows; the requests' stamps are kept, gzipped, in `trace_keep`."""
    repository = tmp / "repository"
    plan: list[tuple[str, int, str]] = []  # (model, concurrency, shared memory)
    for precision in precisions:
        name = f"{precision}_batched"
        # INT8 Q/DQ: ONNX Runtime leaves some nodes on the CPU and refuses CUDA graphs (in-process step).
        write_model(repository, name, onnx_path(models, precision), batching=True, instances=instances,
                    delay_us=delay_us, graphs=precision != "int8", timers=timers)
        plan += [(name, 32, shm), (name, 256, shm)]
    for label, sizes, preferred in variants:  # batch buckets and preferred batch sizes, FP16, beside the default
        write_model(repository, f"fp16_batched_{label}", onnx_path(models, "fp16"), batching=True,
                    instances=instances, delay_us=delay_us, timers=timers, batch_buckets=sizes, preferred=preferred)
        plan += [(f"fp16_batched_{label}", 32, shm), (f"fp16_batched_{label}", 256, shm)]
    for other in delays:  # the same FP16 model with another queue delay, on the same server, in the same run
        write_model(repository, f"fp16_batched_d{other}us", onnx_path(models, "fp16"), batching=True,
                    instances=instances, delay_us=other, timers=timers)
        plan += [(f"fp16_batched_d{other}us", 32, shm), (f"fp16_batched_d{other}us", 256, shm)]
    if unbatched:
        write_model(repository, "fp16_unbatched", onnx_path(models, "fp16"), batching=False, instances=instances,
                    delay_us=0, timers=timers)
        plan += [("fp16_unbatched", 32, shm)]
    if delay_us:  # the batcher's wait at concurrency 32, where few requests queue
        write_model(repository, "fp16_batched_nodelay", onnx_path(models, "fp16"), batching=True,
                    instances=instances, delay_us=0, timers=timers)
        plan.append(("fp16_batched_nodelay", 32, shm))
    for count in also_instances:  # does another instance count help? (each is its own python stub process)
        write_model(repository, f"fp16_batched_x{count}", onnx_path(models, "fp16"), batching=True, instances=count,
                    delay_us=delay_us, timers=timers)
        plan += [(f"fp16_batched_x{count}", 32, shm), (f"fp16_batched_x{count}", 256, shm)]
    if compare_shm:
        plan += [("fp16_batched", c, kind) for kind in ("system", "none") if kind != shm for c in (32, 256)]
    # Each level again in later rounds, in the same order: run-to-run spread next to the figures.
    levels = [(model, concurrency, kind, round_) for round_ in range(1, rounds + 1)
              for model, concurrency, kind in plan]
    http, grpc, metrics = free_ports(3)
    server = TritonServer(repository, tmp / "state", Ports(http, grpc, metrics),
                          # Loading a CUDA runner (a session and a cuDNN search per bucket) outlasts the
                          # python backend's default 30 s stub timeout.
                          extra_args=["--metrics-interval-ms=100", "--backend-config=python,stub-timeout-seconds=600",
                                      # GPU inputs reach the python stubs through this pool (default 64 MB,
                                      # less than 256 requests of 602 KB in flight).
                                      "--cuda-memory-pool-byte-size=0:1073741824",
                                      *(trace_args(tmp / "trace.json", trace_rate) if trace_rate else [])])
    t0 = time.perf_counter()
    try:
        server.start(timeout=540)
    except Exception:
        log = (tmp / "state" / "tritonserver.log")
        text = log.read_text(errors="replace").splitlines() if log.is_file() else []
        wanted = [line[:400] for line in text if "Fallback mode" not in line
                  and any(k in line for k in ("rror", "failed", "UNAVAILABLE", "Exception", "memory"))]
        print("\n".join(wanted)[-8000:], flush=True)
        raise
    print(json.dumps({"server_ready_s": round(time.perf_counter() - t0, 1)}), flush=True)
    rows: list[dict[str, Any]] = []
    try:
        assert server.process is not None
        stubs = stub_pids()
        for model, concurrency, kind, round_ in levels:
            config = SessionConfig(
                models=(model,), url=f"127.0.0.1:{grpc}", levels=(LoadLevel(concurrency=concurrency),),
                measurement=Measurement(measurement_ms=interval_ms, max_trials=5, warmup_requests=2 * concurrency),
                metrics_url=f"http://127.0.0.1:{metrics}/metrics", power_source=PowerSource.NVML,
                shared_memory=SharedMemory(SharedMemoryKind(kind), 0),
            )
            cpu0 = (resource.getrusage(resource.RUSAGE_SELF), cpu_seconds(server.process.pid),
                    sum(cpu_seconds(p) for p in stubs), time.perf_counter())
            (row,) = run(config)
            me, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - cpu0[3]
            result = result_dict(row.result)
            measured = row.result.windows[-3:]  # the windows the summary and the server figures cover
            if measured:  # the client's monotonic clock: the runner stamps its periods with the same one
                result["span_monotonic_ns"] = [measured[0].start_ns, measured[-1].end_ns]
            result |= {"model": model, "shared_memory": kind, "round": round_,
                       "window_checks": window_checks(row.result),
                       "cpu_cores_busy": {
                           "client": round((me.ru_utime + me.ru_stime - cpu0[0].ru_utime - cpu0[0].ru_stime) / wall, 2),
                           "tritonserver": round((cpu_seconds(server.process.pid) - cpu0[1]) / wall, 2),
                           "python_stubs": round((sum(cpu_seconds(p) for p in stubs) - cpu0[2]) / wall, 2)}}
            rows.append(result)
            brief = {k: result[k] for k in ("model", "round", "concurrency", "shared_memory", "throughput", "stable",
                                            "cpu_cores_busy", "power", "server", "span_monotonic_ns") if k in result}
            lat = result.get("latency_us")  # None when no request of the level succeeded: its errors say why
            latency = ({"p50_ms": lat["p50"] / 1e3, "p99_ms": lat["p99"] / 1e3} if lat
                       else {"errors": result.get("errors")})
            print(json.dumps(brief | latency), flush=True)
        if pa_rounds:
            rows += compare_perf_analyzer("fp16_batched", grpc=grpc, interval_ms=interval_ms, rounds=pa_rounds,
                                          tmp=tmp)
    finally:
        log_tail = server.log_tail(40)
        server.stop()  # the runners' finalize writes their timers' last figures
    if timers is not None:
        found = read_runner_timers(timers)
        batches = read_runner_batches(timers, found)
        for r in rows:
            if "span_monotonic_ns" in r:
                r["runner_timers"] = runner_breakdown(found, r["model"], r["span_monotonic_ns"])
                if batches:
                    r["runner_batches"] = batch_breakdown(batches, r["model"], r["span_monotonic_ns"],
                                                          dropped_in(found, r["model"], r["span_monotonic_ns"]))
    if trace_rate:
        attach_traces(rows, tmp / "trace.json", trace_keep)
    rows.append({"server_log_tail": log_tail})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Where a request's time goes: Triton's statistics beside the runner's phase timers (--runner-timers)

PHASES: tuple[str, ...] = tuple(RUNNER.PHASES)
PHASE_LABELS = {
    "read_inputs": "runner: read inputs (get_input_tensor_by_name, as_numpy / to_dlpack, group)",
    "gather": "runner: gather the batch (host concatenate into staging, or issue device copies)",
    "h2d": "runner: host-to-device copy of the staging buffer (update_inplace, blocking)",
    "d2d_wait": "runner: wait for the device-to-device copies (cudaStreamSynchronize)",
    "run": "runner: ONNX Runtime run (IO binding; waits for the GPU)",
    "d2h": "runner: device-to-host copy of the outputs (OrtValue.numpy)",
    "respond": "runner: split outputs, build pb_utils tensors and responses",
}


def read_runner_timers(folder: Path) -> list[dict[str, Any]]:
    """Every instance's timer summary in `folder`, with its period lines under "intervals" (a line cut short
    by a killed stub is left out)."""
    found: list[dict[str, Any]] = []
    for path in sorted(folder.glob("*.json")):
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(summary, dict) or summary.get("format") != RUNNER.TIMERS_FORMAT:
            continue
        lines_file = folder / str(summary.get("intervals_file", ""))
        intervals = []
        for line in lines_file.read_text().splitlines() if lines_file.is_file() else []:
            try:
                intervals.append(json.loads(line))
            except ValueError:
                continue
        found.append({**summary, "intervals": intervals})
    return found


def runner_breakdown(timers: list[dict[str, Any]], model: str, span: list[int]) -> dict[str, Any] | None:
    """The runner's figures for `model` (all its instances) over the timer periods that lie wholly inside
    `span` (monotonic ns: the client's measured windows); None where no period does. Per batch, weighted by
    requests as Triton weights its own (each request counts its batch's time), so they sit beside Triton's
    per-request compute_infer."""
    lo, hi = span
    mine = [t for t in timers if t.get("model") == model]
    picked = [iv for t in mine for iv in t["intervals"] if lo <= iv["first_ns"] and iv["last_ns"] <= hi]
    requests = sum(int(iv["requests"]) for iv in picked)
    executes = sum(int(iv["executes"]) for iv in picked)
    if not requests or not executes:
        return None
    all_executes = sum(int(t["executes"]) for t in mine)
    writes_ns = sum(int(t["timer_writes"]["sum_ns"]) for t in mine)
    return {
        "periods": len(picked), "executes": executes, "requests": requests,
        "rows": sum(int(iv["rows"]) for iv in picked), "requests_per_batch": requests / executes,
        "execute_us": sum(int(iv["execute_weighted_ns"]) for iv in picked) / requests / 1e3,
        "phases_us": {p: sum(int(iv["phases_weighted_ns"].get(p, 0)) for iv in picked) / requests / 1e3
                      for p in PHASES},
        # Each write lands in one batch's compute_infer; spread over all the instances' batches of the run.
        "timer_writes_us": writes_ns / all_executes / 1e3 if all_executes else 0.0,
    }


ROW_BANDS: tuple[tuple[int, int], ...] = ((0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64),
                                          (65, 2**62))


def band(rows: int) -> str:
    a, b = next(band for band in ROW_BANDS if band[0] <= rows <= band[1])
    return str(a) if a == b else f"{a}+" if b == 2**62 else f"{a}-{b}"


def read_runner_batches(folder: Path, timers: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per model, the batch lines (runner_timers_batches) of all its instances, each with its instance's name."""
    out: dict[str, list[dict[str, Any]]] = {}
    for t in timers:
        path = folder / str(t.get("batches_file", ""))
        if not t.get("batches_file") or not path.is_file():
            continue
        for line in path.read_text().splitlines():
            try:
                batch = json.loads(line)
            except ValueError:  # a line cut short by a killed stub
                continue
            out.setdefault(str(t["model"]), []).append(batch | {"instance": t.get("instance")})
    return out


def batch_breakdown(batches: dict[str, list[dict[str, Any]]], model: str, span: list[int],
                    dropped: int = 0) -> dict[str, Any] | None:
    """`model`'s batches wholly inside `span`, grouped by rows and by rows × how many batches of the model's
    other instances were running when each started (counted over all its batches, the span's edges included):
    the run phase (ONNX Runtime, waiting for the GPU) and the execute. Groupings, not causes: at a given
    concurrency larger batches and more overlap come together, hence the cross table. `dropped`: batch lines the
    runner did not write in the span (its cap); the running counts are then lower bounds. A batch whose run
    phase is 0 (its inputs failed) is counted apart."""
    lo, hi = span
    every = batches.get(model, [])
    inside = [b for b in every if lo <= b["start_ns"] and b["start_ns"] + b["execute_ns"] <= hi]
    mine = [b for b in inside if b["run_ns"] > 0]
    if not mine:
        return None
    starts = sorted(b["start_ns"] for b in every)
    ends = sorted(b["start_ns"] + b["execute_ns"] for b in every)

    def running(b: dict[str, Any]) -> int:
        """Batches started at or before b's start and not ended by it, less b itself (a batch of its own
        instance cannot be among them: an instance runs one batch at a time)."""
        return (bisect.bisect_right(starts, b["start_ns"]) - bisect.bisect_right(ends, b["start_ns"])
                - (1 if b["execute_ns"] > 0 else 0))

    def group(members: list[dict[str, Any]]) -> dict[str, Any]:
        run = sorted(b["run_ns"] / 1e3 for b in members)
        execute = sorted(b["execute_ns"] / 1e3 for b in members)
        return {"n": len(members), "run_us_p50": percentile(run, 0.5), "run_us_p90": percentile(run, 0.9),
                "execute_us_p50": percentile(execute, 0.5), "rows_mean": statistics.fmean(b["rows"] for b in members)}

    per_band: dict[str, list[dict[str, Any]]] = {}
    per_cell: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for b in mine:
        rows = band(b["rows"])
        per_band.setdefault(rows, []).append(b)
        per_cell.setdefault((rows, running(b)), []).append(b)
    order = {band(a): i for i, (a, _) in enumerate(ROW_BANDS)}  # bands in ROW_BANDS' order, then by count
    by_rows = [{"rows": r, **group(per_band[r])} for r in sorted(per_band, key=order.__getitem__)]
    cross = [{"rows": r, "others_running": k, **group(per_cell[(r, k)])}
             for r, k in sorted(per_cell, key=lambda cell: (order[cell[0]], cell[1]))]
    return {"batches": len(mine), "failed": len(inside) - len(mine), "dropped": dropped, "by_rows": by_rows,
            "by_rows_and_running": cross}


def dropped_in(timers: list[dict[str, Any]], model: str, span: list[int]) -> int:
    """Batch lines `model`'s instances did not write (their cap) in the periods inside `span`."""
    lo, hi = span
    return sum(int(iv.get("batches_dropped", 0)) for t in timers if t.get("model") == model
               for iv in t["intervals"] if lo <= iv["first_ns"] and iv["last_ns"] <= hi)


def batch_markdown(served_rows: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for r in served_rows:
        b = r.get("runner_batches")
        if not b or "compare" in r:
            continue
        caveat = (f"; {b['dropped']} batch lines not written (the runner's cap): the running counts are lower "
                  "bounds" if b["dropped"] else "")
        lines += ["", f"Batches by rows and by the other instances' batches running at their start: {r['model']}, "
                  f"concurrency {r['concurrency']}, round {r.get('round', 1)}, {b['batches']} batches "
                  f"({b['failed']} failed, left out){caveat}", "",
                  "| rows | others running | batches | run µs p50 / p90 | execute µs p50 |", "|---|---|---|---|---|"]
        for g in b["by_rows"]:
            lines.append(f"| {g['rows']} | any | {g['n']} | {g['run_us_p50']:.0f} / {g['run_us_p90']:.0f} | "
                         f"{g['execute_us_p50']:.0f} |")
        for g in b["by_rows_and_running"]:
            lines.append(f"| {g['rows']} | {g['others_running']} | {g['n']} | {g['run_us_p50']:.0f} / "
                         f"{g['run_us_p90']:.0f} | {g['execute_us_p50']:.0f} |")
    return lines


def time_rows(server: dict[str, Any], runner: dict[str, Any]) -> list[tuple[str, float | None]]:
    """(row, µs per batch) for one measured level: Triton's figures (its per-request averages are each
    request's batch's durations), the runner's phases inside compute_infer, and the remainder
    compute_infer - sum(phases), split into what lies inside execute() between the phases, the timers' own
    file writes, and what lies outside execute() (the python stub reading the requests from shared memory
    and writing the responses back, and the IPC with the server)."""
    def get(key: str) -> float | None:
        value = server.get(key)
        return float(value) if isinstance(value, int | float) else None

    infer = get("compute_infer_us")
    phases = {p: float(runner["phases_us"].get(p, 0.0)) for p in PHASES}
    execute, writes = float(runner["execute_us"]), float(runner["timer_writes_us"])
    inside = sum(phases.values())
    rows: list[tuple[str, float | None]] = [("Triton compute_input", get("compute_input_us")),
                                            ("Triton compute_infer", infer)]
    rows += [(f"  {PHASE_LABELS[p]}", v) for p, v in phases.items()]
    rows += [("  runner: execute() wall time", execute),
             ("  remainder: compute_infer - runner phases", infer - inside if infer is not None else None),
             ("    of it inside execute(), between the phases", execute - inside),
             ("    of it the runner timers' own file writes", writes),
             ("    of it outside execute(): stub reads requests, writes responses, IPC",
              infer - execute - writes if infer is not None else None),
             ("Triton compute_output", get("compute_output_us"))]
    return rows


def where_time_goes(served_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per level (model, concurrency, shared memory) with runner figures: each row's µs per batch and per
    request (per batch / requests per batch), means over the rounds (means, so the rows still add up)."""
    levels: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in served_rows:
        if r.get("runner_timers") and "compare" not in r:
            levels.setdefault((r["model"], r["concurrency"], r["shared_memory"]), []).append(r)
    out: list[dict[str, Any]] = []
    for (model, concurrency, kind), rows in levels.items():
        per_round = [(time_rows(r["server"], r["runner_timers"]), r["runner_timers"]["requests_per_batch"])
                     for r in rows]
        labels = [label for label, _ in per_round[0][0]]
        batch = statistics.fmean(b for _, b in per_round)
        table = []
        for i, label in enumerate(labels):
            values = [v for cells, _ in per_round if (v := cells[i][1]) is not None]
            per_batch = statistics.fmean(values) if values else None
            table.append({"row": label, "us_per_batch": per_batch,
                          "us_per_request": per_batch / batch if per_batch is not None else None})
        queue = [r["server"]["queue_us"] for r in rows if r["server"].get("queue_us") is not None]
        out.append({"model": model, "concurrency": concurrency, "shared_memory": kind, "rounds": len(rows),
                    "requests_per_batch": batch, "queue_us": statistics.fmean(queue) if queue else None,
                    "executes": sum(r["runner_timers"]["executes"] for r in rows),
                    "periods": sum(r["runner_timers"]["periods"] for r in rows), "rows": table})
    return out


def where_time_goes_markdown(levels: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for level in levels:
        infer = next((r["us_per_batch"] for r in level["rows"] if r["row"] == "Triton compute_infer"), None)
        lines += ["", f"Where a request's time goes: {level['model']}, concurrency {level['concurrency']}, "
                  f"{level['shared_memory']} shared memory; mean of {level['rounds']} round(s), "
                  f"{level['executes']} executes in {level['periods']} timer periods inside the measured windows, "
                  f"{level['requests_per_batch']:.1f} requests per batch; Triton queue (each request's own wait) "
                  f"{f(level['queue_us'], '.0f')} µs", "",
                  "| where | µs per batch (what each request in it sees) | µs per request (÷ requests per batch) "
                  "| share of compute_infer |", "|---|---|---|---|"]
        for r in level["rows"]:
            inside = r["row"].startswith("  ")
            share = (f"{100 * r['us_per_batch'] / infer:.1f} %" if inside and infer and r["us_per_batch"] is not None
                     else "-")
            lines.append(f"| {r['row']} | {f(r['us_per_batch'], '.0f')} | {f(r['us_per_request'], '.1f')} | {share} |")
    return lines


OUTPUT_BYTES = 1000 * 4  # logits [1, 1000] float32: one request's output region for both tools



# ---------------------------------------------------------------------------------------------------------------
# Where the tail comes from: Triton's own per-request trace (--trace-rate N)

# Consecutive stamps of a gRPC request in Triton's trace (level TIMESTAMPS), so the phases of a request add up
# to its whole time in the server. The python backend reports a batch's compute stamps for every request in it,
# so the requests of one batch share compute_input and infer; queue includes the wait behind other batches.
TRACE_PHASES: tuple[tuple[str, str, str], ...] = (
    ("receive", "GRPC_WAITREAD_END", "QUEUE_START"),  # from the request read to the scheduler
    ("queue", "QUEUE_START", "COMPUTE_START"),  # waiting for the batcher and a free instance
    ("compute_input", "COMPUTE_START", "COMPUTE_INPUT_END"),  # Triton hands the batch's inputs to the stub
    # The stub's side: the IPC, the stub reading the requests, our runner's execute(), its responses written
    # back (the runner's own share: --runner-timers).
    ("infer", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START"),
    ("output", "COMPUTE_OUTPUT_START", "INFER_RESPONSE_COMPLETE"),  # the stub's outputs into a response
    ("send", "INFER_RESPONSE_COMPLETE", "GRPC_SEND_END"),  # written to the client
)
TAIL_SHARE = 0.01  # "the slowest requests": this share of a level's traced requests
TRACE_FLUSH = 2000  # Triton writes its traces to a new file every this many: its memory stays bounded
MAX_TRACE_RATE = 2**32 - 1  # Triton's rate is an unsigned 32-bit count


def trace_args(path: Path, rate: int) -> list[str]:
    """Triton's options for a trace of 1 in `rate` requests (every rate-th: a rate sharing no factor with the
    concurrency avoids tracing the same client's turn each time) with timestamps, written to path.0, path.1, ...
    every TRACE_FLUSH traces and at the server's stop."""
    return [f"--trace-config=triton,file={path}", f"--trace-config=triton,log-frequency={TRACE_FLUSH}",
            f"--trace-config=rate={rate}", "--trace-config=level=TIMESTAMPS", "--trace-config=count=-1"]


def trace_files(path: Path) -> list[Path]:
    """The files Triton wrote for `path`: path itself (no log frequency) and path.0, path.1, ... in order."""
    numbered = [p for p in path.parent.glob(path.name + ".*") if p.suffix[1:].isdigit()]
    return ([path] if path.is_file() else []) + sorted(numbered, key=lambda p: int(p.suffix[1:]))


def read_trace(paths: list[Path]) -> list[dict[str, Any]]:
    """Triton's trace files as one record per traced request: {"id", "model", "ns": {stamp: ns}}. Triton writes
    a request's model and each stamp as separate entries of a JSON array (one request's entries can span two
    files); they are joined by id. The stamps are the server's steady clock, which is the client's monotonic
    clock on the same machine. ValueError for a file that is no complete JSON array (a server killed before it
    closed the array)."""
    by_id: dict[int, dict[str, Any]] = {}
    for path in paths:
        for entry in json.loads(path.read_text()):
            record = by_id.setdefault(int(entry["id"]), {"id": int(entry["id"]), "model": None, "ns": {}})
            if "model_name" in entry:
                record["model"] = entry["model_name"]
            for stamp in entry.get("timestamps", ()):
                record["ns"].setdefault(stamp["name"], int(stamp["ns"]))
    return list(by_id.values())


def request_phases(record: dict[str, Any]) -> dict[str, float] | None:
    """One traced request's phases in µs and their sum ("total"); None when a stamp is missing (a failed
    request, or one over HTTP, whose stamps are named otherwise)."""
    ns = record["ns"]
    if any(a not in ns or b not in ns for _, a, b in TRACE_PHASES):
        return None
    phases = {name: (ns[b] - ns[a]) / 1e3 for name, a, b in TRACE_PHASES}
    return phases | {"total": sum(phases.values())}


def percentile(values: list[float], q: float) -> float:
    """The client's percentile (perf_analyzer's nearest rank: index q·(n−1) + 0.5, truncated) of sorted values,
    so the server's p50 and p99 sit beside perfclient's on the same rule."""
    return values[int(q * (len(values) - 1) + 0.5)]


def trace_breakdown(records: list[dict[str, Any]], model: str, span: list[int]) -> dict[str, Any] | None:
    """Per phase, over `model`'s traced requests that entered the queue inside `span` (the client's measured
    windows): p50, p99 and mean in µs; and the mean phases of the median requests (server time between its p45
    and p55) beside those of the slowest 1 % (at least one request): which phase makes the tail. Requests with
    a stamp missing ("incomplete") or out of the order TRACE_PHASES assumes ("disordered": a Triton whose
    stamps mean something else) are counted and left out. None where no traced request lies in the span."""
    lo, hi = span
    mine = [r for r in records if r["model"] == model and lo <= r["ns"].get("QUEUE_START", -1) <= hi]
    phased = [p for r in mine if (p := request_phases(r)) is not None]
    got = [p for p in phased if all(p[name] >= 0 for name, _, _ in TRACE_PHASES)]
    if not got:
        return None
    names = [name for name, _, _ in TRACE_PHASES] + ["total"]
    ordered = {n: sorted(p[n] for p in got) for n in names}
    totals = ordered["total"]
    p45, p55, tail = percentile(totals, 0.45), percentile(totals, 0.55), percentile(totals, 1 - TAIL_SHARE)
    middle = [p for p in got if p45 <= p["total"] <= p55]
    slowest = [p for p in got if p["total"] >= tail]
    return {
        "requests": len(got), "incomplete": len(mine) - len(phased), "disordered": len(phased) - len(got),
        "us": {n: {"p50": percentile(ordered[n], 0.5), "p99": percentile(ordered[n], 0.99),
                   "mean": statistics.fmean(ordered[n])} for n in names},
        "median_requests": {"n": len(middle), "us": {n: statistics.fmean(p[n] for p in middle) for n in names}},
        "slowest": {"n": len(slowest), "share": TAIL_SHARE,
                    "us": {n: statistics.fmean(p[n] for p in slowest) for n in names}},
    }


def attach_traces(rows: list[dict[str, Any]], path: Path, keep: Path | None) -> None:
    """Each measured row's `trace` from Triton's files at `path` (gzipped into `keep`, when given, for a later
    look). A trace that cannot be read is each row's {"error": ...} and one printed line, not the run's end:
    the levels were measured."""
    files = trace_files(path)
    try:
        if not files:
            raise ValueError(f"Triton wrote no trace file at {path}")
        records = read_trace(files)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(json.dumps({"trace_error": str(exc)}), flush=True)
        for r in rows:
            if "span_monotonic_ns" in r:
                r["trace"] = {"error": str(exc)}
        return
    if keep is not None:
        with gzip.open(keep, "wt") as out:
            json.dump([{"id": r["id"], "model": r["model"], "ns": r["ns"]} for r in records], out)
    for r in rows:
        if "span_monotonic_ns" in r:
            r["trace"] = trace_breakdown(records, r["model"], r["span_monotonic_ns"])


def trace_markdown(served_rows: list[dict[str, Any]], rate: int | None = None) -> list[str]:
    """Per traced level: the server's p50 and p99 beside the client's, and the mean phases of the median
    requests against the slowest 1 %."""
    rows = [r for r in served_rows if r.get("trace") and r.get("latency_us") and "compare" not in r]
    if not rows:
        return []
    names = [name for name, _, _ in TRACE_PHASES]
    lines = ["", f"Where the tail comes from (Triton's trace of 1 in {rate or 'N'} requests): per level, the "
             "server's time per request (gRPC read to response written) beside the client's, and the mean µs of "
             "each phase for the median requests (p45-p55 of the server's time) and the slowest 1 %", "",
             "| model | round | conc. | shm | traced | client p50 / p99 ms | server p50 / p99 ms | requests (n) | "
             + " | ".join(names) + " | total |", "|" + "---|" * (9 + len(names))]
    for r in rows:
        t = r["trace"]
        if "error" in t:
            lines.append(f"| {r['model']} | {r.get('round', 1)} | {r['concurrency']} | {r['shared_memory']} | "
                         f"trace unreadable: {t['error']} |" + " |" * (4 + len(names)))
            continue
        for label, part in (("median", t["median_requests"]), ("slowest 1 %", t["slowest"])):
            head = ([r["model"], str(r.get("round", 1)), str(r["concurrency"]), r["shared_memory"],
                     str(t["requests"]),
                     f"{r['latency_us']['p50'] / 1e3:.2f} / {r['latency_us']['p99'] / 1e3:.2f}",
                     f"{t['us']['total']['p50'] / 1e3:.2f} / {t['us']['total']['p99'] / 1e3:.2f}"]
                    if label == "median" else [""] * 7)
            cells = [*head, f"{label} ({part['n']})", *(f"{part['us'][n]:.0f}" for n in [*names, "total"])]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def perf_analyzer_setup(tmp: Path) -> tuple[Path, dict[str, str]]:
    """The binary and the library folder it needs (libb64 and CUDA 12's runtime, both among the pytriton wheel's
    bundled libraries); checked before any server starts, so a missing piece costs no measured level."""
    binary = Path(sys.executable).parent / "perf_analyzer"
    if not binary.is_file():
        raise SystemExit(f"bench_ort: --pa-rounds: {binary} missing (it comes with the tritonclient wheel)")
    libs = tmp / "palibs"
    libs.mkdir(exist_ok=True)
    for pattern, name in (("libb64-*.so.0d", "libb64.so.0d"), ("libcudart-*.so.12*", "libcudart.so.12")):
        found = sorted(library_dir().glob(pattern))
        if not found:
            raise SystemExit(f"bench_ort: --pa-rounds: {pattern} not found in {library_dir()}")
        shutil.copyfile(found[0], libs / name)
    return binary, {"LD_LIBRARY_PATH": str(libs)}


def compare_perf_analyzer(model: str, *, grpc: int, interval_ms: int, rounds: int, tmp: Path) -> list[dict[str, Any]]:
    """perf_analyzer (the tritonclient 2.50 wheel's binary) against perfclient on the same server and model,
    both over gRPC with inputs and outputs in CUDA shared memory, at concurrency 32 and 256, alternating
    (pa, pc, pc, pa, ...) so drift and heat fall on both alike."""
    binary, env = perf_analyzer_setup(tmp)
    rows: list[dict[str, Any]] = []
    for concurrency in (32, 256):
        for round_ in range(1, rounds + 1):
            order = ("perf_analyzer", "perfclient") if round_ % 2 else ("perfclient", "perf_analyzer")
            for tool in order:
                if tool == "perf_analyzer":
                    out = tmp / f"pa-{concurrency}-{round_}.csv"
                    cmd = [str(binary), "-m", model, "-u", f"127.0.0.1:{grpc}", "-i", "grpc",
                           "--concurrency-range", f"{concurrency}:{concurrency}",
                           "--measurement-interval", str(interval_ms), "--max-trials", "5",
                           "--shared-memory", "cuda", "--output-shared-memory-size", str(OUTPUT_BYTES),
                           "-f", str(out)]
                    try:
                        proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                                              timeout=300, check=False)
                    except (OSError, subprocess.TimeoutExpired) as exc:  # a row of its own, not the run's end
                        proc = subprocess.CompletedProcess(cmd, -1, "", f"perf_analyzer: {exc}")
                    if proc.returncode != 0 or not out.is_file():
                        row: dict[str, Any] = {"error": (proc.stdout + proc.stderr).strip().splitlines()[-3:]}
                    else:
                        with out.open() as handle:
                            got = next(csv.DictReader(handle))
                        row = {"throughput": float(got["Inferences/Second"]), "p50_us": float(got["p50 latency"]),
                               "p99_us": float(got["p99 latency"])}
                else:
                    config = SessionConfig(
                        models=(model,), url=f"127.0.0.1:{grpc}", levels=(LoadLevel(concurrency=concurrency),),
                        measurement=Measurement(measurement_ms=interval_ms, max_trials=5,
                                                warmup_requests=2 * concurrency),
                        power_source=PowerSource.NONE,
                        shared_memory=SharedMemory(SharedMemoryKind.CUDA, OUTPUT_BYTES))
                    (level,) = run(config)
                    lat = level.result.summary.latency_us
                    row = {"throughput": level.result.summary.throughput,
                           "p50_us": lat.p50 if lat else None, "p99_us": lat.p99 if lat else None}
                row |= {"compare": tool, "model": model, "concurrency": concurrency, "round": round_,
                        "shared_memory": "cuda in+out"}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def spread(values: list[float]) -> str:
    """Median and range of a level's rounds: the form every served figure is quoted in."""
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.0f} ({min(values):.0f}-{max(values):.0f})" if len(values) > 1 else f"{med:.0f}"


def summary_markdown(doc: dict[str, Any]) -> list[str]:
    """Medians and ranges over the rounds: per level, its ratio to the ceiling, p99/p50, where a request's
    time goes on the server, and perf_analyzer against perfclient."""
    ceilings = {p: r["ceiling_iobinding"]["infer_per_s"] for p, r in doc.get("in_process", {}).items()
                if p != "variants" and "error" not in r}
    levels: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    compare: dict[tuple[str, int], list[float]] = {}
    failed: dict[tuple[str, int], int] = {}
    for r in doc.get("served", []):
        if "compare" in r:
            if "throughput" in r:
                compare.setdefault((r["compare"], r["concurrency"]), []).append(r["throughput"])
            else:  # a failed round is counted in the table, not dropped from it
                failed[(r["compare"], r["concurrency"])] = failed.get((r["compare"], r["concurrency"]), 0) + 1
                compare.setdefault((r["compare"], r["concurrency"]), [])
        elif "model" in r and r.get("latency_us"):  # a level none of whose requests succeeded has no figures
            levels.setdefault((r["model"], r["concurrency"], r["shared_memory"]), []).append(r)
    lines = ["", "Served, over the rounds: median (min-max)", "",
             "| model | conc. | shm | rounds | infer/s | x ceiling | p50 ms | p99/p50 | J/inf | avg batch | "
             "server us/request: queue / input / infer / output |", "|" + "---|" * 11]
    for (model, concurrency, kind), rows in levels.items():
        p = model.split("_")[0]
        tput = [r["throughput"] for r in rows]
        ratio = [t / ceilings[p] for t in tput] if p in ceilings else []
        p50 = [r["latency_us"]["p50"] / 1e3 for r in rows]
        tail = [r["latency_us"]["p99"] / r["latency_us"]["p50"] for r in rows]
        joules = [r["power"]["j_per_infer"] for r in rows if r["power"].get("j_per_infer") is not None]
        batch = [r["server"]["avg_batch"] for r in rows if r["server"].get("avg_batch") is not None]

        def med(key: str, rows: list[dict[str, Any]] = rows) -> str:
            got = [r["server"][key] for r in rows if r["server"].get(key) is not None]
            return f"{statistics.median(got):.0f}" if got else "-"

        def fmt(values: list[float], spec: str) -> str:
            if not values:
                return "-"
            return (f"{format(statistics.median(values), spec)} ({format(min(values), spec)}-"
                    f"{format(max(values), spec)})")

        lines.append(f"| {model} | {concurrency} | {kind} | {len(rows)} | {spread(tput)} | {fmt(ratio, '.2f')} | "
                     f"{fmt(p50, '.1f')} | {fmt(tail, '.2f')} | {fmt(joules, '.4f')} | {fmt(batch, '.1f')} | "
                     f"{med('queue_us')} / {med('compute_input_us')} / {med('compute_infer_us')} / "
                     f"{med('compute_output_us')} |")
    if compare:
        lines += ["", "perf_analyzer vs perfclient, same server, gRPC, inputs and outputs in CUDA shared memory "
                  "(alternating rounds): median (min-max) infer/s", "",
                  "| concurrency | perf_analyzer | perfclient | perfclient / perf_analyzer (medians) |",
                  "|---|---|---|---|"]
        for concurrency in sorted({c for _, c in compare}):
            pa, pc = compare.get(("perf_analyzer", concurrency), []), compare.get(("perfclient", concurrency), [])
            vs = f"{statistics.median(pc) / statistics.median(pa):.3f}" if pa and pc else "-"
            cells = [spread(values) + (f" ({n} failed)" if (n := failed.get((tool, concurrency))) else "")
                     for tool, values in (("perf_analyzer", pa), ("perfclient", pc))]
            lines.append(f"| {concurrency} | {cells[0]} | {cells[1]} | {vs} |")
    return lines


def f(x: Any, spec: str) -> str:
    return format(x, spec) if isinstance(x, int | float) else "-"


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"GPU: {doc['gpu']}, driver {doc['driver']}, onnxruntime-gpu {doc['onnxruntime']}", "",
             "In-process, batch 64 (ONNX Runtime CUDA, IO binding):", "",
             "| precision | ceiling img/s | avg W | J/inf | with host copies img/s | J/inf | batch 1 img/s | J/inf |",
             "|---|---|---|---|---|---|---|---|"]
    for p, r in doc.get("in_process", {}).items():
        if p == "variants":
            continue
        if "error" in r:
            lines.append(f"| {p} | error: {r['error']} |" + " |" * 6)
            continue
        c, w = r["ceiling_iobinding"], r["runner_with_copies"]
        one = r.get("ceiling_batch1", {})
        lines.append(f"| {p} | {c['infer_per_s']:.0f} | {c['avg_w']:.0f} | {c['j_per_infer']:.4f} | "
                     f"{w['infer_per_s']:.0f} | {w['j_per_infer']:.4f} | {f(one.get('infer_per_s'), '.0f')} | "
                     f"{f(one.get('j_per_infer'), '.4f')} |")
    for label, rows in doc.get("in_process", {}).get("variants", {}).items():
        cells = [f"{p} {r['ceiling_iobinding']['infer_per_s']:.0f} img/s {r['ceiling_iobinding']['j_per_infer']:.4f} J"
                 if "error" not in r else f"{p} error: {r['error']}" for p, r in rows.items()]
        lines.append(f"\nCeiling with {label}: " + "; ".join(cells))
    lines += ["", "Served (bundled Triton 2.51, python-backend runner on CUDA, perfclient gRPC):", "",
              "| model | round | conc. | shm | infer/s | x ceiling | p50 ms | p99 ms | avg W | J/inf | avg batch "
              "| Triton/NVML J (worst window) | CPU cores client/server/stubs |", "|" + "---|" * 13]
    ceilings = {p: r["ceiling_iobinding"]["infer_per_s"] for p, r in doc["in_process"].items()
                if p != "variants" and "error" not in r}
    for r in doc.get("served", []):
        if "model" not in r or "compare" in r:
            continue
        if not r.get("latency_us"):
            lines.append(f"| {r['model']} | {r.get('round', 1)} | {r['concurrency']} | {r['shared_memory']} | "
                         f"no request succeeded: {r.get('errors')} |" + " |" * 8)
            continue
        p = r["model"].split("_")[0]
        ratios = [w["triton_vs_nvml"] for w in r["window_checks"] if w["triton_vs_nvml"] is not None]
        worst = max(ratios, key=lambda x: abs(x - 1)) if ratios else None
        cpu = r["cpu_cores_busy"]
        lines.append(
            f"| {r['model']} | {r.get('round', 1)} | {r['concurrency']} | {r['shared_memory']} | "
            f"{r['throughput']:.0f} | {f(r['throughput'] / ceilings[p] if p in ceilings else None, '.2f')} | "
            f"{r['latency_us']['p50'] / 1e3:.1f} | "
            f"{r['latency_us']['p99'] / 1e3:.1f} | {f(r['power'].get('avg_w'), '.0f')} | "
            f"{f(r['power'].get('j_per_infer'), '.4f')} | {f(r['server'].get('avg_batch'), '.1f')} | "
            f"{f(worst, '.3f')} | {cpu['client']}/{cpu['tritonserver']}/{cpu['python_stubs']} |")
    return "\n".join(lines + summary_markdown(doc) + where_time_goes_markdown(doc.get("where_time_goes", []))
                     + trace_markdown(doc.get("served", []), doc.get("trace_rate"))
                     + batch_markdown(doc.get("served", []))) + "\n"


def key_value(value: str) -> tuple[str, str]:
    """KEY=VALUE of a provider option; anything else is argparse's one line."""
    key, sep, val = value.partition("=")
    if not key or not sep:
        raise argparse.ArgumentTypeError(f"{value!r}: expected KEY=VALUE")
    return key, val


def main() -> int:
    global SEARCH, RUNNER_BATCHES
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, required=True, help="repository with efficientnet_lite0_{fp32,fp16,int8}")
    p.add_argument("--out", type=Path, default=Path("reports/gpu"))
    p.add_argument("--interval-ms", type=int, default=3000)
    p.add_argument("--in-process-seconds", type=float, default=3.0)
    p.add_argument("--delay-us", type=int, default=1000, help="dynamic batching max queue delay")
    p.add_argument("--search", default=SEARCH, help="cudnn_conv_algo_search of every runner")
    p.add_argument("--instances", type=int, default=None,
                   help="model instances (python stubs) per served model (default: the product's, "
                        f"{GPU_RUNNER_INSTANCES} for the python runner on CUDA)")
    p.add_argument("--shared-memory", default="cuda", choices=("cuda", "system", "none"),
                   help="how perfclient sends the main rows' inputs (FP16 is also measured with the others)")
    p.add_argument("--served-precisions", default=",".join(PRECISIONS), help="precisions served (fp16 always)")
    p.add_argument("--rounds", type=int, default=1, help="measure every served level this many times, in turn")
    p.add_argument("--also-instances", default="", help="FP16 also served with these instance counts (e.g. 2,8)")
    p.add_argument("--no-compare-shm", action="store_true", help="skip FP16 with the other shared-memory kinds")
    p.add_argument("--no-unbatched", action="store_true", help="skip FP16 served without dynamic batching")
    p.add_argument("--batching-variant", action="append", default=[], type=batching_variant,
                   metavar="NAME=BUCKETS[/PREFERRED]",
                   help="FP16 also served as fp16_batched_NAME with the runner's batch_buckets BUCKETS (pow2, "
                        "fine or sizes) and Triton's preferred batch sizes PREFERRED (default, buckets, or sizes); "
                        "repeatable")
    p.add_argument("--delay-variant", action="append", default=[], type=int, metavar="US",
                   help="FP16 also served as fp16_batched_dUSus with this max queue delay (us), at 32 and 256; "
                        "repeatable")
    p.add_argument("--provider-option", action="append", default=[], metavar="KEY=VALUE", type=key_value,
                   help="extra CUDA provider option for every runner, in-process and served (repeatable)")
    p.add_argument("--in-process-variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   type=lambda v: dict(key_value(kv) for kv in v.split(",")),
                   help="also measure the in-process ceiling with these extra provider options (repeatable)")
    p.add_argument("--pa-rounds", type=int, default=0,
                   help="also compare perf_analyzer with perfclient on FP16 at 32 and 256, this many rounds each")
    p.add_argument("--runner-timers", action="store_true",
                   help="serve with the runner's phase timers on (files in OUT/runner_timers) and print where a "
                        "request's time goes per level")
    p.add_argument("--runner-batches", type=int, default=0, metavar="N",
                   help="with --runner-timers: the runner also writes up to N batch lines per instance and 0.25 "
                        "s period (the timers' period then, for every figure of theirs), and each level gets its "
                        "batches' run times by rows and by the other instances' batches running at their start")
    p.add_argument("--trace-rate", type=int, default=0, metavar="N",
                   help="Triton traces 1 in N served requests (timestamps; a prime N such as 23 avoids tracing "
                        "the same client's turn) and each level gets where its tail comes from: the phases of its "
                        "median requests against its slowest 1 %%; the stamps are kept in OUT/triton_trace.json.gz. "
                        "Tracing adds work to the server: a diagnosis, not a run for the headline figures")
    p.add_argument("--skip", default="", help="comma-separated steps to skip: shape,ablation,inprocess,served")
    args = p.parse_args()
    names = [name for name, _, _ in args.batching_variant]
    if len(set(names)) < len(names):
        p.error(f"--batching-variant: each NAME once, got {', '.join(names)}")
    if any(d < 0 or d == args.delay_us for d in args.delay_variant) or len(set(args.delay_variant)) < len(
            args.delay_variant):
        p.error(f"--delay-variant: each a whole number of microseconds >= 0, once, other than --delay-us "
                f"({args.delay_us}); got {args.delay_variant}")
    if not 0 <= args.trace_rate <= MAX_TRACE_RATE:
        p.error(f"--trace-rate {args.trace_rate}: expected a whole number 1..{MAX_TRACE_RATE} (or 0: no trace)")
    if args.trace_rate and "served" in set(args.skip.split(",")):
        p.error("--trace-rate with --skip served: the trace is of the served levels, which would not run")
    if (args.runner_batches and not args.runner_timers) or args.runner_batches < 0:
        p.error(f"--runner-batches {args.runner_batches}: expected a whole number >= 1, with --runner-timers")
    SEARCH = args.search
    PROVIDER_OPTIONS.update(dict(args.provider_option))
    RUNNER_BATCHES = args.runner_batches
    variants: list[dict[str, str]] = args.in_process_variant
    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    import onnxruntime as ort

    nvml = Nvml()
    doc: dict[str, Any] = {"gpu": nvml.gpu, "driver": nvml.driver, "onnxruntime": ort.__version__,
                           "command": " ".join(sys.argv), "cudnn_conv_algo_search": SEARCH, "max_batch": MAX_BATCH,
                           "delay_us": args.delay_us, "trace_rate": args.trace_rate}
    if "shape" not in skip:
        doc["shape_change"] = shape_change(args.models)
        print(json.dumps({"shape_change": doc["shape_change"]}), flush=True)
    if "ablation" not in skip:
        doc["ablation"] = ablation(args.models, args.in_process_seconds)
    doc["provider_options"] = PROVIDER_OPTIONS
    doc["in_process"] = {} if "inprocess" in skip else in_process(args.models, nvml, args.in_process_seconds,
                                                                   variants)
    if args.pa_rounds and "served" not in skip:
        with tempfile.TemporaryDirectory(prefix="ort-gpu-bench-pa-") as check:
            perf_analyzer_setup(Path(check))
    if "served" not in skip:
        with tempfile.TemporaryDirectory(prefix="ort-gpu-bench-") as tmp:
            doc["served"] = served(args.models, interval_ms=args.interval_ms, delay_us=args.delay_us, tmp=Path(tmp),
                                   instances=args.instances, shm=args.shared_memory,
                                   compare_shm=not args.no_compare_shm,
                                   also_instances=tuple(int(n) for n in args.also_instances.split(",") if n),
                                   rounds=args.rounds, pa_rounds=args.pa_rounds,
                                   variants=tuple(args.batching_variant), unbatched=not args.no_unbatched,
                                   delays=tuple(args.delay_variant), trace_rate=args.trace_rate,
                                   trace_keep=(args.out / "triton_trace.json.gz").resolve(),
                                   timers=(args.out / "runner_timers").resolve() if args.runner_timers else None,
                                   precisions=tuple(p for p in PRECISIONS
                                                    if p in args.served_precisions.split(",") or p == "fp16"))
    doc["instances"] = args.instances if args.instances is not None else GPU_RUNNER_INSTANCES
    if args.runner_timers and doc.get("served"):
        doc["where_time_goes"] = where_time_goes(doc["served"])
    (args.out / "ort_gpu_bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    if doc["in_process"] or doc.get("served"):  # whatever ran gets its table, whichever steps were skipped
        table = markdown(doc)
        (args.out / "ort_gpu_bench.md").write_text(table)
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
