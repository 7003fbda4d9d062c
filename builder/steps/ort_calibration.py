"""ONNX Runtime's entropy calibration, streamed: the same ranges as quantize_static's own, in bounded memory.

Why: ONNX Runtime's HistogramCalibrater keeps every sample's output of every calibrated tensor until the last
sample has run, then copies them all into one array per tensor before it makes the histograms. On the corpus
that held 5.6 GB for layout_cdla's 8 samples (a 23 MB model) and 15 GB for kokoro. Its MinMax calibrator keeps
only reduced outputs, so it needs none of this (and its `CalibMaxIntermediateOutputs` cannot help the other:
in ONNX Runtime 1.31 it drops the outputs it has collected instead of reducing them).

How, and why the ranges are identical: two passes over the samples with the calibrator's own augmented session.
The first keeps each tensor's min and max only. The second starts each tensor's histogram empty over the range
the one-shot calibration would have given it (-T, T with T the largest magnitude over all samples, in the
tensor's dtype) and adds one sample's histogram at a time through ONNX Runtime's own HistogramCollector. Since
no sample then lies outside that range, the collector never widens it, and a histogram's counts over fixed
edges are the sum of its parts' counts: the same histograms, so the same entropy thresholds. Only one sample's
activations are held at a time; the price is one more inference pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from numpy.typing import NDArray

log = logging.getLogger(__name__)

Feed = Mapping[str, NDArray[Any]]


def entropy_ranges(prepared: Path, feeds: Callable[[], Iterable[Feed]], *, op_types: Sequence[str],
                   external: bool, workdir: Path) -> Any:
    """ONNX Runtime's entropy TensorsData for `prepared` over `feeds()` (called once per pass), as quantize_static
    would compute it with its default calibration options."""
    from onnxruntime.quantization.calibrate import (
        CalibrationMethod,
        HistogramCollector,
        TensorsData,
        create_calibrator,
    )

    calibrator = create_calibrator(prepared, list(op_types) or None,
                                   augmented_model_path=str(workdir / "augmented_model.onnx"),
                                   calibrate_method=CalibrationMethod.Entropy,
                                   use_external_data_format=external, extra_options={})
    # The calibrator's own session again (its options, its providers), without the CPU arena: a run that returns
    # every calibrated tensor leaves the arena at a graph's worth of activations for the session's life.
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.enable_cpu_mem_arena = False
    session = calibrator.infer_session = ort.InferenceSession(calibrator.augmented_model_path, sess_options=options,
                                                              providers=calibrator.execution_providers)
    names = [o.name for o in session.get_outputs()]
    wanted = [(i, name) for i, name in enumerate(names) if name in calibrator.tensors_to_calibrate]

    def outputs() -> Iterable[list[NDArray[Any]]]:
        count = 0
        for feed in feeds():
            count += 1
            # Flattened as the one-shot calibration flattens each tensor's stack of samples.
            yield [np.asarray(out).ravel() for out in session.run(None, dict(feed))]
        if count == 0:
            raise ValueError("No data is collected.")  # ONNX Runtime's own words for an empty reader

    lows: dict[str, Any] = {}
    highs: dict[str, Any] = {}
    dtypes: dict[str, Any] = {}
    for outs in outputs():
        for i, name in wanted:
            values = outs[i]
            dtypes.setdefault(name, values.dtype)
            if values.size == 0:
                continue
            low, high = np.nanmin(values), np.nanmax(values)
            # fmin/fmax skip NaN as nanmin/nanmax over all samples do.
            lows[name] = low if name not in lows else np.fmin(lows[name], low)
            highs[name] = high if name not in highs else np.fmax(highs[name], high)

    collector = HistogramCollector(method=calibrator.method, symmetric=calibrator.symmetric,
                                   num_bins=calibrator.num_bins, num_quantized_bins=calibrator.num_quantized_bins,
                                   percentile=calibrator.percentile, scenario=calibrator.scenario)
    for _, name in wanted:
        zero = np.array(0, dtype=dtypes[name])  # a tensor empty in every sample, as the one-shot takes it
        low, high = lows.get(name, zero), highs.get(name, zero)
        threshold = np.array(max(abs(low), abs(high)), dtype=low.dtype)
        # Edges as np.histogram makes them from this range and dtype, the same as the one-shot's.
        hist, edges = np.histogram(np.empty(0, dtype=low.dtype), calibrator.num_bins,
                                   range=(-threshold, threshold))  # type: ignore[arg-type]
        collector.histogram_dict[name] = (hist, edges, low, high, threshold)
    for outs in outputs():
        collector.collect_value({name: outs[i] for i, name in wanted})
    log.debug("entropy calibration streamed: %d tensors", len(wanted))
    return TensorsData(CalibrationMethod.Entropy, collector.compute_collection_result())

