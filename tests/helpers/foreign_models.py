"""Tiny ONNX models shaped like the ones users bring from other projects (issue 12), one per class,
each with calibration data and the `trtbuild build` flags and models.toml entry that build it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from numpy.typing import NDArray
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.tiny_models import OFFSET, OFFSET_FEATURES, offset_graph

SAMPLES = 16  # calibration samples per model: 12 calibrate, the last 4 are held out


@dataclass(frozen=True)
class ForeignModel:
    """One generated model: where it is, the build flags, and the same build as a models.toml entry."""

    name: str
    what: str  # the class it stands for (README table)
    onnx: Path
    calibration: Path
    flags: tuple[str, ...]  # after `trtbuild build --onnx … --name … --calibration …`
    toml: str  # extra lines of its [[model]] table
    batching: bool  # whether the build should serve it with max_batch_size > 0

    def build_args(self, repository: Path) -> list[str]:
        return ["build", "--onnx", str(self.onnx), "--name", self.name, "--calibration", str(self.calibration),
                "--repository", str(repository), *self.flags]

    def manifest_entry(self) -> str:
        return (f'[[model]]\nname = "{self.name}"\nonnx = "{self.onnx}"\nprecisions = ["fp32", "fp16", "int8"]\n'
                f'{self.toml}\n[model.calibration]\nsource = "{self.calibration}"\nsamples = 512\n')


def _init(rng: np.random.Generator, name: str, *shape: int, scale: float | None = None) -> onnx.TensorProto:
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
    array = rng.standard_normal(shape) * (scale if scale is not None else 1 / np.sqrt(fan_in))
    return numpy_helper.from_array(array.astype(np.float32), name)


def _save(graph: onnx.GraphProto, path: Path, opset: int = 17, *, external: bool = False,
          domains: tuple[tuple[str, int], ...] = ()) -> Path:
    imports = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, v) for d, v in domains)]
    model = helper.make_model(graph, opset_imports=imports, ir_version=7 if opset < 15 else 8)
    onnx.checker.check_model(model)
    if external:
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=f"{path.stem}.weights", size_threshold=0)
    else:
        onnx.save(model, str(path))
    return path


def _npz(path: Path, arrays: dict[str, NDArray[np.generic]]) -> Path:
    np.savez(path, **arrays)
    return path


def detector(folder: Path) -> ForeignModel:
    """images[p2o.DynamicDimension.0, 3, p2o.DynamicDimension.1, p2o.DynamicDimension.2] → two stride-2
    convs → upsample the deeper map → Concat with the shallower one → 1x1 conv → preds[b, 6, anchors].
    H and W must be multiples of 4, or the Concat's maps differ (the failure the issue saw in autocast)."""
    rng = np.random.default_rng(1)
    dyn: list[str | int] = ["p2o.DynamicDimension.0", 3, "p2o.DynamicDimension.1", "p2o.DynamicDimension.2"]
    nodes = [
        helper.make_node("Conv", ["images", "w1", "b1"], ["c1"], strides=[2, 2], pads=[1, 1, 1, 1], name="stem"),
        helper.make_node("Relu", ["c1"], ["f1"]),
        helper.make_node("Conv", ["f1", "w2", "b2"], ["c2"], strides=[2, 2], pads=[1, 1, 1, 1], name="down"),
        helper.make_node("Relu", ["c2"], ["f2"]),
        helper.make_node("Resize", ["f2", "", "scales"], ["up"], mode="nearest", name="upsample"),
        helper.make_node("Concat", ["f1", "up"], ["cat"], axis=1, name="concat"),
        helper.make_node("Conv", ["cat", "w3", "b3"], ["head"], name="head"),
        helper.make_node("Reshape", ["head", "flat"], ["preds"], name="flatten"),
    ]
    graph = helper.make_graph(
        nodes, "detector",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, dyn)],
        [helper.make_tensor_value_info("preds", TensorProto.FLOAT, ["p2o.DynamicDimension.0", 6, "anchors"])],
        initializer=[_init(rng, "w1", 8, 3, 3, 3), _init(rng, "b1", 8, scale=0.1),
                     _init(rng, "w2", 16, 8, 3, 3), _init(rng, "b2", 16, scale=0.1),
                     _init(rng, "w3", 6, 24, 1, 1), _init(rng, "b3", 6, scale=0.1),
                     numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
                     numpy_helper.from_array(np.array([0, 6, -1], np.int64), "flat")],
    )
    path = _save(graph, folder / "detector.onnx")
    data = _npz(folder / "detector.npz",
                {"images": rng.uniform(0, 1, (SAMPLES, 3, 96, 96)).astype(np.float32)})
    return ForeignModel(
        "detector", "strided detector, Concat over feature maps, dynamic H/W (dims `p2o.DynamicDimension.N`)",
        path, data,
        ("--min-shapes", "images:1x3x64x64", "--opt-shapes", "images:2x3x96x96", "--max-shapes", "images:4x3x128x128"),
        '[model.shapes]\nimages = { min = [1, 3, 64, 64], opt = [2, 3, 96, 96], max = [4, 3, 128, 128] }\n', True)


