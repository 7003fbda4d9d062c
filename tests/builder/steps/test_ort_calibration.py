"""The streamed entropy calibration gives ONNX Runtime's one-shot ranges and Q/DQ graph exactly.

Both run in a fresh interpreter: importing ModelOpt (other tests do) patches ONNX Runtime's calibrators in place.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

_COMPARE = r"""
import json, sys
from pathlib import Path
import numpy as np
import onnx
from onnx import numpy_helper
from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.calibrate import CalibrationCacheEncoder, create_calibrator, save_tensors_data
from builder.steps.ort_calibration import entropy_ranges

model, samples, work = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
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

(work / "one").mkdir()
calibrator = create_calibrator(model, None, augmented_model_path=str(work / "one" / "aug.onnx"),
                               calibrate_method=CalibrationMethod.Entropy)
calibrator.collect_data(Reader())
one_shot = calibrator.compute_data()
(work / "streamed").mkdir()
calls = []
def feeds():
    calls.append(1)
    reader = Reader()
    return iter(reader.get_next, None)
streamed = entropy_ranges(model, feeds, op_types=[], external=False, workdir=work / "streamed")

def quantized(path, cache):
    quantize_static(str(model), str(path), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    calibrate_method=CalibrationMethod.Entropy, calibration_cache_path=cache)
    return {t.name: numpy_helper.to_array(t).tolist() for t in onnx.load(str(path)).graph.initializer}

save_tensors_data(streamed, work / "ranges.json")
print(json.dumps({
    "passes": len(calls),
    "same_ranges": as_json(one_shot) == as_json(streamed),
    "tensors": len(as_json(streamed)["data"]),
    "bins": {k: len(v.hist) for k, v in streamed.items()},
    "same_graph": quantized(work / "a.onnx", None) == quantized(work / "b.onnx", work / "ranges.json"),
}))
"""


def _model(path: Path) -> None:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.normal(size=(8, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(size=(4, 8, 1, 1)).astype(np.float32), "w2")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2"),
             helper.make_node("Add", ["c2", "c2"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4, 8, 8])], [w1, w2])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_streamed_entropy_ranges_and_graph_equal_onnxruntimes_one_shot(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    _model(model)
    rng = np.random.default_rng(1)
    # A quiet first sample and a loud one later: a histogram built sample by sample from the first one's range
    # would have to widen (to ~128 x 300 bins); the streamed one must not, and must match the one-shot's.
    scales = np.array([0.01, 1.0, 3.0, 0.5, 2.0], dtype=np.float32)
    xs = (rng.normal(size=(5, 3, 8, 8)).astype(np.float32) * scales[:, None, None, None]).astype(np.float32)
    xs[3, 0, 0, 0] = np.nan  # NaN is skipped by both
    np.savez(tmp_path / "samples.npz", x=xs)
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([sys.executable, "-c", _COMPARE, str(model), str(tmp_path / "samples.npz"), str(work)],
                          capture_output=True, text=True, timeout=300, check=False,
                          cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["passes"] == 2
    assert result["tensors"] >= 4
    assert result["same_ranges"], result
    assert set(result["bins"].values()) == {128}  # never widened
    assert result["same_graph"]
