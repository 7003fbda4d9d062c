"""One validation pass of the GPU serving path on a lent GPU machine, with the product's own configs,
runner and launcher (see docs/gpu.md, "ONNX Runtime CUDA on a GPU").

    python bench/gpu/validate_gpu.py prepare --source REPO --models efficientnet_lite0_fp16,... --out DIR
    python bench/gpu/validate_gpu.py check --repository DIR --out OUT

`prepare` (any host): copies each variant of a CPU-built repository (`trtbuild engines`) and rewrites its
config.pbtxt to what `--runtime onnxruntime-cuda` writes (the runtime's own `cuda_backend_config`: KIND_GPU,
provider cuda, HEURISTIC search, CUDA graphs) with the current runner as 1/model.py. A CUDA build itself
cannot run where no GPU is. `check` (the GPU host): starts the bundled Triton through `TritonServer` with its
default arguments (stub timeout 300 s), compares each model's answers over gRPC with the same ONNX file run
in-process by ONNX Runtime's CUDA provider, and prints one JSON line per step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from builder.repository import triton_config
from builder.runtimes.onnxruntime_cuda import CudaOptions, cuda_backend_config
from builder.spec.enums import ServingBackend


def prepare(source: Path, models: list[str], out: Path, *, kind_cpu_twin: bool = False) -> None:
    runner = Path(triton_config.__file__).with_name("python_model.py").read_text(encoding="utf-8")
    backend = cuda_backend_config(ServingBackend.PYTHON, CudaOptions())
    for name in models:
        src, dst = source / name, out / name
        if dst.exists():
            shutil.rmtree(dst)
        (dst / "1").mkdir(parents=True)
        shutil.copy2(src / "1" / "model.onnx", dst / "1" / "model.onnx")
        (dst / "1" / "model.py").write_text(runner, encoding="utf-8")
        config = triton_config.parse((src / "config.pbtxt").read_text(encoding="utf-8"))
        for group in config.instance_group:
            group.kind = group.KIND_GPU
        for key, value in backend.parameters:
            config.parameters[key].string_value = value
        (dst / "config.pbtxt").write_text(triton_config.to_text(config), encoding="utf-8")
        print(f"{dst}: GPU config written")
        if kind_cpu_twin:  # the same runner and provider under a KIND_CPU instance group: isolates KIND_GPU
            twin = out / f"{name}_kindcpu"
            if twin.exists():
                shutil.rmtree(twin)
            (twin / "1").mkdir(parents=True)
            shutil.copy2(dst / "1" / "model.onnx", twin / "1" / "model.onnx")
            (twin / "1" / "model.py").write_text(runner, encoding="utf-8")
            config.name = twin.name
            for group in config.instance_group:
                group.kind = group.KIND_CPU
            (twin / "config.pbtxt").write_text(triton_config.to_text(config), encoding="utf-8")


def _inputs(config: Any, batch: int, seq: int, rng: np.random.Generator) -> dict[str, NDArray[Any]]:
    arrays: dict[str, NDArray[Any]] = {}
    for tensor in config.input:
        dims = [seq if d < 0 else d for d in tensor.dims]
        shape = (batch, *dims)
        if "mask" in tensor.name:
            arrays[tensor.name] = np.ones(shape, dtype=np.int64)
        elif "ids" in tensor.name:
            arrays[tensor.name] = rng.integers(1000, 20000, size=shape, dtype=np.int64)
        else:
            arrays[tensor.name] = rng.standard_normal(shape).astype(np.float32)
    return arrays


def check_answers(repository: Path, grpc_url: str, http_url: str) -> list[dict[str, Any]]:
    import onnxruntime as ort
    import tritonclient.grpc as grpcclient
    clients: dict[str, Any] = {"grpc": (grpcclient, grpcclient.InferenceServerClient(grpc_url))}
    # The same requests with their inputs in CUDA shared memory: the runner gets them as device tensors.
    clients["grpc-cudashm"] = (grpcclient, grpcclient.InferenceServerClient(grpc_url))
    try:  # the GPU machines' tritonclient has no HTTP extra (geventhttpclient)
        import tritonclient.http as httpclient

        clients["http"] = (httpclient, httpclient.InferenceServerClient(http_url, network_timeout=300.0))
    except (ImportError, RuntimeError) as exc:
        print(json.dumps({"http": f"skipped: {exc}"}), flush=True)
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    for model_dir in sorted(p for p in repository.iterdir() if (p / "config.pbtxt").is_file()):
        config = triton_config.parse((model_dir / "config.pbtxt").read_text(encoding="utf-8"))
        session = ort.InferenceSession(str(model_dir / "1" / "model.onnx"),
                                       providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        cpu = ort.InferenceSession(str(model_dir / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
        # Several batch sizes and (MiniLM) sequence lengths in a row: the shapes a dynamic batcher sends.
        for batch, seq in ((1, 16), (5, 64), (8, 128), (3, 7)):
            if batch > max(config.max_batch_size, 1):
                continue
            feeds = _inputs(config, batch, seq, rng)
            for protocol in clients:
                rows.append(_compare(clients[protocol], protocol, config, feeds, session, cpu, batch, seq))
    return rows


def _compare(pair: Any, protocol: str, config: Any, feeds: dict[str, NDArray[Any]], session: Any, cpu: Any,
             batch: int, seq: int) -> dict[str, Any]:
    """One request: the served answer against ONNX Runtime CUDA in-process; an error is recorded, not raised."""
    module, client = pair
    row: dict[str, Any] = {"model": config.name, "protocol": protocol, "batch": batch,
                           "seq": seq if any(a.dtype == np.int64 for a in feeds.values()) else None}
    buffers: list[Any] = []
    try:
        request = []
        for name, array in feeds.items():
            item = module.InferInput(name, list(array.shape), "INT64" if array.dtype == np.int64 else "FP32")
            if protocol.endswith("cudashm"):
                from client.cuda_memory import DeviceBuffer, runtime

                buffer = DeviceBuffer(runtime("validate"), array.nbytes, 0)
                buffers.append(buffer)
                buffer.write(np.ascontiguousarray(array).tobytes())
                region = f"validate_{config.name}_{name}_{len(buffers)}"
                client.register_cuda_shared_memory(region, buffer.raw_handle_b64(), 0, array.nbytes)
                item.set_shared_memory(region, array.nbytes)
            else:
                item.set_data_from_numpy(array)
            request.append(item)
        outputs = [module.InferRequestedOutput(o.name) for o in config.output]
        t0 = time.perf_counter()
        answer = client.infer(config.name, request, outputs=outputs)
        row["served_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        response = answer.get_response()
        grpc = protocol.startswith("grpc")
        row["response_outputs"] = str(response.outputs if grpc else response.get("outputs"))[:600]
        if grpc:
            row["raw_output_bytes"] = [len(b) for b in response.raw_output_contents]
        for output in config.output:
            got = answer.as_numpy(output.name)
            want = session.run([output.name], feeds)[0]
            ref_cpu = cpu.run([output.name], feeds)[0]
            a, b = got.reshape(batch, -1).astype(np.float64), want.reshape(batch, -1).astype(np.float64)
            cos = float(np.min(np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))
            row |= {"output": output.name, "max_abs_diff_vs_ort_cuda": float(np.max(np.abs(got - want))),
                    "min_cosine_vs_ort_cuda": cos,
                    "max_abs_diff_ort_cuda_vs_cpu": float(np.max(np.abs(want - ref_cpu))),
                    "session_providers": session.get_providers()[:1]}
            row["ok"] = bool(row["max_abs_diff_vs_ort_cuda"] <= 1e-2 and cos >= 0.999)
    except Exception as exc:  # noqa: BLE001 -- a failed answer is this row's result
        row |= {"ok": False, "error": repr(exc)[:600]}
    finally:
        if buffers:
            try:  # a server that died mid-check cannot answer; the buffers are freed all the same
                client.unregister_cuda_shared_memory()
            except Exception as exc:  # noqa: BLE001 -- recorded with the row
                row |= {"ok": False, "cleanup_error": repr(exc)[:300]}
            for buffer in buffers:
                buffer.free()
    print(json.dumps(row), flush=True)
    return row


def in_process_runner(repository: Path) -> list[dict[str, Any]]:
    """The runner's own classes outside Triton: run_many over two requests against one ORT CUDA session."""
    import onnxruntime as ort

    from builder.repository import python_model

    rows: list[dict[str, Any]] = []
    for model_dir in sorted(p for p in repository.iterdir() if (p / "config.pbtxt").is_file()):
        if model_dir.name.endswith("_kindcpu"):
            continue
        config = triton_config.parse((model_dir / "config.pbtxt").read_text(encoding="utf-8"))
        path = str(model_dir / "1" / "model.onnx")
        row: dict[str, Any] = {"model": config.name, "step": "in-process runner"}
        try:
            params = {k: v.string_value for k, v in config.parameters.items()}
            runner: Any = python_model.make_runner(path, params, config.max_batch_size)  # type: ignore[no-untyped-call]
            session = ort.InferenceSession(path, providers=["CUDAExecutionProvider"])
            feeds = _inputs(config, 3, 64, np.random.default_rng(1))
            got = runner.run_many([{k: v[:1] for k, v in feeds.items()}, {k: v[1:] for k, v in feeds.items()}])[0]
            want = session.run(None, feeds)[0]
            row |= {"shape": list(got.shape), "max_abs_diff": float(np.max(np.abs(got - want))),
                    "runner": runner.describe()}
            del runner
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:600]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def check(repository: Path, out: Path, loads: list[tuple[str, str]], concurrencies: tuple[int, ...] = (32,)) -> int:
    from builder.serving.triton_server import Ports, TritonServer, free_ports

    out.mkdir(parents=True, exist_ok=True)
    http, grpc, metrics = free_ports(3)
    # The product's defaults, as `trtbuild serve` decides them (MPS where it would run under MPS).
    server = TritonServer(repository, out / "state", Ports(http, grpc, metrics), mps=None)
    doc: dict[str, Any] = {"repository": str(repository), "in_process_runner": in_process_runner(repository)}
    t0 = time.perf_counter()
    try:
        server.start(timeout=400)
        doc["server_ready_s"] = round(time.perf_counter() - t0, 1)
        doc["mps"] = {"used": server.mps_used, "note": server.mps_note}  # the figures mean different things
        print(json.dumps({"server_ready_s": doc["server_ready_s"], "mps": doc["mps"]}), flush=True)
        doc["answers"] = check_answers(repository, f"127.0.0.1:{grpc}", f"127.0.0.1:{http}")
    except Exception as exc:  # noqa: BLE001 -- keep what the server said
        doc["error"] = repr(exc)
        print(json.dumps({"error": repr(exc)}), flush=True)
        print(server.log_tail(60), flush=True)
        server.stop()
        (out / "validate.json").write_text(json.dumps(doc, indent=2))
        return 1
    doc["perfclient"] = []
    try:
        for model, shm in loads:
            for concurrency in concurrencies:
                doc["perfclient"].append(perfclient(model, shm, repository=repository, grpc=grpc, metrics=metrics,
                                                    out=out, concurrency=concurrency))
    finally:
        doc["server_log_tail"] = server.log_tail(30)
        server.stop()
        (out / "validate.json").write_text(json.dumps(doc, indent=2))
    return exit_status(doc)