def ocr_classifier(folder: Path) -> ForeignModel:
    """x[-1, 3, '?', '?'] (an unnamed batch, two dims both named `?`) → conv → global pool → Gemm → softmax."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("GlobalAveragePool", ["r1"], ["g"]),
        helper.make_node("Flatten", ["g"], ["flat"]),
        helper.make_node("Gemm", ["flat", "w2", "b2"], ["logits"], transB=1, name="fc"),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=1),
    ]
    graph = helper.make_graph(
        nodes, "ocr_cls",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, "?", "?"])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [-1, 4])],
        initializer=[_init(rng, "w1", 16, 3, 3, 3), _init(rng, "b1", 16, scale=0.1),
                     _init(rng, "w2", 4, 16, scale=2.0), _init(rng, "b2", 4, scale=0.1)],
    )
    graph.input[0].type.tensor_type.shape.dim[0].ClearField("dim_value")  # unnamed: neither value nor name
    path = _save(graph, folder / "ocr_cls.onnx")
    data = _npz(folder / "ocr_cls.npz", {"x": rng.uniform(-1, 1, (SAMPLES, 3, 48, 192)).astype(np.float32)})
    return ForeignModel(
        "ocr_cls", "unnamed batch and duplicate-named (`?`, `?`) dims", path, data,
        ("--min-shapes", "x:1x3x48x64", "--opt-shapes", "x:4x3x48x192", "--max-shapes", "x:8x3x48x320"),
        '[model.shapes]\nx = { min = [1, 3, 48, 64], opt = [4, 3, 48, 192], max = [8, 3, 48, 320] }\n', True)


def stateful(folder: Path) -> ForeignModel:
    """A voice-activity-style model: input[batch, sequence], state[2, batch, 128], sr (int64 scalar) →
    output[batch, 1], stateN[2, batch, 128]. Batch is on axis 1 of the state: max_batch_size 0."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("ReduceMean", ["input"], ["level"], axes=[1], keepdims=1),  # [b, 1]
        helper.make_node("ReduceMean", ["state"], ["memory"], axes=[0], keepdims=0),  # [b, 128]
        helper.make_node("MatMul", ["memory", "w"], ["recall"]),  # [b, 1]
        helper.make_node("Cast", ["sr"], ["sr_f"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["sr_f", "khz"], ["rate"]),
        helper.make_node("Mul", ["level", "rate"], ["scaled"]),
        helper.make_node("Add", ["scaled", "recall"], ["pre"]),
        helper.make_node("Sigmoid", ["pre"], ["output"]),
        helper.make_node("Mul", ["state", "decay"], ["kept"]),
        helper.make_node("Add", ["kept", "scaled"], ["mixed"]),  # [2, b, 128] + [b, 1]
        helper.make_node("Tanh", ["mixed"], ["stateN"]),
    ]
    graph = helper.make_graph(
        nodes, "vad",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "sequence"]),
         helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, "batch", 128]),
         helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 1]),
         helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [2, "batch", 128])],
        initializer=[_init(rng, "w", 128, 1), numpy_helper.from_array(np.array(16000.0, np.float32), "khz"),
                     numpy_helper.from_array(np.array(0.5, np.float32), "decay")],
    )
    path = _save(graph, folder / "vad.onnx")
    data = _npz(folder / "vad.npz", {
        "input": rng.uniform(-1, 1, (SAMPLES, 1, 512)).astype(np.float32),
        "state": rng.uniform(-1, 1, (SAMPLES, 2, 1, 128)).astype(np.float32),
        "sr": np.full(SAMPLES, 16000, np.int64),
    })
    return ForeignModel(
        "vad", "state input with batch on axis 1, int64 scalar input", path, data,
        ("--min-shapes", "input:1x256,state:2x1x128", "--opt-shapes", "input:1x512,state:2x1x128",
         "--max-shapes", "input:1x1024,state:2x1x128"),
        '[model.shapes]\ninput = { min = [1, 256], opt = [1, 512], max = [1, 1024] }\nstate = [2, 1, 128]\n', False)


