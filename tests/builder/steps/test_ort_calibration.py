"""The streamed entropy calibration gives ONNX Runtime's one-shot ranges and Q/DQ graph exactly, for float32 and
float16 graphs, with NaN in samples, ops ONNX Runtime does not quantize and outputs that are not tensors; where
the samples give a tensor no finite range it fails as a calibration failure, one line naming the tensor.

Each case runs in a fresh interpreter: importing ModelOpt (other tests do) patches ONNX Runtime's calibrators in
place.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

_COMPARE = r"""
import json, sys
from pathlib import Path
import numpy as np
import onnx
from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.calibrate import CalibrationCacheEncoder, create_calibrator
from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry
from builder.steps import fetch_groups
from builder.steps.ort_calibration import CalibrationFailed, entropy_ranges, save_ranges

model, samples, work = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
one_shot_too = sys.argv[4] == "1"
drift = sys.argv[5] == "1"  # the second pass sees other values than the first (as a graph with random ops does)
if sys.argv[6] == "1":
    fetch_groups.GROUP_BYTES = 1  # every tensor a group (and a session) of its own
with np.load(samples) as archive:
    xs = archive["x"]

class Reader:
    def __init__(self):
        self.i = 0
    def get_next(self):
        if self.i >= len(xs):
            return None
        self.i += 1
        return {"x": xs[self.i - 1 : self.i]}

def as_json(tensors):
    return json.loads(json.dumps(tensors, cls=CalibrationCacheEncoder))

calls = []
def feeds():
    calls.append(1)
    scale = 3.0 if drift and len(calls) == 3 else 1.0  # calls: the shapes, then the two passes (one group)
    return ({"x": feed["x"] * scale} for feed in iter(Reader().get_next, None))
(work / "streamed").mkdir()
try:
    beyond = {}
    streamed = entropy_ranges(model, feeds, op_types=[], external=False, workdir=work / "streamed", beyond=beyond)
except CalibrationFailed as exc:
    print(json.dumps({"failed": str(exc)}))
    sys.exit(0)

def quantized(path, cache):
    quantize_static(str(model), str(path), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.Entropy, calibration_cache_path=cache)
    return onnx.load(str(path)).graph.SerializeToString()

result = {"passes": len(calls), "tensors": sorted(streamed.keys()),
          "bins": sorted({len(v.hist) for v in streamed.values()}),
          "counted": {k: int(v.hist.sum()) for k, v in streamed.items()},
          "x_hist": streamed["x"].hist.tolist(), "beyond": beyond}
if one_shot_too:
    (work / "one").mkdir()
    # The op types quantize_static calibrates when it is given none.
    ops = sorted(set(QLinearOpsRegistry) | set(QDQRegistry))
    calibrator = create_calibrator(model, ops, augmented_model_path=str(work / "one" / "aug.onnx"),
                                   calibrate_method=CalibrationMethod.Entropy)
    calibrator.collect_data(Reader())
    one_shot = calibrator.compute_data()
    result["same_ranges"] = as_json(one_shot) == as_json(streamed)
    # The whole Q/DQ graph, quantize_static's own calibration against ours read back from the cache file.
    save_ranges(streamed, work / "ranges.json")
    result["same_graph"] = quantized(work / "a.onnx", None) == quantized(work / "b.onnx", work / "ranges.json")
