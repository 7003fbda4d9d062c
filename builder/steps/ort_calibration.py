"""ONNX Runtime's entropy calibration, streamed: the same ranges as quantize_static's own, in bounded memory.

Why: ONNX Runtime's HistogramCalibrater keeps every sample's output of every calibrated tensor until the last
sample has run, then copies them all into one array per tensor before it makes the histograms. On the corpus
that held 5.6 GB for layout_cdla's 8 samples (a 23 MB model) and 15 GB for kokoro. Its MinMax calibrator keeps
only reduced outputs, so it needs none of this (and its `CalibMaxIntermediateOutputs` cannot help the other:
in ONNX Runtime 1.31 it drops the outputs it has collected instead of reducing them).

How, and why the ranges are identical: two passes over the samples with the calibrator's own augmented graph.
The first keeps each tensor's min and max only. The second counts each sample's values into a histogram over
the range the one-shot calibration would have given the tensor (-T, T with T the largest magnitude over all
samples, in the tensor's dtype), the bins ONNX Runtime's HistogramCollector would make for it. Over fixed edges
a histogram's counts are the sum of its parts' (NaN is in no bin, in either), so the histograms, and so the
entropy thresholds, are the same. Only one sample's activations are held at a time, fetched a bounded group of
tensors per run (builder.steps.fetch_groups); the price is one more inference pass, and a prefix of the graph
run again per group (most models have one group: the budget is 512 MB per sample). (Where the samples' shapes
differ, so that the one-shot cannot stack them, this still works; a graph with random ops, whose second pass
differs from its first, has its values beyond the first pass's range counted in the edge bins, and the quantizer
worker says how many.)
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from numpy.typing import NDArray

from builder.steps import fetch_groups

log = logging.getLogger(__name__)

Feed = Mapping[str, NDArray[Any]]


class CalibrationFailed(ValueError):
    """The calibration cannot be made from these samples (none, a calibrated tensor with an infinite value or
    NaN throughout, nothing to calibrate in the graph): a failure of this model's calibration, as ONNX
    Runtime's own calibrator fails on it, not a bug of ours."""


