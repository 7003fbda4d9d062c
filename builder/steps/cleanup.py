"""ONNX clean-up (onnxslim): constant folding and dead-node removal, kept only if outputs are unchanged."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from numpy.typing import NDArray

from builder.errors import last_line
from builder.repository import onnx_files
from builder.runtimes.base import ReferenceExecutor
from common import progress

log = logging.getLogger(__name__)

# Slimming only rewrites the graph, so outputs should agree to float32 rounding.
_ATOL = 1e-4
_RTOL = 1e-3


@dataclass(frozen=True)
class SlimReport:
    applied: bool
    tool: str = "onnxslim"
    reason: str | None = None  # why the slimmed graph was not kept
    nodes_before: int | None = None
    nodes_after: int | None = None
    max_abs_diff: float | None = None


def slim(path: Path, probe: Mapping[str, NDArray[Any]], *, executor: ReferenceExecutor,
         batch_size: int | None = 8) -> SlimReport:
    """Slim the model at `path` in place when its outputs on `probe` (run by `executor`) stay equal; report what
    happened."""
    with progress.task("cleaning up the ONNX graph (onnxslim)"):
        return _slim(path, probe, batch_size, executor)


def _slim(path: Path, probe: Mapping[str, NDArray[Any]], batch_size: int | None,
          executor: ReferenceExecutor) -> SlimReport:
    import onnxslim

    before = onnx.load(str(path))
    nodes_before = len(before.graph.node)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            slimmed = onnxslim.slim(before)
    except Exception as exc:  # noqa: BLE001 - a failed optimisation must not fail the build
        log.warning("onnxslim failed (%s); keeping the exported graph", exc)
        return SlimReport(applied=False, reason=str(exc))
    candidate = path.with_suffix(".slim.onnx")
    nodes_after = len(slimmed.graph.node)
    onnx_files.save(slimmed, candidate)  # its weights beside it where they exceed one protobuf
    # batch_size None: a model that does not batch runs each probe sample whole.
    reference = executor.run(path, probe, batch_size)
    try:
        result = executor.run(candidate, probe, batch_size)
    except executor.errors as exc:  # onnxslim wrote a graph the executor rejects: keep the exported one
        onnx_files.remove_model(candidate)
        log.warning("onnxslim's graph does not run under ONNX Runtime (%s); keeping the exported graph",
                    last_line(exc, 200))
        return SlimReport(applied=False, reason=f"slimmed graph does not run: {type(exc).__name__}",
                          nodes_before=nodes_before)
    # Compared as ONNX Runtime returns them, whatever the graph declares: a slimmed graph that returns
    # another shape (onnxslim trusted a declared output shape the graph contradicts) is not kept.
    reshaped = [k for k in reference if k not in result or reference[k].shape != result[k].shape]
    if reshaped:
        onnx_files.remove_model(candidate)
        name = reshaped[0]
        had, got = list(reference[name].shape), list(result[name].shape) if name in result else "nothing"
        log.warning("onnxslim changed the shape of output %r (%s -> %s); keeping the exported graph", name, had, got)
        return SlimReport(applied=False, reason=f"output {name!r} changed shape: {had} -> {got}",
                          nodes_before=nodes_before)
    worst = max((float(np.max(np.abs(reference[k] - result[k]))) if reference[k].size else 0.0
                 for k in reference), default=0.0)
    same = all(np.allclose(reference[k], result[k], atol=_ATOL, rtol=_RTOL) for k in reference)
    if not same:
        onnx_files.remove_model(candidate)
        log.warning("onnxslim changed outputs (max abs diff %.3g); keeping the exported graph", worst)
        return SlimReport(applied=False, reason=f"outputs changed by {worst:.3g}", nodes_before=nodes_before,
                          max_abs_diff=worst)
    onnx_files.move_model(candidate, path)
    onnx_files.load(path)
    log.debug("onnxslim: %d -> %d nodes (max abs diff %.2g)", nodes_before, nodes_after, worst)
    return SlimReport(applied=True, nodes_before=nodes_before, nodes_after=nodes_after, max_abs_diff=worst)
