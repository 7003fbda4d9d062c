"""config.pbtxt through Triton's own protobuf schema (never string templates)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from builder.dtypes import to_triton
from builder.errors import BuilderError
from builder.manifest import DimRange, ServingSpec, TensorSpec

SERVING_BACKENDS = ("python", "onnxruntime")
# Chosen by the runtime, not by --serving-backend: TensorRT plans go to the native tensorrt backend.
ALL_BACKENDS = (*SERVING_BACKENDS, "tensorrt")


@dataclass(frozen=True)
class ConfigInputs:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batch: DimRange
    serving: ServingSpec
    backend: str = "python"  # python: bundled Triton + ONNX Runtime; onnxruntime/tensorrt: NGC image's backends
    artifact: str = "model.onnx"
    instance_kind: str = "KIND_CPU"
    cuda_graphs: bool = False
    warmup: tuple[dict[str, Any], ...] = ()
    cc_model_filenames: tuple[tuple[str, str], ...] = ()  # (compute capability, plan file)


def _dims(shape: tuple[int | str, ...]) -> list[int]:
    return [d if isinstance(d, int) else -1 for d in shape[1:]]


def preferred_batch_sizes(batch: DimRange) -> list[int]:
    return sorted({b for b in (batch.opt, batch.max) if b > 1})


def build(cfg: ConfigInputs) -> model_config_pb2.ModelConfig:
    if cfg.backend not in ALL_BACKENDS:
        raise BuilderError(f"--serving-backend {cfg.backend!r}: expected one of {', '.join(SERVING_BACKENDS)}")
    doc: dict[str, Any] = {
        "name": cfg.name,
        "max_batch_size": cfg.batch.max,
        "input": [
            {"name": t.name, "data_type": to_triton(t.dtype), "dims": _dims(t.shape)} for t in cfg.inputs
        ],
        "output": [
            {"name": t.name, "data_type": to_triton(t.dtype), "dims": _dims(t.shape)} for t in cfg.outputs
        ],
        "instance_group": [{"count": cfg.serving.instances, "kind": cfg.instance_kind}],
    }
    if cfg.backend == "python":
        doc["backend"] = "python"
        doc["parameters"] = {
            "onnx_file": {"string_value": cfg.artifact},
            "intra_op_threads": {"string_value": str(cfg.serving.ort_intra_op_threads)},
        }
    elif cfg.backend == "onnxruntime":
        doc["platform"] = "onnxruntime_onnx"
        doc["default_model_filename"] = cfg.artifact
    else:
        doc["platform"] = "tensorrt_plan"
        doc["default_model_filename"] = cfg.artifact
        if cfg.cc_model_filenames:
            doc["cc_model_filenames"] = dict(cfg.cc_model_filenames)
        if cfg.cuda_graphs:
            doc["optimization"] = {"cuda": {"graphs": True}}
    if cfg.warmup:
        doc["model_warmup"] = list(cfg.warmup)
    if cfg.serving.dynamic_batching:
        doc["dynamic_batching"] = {
            "preferred_batch_size": preferred_batch_sizes(cfg.batch),
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
