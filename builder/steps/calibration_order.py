"""The sample ModelOpt's entropy calibration sees first: the data's, unless it makes the histograms huge.

Why it matters: ModelOpt (ort_patching) builds each tensor's histogram batch by batch. The first batch fixes
the bin width (its range over 128 bins); a later batch with a wider range adds bins of that same width, so a
tensor ends with about 128 x (its range over all samples / its range in the first batch) bins. ONNX Runtime's
entropy threshold search then costs O(bins^2) in Python. Calibration data that starts with a quiet sample
(silence before speech, a dark image) makes that ratio large: silero VAD's first sample (hiss, state 0) left
one tensor with 36 868 bins and took 62 s of a 66 s calibration.

The bins are also the entropy search's resolution (with 128 it has no threshold to choose but the range's:
max calibration), and which resolution suits a model is the model's: the data's order met the tolerance with
22 nodes kept on ppocr_rec (first sample within 7.45x) where the widest sample first needed a far longer
search; akiki_vad met it with 2 nodes kept with the widest first and with none with a first sample at 3.88x.
So the data's order is kept where its first sample keeps every calibrated tensor within MAX_GROWTH, as
before; where it does not (a quiet first sample: 1.2e5x on akiki_vad, 9e4x on silero VAD), the widest
sample goes first. The ratios come from one FP32 run per sample that reads the float inputs of the ops a
quantizer calibrates; the set of samples is unchanged.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from numpy.typing import NDArray
from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

from builder.repository import onnx_files
from builder.runtimes.onnxruntime import ort_session

log = logging.getLogger(__name__)

Feed = Mapping[str, NDArray[Any]]

# How many times its first 128 bins a histogram may grow to: ~1000 bins, ~0.05 s of entropy search per tensor
# here (36 868 bins took 62 s), while leaving the search thresholds to choose from.
MAX_GROWTH = 8.0
# The ops whose inputs ONNX Runtime's quantizer (and ModelOpt through it) can calibrate.
_CALIBRATED_OPS = frozenset(QDQRegistry) | frozenset(QLinearOpsRegistry)


def calibrated_tensors(model: onnx.ModelProto) -> list[str]:
    """The main graph's tensors a quantizer may calibrate: non-constant inputs of the ops it quantizes."""
    constant = {init.name for init in model.graph.initializer}
    constant.update(out for node in model.graph.node if node.op_type == "Constant" for out in node.output)
    names = [name for node in model.graph.node if node.op_type in _CALIBRATED_OPS
             for name in node.input if name and name not in constant]
    return list(dict.fromkeys(names))


def _exposed(fp32_path: Path, names: Sequence[str]) -> Path:
    """The FP32 graph with `names` added as graph outputs: in the temporary folder, or beside it where its weights
    are in a data file (the copy refers to them by the same relative location)."""
    model = onnx.load(str(fp32_path), load_external_data=False)
    present = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.ValueInfoProto(name=name) for name in names if name not in present)
    folder = fp32_path.parent if onnx_files.has_external_data(fp32_path) else Path(tempfile.gettempdir())
    path = folder / f".{fp32_path.stem}.ranges.{os.getpid()}.onnx"
    onnx.save(model, str(path))
    return path


def _peak(value: object) -> float:
    array = np.asarray(value)
    if array.dtype.kind != "f" or array.size == 0:
        return math.nan
    peak = float(np.max(np.abs(array)))
    return peak if math.isfinite(peak) else math.nan


def sample_ranges(fp32_path: Path, feeds: Sequence[Feed]) -> NDArray[np.float64]:
    """|max| of each calibrated tensor (columns) for each feed (rows), from one run per feed; NaN where a
    tensor is not float or not finite."""
    model = onnx.load(str(fp32_path), load_external_data=False)
    names = calibrated_tensors(model)
    inputs = {value.name for value in model.graph.input}
    computed = [name for name in names if name not in inputs]
    del model
    path = _exposed(fp32_path, computed)
    try:
        # ONNX Runtime itself, not the reference executor: the ranges ModelOpt's and ONNX Runtime's calibrators
        # (ONNX Runtime sessions both) will see, for the ops ONNX Runtime's quantizer registry calibrates.
        session = ort_session(path)
        rows: list[list[float]] = []
        for feed in feeds:
            values = dict(zip(computed, session.run(computed, dict(feed)), strict=True)) if computed else {}
            rows.append([_peak(feed[name] if name in inputs else values[name]) for name in names])
        del session
    finally:
        path.unlink(missing_ok=True)
    return np.asarray(rows, dtype=np.float64).reshape(len(feeds), len(names))


def growth(ranges: NDArray[np.float64]) -> NDArray[np.float64]:
    """For each sample (row): the largest factor by which a tensor's range over all samples exceeds its range
    in that sample, i.e. how many times its starting bins a histogram begun on that sample ends with. A tensor
    all zero (or not float) in the sample does not count: the histogram starts over at the next one's range."""
    if ranges.size == 0:
        return np.ones(len(ranges))
    with np.errstate(invalid="ignore"):
        positive = ranges > 0  # NaN compares False
    overall = np.fmax.reduce(ranges, axis=0)  # NaN only where the whole column is
    ratio = np.divide(overall, ranges, out=np.ones_like(ranges), where=positive)
    return np.asarray(ratio.max(axis=1), dtype=np.float64)


def entropy_order(fp32_path: Path, feeds: Sequence[Feed]) -> list[int]:
    """The feeds' indices in the order ModelOpt's entropy calibration should see them (see the module's text)."""
    order = list(range(len(feeds)))
    if len(feeds) < 2:
        return order
    factors = growth(sample_ranges(fp32_path, feeds))
    if factors[0] <= MAX_GROWTH:
        return order
    first = min(order, key=lambda i: float(factors[i]))
    log.debug("INT8: calibration sample %d first: the data's first would grow a histogram %.3gx (over %gx), this "
              "one %.3gx", first, factors[0], MAX_GROWTH, factors[first])
    return [first, *(i for i in order if i != first)]