def entropy_ranges(prepared: Path, feeds: Callable[[], Iterable[Feed]], *, op_types: Sequence[str],
                   external: bool, workdir: Path, beyond: dict[str, tuple[int, int]] | None = None) -> Any:
    """ONNX Runtime's entropy TensorsData for `prepared` over `feeds()` (called once per pass), as quantize_static
    would compute it with its default calibration options. `beyond`, where given, gets each tensor whose second
    pass had values beyond the first pass's range: (those values, all values of the tensor counted)."""
    from onnxruntime.quantization.calibrate import (
        CalibrationMethod,
        EntropyCalibrater,
        HistogramCollector,
        TensorsData,
    )
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    # quantize_static's own choice when it is given no op types: every op it can quantize (None here would
    # calibrate every float tensor of the graph instead).
    calibrated_ops = list(op_types) or sorted(set(QLinearOpsRegistry) | set(QDQRegistry))
    # What create_calibrator builds for the entropy method with default options, less its inference session:
    # ours below replaces it.
    calibrator = EntropyCalibrater(prepared, calibrated_ops, str(workdir / "augmented_model.onnx"),
                                   use_external_data_format=external)
    calibrator.augment_graph()
    # The calibrator's session options, without the CPU arena: a run that returns every calibrated tensor leaves
    # the arena at a graph's worth of activations for the session's life.
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.enable_cpu_mem_arena = False
    augmented = onnx.load(calibrator.augmented_model_path, load_external_data=False)
    names = [o.name for o in augmented.graph.output if o.name in calibrator.tensors_to_calibrate]
    if not names:
        kinds = f"of the op types {', '.join(op_types)}" if op_types else "of a type ONNX Runtime quantizes"
        raise CalibrationFailed(f"no tensor to calibrate: the graph has no node {kinds}")
    # The calibrated tensors a bounded group at a time, each group a pruned graph (builder.steps.fetch_groups:
    # at 1x3x1280x1280 a detector's are 1 GB per sample), every sample through one group's session.
    folder = Path(calibrator.augmented_model_path).parent
    cut = fetch_groups.groups(names, fetch_groups.largest_bytes(augmented, feeds(), folder),
                              order=fetch_groups.graph_order(augmented))
    log.debug("entropy calibration: %d tensors in %d groups", len(names), len(cut))

    def open_session(model: onnx.ModelProto) -> ort.InferenceSession:
        if not external:
            return ort.InferenceSession(model.SerializeToString(), sess_options=options,
                                        providers=calibrator.execution_providers)
        path = folder / "calibration_group.onnx"  # beside the augmented graph: its weights' paths hold
        try:
            onnx.save(model, str(path))
            return ort.InferenceSession(str(path), sess_options=options, providers=calibrator.execution_providers)
        finally:
            path.unlink(missing_ok=True)

    passes: list[int] = []

    def outputs() -> Iterable[tuple[str, NDArray[Any]]]:
        for group, session in fetch_groups.group_sessions(augmented, cut, open_session):
            count = 0
            for feed in feeds():
                count += 1
                # Flattened as the one-shot calibration flattens each tensor's stack of samples.
                for name, value in fetch_groups.run_group(session, feed, group).items():
                    yield name, np.asarray(value).ravel()
            del session  # before the next group's is made: one session at a time
            if count == 0:
                raise CalibrationFailed("No data is collected.")  # ONNX Runtime's own words for an empty reader
            if passes and count != passes[0]:  # feeds() must give as many samples each time: ours to keep
                raise RuntimeError(f"the calibration gave {passes[0]} samples, then {count}")
            passes.append(count)

    lows: dict[str, Any] = {}
    highs: dict[str, Any] = {}
    dtypes: dict[str, Any] = {}
    for name, values in outputs():
        dtypes.setdefault(name, values.dtype)
        if values.size == 0:
            continue
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a sample all NaN: its min is NaN, skipped below
            low, high = np.nanmin(values), np.nanmax(values)
        # fmin/fmax skip NaN as nanmin/nanmax over all samples do.
        lows[name] = low if name not in lows else np.fmin(lows[name], low)
        highs[name] = high if name not in highs else np.fmax(highs[name], high)

    ranges: dict[str, tuple[Any, Any, Any]] = {}
    hists: dict[str, NDArray[np.int64]] = {}
    edges: dict[str, NDArray[Any]] = {}
    for name in names:
        zero = np.array(0, dtype=dtypes[name])  # a tensor empty in every sample, as the one-shot takes it
        low, high = lows.get(name, zero), highs.get(name, zero)
        threshold = np.array(max(abs(low), abs(high)), dtype=low.dtype)
        if not np.isfinite(threshold):
            raise CalibrationFailed(f"tensor {name!r} has no finite range over the calibration samples "
                                    f"(min {low}, max {high})")
        ranges[name] = (low, high, threshold)
        # Edges as np.histogram makes them from this range and dtype, the same as the one-shot's.
        hists[name], edges[name] = np.histogram(np.empty(0, dtype=low.dtype), calibrator.num_bins,
                                                range=(-threshold, threshold))  # type: ignore[arg-type]
    outside: dict[str, int] = {}
    for name, values in outputs():
        # Over fixed edges a histogram's counts are the sum of its parts' (NaN is in no bin, as in the
        # one-shot's): what ONNX Runtime's collector adds when a sample lies within the range it has.
        threshold = ranges[name][2]
        counts = np.histogram(values, calibrator.num_bins, range=(-threshold, threshold))[0]
        missing = values.size - int(counts.sum())
        if missing and missing > int(np.count_nonzero(np.isnan(values))):
            # Values beyond the first pass's range: the second pass differs from the first (random ops).
            # Counted in the edge bins (np.histogram's own edges: a zero range is widened to ±0.5).
            below = int(np.count_nonzero(values < edges[name][0]))
            above = int(np.count_nonzero(values > edges[name][-1]))
            counts[0] += below
            counts[-1] += above
            outside[name] = outside.get(name, 0) + below + above
        hists[name] += counts
    if beyond is not None:
        beyond.update({name: (count, int(hists[name].sum())) for name, count in outside.items()})

    collector = HistogramCollector(method=calibrator.method, symmetric=calibrator.symmetric,
                                   num_bins=calibrator.num_bins, num_quantized_bins=calibrator.num_quantized_bins,
                                   percentile=calibrator.percentile, scenario=calibrator.scenario)
    collector.histogram_dict = {name: (hists[name], edges[name], *ranges[name]) for name in names}
    log.debug("entropy calibration streamed: %d tensors", len(names))
    return TensorsData(CalibrationMethod.Entropy, collector.compute_collection_result())


def save_ranges(tensors: Any, path: Path) -> None:
    """ONNX Runtime's save_tensors_data, keeping each range's dtype: it writes a numpy float scalar as a plain
    number, which reads back as float32, so an FP16 tensor's range (and so its scale) would change on the way
    through the cache. As 0-d arrays they are written with their dtype and read back as they were."""
    from onnxruntime.quantization.calibrate import TensorData, TensorsData, save_tensors_data

    kept = {}
    for name, data in tensors.items():
        fields = {k: np.asarray(v) if isinstance(v, np.floating) else v
                  for k, v in data.to_dict().items() if k != "CLS"}
        kept[name] = TensorData(**fields)
    save_tensors_data(TensorsData(tensors.calibration_method, kept), path)
