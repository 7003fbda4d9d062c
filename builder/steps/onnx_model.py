"""Checking and describing ONNX graphs: signature, shape inference, runs at the shape range's levels, with
errors that name the file. The files themselves (read, write, copy, hash): builder/repository/onnx_files.py."""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import numpy_helper

from builder.errors import ManifestError, OnnxModelError, tool_cause
from builder.repository import onnx_files
from builder.runtimes.base import Outputs, ReferenceExecutor
from builder.spec.dtypes import from_onnx
from builder.spec.model import TensorSpec
from builder.spec.shapes import Level, ModelShapes, ValueRange, format_shape
from builder.steps.samples import integers_seen, synthetic

if TYPE_CHECKING:
    from numpy.typing import NDArray

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Signature:
    """Graph inputs and outputs: sizes, names of dynamic dims, or -1 for unnamed dynamic dims."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec:
        for tensor in self.inputs:
            if tensor.name == name:
                return tensor
        raise KeyError(name)



def infer_shapes(model: onnx.ModelProto, what: str) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except (onnx.shape_inference.InferenceError, RuntimeError) as exc:
        retried = _without_output_shapes(model, what)
        if retried is None:
            raise OnnxModelError(f"{what}: shape inference failed: {exc}") from exc
        return retried


def _without_output_shapes(model: onnx.ModelProto, what: str) -> onnx.ModelProto | None:
    """Strict inference again with the graph outputs' declared shapes left out (their types kept): None when
    it still fails. Models from other projects declare output shapes their graph contradicts (a CTC model
    declaring [1, seqlen] that returns (W/8, 1, classes)): the outputs are then taken as the graph returns
    them (pipeline: onnx_model.returned_outputs), with one warning line there."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    declared = [o for o in copy.graph.output if o.type.tensor_type.HasField("shape")]
    if not declared:
        return None
    for output in declared:
        output.type.tensor_type.ClearField("shape")
    try:
        inferred_copy = onnx.shape_inference.infer_shapes(copy, check_type=True, strict_mode=True)
    except (onnx.shape_inference.InferenceError, RuntimeError):
        return None
    log.debug("%s: shape inference passes only without the declared output shapes", what)
    return inferred_copy


def inferred(path: Path, what: str) -> onnx.ModelProto:
    """The checked model at `path` with its shapes inferred. A model with external data is inferred from
    its file (no message over 2 GB in memory) and comes back without its weights: for its signature."""
    if not onnx_files.has_external_data(path):
        return infer_shapes(onnx_files.load(path), what)
    onnx_files.load(path)  # the checks, and one line for missing data
    out = path.with_name(f".{path.name}.{os.getpid()}.inferred")
    try:
        onnx.shape_inference.infer_shapes_path(str(path), str(out), check_type=True, strict_mode=True)
        return onnx.load(str(out), load_external_data=False)
    except (onnx.shape_inference.InferenceError, RuntimeError) as exc:
        # Inference needs no weights: the graph alone, with its declared output shapes left out.
        retried = _without_output_shapes(onnx.load(str(path), load_external_data=False), what)
        if retried is None:
            raise OnnxModelError(f"{what}: shape inference failed: {exc}") from exc
        return retried
    finally:
        out.unlink(missing_ok=True)


def signature(model: onnx.ModelProto, what: str) -> Signature:
    initializers = {init.name for init in model.graph.initializer}
    inputs = tuple(
        _tensor(v, f"{what}: input {v.name!r}", is_input=True) for v in model.graph.input if v.name not in initializers
    )
    outputs = tuple(_tensor(v, f"{what}: output {v.name!r}", is_input=False) for v in model.graph.output)
    if not inputs:
        raise OnnxModelError(f"{what}: the graph has no inputs")
    return Signature(inputs, outputs)


def _tensor(value: onnx.ValueInfoProto, what: str, *, is_input: bool) -> TensorSpec:
    tensor_type = value.type.tensor_type
    if not value.type.HasField("tensor_type"):
        raise OnnxModelError(f"{what}: only tensor inputs and outputs are supported")
    dtype = from_onnx(tensor_type.elem_type, what)
    if is_input and not tensor_type.HasField("shape"):
        raise OnnxModelError(f"{what}: the graph gives no shape (not even a rank); expected a shaped tensor")
    dims: list[int | str] = []
    for dim in tensor_type.shape.dim:
        if dim.HasField("dim_value") and dim.dim_value > 0:
            dims.append(int(dim.dim_value))
        else:
            # Names are kept as the graph has them (`?` twice, `p2o.DynamicDimension.1`): the per-input
            # shapes, not the names, are what tell dims apart.
            dims.append(dim.dim_param or -1)
    return TensorSpec(name=value.name, dtype=dtype, shape=tuple(dims))


