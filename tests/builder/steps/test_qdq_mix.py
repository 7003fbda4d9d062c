"""INT8 mixes derived from one calibrated Q/DQ graph (steps/qdq_mix.py), under both INT8 recipes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from numpy import testing
from onnx import numpy_helper

from builder.repository.onnx_files import sha256_file
from builder.runtimes.onnxruntime import run_file
from builder.spec import CalibrationMethod, CalibrationSpec, DataSpec, Int8Recipe
from builder.steps import precision
from builder.steps.guard import quantized_nodes
from builder.steps.qdq_mix import MixError, unquantize
from tests.helpers.tiny_models import mlp_samples, outlier_mlp_onnx


# The static Q/DQ recipes (dynamic quantization has no calibrated scales to keep: its guard quantizes again).
@pytest.fixture(scope="module", params=[r for r in Int8Recipe if r is not Int8Recipe.ONNXRUNTIME_DYNAMIC])
def quantized(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, onnx.ModelProto, onnx.ModelProto]:
    """The outlier MLP, its plain INT8 graph under one recipe, and the float graph that recipe quantized."""
    recipe: Int8Recipe = request.param
    folder = tmp_path_factory.mktemp(recipe.value)
    model = outlier_mlp_onnx(folder / "outlier.onnx")
    plain = folder / "int8.onnx"
    spec = CalibrationSpec(DataSpec("unused.npz", 64), method=CalibrationMethod.MAX, recipe=recipe)
    result = precision.to_int8(model, fp32_sha=sha256_file(model), calibration=mlp_samples(64, seed=0),
                               data_digest="t", spec=spec, out_path=plain, cache_dir=folder / "cache", log_file=None)
    # ModelOpt quantizes the graph it is given; ONNX Runtime's pre-processing changes it first, kept beside it.
    kept = precision.float_graph(folder / "cache", result.cache_key)
    assert kept.is_file() == (recipe is Int8Recipe.ONNXRUNTIME)
    return model, onnx.load(str(plain)), onnx.load(str(kept if kept.is_file() else model))


def _run(model: onnx.ModelProto, path: Path) -> np.ndarray:
    onnx.save(model, str(path))
    return run_file(path, mlp_samples(8, seed=1), 8)["logits"]


def _scales(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name.endswith("_scale")}


def test_every_node_unquantized_computes_the_fp32_graph_exactly(
        quantized: tuple[Path, onnx.ModelProto, onnx.ModelProto], tmp_path: Path) -> None:
    # ONNX Runtime's recipe drops the Relus its uint8 Quantize clamps replace: reading FP32 again puts them back.
    fp32, plain, float_model = quantized
    mix = unquantize(plain, quantized_nodes(plain), float_model)
    assert not quantized_nodes(mix)
    assert not {"QuantizeLinear", "DequantizeLinear"} & {n.op_type for n in mix.graph.node}
    testing.assert_array_equal(_run(mix, tmp_path / "mix.onnx"), run_file(fp32, mlp_samples(8, seed=1), 8)["logits"])


def test_the_other_nodes_stay_quantized_with_the_plain_graphs_scales(
        quantized: tuple[Path, onnx.ModelProto, onnx.ModelProto], tmp_path: Path) -> None:
    _, plain, float_model = quantized
    nodes = quantized_nodes(plain)
    mix = unquantize(plain, ["fc2"], float_model)
    assert quantized_nodes(mix) == [n for n in nodes if n != "fc2"]
    kept = _scales(mix)
    assert kept and all(np.array_equal(kept[name], value) for name, value in _scales(plain).items() if name in kept)
    # fc2 reads FP32: its output moves away from the plain INT8's (the outlier channel is resolved again).
    assert not np.allclose(_run(mix, tmp_path / "mix.onnx"), _run(plain, tmp_path / "plain.onnx"))


def test_a_node_is_refused_where_its_fp32_inputs_cannot_be_found(
        quantized: tuple[Path, onnx.ModelProto, onnx.ModelProto]) -> None:
    _, plain, float_model = quantized
    with pytest.raises(MixError, match="not in the quantized graph"):
        unquantize(plain, ["no_such_node"], float_model)
    # A node of the float graph under another name (fused, renamed): where the quantizer stored the weight
    # quantized (ONNX Runtime), its FP32 value is nowhere else; ModelOpt keeps it, in front of its Quantize.
    renamed = onnx.ModelProto()
    renamed.CopyFrom(float_model)
    next(n for n in renamed.graph.node if n.name == "fc2").name = "fc2_fused"
    weights_quantized = any(i.data_type == onnx.TensorProto.INT8 for i in plain.graph.initializer
                            if not i.name.endswith("_zero_point"))
    if weights_quantized:
        with pytest.raises(MixError, match="renamed or fused"):
            unquantize(plain, ["fc2"], renamed)
    else:
        assert "fc2" not in quantized_nodes(unquantize(plain, ["fc2"], renamed))
