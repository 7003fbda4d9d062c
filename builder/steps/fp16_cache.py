"""FP16 conversions reused across runs, like INT8 calibrations (steps/precision.to_int8): a converted graph is
kept under the cache folder by the digest of everything it depends on (the FP32 graph, the feeds autocast
measured ranges on, the settings, the tools' versions) and copied from there when those are unchanged.

A conversion that failed is not cached (it is tried again, and fails with its own message)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from numpy.typing import NDArray

from builder.repository import onnx_files
from builder.steps import precision, samples

log = logging.getLogger(__name__)

_TOOLS = ("nvidia-modelopt", "onnxruntime", "onnx", "onnxconverter-common")


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def feeds_digest(feeds: Sequence[Mapping[str, NDArray[Any]]]) -> str:
    """One digest for a list of feeds (their order counts)."""
    digest = hashlib.sha256()
    for feed in feeds:
        digest.update(samples.digest(feed).encode())
    return digest.hexdigest()


def fp16_key(*, fp32_sha: str, feeds: str, what_made_it: Mapping[str, object]) -> str:
    payload = {"onnx": fp32_sha, "feeds": feeds, "made_by": dict(what_made_it),
               "tools": {name: _version(name) for name in _TOOLS}, "recipe_version": precision.RECIPE_VERSION}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def cached_conversion(cache_dir: Path, key: str, out: Path,
                      make: Callable[[Path], dict[str, object]]) -> tuple[dict[str, object], bool]:
    """The converted graph at `out` and its settings (as build.json records them), from the cache where `key`
    is there, else from `make(out)` (then stored). Returns the settings and whether they came from the cache."""
    folder = cache_dir / "fp16"
    model, record = folder / f"{key}.onnx", folder / f"{key}.json"
    if model.is_file() and record.is_file():
        try:
            settings = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            settings = None
        if isinstance(settings, dict):
            log.debug("FP16: reusing conversion %s (inputs unchanged)", key[:12])
            onnx_files.copy_model(model, out)
            return settings, True
    settings = make(out)
    folder.mkdir(parents=True, exist_ok=True)
    onnx_files.copy_model(out, model)  # the graph first: a record without its graph is never read
    temporary = record.with_name(f".{record.name}.tmp")
    temporary.write_text(json.dumps(settings, sort_keys=True, default=str), encoding="utf-8")
    temporary.replace(record)
    return settings, False
