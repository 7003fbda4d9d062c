"""GPU benchmark: Triton (bundled binary) serving a PyTorch FP16 ResNet-50 on CUDA, loaded by
perfclient at concurrency 1, 8 and 32 with and without dynamic batching; energy from NVML's
counter, cross-checked against Triton's nv_energy_consumption and against integrated instant power.

    python bench/gpu/bench_gpu.py [--out DIR] [--interval-ms 5000] [--concurrency 1,8,32]

Configurations come from the project's config writer (builder.repository.triton_config), switched to a GPU
instance group. Writes gpu_bench.json and gpu_bench.md to --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from builder.repository.triton_config import BackendConfig, ConfigInputs, InstanceKind, TritonBackend, build, to_text
from builder.serving.triton_server import Ports, TritonServer, free_ports
from builder.spec import DimRange, ServingSpec, TensorSpec
from client.engine import LevelResult, LoadLevel, Measurement
from client.power import PowerFigures, PowerSource
from client.report import result_dict
from client.session import SessionConfig, run

HERE = Path(__file__).resolve().parent
MAX_BATCH = 64


def make_repository(root: Path, delay_us: int) -> dict[str, bool]:
    models = {"resnet50_fp16_batched": True, "resnet50_fp16_unbatched": False}
    for name, batching in models.items():
        serving = ServingSpec(instances=1, dynamic_batching=batching, max_queue_delay_us=delay_us)
        config = build(ConfigInputs(
            name=name, inputs=(TensorSpec("input", "float32", (-1, 3, 224, 224)),),
            outputs=(TensorSpec("logits", "float32", (-1, 1000)),), batch=DimRange(1, 32, MAX_BATCH),
            serving=serving,
            backend=BackendConfig(TritonBackend.PYTHON, "model.py", InstanceKind.GPU),
        ))
        config.ClearField("parameters")  # the torch model reads no ONNX file
        (root / name / "1").mkdir(parents=True)
        shutil.copyfile(HERE / "torch_resnet_model.py", root / name / "1" / "model.py")
        (root / name / "config.pbtxt").write_text(to_text(config))
    return models


def cross_check(power: PowerFigures) -> dict[str, float | None]:
    """Triton's energy counter and the integrated NVML samples, each as a ratio to NVML's counter."""
    nvml = power.energy_j

    def ratio(x: float | None) -> float | None:
        return x / nvml if x is not None and nvml is not None and nvml > 0 else None

    return {"triton_vs_nvml": ratio(power.cross_checks.get(PowerSource.TRITON)),
            "samples_vs_nvml": ratio(power.energy_j_from_samples)}


def window_cross_checks(level: LevelResult) -> list[dict[str, float | None]]:
    rows: list[dict[str, float | None]] = []
    for w in level.windows:
        p = w.power
        rows.append({"seconds": w.seconds, "nvml_j": p.energy_j if p else None,
                     "triton_j": p.cross_checks.get(PowerSource.TRITON) if p else None,
                     "samples_j": p.energy_j_from_samples if p else None})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("reports/gpu"))
    p.add_argument("--interval-ms", type=int, default=5000)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--delay-us", type=int, default=2000, help="dynamic batching max queue delay")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp_name:
        tmp = Path(tmp_name)
        repository = tmp / "repository"
        models = make_repository(repository, args.delay_us)
        http, grpc, metrics = free_ports(3)
        # GPU metrics every 100 ms (default 2 s), so energy deltas line up with 5 s windows.
        server = TritonServer(repository, tmp / "state", Ports(http, grpc, metrics),
                              extra_args=["--metrics-interval-ms=100"])
        server.start(timeout=300)
        try:
            for model in models:
                for concurrency in levels:
                    config = SessionConfig(
                        models=(model,), url=f"127.0.0.1:{grpc}", levels=(LoadLevel(concurrency=concurrency),),
                        measurement=Measurement(measurement_ms=args.interval_ms, max_trials=6, warmup_requests=50),
                        metrics_url=f"http://127.0.0.1:{metrics}/metrics",
                    )
                    (row,) = run(config)
                    result = result_dict(row.result)
                    result["model"] = model
                    result["dynamic_batching"] = models[model]
                    result["cross_check"] = cross_check(row.result.power)
                    result["window_cross_checks"] = window_cross_checks(row.result)
                    rows.append(result)
                    print(json.dumps({k: result[k] for k in ("model", "concurrency", "throughput", "stable")}
                                     | {"power": result["power"]}), flush=True)
        finally:
            log_tail = server.log_tail(5)
            server.stop()
    import pynvml

    pynvml.nvmlInit()
    gpu = str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)))
    driver = str(pynvml.nvmlSystemGetDriverVersion())
    pynvml.nvmlShutdown()
    (args.out / "gpu_bench.json").write_text(json.dumps({"gpu": gpu, "driver": driver, "results": rows,
                                                         "server_log_tail": log_tail}, indent=2) + "\n")
    table = markdown(gpu, driver, rows)
    (args.out / "gpu_bench.md").write_text(table)
    print(table)
    return 0


def markdown(gpu: str, driver: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"GPU: {gpu}, driver {driver}", "",
             "| dynamic batching | concurrency | infer/s | p50 ms | p99 ms | avg W | J/infer | infer/J | avg batch "
             "| Triton J / NVML J | samples J / NVML J | stable |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x: Any, spec: str) -> str:
        return format(x, spec) if isinstance(x, int | float) else "-"

    for r in rows:
        p, c = r["power"], r["cross_check"]
        lines.append(
            f"| {'on' if r['dynamic_batching'] else 'off'} | {r['concurrency']} | {r['throughput']:.1f} | "
            f"{r['latency_us']['p50'] / 1e3:.2f} | {r['latency_us']['p99'] / 1e3:.2f} | {f(p.get('avg_w'), '.1f')} | "
            f"{f(p.get('j_per_infer'), '.4f')} | {f(p.get('infer_per_j'), '.2f')} | "
            f"{r['server']['avg_batch']:.1f} | {f(c['triton_vs_nvml'], '.3f')} | {f(c['samples_vs_nvml'], '.3f')} | "
            f"{'yes' if r['stable'] else 'no'} |")
    by = {(r["dynamic_batching"], r["concurrency"]): r for r in rows}
    if (True, 32) in by and (False, 32) in by:
        on, off = by[(True, 32)], by[(False, 32)]
        gain = on["throughput"] / off["throughput"]
        ipj_on, ipj_off = on["power"].get("infer_per_j"), off["power"].get("infer_per_j")
        eff = f"{ipj_on / ipj_off:.2f}x" if ipj_on and ipj_off else "-"
        lines += ["", f"Dynamic batching at concurrency 32: throughput {gain:.2f}x, inferences per joule {eff}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
