"""The packaged real models and their data (slow: loads real weights)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from builder.examples import datasets
from builder.spec import load_manifest
from builder.steps import onnx_model
from builder.steps.export import export

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def test_calibration_and_heldout_photos_are_disjoint() -> None:
    assert not set(datasets._CALIBRATION_PHOTOS) & set(datasets._HELDOUT_PHOTOS)
    cal = datasets.imagenet_calibration(4, 0)["input"]
    held = datasets.imagenet_heldout(4, 1)["input"]
    assert cal.shape == held.shape == (4, 3, 224, 224) and cal.dtype == np.float32
    assert float(cal.min()) >= -1.0 and float(cal.max()) <= 1.0  # (x - 127) / 128 of 0..255


def test_sentence_sets_are_disjoint_and_tokenized() -> None:
    assert not set(datasets._sentences("sentences_calibration.txt")) & set(
        datasets._sentences("sentences_heldout.txt"))
    batch = datasets.sentences_heldout(5, 0)
    assert batch["input_ids"].shape == (5, datasets.SEQUENCE_LENGTH) and batch["input_ids"].dtype == np.int64
    assert batch["attention_mask"].sum(axis=1).min() > 2


@pytest.mark.parametrize("name", ["efficientnet_lite0", "minilm_l6_v2"])
def test_real_models_export_with_dynamic_axes(name: str, tmp_path: Path) -> None:
    spec = {s.name: s for s in load_manifest(ROOT / "models.toml")}[name]
    model = export(spec, tmp_path / "m.onnx")
    sig = onnx_model.signature(model, name)
    assert [t.name for t in sig.inputs] == [t.name for t in spec.inputs]
    # Dynamic dims keep the graph's own names (the export names the batch axis "batch").
    assert all(not isinstance(t.shape[0], int) for t in sig.inputs)
    if name == "minilm_l6_v2":
        assert sig.inputs[0].shape == ("batch", "sequence") and sig.outputs[0].shape[1:] == (384,)
    else:
        assert sig.outputs[0].shape[1:] == (1000,)
