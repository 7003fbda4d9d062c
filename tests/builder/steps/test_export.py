"""builder.steps.export: a PyTorch source becomes an ONNX file with a dynamic batch axis and the named
dynamic dims of the spec; a bad source fails in one line that names it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from builder.errors import BuilderError, ManifestError
from builder.spec import DimRange, ModelSpec, Precision, TensorSpec
from builder.steps.export import export
from tests.helpers.tiny_models import tiny_torch


class Raises(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("this module cannot be traced")


def raising_module() -> torch.nn.Module:
    """Source for the export-failure test: `tests.builder.steps.test_export:raising_module`."""
    return Raises()


def spec(source: str, name: str = "tiny") -> ModelSpec:
    return ModelSpec(name=name, source=source, inputs=(TensorSpec("x", "float32", (-1, "tokens", 32)),),
                     outputs=("logits",), dims={"tokens": DimRange(1, 4, 16)}, batch=DimRange(1, 4, 8),
                     precisions=(Precision.FP32,)).check()


def dims(value: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def test_export_has_a_dynamic_batch_and_the_named_dims_and_matches_pytorch(tmp_path: Path) -> None:
    out = tmp_path / "model.onnx"
    model = export(spec("tests.helpers.tiny_models:tiny_torch"), out)
    saved = onnx.load(str(out))
    assert saved == model
    assert [i.name for i in saved.graph.input] == ["x"] and [o.name for o in saved.graph.output] == ["logits"]
    assert dims(saved.graph.input[0]) == ["batch", "tokens", 32]
    assert dims(saved.graph.output[0]) == ["batch", 16]
    assert saved.opset_import[0].version == 17
    assert saved.graph.value_info, "the saved model carries the inferred intermediate shapes"
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    reference = tiny_torch()
    rng = np.random.default_rng(0)
    for batch, tokens in ((1, 3), (5, 7), (8, 16)):  # neither the example batch (2) nor the opt tokens (4)
        x = rng.standard_normal((batch, tokens, 32)).astype(np.float32)
        (logits,) = session.run(["logits"], {"x": x})
        with torch.no_grad():
            expected = reference(torch.from_numpy(x)).numpy()
        assert logits.shape == (batch, 16)
        np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


def test_a_source_that_returns_no_module_fails_in_one_line_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "model.onnx"
    with pytest.raises(ManifestError) as caught:
        export(spec("tests.helpers.tiny_models:not_a_module", name="bad"), out)
    assert str(caught.value) == ("model 'bad': source tests.helpers.tiny_models:not_a_module returned int, "
                                 "expected a torch.nn.Module")
    assert not out.exists()


def test_a_source_that_cannot_be_imported_fails_in_one_line_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ManifestError) as caught:
        export(spec("tests.helpers.no_such_module:make", name="gone"), tmp_path / "model.onnx")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("model 'gone': source: cannot import module 'tests.helpers.no_such_module'")
    with pytest.raises(ManifestError, match=r"^model 'gone': source: 'tests.helpers.tiny_models' has no callable "
                                            r"'nothing_here'$"):
        export(spec("tests.helpers.tiny_models:nothing_here", name="gone"), tmp_path / "model.onnx")


def test_a_module_that_fails_to_export_is_a_builder_error_with_the_cause(tmp_path: Path) -> None:
    out = tmp_path / "model.onnx"
    with pytest.raises(BuilderError) as caught:
        export(spec("tests.builder.steps.test_export:raising_module", name="broken"), out)
    assert not isinstance(caught.value, ManifestError)
    assert str(caught.value) == "model 'broken': ONNX export failed: this module cannot be traced"
    assert isinstance(caught.value.__cause__, ValueError)
    assert not out.exists()
