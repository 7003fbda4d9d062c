"""tuned.toml: the serving settings `trtbuild tune` chose, layered by the builder over models.toml.

Why a file of its own beside models.toml rather than an edit of `[model.serving]`: a tuned setting
belongs to one variant on one machine (the INT8 variant's best batch on this CPU is not the FP32
variant's, nor a GPU's), which `[model.serving]` (one table for all of a model's variants) cannot say;
the file the user writes stays theirs, and the machine's choice can be reviewed, committed per host or
deleted to go back, in one place. tomlkit keeps the file's comments and other entries when one is
replaced.

    [efficientnet_lite0]                  # one entry per model: the variant the tuner picked
    variant = "efficientnet_lite0_int8"
    max_batch_size = 8
    dynamic_batching = true
    max_queue_delay_us = 1000
    instances = 2
    [efficientnet_lite0.measured]         # provenance only (the builder ignores it)
    objective = "throughput"
    ...
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomlkit

from builder.errors import ManifestError
from builder.spec.names import check_model_name
from builder.spec.untrusted import MAX_TUNED_BYTES, read_text
from common.files import write_atomic

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


TUNED_FILE = "tuned.toml"
HEADER = ("Serving settings chosen by `trtbuild tune`. `trtbuild engines` applies each entry to the variant\n"
          "it names, over models.toml's [model.serving]. Delete an entry to go back to models.toml's settings.")
_KEYS = {"variant", "max_batch_size", "dynamic_batching", "max_queue_delay_us", "instances", "measured"}


@dataclass(frozen=True)
class TunedServing:
    model: str
    variant: str
    max_batch_size: int
    queue_delay_us: int | None  # None: dynamic batching off
    instances: int
    measured: Mapping[str, Any] = field(default_factory=dict)  # provenance: objective, figures, when

    def label(self) -> str:
        batching = "off" if self.queue_delay_us is None else f"{self.queue_delay_us}us"
        return f"mbs={self.max_batch_size} batching={batching} inst={self.instances}"


def tuned_path(manifest: Path) -> Path:
    return manifest.parent / TUNED_FILE


def _positive_int(value: object, where: str, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ManifestError(f"{where}: expected an integer >= {low}, got {value!r}")
    return value


def load_tuned(path: Path) -> dict[str, TunedServing]:
    """Entries by variant name; {} when the file does not exist. A bad entry: one ManifestError line.

    Read as untrusted: at most MAX_TUNED_BYTES; model and variant names follow the naming rule (they
    become folder names under the repository)."""
    if not path.is_file():
        return {}
    try:
        raw = tomllib.loads(read_text(path, limit=MAX_TUNED_BYTES))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: not valid TOML ({exc})") from exc
    out: dict[str, TunedServing] = {}
    for model, entry in raw.items():
        where = f"{path}: [{model}]"
        check_model_name(model, f"{path}: table name")
        if not isinstance(entry, dict):
            raise ManifestError(f"{where}: expected a table of serving settings")
        unknown = sorted(set(entry) - _KEYS)
        if unknown:
            raise ManifestError(f"{where}: unknown key {unknown[0]!r} (expected {', '.join(sorted(_KEYS))})")
        variant = entry.get("variant")
        if not isinstance(variant, str) or not variant.startswith(f"{model}_"):
            raise ManifestError(f"{where}.variant: expected a variant name {model}_<precision>, got {variant!r}")
        check_model_name(variant, f"{where}.variant")
        batching = entry.get("dynamic_batching", True)
        if not isinstance(batching, bool):
            raise ManifestError(f"{where}.dynamic_batching: expected true or false, got {batching!r}")
        delay = _positive_int(entry.get("max_queue_delay_us", 0), f"{where}.max_queue_delay_us", low=0)
        measured = entry.get("measured", {})
        if not isinstance(measured, dict):
            raise ManifestError(f"{where}.measured: expected a table (provenance written by `trtbuild tune`), "
                                f"got {measured!r}")
        # 0: a model built without batching (whole shapes), which has no dynamic batching either.
        max_batch = _positive_int(entry.get("max_batch_size"), f"{where}.max_batch_size", low=0)
        if max_batch == 0 and batching:
            raise ManifestError(f"{where}.dynamic_batching: expected false with max_batch_size 0")
        out[variant] = TunedServing(
            model=model, variant=variant,
            max_batch_size=max_batch,
            queue_delay_us=delay if batching else None,
            instances=_positive_int(entry.get("instances", 1), f"{where}.instances", low=1),
            measured=measured,
        )
    return out


def _entry(tuned: TunedServing) -> tomlkit.items.Table:
    table = tomlkit.table()
    table.add("variant", tuned.variant)
    table.add("max_batch_size", tuned.max_batch_size)
    table.add("dynamic_batching", tuned.queue_delay_us is not None)
    table.add("max_queue_delay_us", tuned.queue_delay_us or 0)
    table.add("instances", tuned.instances)
    if tuned.measured:
        measured = tomlkit.table()
        for key, value in tuned.measured.items():
            if value is not None:  # TOML has no null: an unmeasured figure is left out
                measured.add(key, value)
        table.add("measured", measured)
    return table


def render(path: Path, tuned: TunedServing) -> tuple[str, str]:
    """(the file's text now, its text with `tuned` as its model's entry), comments and other entries kept."""
    before = path.read_text(encoding="utf-8") if path.is_file() else ""
    try:
        doc = tomlkit.parse(before) if before else tomlkit.document()
    except tomlkit.exceptions.ParseError as exc:
        raise ManifestError(f"{path}: not valid TOML ({exc})") from exc
    if not before:
        for line in HEADER.splitlines():
            doc.add(tomlkit.comment(line))
    if tuned.model in doc:
        doc[tuned.model] = _entry(tuned)
    else:
        doc.add(tuned.model, _entry(tuned))
    return before, tomlkit.dumps(doc)


def diff(path: Path, before: str, after: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        fromfile=str(path), tofile=f"{path} (tuned)"))


def save(path: Path, tuned: TunedServing) -> str:
    """Write `tuned` as its model's entry (atomically); returns the unified diff of the change."""
    before, after = render(path, tuned)
    write_atomic(path, after)
    return diff(path, before, after)