def int32_classifier(folder: Path) -> ForeignModel:
    """bytes[batch, 256] int32 (values 0..255) → embedding Gather → mean → MatMul → an `ai.onnx.ml`
    Normalizer (a non-default domain) → logits[batch, 5]."""
    rng = np.random.default_rng(4)
    nodes = [
        helper.make_node("Gather", ["table", "bytes"], ["emb"], name="embed"),  # [b, 256, 16]
        helper.make_node("MatMul", ["emb", "proj"], ["h"], name="proj"),  # [b, 256, 16]
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("ReduceMean", ["r"], ["pooled"], axes=[1], keepdims=0),
        helper.make_node("MatMul", ["pooled", "head"], ["raw"], name="head"),
        helper.make_node("Normalizer", ["raw"], ["logits"], domain="ai.onnx.ml", norm="L2", name="normalize"),
    ]
    graph = helper.make_graph(
        nodes, "filetype",
        [helper.make_tensor_value_info("bytes", TensorProto.INT32, ["batch", 256])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 5])],
        initializer=[_init(rng, "table", 256, 16, scale=1.0), _init(rng, "proj", 16, 16),
                     _init(rng, "head", 16, 5, scale=1.0)],
    )
    path = _save(graph, folder / "filetype.onnx", domains=(("ai.onnx.ml", 3),))
    data = _npz(folder / "filetype.npz", {"bytes": rng.integers(0, 256, (SAMPLES, 256)).astype(np.int32)})
    return ForeignModel("filetype", "int32 input with a declared value range, an `ai.onnx.ml` op", path, data,
                        ("--input-range", "bytes:0:255", "--max-batch", "8"),
                        "batch = [1, 4, 8]\n[model.input_ranges]\nbytes = [0, 255]\n", True)


def opset11(folder: Path) -> ForeignModel:
    """An opset 11 export: x[batch, 8, 32] → MatMul → Add → Relu → MatMul → y[batch, 8, 16], and a
    ReduceMean with the `axes` attribute (an input from opset 18 on). Three-dimensional, so ModelOpt's
    INT8 mode quantizes the MatMuls (it leaves GEMV-shaped ones in high precision)."""
    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
        helper.make_node("ReduceMean", ["r"], ["energy"], axes=[2], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "old",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 16]),
         helper.make_tensor_value_info("energy", TensorProto.FLOAT, ["batch", 8])],
        initializer=[_init(rng, "w1", 32, 64), _init(rng, "b1", 64, scale=0.1), _init(rng, "w2", 64, 16)],
    )
    path = _save(graph, folder / "opset11.onnx", opset=11)
    data = _npz(folder / "opset11.npz", {"x": rng.standard_normal((SAMPLES, 8, 32)).astype(np.float32)})
    return ForeignModel("opset11", "opset 11 export", path, data, (), "", True)


def opset21(folder: Path) -> ForeignModel:
    """An opset 21 export with the newest `ai.onnx.ml` (5): x[batch, 8, 32] → MatMul → Add → Relu →
    MatMul → y[batch, 8, 16], and ReduceMean with `axes` as an input (its form from opset 18 on) → an
    `ai.onnx.ml` Normalizer → energy[batch, 8]."""
    rng = np.random.default_rng(7)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
        helper.make_node("ReduceMean", ["r", "axes"], ["pooled"], keepdims=0),
        helper.make_node("Normalizer", ["pooled"], ["energy"], domain="ai.onnx.ml", norm="L2", name="normalize"),
    ]
    graph = helper.make_graph(
        nodes, "new",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 16]),
         helper.make_tensor_value_info("energy", TensorProto.FLOAT, ["batch", 8])],
        initializer=[_init(rng, "w1", 32, 64), _init(rng, "b1", 64, scale=0.1), _init(rng, "w2", 64, 16),
                     numpy_helper.from_array(np.array([2], np.int64), "axes")],
    )
    path = _save(graph, folder / "opset21.onnx", opset=21, domains=(("ai.onnx.ml", 5),))
    data = _npz(folder / "opset21.npz", {"x": rng.standard_normal((SAMPLES, 8, 32)).astype(np.float32)})
    return ForeignModel("opset21", "opset 21 export, `ai.onnx.ml` 5", path, data, (), "", True)



