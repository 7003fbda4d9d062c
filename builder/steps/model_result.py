"""What the build of one model returns: its status, the variants built, those not written and why. The build
report and the CLI's summary read these records."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from builder.errors import AccuracyError, BuilderError
from builder.spec.enums import Precision
from builder.spec.model import ModelSpec
from builder.spec.names import variant_name
from common.choices import Choice

if TYPE_CHECKING:  # types only: the summary imports these records without ONNX, ONNX Runtime or ModelOpt
    from builder.steps.cleanup import SlimReport
    from builder.steps.results import VariantResult

# A model's build lines keep the name they have always had in the build log and on stderr
# ("INFO builder.pipeline: m: rebuilding: ..."), which users and scripts filter on.
log = logging.getLogger("builder.pipeline")


class ModelStatus(Choice):
    BUILT = "built"
    UNCHANGED = "unchanged"
    FAILED = "failed"  # before any variant was built (export, checks, data): none written


@dataclass(frozen=True)
class VariantFailure:
    """A variant not written by this build: why, as one line, and for an accuracy miss the metric, its
    value and the limit. `kept_previous`: the repository still holds the copy an earlier build wrote."""

    variant: str
    precision: Precision
    reason: str
    metric: str | None = None
    value: float | None = None
    limit: float | None = None
    kept_previous: bool = False

    def line(self) -> str:
        kept = f"; the previous {self.variant} stays in place" if self.kept_previous else ""
        return f"{self.variant} not written: {self.reason}{kept}"


def failure(variant: str, prec: Precision, exc: BuilderError, repository: Path) -> VariantFailure:
    kept = (repository / variant / "config.pbtxt").is_file()
    found = exc.violation if isinstance(exc, AccuracyError) else None
    if found is not None:
        guard = exc.guard if isinstance(exc, AccuracyError) and exc.guard else None
        reason = f"{found.text()} ({guard})" if guard else found.text()
        return VariantFailure(variant, prec, reason, found.metric, found.value, found.limit, kept)
    return VariantFailure(variant, prec, str(exc).removeprefix(f"{variant}: "), kept_previous=kept)


@dataclass
class ModelResult:
    name: str
    status: ModelStatus
    build_key: str
    variants: list[VariantResult]
    cleanup: SlimReport | None = None
    seconds: float = 0.0
    failures: list[VariantFailure] = field(default_factory=list)
    error: str | None = None  # status FAILED: why no variant was built
    unchanged: list[str] = field(default_factory=list)  # status BUILT: variants whose inputs had not changed


def model_failed(spec: ModelSpec, exc: BuilderError, repository: Path) -> ModelResult:
    failures = []
    for prec in spec.precisions:
        failures.append(failure(variant_name(spec.name, prec), prec, exc, repository))
    log.debug("%s: %s", spec.name, exc)  # the CLI prints it once, at the end
    return ModelResult(spec.name, ModelStatus.FAILED, "", [], failures=failures, error=str(exc))
