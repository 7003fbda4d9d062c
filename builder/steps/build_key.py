"""Build keys: what each variant is built from (the shared inputs and its own settings) as a digest, which
variants in the repository are stale, and why, in one line per changed field."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from builder import __version__
from builder.repository.model_folder import read_record
from builder.spec.enums import GuardSensitivity, Precision
from builder.spec.model import ModelSpec
from builder.spec.names import variant_name
from builder.steps import int8_recipe, precision
from builder.steps.budget import DEFAULT_GUARD_BUDGET_S


def tool_versions() -> dict[str, str]:
    names = ["torch", "onnx", "onnxruntime", "nvidia-modelopt", "onnxslim", "tritonclient"]
    found = {"builder": __version__}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "absent"
    return found


def digest(payload: object) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _spec_fingerprint(spec: ModelSpec) -> dict[str, Any]:
    raw = asdict(spec)
    raw["onnx"] = None  # the file's content is hashed instead of its path
    if raw["serving"].get("batch_buckets") == "pow2":  # added later: keys of builds with the default stay as they were
        del raw["serving"]["batch_buckets"]
    return raw


# Fields of a spec that are one precision's own (its tolerance, INT8's calibration settings): they are in
# that variant's "settings", so that changing one rebuilds that variant only.
_PER_PRECISION = ("precisions", "tolerances", "calibration", "guard")


def spec_fields(spec: ModelSpec) -> dict[str, str]:
    """The spec's fields every variant depends on, each by a short digest (a changed one is named)."""
    raw = _spec_fingerprint(spec)
    return {name: digest(value)[:16] for name, value in sorted(raw.items()) if name not in _PER_PRECISION}


def precision_settings(spec: ModelSpec, prec: Precision, int8: Mapping[str, Any] | None = None,
                       guard_sensitivity: GuardSensitivity = GuardSensitivity.ONE_PASS,
                       guard_budget_s: float | None = DEFAULT_GUARD_BUDGET_S) -> dict[str, Any]:
    """What only this precision's variant depends on: its tolerance, its guard and how the guard ranks nodes
    (another ranking can keep other nodes in higher precision), and, for INT8, the calibration settings (the
    data itself is in the inputs every variant shares: FP16 measures its ranges on it too) and the recipe
    `int8` the graph and runtime decide (int8_key)."""
    tolerance = asdict(spec.tolerance(prec))
    if tolerance.get("detection_agreement_min") is None:  # added later: keys of builds without it stay as they were
        del tolerance["detection_agreement_min"]
    settings: dict[str, Any] = {"tolerance": tolerance}
    if prec is not Precision.FP32:
        settings["guard"] = spec.guard
        if spec.guard:
            settings["guard_sensitivity"] = guard_sensitivity
            if guard_budget_s != DEFAULT_GUARD_BUDGET_S:  # keys of builds with the default stay as they were
                settings["guard_budget_s"] = guard_budget_s
    if prec is Precision.FP16:
        settings["fp16_version"] = precision.FP16_VERSION
    if prec is Precision.INT8 and spec.calibration is not None:
        settings["calibration"] = {k: v for k, v in asdict(spec.calibration).items() if k != "data"}
        settings["int8_version"] = precision.INT8_VERSION
        if int8 is not None:
            settings["int8_recipe"] = dict(int8)
    recorded: dict[str, Any] = json.loads(json.dumps(settings, sort_keys=True, default=str))  # as build.json holds it
    return recorded


def variant_inputs(spec: ModelSpec, shared: Mapping[str, Any],
                   int8: Mapping[str, Any] | None = None,
                   guard_sensitivity: GuardSensitivity = GuardSensitivity.ONE_PASS,
                   guard_budget_s: float | None = DEFAULT_GUARD_BUDGET_S) -> dict[Precision, dict[str, Any]]:
    """Each variant's inputs: what every variant shares and its own settings; its digest is its build key."""
    return {prec: {**shared, "settings": precision_settings(spec, prec, int8, guard_sensitivity, guard_budget_s)}
            for prec in spec.precisions}


def int8_key(spec: ModelSpec, fp32_path: Path, runtime: str) -> dict[str, Any] | None:
    """The INT8 recipe the graph and the runtime decide (steps/int8_recipe.py), as the INT8 variant's build key
    holds it: a new runtime or class rebuilds that variant. None without an INT8 variant."""
    if Precision.INT8 not in spec.precisions or spec.calibration is None:
        return None
    choice = int8_recipe.choose_for(fp32_path, spec.calibration.recipe, runtime)
    return {"recipe": choice.recipe.value, "class": choice.model_class.value,
            "as_given": precision.already_quantized(fp32_path) is not None}


def stale(spec: ModelSpec, repository: Path, keys: Mapping[Precision, str]) -> list[Precision]:
    """The precisions whose variant in the repository was not built from these inputs."""
    found = []
    for prec in spec.precisions:
        record = read_record(repository / variant_name(spec.name, prec))
        if record is None or record.build_key != keys[prec]:
            found.append(prec)
    return found


# A variant's own settings that come from the builder or a flag of `trtbuild engines`, not from models.toml.
_SETTING_LABELS = {"int8_version": "build recipe", "fp16_version": "build recipe", "int8_recipe": "build recipe",
                   "guard_sensitivity": "--guard-sensitivity", "guard_budget_s": "--guard-budget"}
_REASON_LABELS = {"onnx": "exported ONNX", "evaluation": "evaluation data", "calibration": "calibration data",
                  "spec": "models.toml entry", "settings": "models.toml entry", "runtime": "runtime",
                  "recipe": "build recipe", "tools": "tool versions"}


def _change(old: object, new: object) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        return ", ".join(f"{k} {old.get(k)} -> {new.get(k)}" for k in changed)
    return f"{old} -> {new}"


def rebuild_reasons(spec: ModelSpec, repository: Path, wanted: Mapping[str, Any], *,
                    per_precision: Mapping[Precision, Mapping[str, Any]] | None = None,
                    origin: str = "models.toml entry") -> list[str]:
    """Why a model's variants are rebuilt, from what their build records say they were built from: `wanted`
    (what every variant depends on) and `per_precision` (each variant's own, e.g. its "settings"). `origin`
    names where the spec came from ("models.toml entry", "build flags"). Empty when the records match (a
    forced rebuild)."""
    reasons: list[str] = []
    missing: list[str] = []
    for prec in spec.precisions:
        record = read_record(repository / variant_name(spec.name, prec))
        if record is None:
            missing.append(variant_name(spec.name, prec))
            continue
        present = record.inputs
        want = {**wanted, **(per_precision or {}).get(prec, {})}
        for key in sorted(set(present) | set(want), key=lambda k: (k not in _REASON_LABELS, k)):
            old, new = present.get(key), want.get(key)
            if old == new:
                continue
            label = origin if key in ("spec", "settings") else _REASON_LABELS.get(key, key)
            if key == "spec" and isinstance(old, dict) and isinstance(new, dict):
                changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
                reasons.append(f"{label} changed: {', '.join(changed)}")
            elif key == "settings" and isinstance(old, dict) and isinstance(new, dict):
                for name in sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k)):
                    said = _SETTING_LABELS.get(name, label)
                    reasons.append(f"{said} changed: {name} {prec.value} ({_change(old.get(name), new.get(name))})")
            elif isinstance(old, dict) and isinstance(new, dict):
                reasons.append(f"{label} changed ({_change(old, new)})")
            else:
                reasons.append(f"{label} changed")
    return ([f"{', '.join(missing)} not built yet"] if missing else []) + sorted(set(reasons))
