"""config.pbtxt through Triton's own protobuf schema (never string templates)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from builder.spec.dtypes import to_triton_config
from builder.spec.enums import ServingBackend
from builder.spec.model import DimRange, ServingSpec, TensorSpec
from builder.spec.shapes import ModelShapes
from common.choices import Choice

log = logging.getLogger(__name__)


class TritonBackend(Choice):
    """The Triton backend a model folder is served by (the runtime decides; see BackendConfig)."""

    PYTHON = "python"  # the bundled server: our runner (model.py) + ONNX Runtime
    ONNXRUNTIME = "onnxruntime"  # the NGC image's native backend
    TENSORRT = "tensorrt"

    @staticmethod
    def serving(choice: ServingBackend) -> TritonBackend:
        return TritonBackend(choice.value)


class InstanceKind(Choice):
    CPU = "KIND_CPU"
    GPU = "KIND_GPU"


@dataclass(frozen=True)
class BackendConfig:
    """The runtime-specific part of a model's config: which backend serves which artifact, where,
    and what the artifact itself imposes (a TensorRT profile's largest batch, warm-up, CUDA graphs,
    one plan per compute capability)."""

    backend: TritonBackend
    artifact: str
    instance_kind: InstanceKind = InstanceKind.CPU
    # Instances (per GPU) where models.toml names none.
    default_instances: int = 1
    max_batch: int | None = None  # the artifact's own limit; None when it has none
    cuda_graphs: bool = False
    warmup: tuple[dict[str, Any], ...] = ()
    cc_model_filenames: tuple[tuple[str, str], ...] = ()  # (compute capability, plan file)
    # Extra config parameters: the python runner's provider settings, or the native onnxruntime
    # backend's CUDA provider keys (cudnn_conv_algo_search, ...).
    parameters: tuple[tuple[str, str], ...] = ()
    # The native onnxruntime backend on a GPU: hand subgraphs to TensorRT with these parameters
    # (precision_mode FP16, ...); empty = CUDA provider only.
    tensorrt_accelerator: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ConfigInputs:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batch: DimRange
    serving: ServingSpec
    backend: BackendConfig
    shapes: ModelShapes | None = None  # every input's resolved range; None: from the inputs' dims and batch

    @property
    def batching(self) -> bool:
        return self.shapes is None or self.shapes.batching

    @property
    def batch_range(self) -> DimRange:
        return (self.shapes.batch if self.shapes is not None else None) or self.batch

    @property
    def max_batch_size(self) -> int:
        if not self.batching:
            return 0  # Triton's "does not batch": dims are whole shapes, no dynamic batcher
        # Never accept a batch the artifact cannot run.
        limit = self.backend.max_batch
        return self.batch_range.max if limit is None else min(self.batch_range.max, limit)

    def input_dims(self, tensor: TensorSpec) -> list[int]:
        if self.shapes is not None:
            return self.shapes.config_dims(tensor.name)
        return _dims(tensor.shape)

    def output_dims(self, tensor: TensorSpec) -> list[int]:
        if self.batching:
            return _dims(tensor.shape)
        return [d if isinstance(d, int) and d > 0 else -1 for d in tensor.shape]


def _dims(shape: tuple[int | str, ...]) -> list[int]:
    return [d if isinstance(d, int) and d > 0 else -1 for d in shape[1:]]


def _tensor(tensor: TensorSpec, dims: list[int], batching: bool) -> dict[str, Any]:
    """One input or output. Triton needs a dim: a scalar is declared [1]; a batching model reshapes it
    to [] (a non-batching one may not: its runner reshapes, see `scalar_inputs`)."""
    entry: dict[str, Any] = {"name": tensor.name, "data_type": to_triton_config(tensor.dtype), "dims": dims or [1]}
    if not dims and batching:
        entry["reshape"] = {"shape": []}
    return entry


def scalar_inputs(cfg: ConfigInputs) -> list[str]:
    """Inputs of a non-batching model that are scalars in the graph but [1] in config.pbtxt."""
    return [] if cfg.batching else [t.name for t in cfg.inputs if not cfg.input_dims(t)]


def preferred_batch_sizes(batch: DimRange, max_batch_size: int) -> list[int]:
    return sorted({b for b in (min(batch.opt, max_batch_size), max_batch_size) if b > 1})


def _instance_group(serving: ServingSpec, backend: BackendConfig) -> dict[str, Any]:
    """`instances` (else the backend's default) per GPU on `serving.gpus` (Triton counts per listed GPU) for a GPU
    variant; a CPU variant runs on the CPU whatever the GPUs named."""
    kind = backend.instance_kind
    count = serving.instances if serving.instances is not None else backend.default_instances
    group: dict[str, Any] = {"count": count, "kind": kind.value}
    if kind is InstanceKind.GPU and serving.gpus:
        group["gpus"] = list(serving.gpus)
    return group


def build(cfg: ConfigInputs) -> model_config_pb2.ModelConfig:
    backend = cfg.backend
    max_batch = cfg.max_batch_size
    doc: dict[str, Any] = {
        "name": cfg.name,
        "max_batch_size": max_batch,
        "input": [_tensor(t, cfg.input_dims(t), cfg.batching) for t in cfg.inputs],
        "output": [_tensor(t, cfg.output_dims(t), cfg.batching) for t in cfg.outputs],
        "instance_group": [_instance_group(cfg.serving, backend)],
    }
    if backend.backend is TritonBackend.PYTHON:
        doc["backend"] = "python"
        doc["parameters"] = {
            "onnx_file": {"string_value": backend.artifact},
            "intra_op_threads": {"string_value": str(cfg.serving.ort_intra_op_threads)},
        } | {k: {"string_value": v} for k, v in backend.parameters}
        if scalar_inputs(cfg):
            doc["parameters"]["scalar_inputs"] = {"string_value": ",".join(scalar_inputs(cfg))}
        if cfg.serving.batch_buckets != "pow2" and ("provider", "cuda") in backend.parameters:
            doc["parameters"]["batch_buckets"] = {"string_value": cfg.serving.batch_buckets}
    elif backend.backend is TritonBackend.ONNXRUNTIME:
        doc["platform"] = "onnxruntime_onnx"
        doc["default_model_filename"] = backend.artifact
        if backend.parameters:
            doc["parameters"] = {k: {"string_value": v} for k, v in backend.parameters}
        if backend.tensorrt_accelerator:
            doc["optimization"] = {"execution_accelerators": {"gpu_execution_accelerator": [
                {"name": "tensorrt", "parameters": dict(backend.tensorrt_accelerator)}]}}
    else:
        doc["platform"] = "tensorrt_plan"
        doc["default_model_filename"] = backend.artifact
        if backend.cc_model_filenames:
            doc["cc_model_filenames"] = dict(backend.cc_model_filenames)
        if backend.cuda_graphs:
            doc["optimization"] = {"cuda": {"graphs": True}}
    if cfg.serving.batch_buckets != "pow2" and "batch_buckets" not in doc.get("parameters", {}):
        log.warning("%s: batch_buckets = %s applies to the python runner on CUDA only; this variant runs without "
                    "buckets", cfg.name, cfg.serving.batch_buckets)
    if backend.warmup:
        doc["model_warmup"] = list(backend.warmup)
    if cfg.serving.dynamic_batching and max_batch > 0:
        doc["dynamic_batching"] = {
            "preferred_batch_size": preferred_batch_sizes(cfg.batch_range, max_batch),
            "max_queue_delay_microseconds": str(cfg.serving.max_queue_delay_us),
        }
    message = model_config_pb2.ModelConfig()
    json_format.ParseDict(doc, message)
    return message


def to_text(config: model_config_pb2.ModelConfig) -> str:
    return str(text_format.MessageToString(config))


def parse(text: str) -> model_config_pb2.ModelConfig:
    message = model_config_pb2.ModelConfig()
    text_format.Parse(text, message)
    return message