def fp16_sensitive(folder: Path) -> ForeignModel:
    """Plain FP16 provably misses its tolerance: x[batch, 16] − offset (300 + u, |u| ≤ 0.12) → ×10 → MatMul
    → Relu → MatMul → logits[batch, 8], fed values around 300, as a normalization layer fed raw sensor
    values. FP16's spacing at 300 is 0.25, so the subtraction (node `centre`) loses the offset's fraction;
    kept in FP32, the rest computes in FP16 within the default cosine_min 0.999."""
    rng = np.random.default_rng(0)
    graph = offset_graph(rng)  # the FP16 guard's own test model (tests/builder/steps/test_fp16_guard.py)
    path = _save(graph, folder / "sensor.onnx")
    data = _npz(folder / "sensor.npz",
                {"x": (OFFSET + 0.1 * rng.standard_normal((SAMPLES, OFFSET_FEATURES))).astype(np.float32)})
    return ForeignModel("sensor", "FP16-sensitive: an offset FP16 cannot hold (plain FP16 misses cosine_min 0.999)",
                        path, data, ("--max-batch", "8"), "batch = [1, 4, 8]\n", True)


def external_data(folder: Path) -> ForeignModel:
    """Weights in a separate file beside the .onnx (save_as_external_data): x[batch, 8, 64] → MatMul →
    Relu → MatMul → y[batch, 8, 32]."""
    rng = np.random.default_rng(6)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = helper.make_graph(
        nodes, "external",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 32])],
        initializer=[_init(rng, "w", 64, 128), _init(rng, "w2", 128, 32)],
    )
    sub = folder / "external"
    sub.mkdir(exist_ok=True)
    path = _save(graph, sub / "model.onnx", external=True)
    data = _npz(folder / "external.npz", {"x": rng.standard_normal((SAMPLES, 8, 64)).astype(np.float32)})
    return ForeignModel("external", "weights in an external data file", path, data, (), "", True)


MAKERS: tuple[Callable[[Path], ForeignModel], ...] = (
    detector, ocr_classifier, stateful, int32_classifier, opset11, opset21, fp16_sensitive, external_data)


def all_models(folder: Path) -> list[ForeignModel]:
    return [make(folder) for make in MAKERS]


# Issue 22: classes that broke the build on real third-party models (look-alikes, generated here).


def ctc_recognizer(folder: Path) -> ForeignModel:
    """A CTC text recognizer whose declared output contradicts what it returns: x[1, 1, 32, W] → a stride-8
    conv over the width → Transpose → MatMul → Softmax → probs, declared [1, seqlen] but returned as
    (W/8, 1, classes), time first and the batch on axis 1 (a captcha OCR shipped in a wheel does this)."""
    rng = np.random.default_rng(8)
    classes = 40
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=[32, 8], kernel_shape=[32, 8], name="conv"),
        helper.make_node("Squeeze", ["c", "height"], ["s"], name="squeeze"),  # [1, 16, W/8]
        helper.make_node("Transpose", ["s"], ["t"], perm=[2, 0, 1], name="time_first"),  # [W/8, 1, 16]
        helper.make_node("MatMul", ["t", "proj"], ["logits"], name="proj"),  # [W/8, 1, classes]
        helper.make_node("Softmax", ["logits"], ["probs"], axis=2, name="softmax"),
    ]
    graph = helper.make_graph(
        nodes, "ctc",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 32, "W"])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, "seqlen"])],
        initializer=[_init(rng, "w", 16, 1, 32, 8), _init(rng, "b", 16, scale=0.1),
                     numpy_helper.from_array(np.array([2], np.int64), "height"), _init(rng, "proj", 16, classes)],
    )
    path = _save(graph, folder / "ctc.onnx")
    data = _npz(folder / "ctc.npz", {"x": rng.uniform(0, 1, (SAMPLES, 1, 1, 32, 160)).astype(np.float32)})
    return ForeignModel(
        "ctc", "declared output [1, seqlen] contradicts the returned (W/8, 1, classes)", path, data,
        ("--min-shapes", "x:1x1x32x64", "--opt-shapes", "x:1x1x32x160", "--max-shapes", "x:1x1x32x320"),
        '[model.shapes]\nx = { min = [1, 1, 32, 64], opt = [1, 1, 32, 160], max = [1, 1, 32, 320] }\n', False)


