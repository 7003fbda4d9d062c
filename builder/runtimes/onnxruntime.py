"""ONNX Runtime on the CPU: the reference executor every variant is compared with (OnnxRuntimeReference), and
the runtime where TensorRT is absent (OnnxRuntimeCPU: the variant ONNX itself is the artifact)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from numpy.typing import NDArray

from builder.repository.onnx_files import copy_model
from builder.repository.triton_config import BackendConfig, InstanceKind, TritonBackend
from builder.runtimes.base import CompileTarget, Outputs
from builder.runtimes.base import feeds as sample_feeds
from builder.runtimes.base import join as join_outputs
from builder.spec.enums import ServingBackend


def _ort_errors() -> tuple[type[Exception], ...]:
    """ONNX Runtime's own exception types (its pybind layer derives them from Exception directly)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    names = ("Fail", "InvalidArgument", "NoSuchFile", "NoModel", "EngineError", "RuntimeException",
             "InvalidProtobuf", "ModelLoaded", "NotImplemented", "InvalidGraph", "EPFail")
    found = (getattr(state, name, None) for name in names)
    return tuple(t for t in found if isinstance(t, type) and issubclass(t, Exception))


ORT_ERRORS = _ort_errors()


def ort_session(path: Path, intra_op_threads: int = 0, *, arena: bool = True,
                optimize: bool = True) -> ort.InferenceSession:
    """A CPU session; `arena` False: memory goes back as each run frees it (the arena keeps its high-water mark for
    the session's life, which a session returning every tensor of a graph makes a graph's worth); `optimize` False:
    no graph optimizations (each node computed as the graph says, whatever tensors are exposed)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    options.enable_cpu_mem_arena = arena
    if intra_op_threads:
        options.intra_op_num_threads = intra_op_threads
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def run_session(session: ort.InferenceSession, samples: Mapping[str, NDArray[Any]],
                batch_size: int | None) -> Outputs:
    """Run every sample through the session in batches; outputs concatenated along axis 0. A model
    that does not batch (`batch_size` None) runs each sample whole; outputs stacked on a new axis 0."""
    names = [o.name for o in session.get_outputs()]
    chunks: dict[str, list[NDArray[Any]]] = {n: [] for n in names}
    for feed in sample_feeds(samples, batch_size):
        for name, value in zip(names, session.run(names, feed), strict=True):
            chunks[name].append(np.asarray(value))
    return join_outputs(chunks, batch_size)


def run_file(path: Path, samples: Mapping[str, NDArray[Any]], batch_size: int | None) -> Outputs:
    return run_session(ort_session(path), samples, batch_size)


def ort_throughput(path: Path, feed: Mapping[str, NDArray[Any]], threads: int = 0, seconds: float = 1.0) -> float:
    """Inferences per second of one feed, repeated for `seconds` after three warm-up runs."""
    session = ort_session(path, threads)
    for _ in range(3):
        session.run(None, dict(feed))
    batch = len(next(iter(feed.values())))
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        session.run(None, dict(feed))
        runs += 1
    return runs * batch / (time.perf_counter() - start)


# Runs per round at least: a round of one or two runs (PP-OCRv4 rec at 0.15 s) is one or two samples of the
# machine's noise, and a pick was made on such rounds (builder/summary.PICK_MARGIN). A model slower than that
# stops a round after MAX_ROUND_SECONDS (one run at least), so the build's time stays bounded.
MIN_ROUND_RUNS = 3
MAX_ROUND_SECONDS = 1.0


def ort_rounds(paths: Sequence[Path], feed: Mapping[str, NDArray[Any]], *, batch: int = 1, threads: int = 0,
               rounds: int = 3, seconds: float = 0.15) -> list[list[float]]:
    """Inferences per second of one feed under each model, in `rounds` short rounds taken in turn (model 1,
    model 2, ..., then again), so that a change in the machine's load falls on all of them alike; each session
    opened once with `threads` intra-op threads (0: ONNX Runtime's default, as the served runner) and warmed
    up by three runs first. Each round lasts `seconds`, and MIN_ROUND_RUNS runs where they fit in
    MAX_ROUND_SECONDS. `batch`: the inferences one run of the feed makes."""
    sessions = [ort_session(path, threads) for path in paths]
    for session in sessions:
        for _ in range(3):
            session.run(None, dict(feed))
    found: list[list[float]] = [[] for _ in sessions]
    for _ in range(rounds):
        for session, figures in zip(sessions, found, strict=True):
            runs, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds or runs == 0 or (
                    runs < MIN_ROUND_RUNS and elapsed < MAX_ROUND_SECONDS):
                session.run(None, dict(feed))
                runs += 1
            figures.append(runs * batch / (time.perf_counter() - start))
    return found


class OnnxRuntimeReference:
    """The steps' reference executor (runtimes.base.ReferenceExecutor): ONNX Runtime on the CPU, all graph
    optimizations, its default threads."""

    name = "onnxruntime"
    errors = ORT_ERRORS

    def run(self, path: Path, samples: Mapping[str, NDArray[Any]], batch_size: int | None) -> Outputs:
        return run_file(path, samples, batch_size)

    def throughput(self, path: Path, feed: Mapping[str, NDArray[Any]], *, seconds: float = 1.0) -> float:
        return ort_throughput(path, feed, seconds=seconds)


class OnnxRuntimeCPU:
    """The variant ONNX is the artifact; Triton serves it through the chosen backend."""

    name = "onnxruntime"
    artifact = "model.onnx"

    def __init__(self, serving_backend: ServingBackend = ServingBackend.PYTHON) -> None:
        self.serving_backend = serving_backend

    def identity(self) -> dict[str, str]:
        return {"onnxruntime": ort.__version__, "serving_backend": self.serving_backend.value}

    def served_options(self, artifact: Path) -> dict[str, str]:
        return {}

    def carry_over(self, previous: Path, version_dir: Path, target: CompileTarget) -> None:
        """Nothing to carry: the artifact is rebuilt from the variant ONNX in a copy."""

    def compile(self, onnx_path: Path, out_path: Path, target: CompileTarget) -> None:
        copy_model(onnx_path, out_path)  # with its data file, if it has one

    def run(self, artifact: Path, samples: Mapping[str, NDArray[Any]], batch_size: int | None) -> Outputs:
        return run_file(artifact, samples, batch_size)

    def backend_config(self, target: CompileTarget, version_dir: Path) -> BackendConfig:
        return BackendConfig(backend=TritonBackend.serving(self.serving_backend), artifact=self.artifact,
                             instance_kind=InstanceKind.CPU)
