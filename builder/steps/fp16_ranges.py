"""The tensor ranges ModelOpt autocast decides by, collected one feed at a time.

Autocast's ReferenceRunner runs its feeds through Polygraphy, which keeps every tensor of every feed until the
last feed has run: FP16 conversion of a 1x3x800x608 layout model peaked at 5.9 GB with 4 feeds. Autocast reads
only each tensor's absmax, min, max and shape (its TensorStats), so `streaming()` swaps in a runner that keeps
those and drops each feed's tensors before the next feed runs, fetching them a bounded group at a time
(builder.steps.fetch_groups): the peak is one group of one feed's tensors.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from numpy.typing import NDArray

from builder.steps import fetch_groups, onnx_model

log = logging.getLogger(__name__)

# A model whose serialized form ONNX Runtime cannot take from memory (protobuf's 2 GB) keeps ModelOpt's runner.
_IN_MEMORY_LIMIT = 1_800_000_000
_lock = threading.Lock()


class Ranges:
    """Running absmax/min/max per tensor, and each tensor's first shape, aggregated as ModelOpt's runner does: a
    feed whose figure is NaN leaves the running one as it was (Python's min and max keep their first argument
    against a NaN), so one NaN does not hide the other feeds' ranges."""

    def __init__(self) -> None:
        self.low: dict[str, float] = {}
        self.high: dict[str, float] = {}
        self.absmax: dict[str, float] = {}
        self.shape: dict[str, tuple[int, ...]] = {}

    def add(self, name: str, value: NDArray[Any]) -> None:
        if value.dtype.kind not in "biuf":  # strings have no range (autocast skips what it does not find)
            return
        self.shape.setdefault(name, tuple(value.shape))
        if value.size == 0:
            low = high = 0.0
        else:
            low, high = float(np.min(value)), float(np.max(value))
        self.low[name] = min(self.low.get(name, math.inf), low)
        self.high[name] = max(self.high.get(name, -math.inf), high)
        self.absmax[name] = max(self.absmax.get(name, -math.inf), max(abs(low), abs(high)))

    def stats(self, tensor_stats: type) -> OrderedDict[str, Any]:
        """ModelOpt's TensorStats per tensor (absmax from min and max: no |x| copy of a large tensor)."""
        return OrderedDict((name, tensor_stats(absmax=self.absmax[name], min_val=self.low[name],
                                               max_val=self.high[name], shape=shape))
                           for name, shape in self.shape.items())


def exposed_outputs(model: Any) -> Any:
    """A copy of `model` whose every main-graph tensor is a graph output, as Polygraphy marks them for ModelOpt's
    own runner: Constant nodes' outputs are not among them (a large constant, an attention mask's -1e9, would
    otherwise keep its consumer in FP32), and subgraph tensors stay inside their If/Loop/Scan."""
    from modelopt.onnx import utils as onnx_utils

    exposed = copy.deepcopy(model)
    # One copy of each weight that ModelOpt's sanitizer duplicated per consumer (captcha_crnn's unrolled LSTM: 19 MB
    # became 270 MB), before shape inference and the session copy it again: the ranges are of node outputs only.
    onnx_model.dedupe_initializers(exposed)
    onnx_utils.clear_stale_value_info(exposed)
    present = {o.name for o in exposed.graph.output} | {i.name for i in exposed.graph.input}
    for node in exposed.graph.node:
        if node.op_type == "Constant":
            continue
        for name in node.output:
            if name and name not in present:
                present.add(name)
                exposed.graph.output.add().name = name
    return exposed


def _streaming_runner(base: type) -> type:
    from modelopt.onnx.autocast.referencerunner import TensorStats

    class StreamingReferenceRunner(base):  # type: ignore[misc]
        """ModelOpt's ReferenceRunner, run one feed at a time where the feeds are a folder of .npz files on
        ONNX Runtime's CPU provider (what builder.steps.precision.to_fp16 gives it); anything else, its own run."""

        def run(self, inputs: Any = None) -> Any:
            folder = Path(inputs) if isinstance(inputs, str) else None
            providers = [p if isinstance(p, str) else p[0] for p in self.providers]
            if (folder is None or not folder.is_dir() or providers != ["CPUExecutionProvider"]
                    or self.model.ByteSize() > _IN_MEMORY_LIMIT):
                return super().run(inputs)
            files = sorted(folder.glob("*.npz"))
            data_loader = [np.load(f) for f in files]
            self._validate_inputs(data_loader)  # ModelOpt's own check and message
            for archive in data_loader:
                archive.close()
            options = ort.SessionOptions()
            options.log_severity_level = 3
            options.enable_cpu_mem_arena = False  # its high-water mark would be every tensor of the graph at once
            # No graph optimizations: a tensor's values must not depend on which others share its group (a fused
            # MatMul + Add rounds differently).
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            exposed = exposed_outputs(self.model)
            names = [o.name for o in exposed.graph.output]

            def each_feed() -> Iterator[dict[str, NDArray[Any]]]:
                for file in files:
                    with np.load(file) as archive:
                        yield {k: archive[k] for k in archive.files}

            def open_session(model: Any) -> Any:
                return ort.InferenceSession(model.SerializeToString(), sess_options=options,
                                            providers=["CPUExecutionProvider"])

            # A bounded group of tensors per pruned graph (a 1280x1280 detector's are 1 GB per feed), every feed
            # through one group's session; feeds are read from their files again per group.
            cut = fetch_groups.groups(names, fetch_groups.largest_bytes(exposed, each_feed()),
                                      order=fetch_groups.graph_order(exposed))
            ranges = Ranges()
            for feed in each_feed():
                for name, value in feed.items():
                    ranges.add(name, value)
            for group, session in fetch_groups.group_sessions(exposed, cut, open_session):
                for feed in each_feed():
                    for name, value in fetch_groups.run_group(session, feed, group).items():
                        if isinstance(value, np.ndarray) and name not in feed:
                            ranges.add(name, value)
                del session
            del exposed
            log.debug("autocast reference ranges: %d tensors over %d feeds, one feed at a time", len(ranges.shape),
                      len(files))
            return ranges.stats(TensorStats)

    return StreamingReferenceRunner


@contextlib.contextmanager
def streaming() -> Iterator[None]:
    """ModelOpt autocast with the streaming reference runner, for the duration (one conversion at a time)."""
    from modelopt.onnx.autocast import convert

    with _lock:
        original = convert.ReferenceRunner
        convert.ReferenceRunner = _streaming_runner(original)
        try:
            yield
        finally:
            convert.ReferenceRunner = original
