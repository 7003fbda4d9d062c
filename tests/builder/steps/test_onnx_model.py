from pathlib import Path

import pytest

from builder.errors import ManifestError, OnnxModelError
from builder.spec import DimRange
from builder.steps import onnx_model
from tests.helpers.tiny_models import mlp_onnx, sequence_onnx


def test_missing_foreign_and_truncated_files_give_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(OnnxModelError, match="file not found"):
        onnx_model.load(tmp_path / "nope.onnx")
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a model\n" * 20)
    with pytest.raises(OnnxModelError, match="not"):
        onnx_model.load(text)
    full = mlp_onnx(tmp_path / "mlp.onnx")
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    with pytest.raises(OnnxModelError, match=str(cut)):
        onnx_model.load(cut)


def test_signature_reads_dtypes_and_dynamic_dims(tmp_path: Path) -> None:
    sig = onnx_model.signature(onnx_model.load(sequence_onnx(tmp_path / "seq.onnx")), "seq")
    (ids,) = sig.inputs
    assert ids.name == "ids" and ids.dtype == "int64" and ids.shape == (-1, "seq")
    assert sig.outputs[0].shape == (-1, 8)


def test_dynamic_non_batch_dim_needs_a_range(tmp_path: Path) -> None:
    sig = onnx_model.signature(onnx_model.load(sequence_onnx(tmp_path / "seq.onnx")), "seq")
    with pytest.raises(ManifestError, match="dynamic dim 'seq' without a range; expected --dim seq=MIN:OPT:MAX"):
        onnx_model.check_batchable(sig, {}, "seq")
    onnx_model.check_batchable(sig, {"seq": DimRange(1, 8, 16)}, "seq")
