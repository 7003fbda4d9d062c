"""Tolerances from the command line: `--tolerance fp16:cosine_min=0.998,int8:top1_agreement_min=0.9`.

The metric names are models.toml's ([model.tolerances.<precision>] keys). A flag's limits replace the
same limits of that precision (from models.toml, else the built-in default); the others stay.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from pydantic import ValidationError

from builder.errors import ManifestError
from builder.spec.enums import Precision
from builder.spec.model import ModelSpec
from builder.spec.schema import TolerancesTable, error_lines


def parse_tolerances(value: str, flag: str = "--tolerance") -> dict[Precision, dict[str, float]]:
    """`PRECISION:METRIC=VALUE[,PRECISION:METRIC=VALUE...]` → limits by precision. The syntax is parsed here;
    the precisions, metrics and values are checked by models.toml's [model.tolerances] schema, so a bad one
    gets its line with `--tolerance fp16:cosine_min` in place of `model[0].tolerances.fp16.cosine_min`.
    ManifestError naming the flag otherwise, one line per error."""
    given: dict[str, dict[str, object]] = {}
    for part in (p.strip() for p in value.split(",")):
        if not part:
            raise ManifestError(f"{flag} {value!r}: an empty item between commas; expected "
                                "PRECISION:METRIC=VALUE[,PRECISION:METRIC=VALUE...]")
        prec, colon, assignment = part.partition(":")
        metric, equals, number = assignment.partition("=")
        prec, metric = prec.strip(), metric.strip()
        if not (colon and equals and prec and metric):
            raise ManifestError(f"{flag} {part!r}: expected PRECISION:METRIC=VALUE "
                                "(e.g. fp16:cosine_min=0.998), comma-separated")
        if metric in given.get(prec, {}):
            raise ManifestError(f"{flag} {value!r}: {prec}:{metric} is given twice; expected it once")
        given.setdefault(prec, {})[metric] = _number(number.strip())
    try:
        table = TolerancesTable.model_validate(given)
    except ValidationError as exc:
        lines = error_lines(exc, lambda loc: f"{flag} {':'.join(map(str, loc))}", inside=("model", 0, "tolerances"))
        raise ManifestError("\n".join(line for _, line in lines)) from None
    return {Precision(prec): getattr(table, prec).model_dump(exclude_unset=True) for prec in given}


def _number(text: str) -> object:
    """The value as TOML would hold it: a float, else the text (the schema then says what it expected)."""
    try:
        return float(text)
    except ValueError:
        return text


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
