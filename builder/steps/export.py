"""PyTorch → ONNX with a dynamic batch axis (and named dynamic dims), checked and shape-inferred."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch

from builder.errors import BuilderError, ManifestError
from builder.repository import onnx_files
from builder.spec.model import ModelSpec
from builder.spec.shapes import for_model
from builder.steps import onnx_model
from builder.steps.samples import resolve
from common import progress

log = logging.getLogger(__name__)

_EXAMPLE_BATCH = 2  # not 1, so the exporter cannot specialise the batch axis away


def example_inputs(spec: ModelSpec) -> tuple[torch.Tensor, ...]:
    """One batch of the declared inputs at their opt shapes (named dims or per-input shapes)."""
    rng = np.random.default_rng(0)
    shapes = for_model(spec, spec.inputs, f"model {spec.name!r}")
    tensors = []
    for tensor in spec.inputs:
        shape = [_EXAMPLE_BATCH, *shapes.sample_range(tensor.name).opt]
        if np.issubdtype(np.dtype(tensor.dtype), np.floating):
            array = rng.standard_normal(shape).astype(tensor.dtype)
        else:
            array = np.ones(shape, dtype=tensor.dtype)
        tensors.append(torch.from_numpy(array))
    return tuple(tensors)


def export(spec: ModelSpec, out_path: Path) -> onnx.ModelProto:
    """Build the PyTorch module named by spec.source and export it to out_path."""
    assert spec.source is not None
    factory = resolve(spec.source, f"model {spec.name!r}: source")
    module = factory()
    if not isinstance(module, torch.nn.Module):
        raise ManifestError(f"model {spec.name!r}: source {spec.source} returned {type(module).__name__}, "
                            "expected a torch.nn.Module")
    module.eval()
    dynamic_axes: dict[str, dict[int, str]] = {}
    for tensor in spec.inputs:
        axes = {0: "batch"}
        axes.update({i: d for i, d in enumerate(tensor.shape) if isinstance(d, str)})
        dynamic_axes[tensor.name] = axes
    output_names = list(spec.outputs) or ["output"]
    for name in output_names:
        dynamic_axes[name] = {0: "batch"}
    log.debug("exporting %s from %s (opset %d)", spec.name, spec.source, spec.opset)
    with progress.task(f"{spec.name}: exporting to ONNX"), warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(
                module,
                example_inputs(spec),
                str(out_path),
                input_names=[t.name for t in spec.inputs],
                output_names=output_names,
                dynamic_axes=dynamic_axes,
                opset_version=spec.opset,
                do_constant_folding=True,
                dynamo=False,
            )
        except (RuntimeError, TypeError, ValueError) as exc:
            raise BuilderError(f"model {spec.name!r}: ONNX export failed: {exc}") from exc
    model = onnx_files.load(out_path)
    model = onnx_model.infer_shapes(model, f"model {spec.name!r}")
    onnx_files.save(model, out_path)
    return model
