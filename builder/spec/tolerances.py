"""Tolerances from the command line: `--tolerance fp16:cosine_min=0.998,int8:top1_agreement_min=0.9`.

The metric names are models.toml's ([model.tolerances.<precision>] keys). A flag's limits replace the
same limits of that precision (from models.toml, else the built-in default); the others stay.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields, replace

from builder.errors import ManifestError
from builder.spec.enums import Precision
from builder.spec.model import ModelSpec, Tolerance

METRICS: tuple[str, ...] = tuple(f.name for f in fields(Tolerance))


def parse_tolerances(value: str, flag: str = "--tolerance") -> dict[Precision, dict[str, float]]:
    """`PRECISION:METRIC=VALUE[,PRECISION:METRIC=VALUE...]` → limits by precision; ManifestError naming
    the flag and the bad part otherwise."""
    limits: dict[Precision, dict[str, float]] = {}
    for part in (p.strip() for p in value.split(",")):
        if not part:
            raise ManifestError(f"{flag} {value!r}: an empty item between commas; expected "
                                "PRECISION:METRIC=VALUE[,PRECISION:METRIC=VALUE...]")
        prec_text, colon, assignment = part.partition(":")
        metric, equals, number = assignment.partition("=")
        if not (colon and equals and prec_text and metric):
            raise ManifestError(f"{flag} {part!r}: expected PRECISION:METRIC=VALUE "
                                "(e.g. fp16:cosine_min=0.998), comma-separated")
        prec = Precision.parse(prec_text.strip(), f"{flag} {part!r}: precision", error=ManifestError)
        metric = metric.strip()
        if metric not in METRICS:
            raise ManifestError(f"{flag} {part!r}: metric {metric!r}: expected one of {', '.join(METRICS)}")
        try:
            limit = float(number)
        except ValueError:
            raise ManifestError(f"{flag} {part!r}: value {number.strip()!r}: expected a number >= 0") from None
        if not math.isfinite(limit) or limit < 0:
            raise ManifestError(f"{flag} {part!r}: value {number.strip()!r}: expected a finite number >= 0")
        if metric.endswith("_min") and limit > 1:
            raise ManifestError(f"{flag} {part!r}: value {limit:g}: {metric} is a similarity; expected 0 to 1")
        if metric in limits.get(prec, {}):
            raise ManifestError(f"{flag} {value!r}: {prec.value}:{metric} is given twice; expected it once")
        limits.setdefault(prec, {})[metric] = limit
    return limits


def with_tolerances(spec: ModelSpec, limits: Mapping[Precision, Mapping[str, float]]) -> ModelSpec:
    """The spec with the flag's limits laid over each precision's tolerance. A precision given on the
    command line counts as an explicit tolerance (the INT8 guard runs for it, as for models.toml's)."""
    # Only the precisions this model builds: a limit for another would change its fingerprint (and
    # rebuild it) for nothing.
    mine = {prec: given for prec, given in limits.items() if prec in spec.precisions}
    if not mine:
        return spec
    merged = dict(spec.tolerances)
    for prec, given in mine.items():
        merged[prec] = replace(spec.tolerance(prec), **given)
    return replace(spec, tolerances=merged)