print(json.dumps(result))
"""


def _model(path: Path, dtype: Any = np.float32, sequence_output: bool = False, only_tanh: bool = False) -> None:
    """Conv → Relu → Conv → Add, and Tanh (an op ONNX Runtime does not quantize) after it; optionally
    a sequence of two tensors of different shapes as a second output; or Tanh alone."""
    if only_tanh:
        graph = helper.make_graph([helper.make_node("Tanh", ["x"], ["t"], name="tanh")], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, 8, 8])],
                                  [helper.make_tensor_value_info("t", TensorProto.FLOAT, [None, 3, 8, 8])])
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
        return
    rng = np.random.default_rng(0)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    w1 = numpy_helper.from_array(rng.normal(size=(8, 3, 3, 3)).astype(dtype), "w1")
    w2 = numpy_helper.from_array(rng.normal(size=(4, 8, 1, 1)).astype(dtype), "w2")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2"),
             helper.make_node("Add", ["c2", "c2"], ["y"], name="add"),
             helper.make_node("Tanh", ["y"], ["t"], name="tanh")]
    outputs = [helper.make_tensor_value_info("y", elem, [None, 4, 8, 8]),
               helper.make_tensor_value_info("t", elem, [None, 4, 8, 8])]
    if sequence_output:
        nodes.append(helper.make_node("SequenceConstruct", ["r1", "y"], ["seq"], name="seq"))
        outputs.append(helper.make_tensor_sequence_value_info("seq", elem, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, [None, 3, 8, 8])],
                              outputs, [w1, w2])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def _samples(dtype: Any) -> Any:
    rng = np.random.default_rng(1)
    # A quiet first sample and a loud one later: a histogram built sample by sample from the first one's range
    # would have to widen (to ~128 x 300 bins); the streamed one must not, and must match the one-shot's.
    scales = np.array([0.01, 1.0, 3.0, 0.5, 2.0], dtype=np.float32)
    xs = rng.normal(size=(5, 3, 8, 8)).astype(np.float32) * scales[:, None, None, None]
    xs[3, 0, 0, 0] = np.nan  # one NaN in a sample: skipped by both
    xs[1] = np.nan  # a sample NaN throughout (so is every tensor it reaches): skipped by both, never a crash
    return xs.astype(dtype)


def _run(tmp_path: Path, xs: Any, one_shot: bool = True, drift: bool = False, grouped: bool = False,
         **model: Any) -> dict[str, Any]:
    _model(tmp_path / "m.onnx", dtype=xs.dtype, **model)
    np.savez(tmp_path / "samples.npz", x=xs)
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([sys.executable, "-c", _COMPARE, str(tmp_path / "m.onnx"), str(tmp_path / "samples.npz"),
                           str(work), "1" if one_shot else "0", "1" if drift else "0", "1" if grouped else "0"],
                          capture_output=True, text=True, timeout=300, check=False,
                          cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_streamed_entropy_ranges_and_graph_equal_onnxruntimes_one_shot(tmp_path: Path, dtype: Any) -> None:
    result = _run(tmp_path, _samples(dtype))
    assert result.get("passes") == 3, result  # the samples' shapes read (no run), then two passes
    assert "t" not in result["tensors"]  # Tanh's output: no op ONNX Runtime quantizes reads or writes it
    assert {"x", "c1", "r1", "c2", "y"} <= set(result["tensors"])
    assert result["same_ranges"], result
    assert result["bins"] == [128]  # never widened
    assert result["same_graph"]  # through the JSON cache too: FP16 ranges keep their dtype


def test_calibrated_tensors_fetched_a_group_at_a_time_give_the_same_ranges_and_graph(tmp_path: Path) -> None:
    """One tensor per group, each group a session exposing it alone (ONNX Runtime holds every output of a graph
    until a run ends): the ranges and the Q/DQ graph are the one-shot's still."""
    result = _run(tmp_path, _samples(np.float32), grouped=True)
    assert result["passes"] == 1 + 2 * 5  # the shapes, then two passes per tensor: x, c1, r1, c2, y
    assert result["same_ranges"] and result["same_graph"], result


def test_outputs_that_are_sequences_are_not_read(tmp_path: Path) -> None:
    result = _run(tmp_path, _samples(np.float32), sequence_output=True)
    assert result["passes"] == 3
    assert {"x", "c1", "r1", "c2", "y"} <= set(result["tensors"])
    assert result["same_ranges"] and result["same_graph"], result


def test_values_beyond_the_first_passs_range_are_counted_not_dropped(tmp_path: Path) -> None:
    """A graph whose runs differ (random ops: a TTS model's noise) gives the second pass values the first did
    not see: every finite value is still counted, in the edge bins."""
    xs = _samples(np.float32)
    result = _run(tmp_path, xs, one_shot=False, drift=True)
    finite = int(np.count_nonzero(~np.isnan(xs)))
    assert result["counted"]["x"] == finite
    # The first pass's range, the second pass's values (3x) clipped into it: its edge bins take the rest.
    threshold = np.nanmax(np.abs(xs))
    expected = np.histogram(np.clip(xs * 3, -threshold, threshold), 128, range=(-threshold, threshold))[0]
    assert result["x_hist"] == expected.tolist()
    out, total = result["beyond"]["x"]
    assert total == finite and out == int(np.count_nonzero(np.abs(xs * 3) > threshold))


def test_a_deterministic_graph_has_nothing_beyond_the_first_passs_range(tmp_path: Path) -> None:
    result = _run(tmp_path, _samples(np.float32), one_shot=False)
    assert result["beyond"] == {}


@pytest.mark.parametrize(("case", "said"), [
    ("nan", r"tensor '\w+' has no finite range over the calibration samples \(min nan, max nan\)$"),
    ("no samples", r"No data is collected\.$"),
    ("nothing to calibrate", r"no tensor to calibrate: the graph has no node of a type ONNX Runtime quantizes$"),
])
def test_a_calibration_the_samples_cannot_give_fails_in_one_line(tmp_path: Path, case: str, said: str) -> None:
    xs = _samples(np.float32)
    if case == "nan":
        xs[:] = np.nan
    elif case == "no samples":
        xs = xs[:0]
    result = _run(tmp_path, xs, one_shot=False, only_tanh=case == "nothing to calibrate")
    assert re.match(said, result["failed"]), result
