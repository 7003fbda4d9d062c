"""tuned.toml's settings applied to one model folder: its config.pbtxt (through Triton's schema) and the
build.json record of what the builder wrote and which tuned settings replaced it.

The tuned.toml file itself (reading, rendering, saving) is builder/spec/tuned.py; this half writes into the
model repository, so it lives in the repository layer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.repository import triton_config
from builder.repository.model_folder import CONFIG, RECORD
from builder.spec.tuned import TUNED_FILE, TunedServing
from builder.spec.untrusted import MAX_RECORD_BYTES, UnsafeInput, read_text
from common.files import write_atomic

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Serving:
    """The serving settings the tuner searches, as one config.pbtxt holds them."""

    max_batch_size: int
    queue_delay_us: int | None  # None: dynamic batching off
    instances: int

    def to_json(self) -> dict[str, Any]:
        return {"max_batch_size": self.max_batch_size, "dynamic_batching": self.queue_delay_us is not None,
                "max_queue_delay_us": self.queue_delay_us or 0, "instances": self.instances}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Serving:
        return Serving(int(data["max_batch_size"]),
                       int(data["max_queue_delay_us"]) if data.get("dynamic_batching", True) else None,
                       int(data["instances"]))


def serving_of(config_text: str) -> Serving:
    config = triton_config.parse(config_text)
    delay = int(config.dynamic_batching.max_queue_delay_microseconds) if config.HasField("dynamic_batching") else None
    count = config.instance_group[0].count if config.instance_group else 1
    return Serving(int(config.max_batch_size), delay, int(count))


def configure(config_text: str, serving: Serving) -> str:
    """The config with these serving settings, through Triton's schema."""
    config = triton_config.parse(config_text)
    config.max_batch_size = serving.max_batch_size
    if not config.instance_group:
        config.instance_group.add()
    config.instance_group[0].count = serving.instances
    if serving.queue_delay_us is None:
        config.ClearField("dynamic_batching")
    else:
        config.dynamic_batching.max_queue_delay_microseconds = serving.queue_delay_us
        del config.dynamic_batching.preferred_batch_size[:]
        if serving.max_batch_size > 1:
            config.dynamic_batching.preferred_batch_size.append(serving.max_batch_size)
    return triton_config.to_text(config)


def _record(model_dir: Path) -> dict[str, Any] | None:
    try:
        # Bounded and inside the repository, as model_folder.read_record reads it (a crafted build.json).
        data = json.loads(read_text(model_dir / RECORD, limit=MAX_RECORD_BYTES, root=model_dir.parent))
    except (OSError, ValueError, UnsafeInput):
        return None
    return data if isinstance(data, dict) else None


def as_built(model_dir: Path) -> Serving | None:
    """The settings the builder wrote (before any tuning), from build.json; None for older builds."""
    record = _record(model_dir)
    try:
        return Serving.from_json(record["serving_as_built"]) if record else None
    except (KeyError, TypeError, ValueError):
        return None


def max_batch_limit(model_dir: Path) -> int:
    """The largest batch the folder's engine takes: as built (models.toml's batch max, clamped to the
    engine's or TensorRT profile's), else the config's own max_batch_size."""
    built = as_built(model_dir)
    if built is not None:
        return built.max_batch_size
    return serving_of((model_dir / CONFIG).read_text(encoding="utf-8")).max_batch_size


def record_tuned(model_dir: Path, tuned: TunedServing | None, built: Serving) -> None:
    """build.json says what the builder wrote and which tuned settings replaced it (or none)."""
    before = _record(model_dir) or {}
    record = {**before, "serving_as_built": built.to_json(), "tuned": None if tuned is None else {
        **Serving(tuned.max_batch_size, tuned.queue_delay_us, tuned.instances).to_json(),
        "from": TUNED_FILE, "measured": dict(tuned.measured)}}
    if record != before:  # an unchanged build leaves the file alone
        write_atomic(model_dir / RECORD, json.dumps(record, indent=2, default=str) + "\n")


def layer(model_dir: Path, tuned: TunedServing | None) -> str | None:
    """Make the folder's config.pbtxt serve `tuned` (or, with None, what the builder wrote), atomically;
    records both in build.json. Returns a line for the log when tuned settings are in force."""
    config_path = model_dir / CONFIG
    text = config_path.read_text(encoding="utf-8")
    built = as_built(model_dir)
    if built is None:
        # A fresh build (or one from before tuned.toml): the config is the builder's own.
        built = serving_of(text)
    if tuned is None:
        wanted = built
    else:
        mbs = tuned.max_batch_size
        if mbs > built.max_batch_size:
            log.warning("%s: tuned max_batch_size %d is over what the engine takes (%d); using %d",
                        tuned.variant, mbs, built.max_batch_size, built.max_batch_size)
            mbs = built.max_batch_size
        # A model rebuilt without batching (max_batch_size 0) takes no dynamic batching either: Triton
        # refuses a config that has it.
        wanted = Serving(mbs, tuned.queue_delay_us if mbs > 0 else None, tuned.instances)
    if serving_of(text) != wanted:
        write_atomic(config_path, configure(text, wanted))
    record_tuned(model_dir, tuned, built)
    if tuned is None:
        return None
    return f"{tuned.variant}: keeping the tuned settings from {TUNED_FILE} ({tuned.label()})"
