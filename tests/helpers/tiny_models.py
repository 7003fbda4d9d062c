"""Tiny models built by the tests themselves: ONNX graphs and a PyTorch module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from numpy.typing import NDArray
from onnx import TensorProto, helper, numpy_helper

from builder.spec import CalibrationSpec, DataSpec, DimRange, ModelSpec, Precision, Task, Tolerance

TOKENS = 4


def mlp_onnx(path: Path, features: int = 32, hidden: int = 64, classes: int = 16, seed: int = 0) -> Path:
    """x[batch, 4, features] → MatMul → Relu → MatMul → mean over the 4 tokens → logits[batch, classes].

    Three-dimensional so that ModelOpt's INT8 mode quantizes the MatMuls (it leaves GEMV-shaped
    and K/N < 16 MatMuls in high precision)."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((features, hidden)) / np.sqrt(features)).astype(np.float32)
    b1 = (rng.standard_normal(hidden) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((hidden, classes)) / np.sqrt(hidden)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="fc1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="bias1"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu1"),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"], name="fc2"),
        helper.make_node("ReduceMean", ["h3"], ["logits"], axes=[1], keepdims=0, name="pool"),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", TOKENS, features])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        initializer=[numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"),
                     numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def sequence_onnx(path: Path, vocab: int = 50, width: int = 8, seed: int = 0) -> Path:
    """ids[batch, seq] int64 → Gather(embedding) → MatMul → ReduceMean over seq → out[batch, width]."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((vocab, width)).astype(np.float32)
    proj = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed"),
        helper.make_node("MatMul", ["emb", "proj"], ["h"], name="proj"),
        helper.make_node("ReduceMean", ["h"], ["out"], axes=[1], keepdims=0, name="pool"),
    ]
    graph = helper.make_graph(
        nodes, "seq",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", width])],
        initializer=[numpy_helper.from_array(table, "table"), numpy_helper.from_array(proj, "proj")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _saved(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def encoder_onnx(path: Path, width: int = 32, seed: int = 0) -> Path:
    """A one-layer attention encoder: x[batch, 4, width] → Q/K/V MatMuls → Q·Kᵀ (an activation x activation
    MatMul) → Softmax → ·V → Reshape → Gemm (transB, a [1, width] bias, as exporters write it) → Reshape →
    mean over the tokens → embedding[batch, width]."""
    rng = np.random.default_rng(seed)

    def weight(name: str) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32), name)

    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"], name="query"),
        helper.make_node("MatMul", ["x", "wk"], ["k"], name="key"),
        helper.make_node("MatMul", ["x", "wv"], ["v"], name="value"),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="key_t"),
        helper.make_node("MatMul", ["q", "kt"], ["scores"], name="scores"),
        helper.make_node("Mul", ["scores", "scale"], ["scaled"], name="scale"),
        helper.make_node("Softmax", ["scaled"], ["attention"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["attention", "v"], ["context"], name="context"),
        helper.make_node("Shape", ["x"], ["x_shape"], name="x_shape"),
        helper.make_node("Reshape", ["context", "rows"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "wo", "bo"], ["projected"], transB=1, name="output"),
        helper.make_node("Reshape", ["projected", "x_shape"], ["y"], name="unflatten"),
        helper.make_node("ReduceMean", ["y"], ["embedding"], axes=[1], keepdims=0, name="pool"),
    ]
    bias = (rng.standard_normal((1, width)) * 0.1).astype(np.float32)
    graph = helper.make_graph(
        nodes, "encoder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", TOKENS, width])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", width])],
        initializer=[weight("wq"), weight("wk"), weight("wv"), weight("wo"), numpy_helper.from_array(bias, "bo"),
                     numpy_helper.from_array(np.array(1 / np.sqrt(width), np.float32), "scale"),
                     numpy_helper.from_array(np.array([-1, width], np.int64), "rows")],
    )
    return _saved(graph, path)


def encoder_samples(count: int, width: int = 32, seed: int = 0) -> dict[str, NDArray[Any]]:
    return {"x": np.random.default_rng(seed).standard_normal((count, TOKENS, width)).astype(np.float32)}


CNN_SIDE = 16


def cnn_onnx(path: Path, seed: int = 0) -> Path:
    """image[batch, 3, 16, 16] → Conv 3x3 → Relu → depthwise Conv 3x3 (`depthwise`) → Relu → Conv 1x1 → Relu →
    GlobalAveragePool → Flatten → Gemm (a [1, 10] bias) → logits[batch, 10]."""
    rng = np.random.default_rng(seed)

    def array(*shape: int, scale: float = 1.0) -> NDArray[np.float32]:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        out: NDArray[np.float32] = (rng.standard_normal(shape) * scale / np.sqrt(fan_in)).astype(np.float32)
        return out

    nodes = [
        helper.make_node("Conv", ["image", "w1", "b1"], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="stem"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=16,
                         name="depthwise"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], kernel_shape=[1, 1], name="pointwise"),
        helper.make_node("Relu", ["c3"], ["r3"], name="relu3"),
        helper.make_node("GlobalAveragePool", ["r3"], ["pooled"], name="pool"),
        helper.make_node("Flatten", ["pooled"], ["features"], name="flatten"),
        helper.make_node("Gemm", ["features", "wf", "bf"], ["logits"], transB=1, name="classifier"),
    ]
    graph = helper.make_graph(
        nodes, "cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, CNN_SIDE, CNN_SIDE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        initializer=[numpy_helper.from_array(a, n) for a, n in (
            (array(16, 3, 3, 3), "w1"), (array(16, scale=0.1), "b1"), (array(16, 1, 3, 3), "w2"),
            (array(16, scale=0.1), "b2"), (array(32, 16, 1, 1), "w3"), (array(32, scale=0.1), "b3"),
            (array(10, 32), "wf"), (array(1, 10, scale=0.1), "bf"))],
    )
    return _saved(graph, path)


def cnn_samples(count: int, seed: int = 0) -> dict[str, NDArray[Any]]:
    shape = (count, 3, CNN_SIDE, CNN_SIDE)
    return {"image": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


def mlp_samples(count: int, features: int = 32, seed: int = 0) -> dict[str, NDArray[Any]]:
    return {"x": np.random.default_rng(seed).standard_normal((count, TOKENS, features)).astype(np.float32)}


def mlp_samples_fn(count: int, seed: int) -> dict[str, NDArray[Any]]:
    """Data source for manifests: `tests.helpers.tiny_models:mlp_samples_fn`."""
    return mlp_samples(count, seed=seed)


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))).mean(dim=1)


def tiny_torch() -> torch.nn.Module:
    """Source for manifests: `tests.helpers.tiny_models:tiny_torch`."""
    torch.manual_seed(0)
    return TinyNet().eval()


def not_a_module() -> int:
    return 3


def outlier_mlp_onnx(path: Path, features: int = 32, hidden: int = 64, classes: int = 16, scale: float = 400.0,
                     seed: int = 0) -> Path:
    """fc_in → relu → fc1 (+ bias) → relu → fc2 → relu → fc3 → mean over tokens → logits.

    Hidden channel 0 after fc1 carries activations `scale` times larger than the others, and fc2
    scales it back down: FP32 outputs stay ordinary, while one per-tensor INT8 scale for that tensor
    cannot resolve the ordinary channels. Keeping the layers around the outlier in higher precision
    repairs it; the rest can stay INT8."""
    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int) -> NDArray[np.float32]:
        return (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32)

    w_in, w1, w2, w3 = weight(features, hidden), weight(hidden, hidden), weight(hidden, hidden), weight(hidden, classes)
    w1[:, 0] = np.abs(w1[:, 0]) * scale / np.sqrt(hidden)
    b1 = (rng.standard_normal(hidden) * 0.1).astype(np.float32)
    b1[0] = scale
    w2[0, :] /= scale
    nodes = [
        helper.make_node("MatMul", ["x", "w_in"], ["a0"], name="fc_in"),
        helper.make_node("Relu", ["a0"], ["a1"], name="relu_in"),
        helper.make_node("MatMul", ["a1", "w1"], ["h0"], name="fc1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="bias1"),
        helper.make_node("Relu", ["h1"], ["h2"], name="relu1"),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"], name="fc2"),
        helper.make_node("Relu", ["h3"], ["h4"], name="relu2"),
        helper.make_node("MatMul", ["h4", "w3"], ["h5"], name="fc3"),
        helper.make_node("ReduceMean", ["h5"], ["logits"], axes=[1], keepdims=0, name="pool"),
    ]
    graph = helper.make_graph(
        nodes, "outlier_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", TOKENS, features])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        initializer=[numpy_helper.from_array(a, n) for a, n in
                     ((w_in, "w_in"), (w1, "w1"), (b1, "b1"), (w2, "w2"), (w3, "w3"))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


OFFSET_FEATURES = 16
OFFSET = 300.0


def offset_graph(rng: np.random.Generator, *, head: bool = True) -> onnx.GraphProto:
    """A model plain FP16 provably gets wrong: x[batch, 16] − offset (300 + u, |u| ≤ 0.12) → ×10 → MatMul →
    Relu → MatMul → logits[batch, 8], as a normalization layer fed raw sensor values (FP16's spacing at 300
    is 0.25, so the subtraction, node `centre`, loses the offset's fraction). Without `head`, the subtraction
    alone (its output is `logits`). Draws the offset, then w1 and w2, from `rng`."""
    offset = (OFFSET + rng.uniform(-0.12, 0.12, OFFSET_FEATURES)).astype(np.float32)
    w1 = (rng.standard_normal((OFFSET_FEATURES, 32)) / 4).astype(np.float32)
    w2 = (rng.standard_normal((32, 8)) / 6).astype(np.float32)
    nodes = [
        helper.make_node("Sub", ["x", "offset"], ["centred"], name="centre"),
        helper.make_node("Mul", ["centred", "scale"], ["scaled"], name="scale"),
        helper.make_node("MatMul", ["scaled", "w1"], ["h0"], name="fc1"),
        helper.make_node("Relu", ["h0"], ["h"], name="relu"),
        helper.make_node("MatMul", ["h", "w2"], ["logits"], name="fc2"),
    ]
    if not head:
        nodes = [helper.make_node("Sub", ["x", "offset"], ["logits"], name="centre")]
    return helper.make_graph(
        nodes, "offset",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", OFFSET_FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 8 if head else OFFSET_FEATURES])],
        initializer=[numpy_helper.from_array(offset, "offset"),
                     numpy_helper.from_array(np.full(OFFSET_FEATURES, 10.0, np.float32), "scale"),
                     numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )


def tiny_specs(data_dir: Path) -> list[ModelSpec]:
    """An MLP classifier (fp32/fp16/int8, calibration from .npz) and a sequence model with a named dim."""
    mlp = mlp_onnx(data_dir / "mlp.onnx")
    np.savez(data_dir / "mlp_calib.npz", **mlp_samples(64, seed=0))
    np.savez(data_dir / "mlp_eval.npz", **mlp_samples(32, seed=1))
    seq = sequence_onnx(data_dir / "seq.onnx")
    rng = np.random.default_rng(2)
    np.savez(data_dir / "seq_eval.npz", ids=rng.integers(0, 50, size=(16, 12)).astype(np.int64))
    return [
        ModelSpec(
            name="mlp", onnx=mlp, task=Task.CLASSIFICATION, batch=DimRange(1, 4, 8),
            precisions=(Precision.FP32, Precision.FP16, Precision.INT8),
            calibration=CalibrationSpec(DataSpec(str(data_dir / "mlp_calib.npz"), 64)),
            evaluation=DataSpec(str(data_dir / "mlp_eval.npz"), 32),
            tolerances={Precision.INT8: Tolerance(cosine_min=0.95, top1_agreement_min=0.8)},
        ),
        ModelSpec(
            name="seq", onnx=seq, batch=DimRange(1, 2, 4), precisions=(Precision.FP32, Precision.FP16),
            dims={"seq": DimRange(1, 12, 32)}, evaluation=DataSpec(str(data_dir / "seq_eval.npz"), 16),
        ),
    ]
