"""One Triton model folder: config.pbtxt, the python-backend runner where that backend serves it,
and build.json, the record of what it was built from."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2

from builder.repository import triton_config
from builder.repository.triton_config import ConfigInputs, TritonBackend
from builder.spec.shapes import ModelShapes
from builder.spec.untrusted import MAX_RECORD_BYTES, UnsafeInput, inside, read_text
from common.files import write_atomic, write_json

RECORD = "build.json"
CONFIG = "config.pbtxt"
RUNNER = "model.py"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildRecord:
    """What later commands read back from a folder's build.json (it holds more, for people)."""

    build_key: str
    artifact: str  # relative to the repository
    runtime: str  # the Runtime's name
    inputs: Mapping[str, Any]  # everything the build depended on, by kind (compared for rebuild reasons)
    shapes: ModelShapes | None = None  # every input's shape range and whether it batches (older records: None)


def read_record(model_dir: Path) -> BuildRecord | None:
    """The folder's build record, or None when it has none (or one this version cannot read).

    Read as untrusted (the repository may come from elsewhere): at most MAX_RECORD_BYTES, the file and
    its artifact inside the repository (model_dir's parent). An unsafe one is None, with a warning."""
    try:
        text = read_text(model_dir / RECORD, limit=MAX_RECORD_BYTES, root=model_dir.parent)
        data = json.loads(text)
        record = BuildRecord(build_key=data["build_key"], artifact=data["artifact"], runtime=data["runtime"],
                             inputs=data["inputs"],
                             shapes=ModelShapes.from_json(data["shapes"]) if data.get("shapes") else None)
        if not all(isinstance(v, str) for v in (record.build_key, record.artifact, record.runtime)):
            return None
        inside(model_dir.parent, record.artifact, f"{model_dir / RECORD}: artifact")
    except UnsafeInput as exc:
        log.warning("ignoring %s", exc)
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    return record if isinstance(record.inputs, Mapping) else None


def write_record(model_dir: Path, record: dict[str, Any]) -> None:
    write_json(model_dir / RECORD, record)


def write_config(model_dir: Path, version_dir: Path, inputs: ConfigInputs) -> model_config_pb2.ModelConfig:
    """config.pbtxt through Triton's schema, plus our runner when the python backend serves it."""
    config = triton_config.build(inputs)
    write_atomic(model_dir / CONFIG, triton_config.to_text(config))
    if inputs.backend.backend is TritonBackend.PYTHON:
        source = resources.files("builder.repository").joinpath("python_model.py").read_text(encoding="utf-8")
        write_atomic(version_dir / RUNNER, source)
    return config


def load_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """The shapes a variant's requests take where its config.pbtxt leaves dims free (-1): each such
    input's opt shape from build.json, without the batch axis for a batching model and whole for one
    built with max_batch_size 0. Empty for a record without shapes (an older build)."""
    record = read_record(model_dir)
    if record is None or record.shapes is None:
        return {}
    shapes = record.shapes
    return {name: shapes.sample_range(name).opt for name in shapes.inputs if -1 in shapes.config_dims(name)}
