"""Model and variant names: one validator and one naming rule for every entry point."""

from __future__ import annotations

import re

from builder.errors import ManifestError
from builder.spec.enums import Precision

# Triton model names become folder names and URL path segments.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"
NAME_RULE = "letters, digits, '_' and '-' (not first)"
_NAME = re.compile(NAME_PATTERN)


def check_model_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ManifestError(f"{what} {name!r}: expected {NAME_RULE}")
    return name


def name_from_path(path: str) -> str:
    """A model name from a file's stem (`yolov8n-640.onnx` → `yolov8n-640`): characters outside the
    rule become `_`, and a name that would start with one gets an `m` in front."""
    stem = path.rsplit("/", 1)[-1].split(".", 1)[0]
    name = re.sub(r"[^A-Za-z0-9_-]", "_", stem)
    return name if _NAME.match(name) else f"m{name}"


def variant_name(model: str, precision: Precision) -> str:
    """The Triton model that serves one precision of a model: `<model>_<precision>`."""
    return f"{model}_{precision.value}"