def _branch(rng: np.random.Generator, name: str, scale: float) -> onnx.GraphProto:
    """One branch of control_flow's If: reads `h`, `state` and `decay` from the outer graph."""
    return helper.make_graph(
        [helper.make_node("MatMul", ["h", f"w_{name}"], [f"o_{name}"], name=f"{name}_fc"),
         helper.make_node("Tanh", [f"o_{name}"], [f"out_{name}"], name=f"{name}_tanh"),
         helper.make_node("Mul", ["state", "decay"], [f"s_{name}"], name=f"{name}_decay")],
        name, [],
        [helper.make_tensor_value_info(f"out_{name}", TensorProto.FLOAT, ["batch", 8]),
         helper.make_tensor_value_info(f"s_{name}", TensorProto.FLOAT, [2, "batch", 16])],
        initializer=[_init(rng, f"w_{name}", 32, 8, scale=scale / 6)])


def control_flow(folder: Path) -> ForeignModel:
    """A voice-activity model with control flow: x[batch, 32], state[2, batch, 16], sr (int64[1]) → Relu →
    If (sr == 16000) whose branches read outer values (`h`, `state`, an initializer) and produce the graph's
    outputs y[batch, 8] and stateN[2, batch, 16] directly. Batch on axis 1 of the state: max_batch_size 0."""
    rng = np.random.default_rng(9)
    nodes = [
        helper.make_node("Relu", ["x"], ["h"], name="relu"),
        helper.make_node("Equal", ["sr", "khz16"], ["is16"], name="is16"),
        helper.make_node("Squeeze", ["is16"], ["cond"], name="cond"),
        helper.make_node("If", ["cond"], ["y", "stateN"], then_branch=_branch(rng, "wide", 1.0),
                         else_branch=_branch(rng, "narrow", 0.5), name="rate"),
    ]
    graph = helper.make_graph(
        nodes, "vad_if",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 32]),
         helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, "batch", 16]),
         helper.make_tensor_value_info("sr", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8]),
         helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [2, "batch", 16])],
        initializer=[numpy_helper.from_array(np.array(0.5, np.float32), "decay"),
                     numpy_helper.from_array(np.array([16000], np.int64), "khz16")],
    )
    path = _save(graph, folder / "vad_if.onnx")
    data = _npz(folder / "vad_if.npz", {
        "x": rng.standard_normal((SAMPLES, 1, 32)).astype(np.float32),
        "state": rng.standard_normal((SAMPLES, 2, 1, 16)).astype(np.float32),
        "sr": np.full((SAMPLES, 1), 16000, np.int64),
    })
    return ForeignModel(
        "vad_if", "If subgraphs reading outer values, producing the graph's outputs", path, data,
        ("--shapes", "x:1x32,state:2x1x16,sr:1"), '[model.shapes]\nx = [1, 32]\nstate = [2, 1, 16]\nsr = [1]\n',
        False)


