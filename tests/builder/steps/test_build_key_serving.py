"""The build key's serving fields: a key added later (batch_buckets) leaves the keys of builds made before it as
they were at its default, and a changed value is a changed key."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

from builder.spec import ModelSpec, ServingSpec
from builder.steps.build_key import digest, spec_fields
from tests.helpers.tiny_models import tiny_specs


def test_default_batch_buckets_keeps_earlier_keys_and_fine_changes_them(tmp_path: Path) -> None:
    spec: ModelSpec = tiny_specs(tmp_path)[0]
    before = {k: v for k, v in asdict(spec.serving).items() if k != "batch_buckets"}  # a build from before the key
    assert spec_fields(spec)["serving"] == digest(before)[:16]
    fine = replace(spec, serving=ServingSpec(batch_buckets="fine"))
    assert spec_fields(fine)["serving"] != spec_fields(spec)["serving"]
    assert {k: v for k, v in spec_fields(fine).items() if k != "serving"} == \
        {k: v for k, v in spec_fields(spec).items() if k != "serving"}