def exit_status(doc: dict[str, Any]) -> int:
    """0 only when every answer matched, the in-process runner ran and every perfclient load exited 0."""
    answers = doc.get("answers") or []
    ok = (bool(answers) and all(r.get("ok") for r in answers)
          and all("error" not in r for r in doc.get("in_process_runner", []))
          and all(r.get("rc") == 0 for r in doc.get("perfclient", [])))
    return 0 if ok else 2


def concurrencies(value: str) -> tuple[int, ...]:
    """--concurrency C[,C...], each a whole number >= 1."""
    try:
        levels = tuple(int(c) for c in value.split(","))
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected whole numbers >= 1, comma-separated")
    return levels


def load_arg(value: str) -> tuple[str, str]:
    """--load MODEL:SHM."""
    model, _, shm = value.rpartition(":")
    if not model or shm not in ("none", "system", "cuda"):
        raise argparse.ArgumentTypeError(f"{value!r}: expected MODEL:SHM with SHM none, system or cuda")
    return model, shm


def perfclient(model: str, shm: str, *, repository: Path, grpc: int, metrics: int, out: Path,
               concurrency: int = 32) -> dict[str, Any]:
    """The perfclient CLI at `concurrency` with NVML power; its JSON report and its printed table.
    A variable dim (MiniLM's sequence) is sent at 128."""
    config = triton_config.parse((repository / model / "config.pbtxt").read_text(encoding="utf-8"))
    shapes = [a for t in config.input if -1 in t.dims
              for a in ("--shape", f"{t.name}:" + ",".join("128" if d < 0 else str(d) for d in t.dims))]
    report = out / f"perf_{model}_{shm}_c{concurrency}.json"
    cmd = [sys.executable, "-m", "client.cli", "-m", model, "-u", f"127.0.0.1:{grpc}",
           "--concurrency", str(concurrency), "--shared-memory", shm,
           "--measurement-interval", "3000", "--max-trials", "5",
           "--power-source", "nvml", "--metrics-url", f"http://127.0.0.1:{metrics}/metrics",
           "--json", str(report), "--no-progress", *shapes]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, check=False)
    row: dict[str, Any] = {"model": model, "shared_memory": shm, "concurrency": concurrency,
                           "command": " ".join(cmd[1:]), "rc": done.returncode,
                           "wall_s": round(time.perf_counter() - t0, 1), "stdout": done.stdout[-3000:],
                           "stderr": done.stderr[-2000:]}
    if report.is_file():
        row["report"] = json.loads(report.read_text())
    print(done.stdout[-2500:], done.stderr[-1500:], json.dumps({k: row[k] for k in ("model", "shared_memory", "rc")}),
          flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--source", type=Path, required=True)
    a.add_argument("--models", required=True)
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--kind-cpu-twin", action="store_true")
    b = sub.add_parser("check")
    b.add_argument("--repository", type=Path, required=True)
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--load", action="append", default=[], type=load_arg,
                   help="MODEL:SHM (none|system|cuda), repeatable")
    b.add_argument("--concurrency", default=(32,), type=concurrencies,
                   help="comma-separated concurrencies of each --load")
    args = p.parse_args()
    if args.step == "prepare":
        prepare(args.source, args.models.split(","), args.out, kind_cpu_twin=args.kind_cpu_twin)
        return 0
    return check(args.repository, args.out, args.load, args.concurrency)


if __name__ == "__main__":
    sys.exit(main())