def split_detector(folder: Path) -> ForeignModel:
    """A YOLO-style head with dynamic H/W: images[batch, 3, H, W] → stride-4 conv → Reshape [b, 82, A] →
    Split [64, 18] → (box distribution: Reshape, Softmax, ReduceSum) and (classes: Sigmoid) → Concat →
    preds[batch, 22, A]. A converter's shape annotations taken at one size go stale at others."""
    rng = np.random.default_rng(10)
    nodes = [
        helper.make_node("Conv", ["images", "w", "b"], ["c"], strides=[4, 4], kernel_shape=[4, 4], name="stem"),
        helper.make_node("Reshape", ["c", "flat"], ["r"], name="flatten"),
        helper.make_node("Split", ["r", "sizes"], ["box", "cls"], axis=1, name="split"),
        helper.make_node("Reshape", ["box", "bins"], ["box4"], name="bins"),
        helper.make_node("Softmax", ["box4"], ["soft"], axis=2, name="softmax"),
        helper.make_node("ReduceSum", ["soft", "axis2"], ["dist"], keepdims=0, name="dist"),
        helper.make_node("Sigmoid", ["cls"], ["scores"], name="scores"),
        helper.make_node("Concat", ["dist", "scores"], ["preds"], axis=1, name="concat"),
    ]
    ints = (([0, 82, -1], "flat"), ([64, 18], "sizes"), ([0, 4, 16, -1], "bins"), ([2], "axis2"))
    graph = helper.make_graph(
        nodes, "split_detector",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info("preds", TensorProto.FLOAT, ["batch", 22, "anchors"])],
        initializer=[_init(rng, "w", 82, 3, 4, 4), _init(rng, "b", 82, scale=0.1),
                     *(numpy_helper.from_array(np.array(v, np.int64), n) for v, n in ints)],
    )
    path = _save(graph, folder / "split_detector.onnx")
    data = _npz(folder / "split_detector.npz",
                {"images": rng.uniform(0, 1, (SAMPLES, 3, 64, 64)).astype(np.float32)})
    return ForeignModel(
        "split_detector", "Split head, dynamic H/W (a converter's shape annotations go stale)", path, data,
        ("--min-shapes", "images:1x3x32x32", "--opt-shapes", "images:2x3x64x64", "--max-shapes",
         "images:4x3x128x128"),
        '[model.shapes]\nimages = { min = [1, 3, 32, 32], opt = [2, 3, 64, 64], max = [4, 3, 128, 128] }\n', True)


def rate_gated(folder: Path) -> ForeignModel:
    """Silero-VAD-like: x[batch, 32], sr (int64 scalar) → If (sr == 16000): the then branch is the model; the
    else branch (8 kHz windows) reshapes x into rows of 7 and cannot run on a 16 kHz window of 32 values, as
    silero's 8 kHz branch fails on a 512-sample window (`LSTM ... Input X must have 3 dimensions only`).
    The scalar `sr` makes it a max_batch_size 0 model."""
    rng = np.random.default_rng(11)
    then_branch = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w16"], ["y16"], name="fc16")], "khz16", [],
        [helper.make_tensor_value_info("y16", TensorProto.FLOAT, ["batch", 8])],
        initializer=[_init(rng, "w16", 32, 8, scale=0.2)])
    else_branch = helper.make_graph(
        [helper.make_node("Reshape", ["x", "rows7"], ["x7"], name="rows7"),
         helper.make_node("MatMul", ["x7", "w8"], ["y8"], name="fc8")], "khz8", [],
        [helper.make_tensor_value_info("y8", TensorProto.FLOAT, ["rows", 8])],
        initializer=[numpy_helper.from_array(np.array([-1, 7], np.int64), "rows7"), _init(rng, "w8", 7, 8)])
    graph = helper.make_graph(
        [helper.make_node("Equal", ["sr", "khz16"], ["cond"], name="is16"),
         helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch, name="rate")],
        "rate_gated",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 32]),
         helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        initializer=[numpy_helper.from_array(np.array(16000, np.int64), "khz16")],
    )
    path = _save(graph, folder / "rate_gated.onnx")
    data = _npz(folder / "rate_gated.npz", {
        "x": rng.standard_normal((SAMPLES, 1, 32)).astype(np.float32),
        "sr": np.full((SAMPLES,), 16000, np.int64),
    })
    return ForeignModel(
        "rate_gated", "If on an int64 scalar sample rate; the other rate's branch cannot run this window", path,
        data, ("--shapes", "x:1x32,sr:[]"), '[model.shapes]\nx = [1, 32]\nsr = []\n', False)