def check_manifest_inputs(sig: Signature, declared: tuple[TensorSpec, ...], what: str) -> None:
    """Declared inputs (models.toml) must match the exported graph by name, dtype and rank."""
    if not declared:
        return
    names = [t.name for t in sig.inputs]
    if [t.name for t in declared] != names:
        raise ManifestError(f"{what}: inputs {[t.name for t in declared]} differ from the ONNX graph's {names}")
    for want, have in zip(declared, sig.inputs, strict=True):
        if want.dtype != have.dtype or len(want.shape) != len(have.shape):
            raise ManifestError(
                f"{what}: input {want.name!r} declared {want.dtype}{list(want.shape)}, "
                f"ONNX has {have.dtype}{list(have.shape)}"
            )


def check_runs_at_levels(path: Path, inputs: tuple[TensorSpec, ...], shapes: ModelShapes, what: str, *,
                         executor: ReferenceExecutor, graph: str = "the FP32 model",
                         value_ranges: Mapping[str, ValueRange] | None = None,
                         examples: Mapping[str, NDArray[Any]] | None = None) -> None:
    """Run the FP32 graph (or a converted one: `graph` names it) at the min, opt and max shapes (batch
    included) on synthetic data, so a range the graph cannot take (a stride that does not divide, a Concat
    of mismatched maps, a converted graph's stale shape annotations) fails here, in one line naming the
    shapes, instead of inside a later tool.

    Integer inputs take their values from `value_ranges` (--input-range), else from the values the user's
    `examples` hold for them (a sample rate of 16000, real token ids), else 0s and 1s: a control input
    such as a VAD's `sr` selects an If branch, and 0 or 1 would run a branch the user never feeds."""
    ranges = value_ranges or {}
    for index, level in enumerate(Level):
        at = {name: r.at(level) for name, r in shapes.inputs.items()}
        batch = at[inputs[0].name][0] if shapes.batching else None
        feed = synthetic(inputs, shapes, batch or 1, seed=7, level=level, value_ranges=ranges, integers=True,
                         what=what)
        feed = integers_seen(feed, examples, ranges, seed=7 + index)
        try:
            executor.run(path, feed, batch)
        except executor.errors as exc:
            given = ",".join(f"{name}:{format_shape(shape)}" for name, shape in at.items())
            raise OnnxModelError(f"{what}: {graph} does not run at the {level} shapes ({given}): "
                                 f"{tool_cause(exc, limit=400)}") from exc


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The graphs a node holds in its attributes (an If's branches, a Loop's or Scan's body)."""
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            yield attribute.g
        yield from attribute.graphs


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of `graph` and of the subgraphs its nodes hold, depth first (a node before its subgraphs)."""
    for node in graph.node:
        yield node
        for sub in subgraphs(node):
            yield from all_nodes(sub)


def _defined_in_subgraphs(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph defines itself (its inputs, initializers, node outputs): there they shadow the outer ones."""
    names: set[str] = set()
    for node in graph.node:
        for sub in subgraphs(node):
            names.update(i.name for i in sub.input)
            names.update(i.name for i in sub.initializer)
            names.update(o for n in all_nodes(sub) for o in n.output)
            names |= _defined_in_subgraphs(sub)
    return names


def dedupe_initializers(model: onnx.ModelProto) -> int:
    """Keep one copy of each group of identical main-graph initializers (same type, shape and bytes) and point
    their users at it; the bytes saved. Converters cast or quantize a shared weight once per consumer: an
    unrolled LSTM's 20 Gemms on one 6.6 MB weight came out of FP16 conversion as 20 copies (19 MB FP32 became
    137 MB FP16, and 275 MB INT8). Tensors kept outside the file, and names a graph output or a subgraph's own
    definition also uses, are left as they are."""
    graph = model.graph
    protected = {o.name for o in graph.output} | _defined_in_subgraphs(graph)
    first: dict[tuple[int, tuple[int, ...], bytes], str] = {}
    rename: dict[str, str] = {}
    saved = 0
    for tensor in graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.name in protected:
            continue
        data = numpy_helper.to_array(tensor)
        key = (tensor.data_type, tuple(tensor.dims), hashlib.sha256(data.tobytes()).digest())
        kept = first.setdefault(key, tensor.name)
        if kept != tensor.name:
            rename[tensor.name] = kept
            saved += data.nbytes
    if not rename:
        return 0
    for node in all_nodes(graph):
        for index, name in enumerate(node.input):
            if name in rename:
                node.input[index] = rename[name]
    kept_tensors = [t for t in graph.initializer if t.name not in rename]
    del graph.initializer[:]
    graph.initializer.extend(kept_tensors)
    kept_info = [v for v in graph.value_info if v.name not in rename]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    kept_inputs = [i for i in graph.input if i.name not in rename]  # IR < 4 lists initializers as inputs too
    del graph.input[:]
    graph.input.extend(kept_inputs)
    log.debug("removed %d duplicate initializers (%.1f MB)", len(rename), saved / 1e6)
    return saved


def initializer_bytes(tensor: onnx.TensorProto) -> int:
    """Bytes of an initializer's values, from its dims and type (weights outside the file need not be loaded)."""
    return int(np.prod(tensor.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def shared_constant_growth(model: onnx.ModelProto) -> int:
    """Bytes that copying each shared initializer once per consumer would add to `model` (what ModelOpt's
    duplicate_shared_constants does before FP16 conversion and INT8 quantization): an initializer read by n
    inputs of main-graph nodes, n > 1, counted n - 1 times. From the dims, so weights outside the file need not
    be loaded."""
    uses: Counter[str] = Counter(name for node in model.graph.node for name in node.input if name)
    growth = 0
    for tensor in model.graph.initializer:
        count = uses.get(tensor.name, 0)
        if count > 1:
            growth += (count - 1) * initializer_bytes(tensor)
    return growth


def refresh_value_info(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` without the shape annotations (`value_info`) a converter left, in the graph and its subgraphs,
    and with them inferred again: a converter's annotations can hold the shapes of the samples it ran on,
    and ONNX Runtime plans its buffers by them, so at other shapes the graph fails ("Shape mismatch attempting
    to re-use buffer"). Where inference fails (or the model is over protobuf's limit), none are kept:
    ONNX Runtime infers its own."""
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        del graph.value_info[:]
        for node in graph.node:
            graphs.extend(subgraphs(node))
    try:
        if model.ByteSize() >= onnx_files.PROTOBUF_LIMIT:
            return model
        return onnx.shape_inference.infer_shapes(model)
    except (onnx.shape_inference.InferenceError, RuntimeError, ValueError, OverflowError):
        return model


def output_shape_notes(sig: Signature, outputs: Mapping[str, NDArray[Any]], *, batching: bool) -> list[str]:
    """Outputs whose declared shape contradicts what ONNX Runtime returns (rank, or a fixed size), one note
    each: the graph's returned shape is what the build compares and serves. `outputs` are a run's, joined
    along a leading axis (the batch, or a sample axis for a model that does not batch)."""
    notes = []
    for spec in sig.outputs:
        array = outputs.get(spec.name)
        if array is None or not spec.shape:
            continue
        returned = tuple(array.shape[1:])
        declared = spec.shape[1:] if batching else spec.shape
        fixed_differs = len(declared) == len(returned) and any(
            isinstance(d, int) and d > 0 and d != r for d, r in zip(declared, returned, strict=True))
        if len(declared) != len(returned) or fixed_differs:
            shown = [d if isinstance(d, int) and d > 0 else "?" if d == -1 else d for d in spec.shape]
            got = ["batch", *returned] if batching else list(returned)
            notes.append(f"output {spec.name!r} is declared {shown} but the graph returns {got}; "
                         "the build compares and serves what it returns")
    return notes


def returned_outputs(sig: Signature, outputs: Mapping[str, NDArray[Any]], *, batching: bool) -> Signature:
    """The signature with each output whose declared shape contradicts what the graph returns (see
    output_shape_notes) shaped as returned: its rank, sizes that are fixed where they agree, -1 elsewhere."""
    fixed = []
    for spec in sig.outputs:
        array = outputs.get(spec.name)
        declared = spec.shape[1:] if batching else spec.shape
        if array is not None and not spec.shape:  # no shape declared: as returned
            fixed.append(TensorSpec(name=spec.name, dtype=spec.dtype,
                                    shape=(-1,) * (array.ndim if batching else array.ndim - 1)))
            continue
        if array is None or not output_shape_notes(Signature(sig.inputs, (spec,)), {spec.name: array},
                                                   batching=batching):
            fixed.append(spec)
            continue
        returned = tuple(array.shape[1:])
        same_rank = len(declared) == len(returned)
        dims: list[int | str] = [d if same_rank and (isinstance(d, str) or d in (-1, r)) else -1
                                 for d, r in zip(declared if same_rank else returned, returned, strict=True)]
        head: list[int | str] = [spec.shape[0]] if batching else []
        fixed.append(TensorSpec(name=spec.name, dtype=spec.dtype, shape=(*head, *dims)))
    return Signature(sig.inputs, tuple(fixed))


def run_fp32(path: Path, samples: Mapping[str, NDArray[Any]], batch_size: int | None, what: str, *,
             executor: ReferenceExecutor) -> Outputs:
    """The FP32 graph's outputs on the evaluation samples; one line naming the arrays' shapes where the
    reference executor cannot run it on them (data at a size inside the range the graph cannot take)."""
    try:
        return executor.run(path, samples, batch_size)
    except executor.errors as exc:
        given = ", ".join(f"{name} {list(array.shape)}" for name, array in samples.items())
        raise OnnxModelError(f"{what}: the FP32 model does not run on the evaluation samples ({given}): "
                             f"{tool_cause(exc, limit=400)}") from exc



def default_opset(path: Path) -> int | None:
    """The model's opset of the default (ai.onnx) domain; None when it imports none."""
    model = onnx.load(str(path), load_external_data=False)
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
