"""ONNX clean-up (onnxslim): constant folding and dead-node removal, kept only if outputs are unchanged."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from numpy.typing import NDArray

from builder import onnx_model
from builder.runtimes import ort_session, run_session

log = logging.getLogger(__name__)

# Slimming only rewrites the graph, so outputs should agree to float32 rounding.
_ATOL = 1e-4
_RTOL = 1e-3


def slim(path: Path, probe: Mapping[str, NDArray[Any]]) -> dict[str, object]:
    """Slim the model at `path` in place when its outputs on `probe` stay equal; report what happened."""
    import onnxslim

    before = onnx.load(str(path))
    nodes_before = len(before.graph.node)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            slimmed = onnxslim.slim(before)
    except Exception as exc:  # noqa: BLE001 - a failed optimisation must not fail the build
        log.warning("onnxslim failed (%s); keeping the exported graph", exc)
        return {"tool": "onnxslim", "applied": False, "reason": str(exc)}
    candidate = path.with_suffix(".slim.onnx")
    onnx.save(slimmed, str(candidate))
    reference = run_session(ort_session(path), probe, 8)
    result = run_session(ort_session(candidate), probe, 8)
    worst = max(float(np.max(np.abs(reference[k] - result[k]))) for k in reference)
    same = all(np.allclose(reference[k], result[k], atol=_ATOL, rtol=_RTOL) for k in reference)
    if not same:
        candidate.unlink()
        log.warning("onnxslim changed outputs (max abs diff %.3g); keeping the exported graph", worst)
        return {"tool": "onnxslim", "applied": False, "reason": f"outputs changed by {worst:.3g}"}
    candidate.replace(path)
    onnx_model.load(path)
    nodes_after = len(slimmed.graph.node)
    log.info("onnxslim: %d -> %d nodes (max abs diff %.2g)", nodes_before, nodes_after, worst)
    return {"tool": "onnxslim", "applied": True, "nodes_before": nodes_before, "nodes_after": nodes_after,
            "max_abs_diff": worst}
