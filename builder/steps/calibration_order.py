"""The order ModelOpt's entropy calibration sees the samples in: the widest first.

Why it matters: ModelOpt (ort_patching) builds each tensor's histogram batch by batch. The first batch fixes
the bin width (its range over 128 bins); a later batch with a wider range adds bins of that same width, so a
tensor ends with about 128 x (its range over all samples / its range in the first batch) bins. ONNX Runtime's
entropy threshold search then costs O(bins^2) in Python. Calibration data that starts with a quiet sample
(silence before speech, a dark image) makes that ratio large: silero VAD's first sample (hiss, state 0) left
one tensor with 36 868 bins and took 62 s of a 66 s calibration; the same samples with a wide one first take
under a second.

So the samples are ordered by how far each one's ranges fall short of all samples' (the largest ratio over
the graph's float tensors, from one FP32 run that reads every main-graph tensor), the widest first. The set
of samples is unchanged; the histograms then keep about 128 bins, where the entropy search has little to
clip, so the result comes close to max calibration.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from numpy.typing import NDArray

from builder.runtimes.onnxruntime import ort_session

log = logging.getLogger(__name__)

Feed = dict[str, NDArray[Any]]

def _exposed(fp32_path: Path) -> tuple[Path, list[str]]:
    """The FP32 graph with every main-graph node output added as a graph output, beside it (weights kept in
    a data file stay there: the copy refers to them by the same relative location)."""
    model = onnx.load(str(fp32_path), load_external_data=False)
    present = {o.name for o in model.graph.output}
    names = [out for node in model.graph.node for out in node.output if out and out not in present]
    for name in dict.fromkeys(names):
        model.graph.output.append(onnx.ValueInfoProto(name=name))
    path = fp32_path.with_name(f".{fp32_path.stem}.ranges.{os.getpid()}.onnx")
    onnx.save(model, str(path))
    return path, [o.name for o in model.graph.output]


def sample_ranges(fp32_path: Path, feeds: Sequence[Feed]) -> NDArray[np.float64]:
    """|max| of each float tensor of the main graph (columns) for each feed (rows), from one run per feed;
    NaN where a tensor is not float or not finite."""
    path, names = _exposed(fp32_path)
    try:
        session = ort_session(path)
        rows: list[list[float]] = []
        for feed in feeds:
            row = []
            for value in session.run(names, dict(feed)):
                array = np.asarray(value)
                if array.dtype.kind != "f" or array.size == 0:
                    row.append(math.nan)
                    continue
                peak = float(np.max(np.abs(array)))
                row.append(peak if math.isfinite(peak) else math.nan)
            rows.append(row)
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


def widest_first(fp32_path: Path, feeds: Sequence[Feed]) -> list[int]:
    """The feeds' indices, the feed whose ranges come closest to all feeds' first (stable among equals)."""
    if len(feeds) < 2:
        return list(range(len(feeds)))
    factors = growth(sample_ranges(fp32_path, feeds))
    order = sorted(range(len(feeds)), key=lambda i: float(factors[i]))
    # The factors cover every float tensor, a superset of those ModelOpt calibrates: an upper bound.
    log.debug("INT8: calibration samples widest first: sample %d first (every tensor's range within %.3gx of all "
              "samples'; the data's first sample: within %.3gx)", order[0], factors[order[0]], factors[0])
    return order