def prequantized(folder: Path, *, float_head: bool = False) -> ForeignModel:
    """An OCR model already quantized dynamically by its exporter, with a contrib op: x[1, 8] (no batching) →
    DynamicQuantizeLinear → MatMulInteger (int8 weights) → Cast to float → Mul by the scales → Add bias →
    com.microsoft Gelu → y[1, 6]. No float Conv/MatMul/Gemm is left; ModelOpt hands the custom op to TensorRT
    (absent: "name 'trt' is not defined"), and onnxconverter-common's FP16 mixes FP16 with the float the Casts
    and the FP32-only DynamicQuantizeLinear produce. `float_head`: a float MatMul after the Gelu, as kokoro's TTS
    keeps 26 float MatMul beside its 148 MatMulInteger (quantized in part)."""
    rng = np.random.default_rng(12)
    weights = rng.integers(-127, 128, (8, 6)).astype(np.int8)
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="x_quant"),
        helper.make_node("MatMulInteger", ["xq", "wq", "xz", "wz"], ["acc"], name="matmul_int"),
        helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT, name="acc_float"),
        helper.make_node("Mul", ["xs", "ws"], ["scale"], name="scale"),
        helper.make_node("Mul", ["accf", "scale"], ["mm"], name="scale_mul"),
        helper.make_node("Add", ["mm", "bias"], ["pre"], name="bias"),
        helper.make_node("Gelu", ["pre"], ["g" if float_head else "y"], domain="com.microsoft", name="gelu"),
    ]
    head = [_init(rng, "head_w", 6, 6)] if float_head else []
    if float_head:
        nodes.append(helper.make_node("MatMul", ["g", "head_w"], ["y"], name="head"))
    graph = helper.make_graph(
        nodes, "prequantized",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6])],
        initializer=[numpy_helper.from_array(weights, "wq"), numpy_helper.from_array(np.array(0, np.int8), "wz"),
                     numpy_helper.from_array(np.array(0.01, np.float32), "ws"), _init(rng, "bias", 6, scale=0.1),
                     *head],
    )
    path = _save(graph, folder / "prequantized.onnx", 13, domains=(("com.microsoft", 1),))
    data = _npz(folder / "prequantized.npz", {"x": rng.standard_normal((SAMPLES, 1, 8)).astype(np.float32)})
    return ForeignModel("prequantized", "already quantized (MatMulInteger) with a com.microsoft op", path, data,
                        ("--shapes", "x:1x8"), '[model.shapes]\nx = [1, 8]\n', False)


def float_cast(folder: Path) -> ForeignModel:
    """An exporter's explicit Cast to float feeding a node whose other input is a weight (silero's STFT
    magnitude into the first Conv, its decoder's Cast into an Add): x[batch, 16] → Relu → Cast(to float) → Add
    bias → MatMul → y[batch, 4]. onnxconverter-common keeps a Cast to float as float and makes the bias FP16:
    ONNX Runtime refuses the Add ("bound to different types")."""
    rng = np.random.default_rng(13)
    nodes = [
        helper.make_node("Relu", ["x"], ["h"], name="relu"),
        helper.make_node("Cast", ["h"], ["hf"], to=TensorProto.FLOAT, name="/Cast"),
        helper.make_node("Add", ["hf", "bias"], ["biased"], name="/Add"),
        helper.make_node("MatMul", ["biased", "w"], ["y"], name="/MatMul"),
    ]
    graph = helper.make_graph(
        nodes, "float_cast",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[_init(rng, "bias", 16, scale=0.1), _init(rng, "w", 16, 4)],
    )
    path = _save(graph, folder / "float_cast.onnx")
    data = _npz(folder / "float_cast.npz", {"x": rng.standard_normal((SAMPLES, 16)).astype(np.float32)})
    return ForeignModel("float_cast", "an explicit Cast to float before a node with a weight", path, data,
                        ("--min-shapes", "x:1x16", "--opt-shapes", "x:2x16", "--max-shapes", "x:4x16"),
                        "", True)


def data_sized(folder: Path) -> ForeignModel:
    """A TTS-like model whose output length depends on the data: tokens[1, 8] → audio[audio_length], the scaled
    tokens above zero (kokoro's audio grows with its text). Verify compares each answer with the local run's
    outputs, which stack the samples padded with zeros."""
    rng = np.random.default_rng(9)
    nodes = [
        helper.make_node("Mul", ["tokens", "gain"], ["scaled"]),
        helper.make_node("Greater", ["tokens", "zero"], ["voiced"]),
        helper.make_node("Compress", ["scaled", "voiced"], ["audio"]),  # no axis: flattened, data-sized
    ]
    graph = helper.make_graph(
        nodes, "tts",
        [helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["audio_length"])],
        initializer=[numpy_helper.from_array(np.array(3.0, np.float32), "gain"),
                     numpy_helper.from_array(np.array(0.0, np.float32), "zero")],
    )
    path = _save(graph, folder / "tts.onnx")
    data = _npz(folder / "tts.npz", {"tokens": rng.uniform(-1, 1, (SAMPLES, 1, 8)).astype(np.float32)})
    return ForeignModel("tts", "output whose length depends on the data", path, data, (), "", False)
