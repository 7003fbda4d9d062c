"""Where variants execute: ONNX Runtime here; TensorRT plugs in behind the same seam.

A runtime turns a precision variant's ONNX into the artifact Triton serves and runs that artifact
for the accuracy check.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort
from numpy.typing import NDArray

from builder.errors import RuntimeUnavailableError

log = logging.getLogger(__name__)

RUNTIMES = ("auto", "onnxruntime", "tensorrt")

Outputs = dict[str, NDArray[Any]]


class Runtime(Protocol):
    name: str
    artifact: str  # file name inside the Triton model version folder

    def compile(self, onnx_path: Path, out_path: Path) -> None: ...

    def run(self, artifact: Path, samples: Mapping[str, NDArray[Any]], batch_size: int) -> Outputs: ...


def ort_session(path: Path, intra_op_threads: int = 0) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if intra_op_threads:
        options.intra_op_num_threads = intra_op_threads
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def run_session(session: ort.InferenceSession, samples: Mapping[str, NDArray[Any]], batch_size: int) -> Outputs:
    """Run every sample through the session in batches; outputs concatenated along axis 0."""
    count = len(next(iter(samples.values())))
    names = [o.name for o in session.get_outputs()]
    chunks: dict[str, list[NDArray[Any]]] = {n: [] for n in names}
    for start in range(0, count, batch_size):
        feed = {k: v[start : start + batch_size] for k, v in samples.items()}
        for name, value in zip(names, session.run(names, feed), strict=True):
            chunks[name].append(np.asarray(value))
    return {n: np.concatenate(parts) for n, parts in chunks.items()}


class OnnxRuntimeCPU:
    """The variant ONNX is the artifact; Triton's python backend runs it with ONNX Runtime."""

    name = "onnxruntime"
    artifact = "model.onnx"

    def compile(self, onnx_path: Path, out_path: Path) -> None:
        shutil.copyfile(onnx_path, out_path)

    def run(self, artifact: Path, samples: Mapping[str, NDArray[Any]], batch_size: int) -> Outputs:
        return run_session(ort_session(artifact), samples, batch_size)


def tensorrt_available() -> bool:
    """True when the real TensorRT (not only its type stubs) imports and a CUDA GPU answers."""
    if importlib.util.find_spec("tensorrt") is None:
        return False
    try:
        import tensorrt

        if not hasattr(tensorrt, "Builder"):
            return False
        tensorrt.Builder(tensorrt.Logger(tensorrt.Logger.ERROR))
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return False
    return True


def select(requested: str) -> Runtime:
    if requested not in RUNTIMES:
        raise RuntimeUnavailableError(f"--runtime {requested!r}: expected one of {', '.join(RUNTIMES)}")
    if requested == "auto":
        requested = "tensorrt" if tensorrt_available() else "onnxruntime"
        log.info("runtime: %s (auto)", requested)
    if requested == "tensorrt":
        if not tensorrt_available():
            raise RuntimeUnavailableError(
                "--runtime tensorrt: TensorRT with a CUDA GPU is not available here; install it with "
                "pip install '.[tensorrt]' on a GPU machine, or build inside the NGC Triton container"
            )
        raise RuntimeUnavailableError(
            "--runtime tensorrt: the TensorRT compile step is not part of this build yet; "
            "use --runtime onnxruntime"
        )
    return OnnxRuntimeCPU()
