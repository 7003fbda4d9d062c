"""The orchestrator: every model of the build under the repository's lock, each through one context handed
down to the steps (steps/model.py: export → checks → clean-up → reference → its variants' steps → staged model
folders, each committed to the repository as soon as it passes; one that fails is listed and the repository's
copy of it stays), or, with `all_or_nothing`, all of them committed only when every model passed; then the
build report.

It drives whatever runtime and reference executor it is given through their seams and knows nothing specific
to one; the steps never call back into it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from builder.errors import BuilderError, ManifestError
from builder.repository.lock import repository_lock
from builder.repository.staging import Staging
from builder.runtimes.base import ReferenceExecutor, Runtime
from builder.runtimes.onnxruntime import OnnxRuntimeReference, ort_rounds
from builder.spec.enums import GuardSensitivity, Int8Recipe, Precision
from builder.spec.model import ModelSpec
from builder.spec.settings import default_cache_dir
from builder.spec.tuned import TunedServing
from builder.steps import int8_recipe
from builder.steps.budget import DEFAULT_GUARD_BUDGET_S
from builder.steps.build_key import tool_versions
from builder.steps.context import BuildContext
from builder.steps.model import build_model
from builder.steps.model_result import ModelResult, ModelStatus, VariantFailure, model_failed
from builder.steps.speed import Meter
from common.files import write_json

# What build_all returns is the steps' records: named here too, as the build's API.
__all__ = ["BuildOptions", "ModelResult", "ModelStatus", "VariantFailure", "build_all"]


@dataclass
class BuildOptions:
    repository: Path
    runtime: Runtime
    cache_dir: Path = field(default_factory=default_cache_dir)
    force: bool = False
    wait: bool = True  # for another writer of the repository to finish (False: fail at once)
    # `trtbuild tune`'s settings by variant name (tuned.toml beside the manifest), layered over models.toml.
    tuned: Mapping[str, TunedServing] = field(default_factory=dict)
    # True: the first failure stops the build and nothing is written (for CI pipelines that want it);
    # False: every variant that passes is written, each on its own, and failures are listed.
    all_or_nothing: bool = False
    # How the accuracy guards rank nodes: one pass over both graphs, or one conversion per node.
    guard_sensitivity: GuardSensitivity = GuardSensitivity.ONE_PASS
    # Each accuracy guard's search stops after this many seconds (None: no bound): steps/budget.py.
    guard_budget_s: float | None = DEFAULT_GUARD_BUDGET_S
    # Where the specs came from, as rebuild reasons name it: "models.toml entry", or "build flags" (build --onnx).
    spec_origin: str = "models.toml entry"
    # How each variant's throughput is measured against FP32's (steps/speed.py); None, or TRTBUILD_NO_SPEED
    # set: not measured.
    speed_meter: Meter | None = ort_rounds
    # The build log: tools' full output is appended there and the one-line errors name it (the CLI's --log);
    # None: each failure's output in a file of its own under the cache. The runtime gets it at construction.
    log_file: Path | None = None
    # What runs the FP32 reference and the candidates the clean-up and the guards compare with it, whatever
    # runtime serves the variants; the steps get it through their context, never ONNX Runtime directly.
    executor: ReferenceExecutor = field(default_factory=OnnxRuntimeReference)


def _accumulated(report_path: Path, repository: Path, models: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This build's models after those an earlier report of the same repository lists and this build did not
    build (per model, the newest build's entry): one report for every model built into the repository."""
    try:
        earlier = json.loads(report_path.read_text(encoding="utf-8"))
        # The same repository however it was spelled (`R`, `./R`, `/abs/R`): the default report lies in it,
        # and a relative path recorded by an earlier build is read from here, where builds usually run.
        recorded = earlier.get("repository")
        same = report_path.resolve().parent == repository.resolve() or (
            isinstance(recorded, str) and Path(recorded).resolve() == repository.resolve())
        kept = earlier["models"] if same else []
        names = {m["name"] for m in models}
        kept = [m for m in kept if isinstance(m, dict) and m.get("name") not in names]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none yet, or not one of ours
        kept = []
    return [*kept, *models]


def _check_recipes(specs: Sequence[ModelSpec], options: BuildOptions) -> None:
    """An INT8 recipe the build's runtime cannot run, refused before any model is built: one line naming the model,
    the setting and what the runtime takes (found mid-build, it stopped that model's every variant)."""
    runtime = options.runtime.name
    setting = "--int8-recipe" if options.spec_origin == "build flags" else "calibration.recipe"
    bad = [spec.name for spec in specs if Precision.INT8 in spec.precisions and spec.calibration is not None
           and spec.calibration.recipe is Int8Recipe.ONNXRUNTIME_DYNAMIC and runtime != int8_recipe.CPU_RUNTIME]
    if bad:
        raise ManifestError(f"model {', '.join(repr(n) for n in bad)}: {setting} "
                            f"{Int8Recipe.ONNXRUNTIME_DYNAMIC.value!r} runs on ONNX Runtime on the CPU only, and "
                            f"this build runs on {runtime} (static Q/DQ): expected {setting} auto, modelopt or "
                            "onnxruntime, or --runtime onnxruntime")


def build_all(
    specs: list[ModelSpec], options: BuildOptions, report_path: Path | None, command: list[str]
) -> list[ModelResult]:
    """Build every model. Each variant that passes is written as it passes and each failure is listed in
    its model's result (the report is written either way); with `all_or_nothing`, the first failure
    raises and nothing is written."""
    _check_recipes(specs, options)
    started = time.time()
    results: list[ModelResult] = []
    with repository_lock(options.repository, what=f"the build of {', '.join(s.name for s in specs)}",
                         wait=options.wait):
        staging = Staging(options.repository)
        errors: list[BuilderError] = []
        try:
            for spec in specs:
                # One context per model, handed down: the steps build the model from it and return its result.
                job = BuildContext(
                    spec=spec, runtime=options.runtime, executor=options.executor, repository=options.repository,
                    staging=staging, cache_dir=options.cache_dir, log_file=options.log_file, force=options.force,
                    all_or_nothing=options.all_or_nothing, tuned=options.tuned,
                    guard_sensitivity=options.guard_sensitivity, guard_budget_s=options.guard_budget_s,
                    spec_origin=options.spec_origin,
                    speed_meter=options.speed_meter)
                try:
                    results.append(build_model(job))
                except BuilderError as exc:
                    # The model failed before its variants (export, checks, data): the other models go on.
                    if options.all_or_nothing:
                        raise
                    errors.append(exc)
                    results.append(model_failed(spec, exc, options.repository))
            if options.all_or_nothing:
                staging.commit()
        finally:
            staging.discard()
        if report_path is not None:  # under the lock: a build beside this one adds its models after
            models = [{**asdict(r), "command": command, "started_unix": started} for r in results]
            write_json(report_path, {
                "command": command,
                "started_unix": started,
                "seconds": round(time.time() - started, 3),
                "repository": str(options.repository),
                "runtime": options.runtime.name,
                "tools": tool_versions(),
                "models": _accumulated(report_path, options.repository, models),
            })
    if errors and len(errors) == len(specs):
        # Every model failed before building anything: no model was written; the report (above) says why.
        if len(errors) == 1:
            raise errors[0]
        raise BuilderError("\n".join(str(e) for e in errors))
    return results
