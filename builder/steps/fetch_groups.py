"""Intermediate tensors fetched from ONNX Runtime a bounded group at a time.

Calibration, autocast's reference ranges and the guards' one-pass sensitivity read every intermediate tensor of
a graph, each exposed as a graph output. ONNX Runtime holds every graph output of a run until the run ends, and
asking a session for fewer of its outputs does not change that: isbnx_det (a 10 MB detector) at 2x3x1280x1280
peaks at 454 MB run as given and at 3.1 GB with every tensor exposed, even when one output is asked for. Its
build peaked at 4.4 GB for a 2.1 GB goal. Here the tensors are cut, in graph order, into groups whose bytes stay
within a budget, and each group gets a session of its own: the graph pruned to the nodes the group's tensors
depend on (ONNX Runtime runs every node of a graph, asked for or not), exposing that group only. The early groups
cost a prefix of the graph, and the peak is one group's tensors plus what the graph holds anyway. The loops run
group by group, every feed through one group's session, so each session is made once. Callers make these
sessions without graph optimizations, so a tensor's values do not depend on which others share its group.

Sizes come from ONNX shape inference with the feed's own shapes (no run). A tensor whose shape stays unknown
(data-dependent: after NonZero, TopK with a computed k, a TTS model's predicted durations) rides along with its
neighbours in graph order and counts nothing against the budget: cutting those by count cost kokoro_ja's
calibration (all of its tensors past the durations unknown, about a hundred groups of a 92 MB graph) more than
the corpus run's 600 s, where one group had taken 50 s. So their memory is not bounded here (a limit).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from numpy.typing import NDArray

from builder.steps import onnx_model

log = logging.getLogger(__name__)

# What one run may return, in bytes. Against issue 23's goal (4x the model plus 2 GB), with the build process at
# 0.6-0.7 GB before any of these passes (its libraries; isbnx_det's build, 2026-11-29): half a gigabyte leaves
# room for the session and the caller's copies.
GROUP_BYTES = 512 << 20
# Initializers with more elements than this are given to shape inference by their shape alone: their values
# matter only to shape computations (a Reshape's target), which are small.
_VALUES_KEPT = 1024


def _shape_only(model: onnx.ModelProto, base: Path | None = None) -> onnx.ModelProto:
    """`model` without its weights' values (each large initializer becomes an input of its type and shape), so
    shape inference copies kilobytes, not the weights. A small initializer stored outside the file is read from
    `base` (the model's folder), where given: a Reshape's target must have its values."""
    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    graph = light.graph
    graph.node.extend(model.graph.node)
    graph.input.extend(model.graph.input)
    # Outputs by name alone: a declared shape ("N" for the batch, as a calibrator's augmented graph declares its
    # added outputs) would be kept over the one inferred at the feed's shapes.
    for value in model.graph.output:
        graph.output.add().name = value.name
    declared = {i.name for i in model.graph.input}
    for init in model.graph.initializer:
        small = int(np.prod(init.dims, dtype=np.int64)) <= _VALUES_KEPT
        if small and init.data_location == onnx.TensorProto.EXTERNAL and base is not None:
            loaded = onnx.TensorProto()
            loaded.CopyFrom(init)
            with contextlib.suppress(OSError, ValueError):
                onnx.external_data_helper.load_external_data_for_tensor(loaded, str(base))
                loaded.data_location = onnx.TensorProto.DEFAULT
                del loaded.external_data[:]
                graph.initializer.append(loaded)
                continue
        if small and init.data_location != onnx.TensorProto.EXTERNAL:
            graph.initializer.append(init)
        elif init.name not in declared:
            graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    return light


def _with_shapes(model: onnx.ModelProto, feed: Mapping[str, NDArray[Any]]) -> onnx.ModelProto:
    for value in model.graph.input:
        if value.name not in feed or not value.type.HasField("tensor_type"):
            continue
        shape = np.shape(feed[value.name])
        tensor = value.type.tensor_type
        if tensor.HasField("shape") and len(tensor.shape.dim) != len(shape):
            continue  # the runtime will say what is wrong with the feed
        tensor.shape.Clear()  # an input declared without a shape gets the feed's too
        for size in shape:
            tensor.shape.dim.add().dim_value = int(size)
    return model


def tensor_bytes(model: onnx.ModelProto, feed: Mapping[str, NDArray[Any]], base: Path | None = None
                 ) -> dict[str, int]:
    """Bytes of each main-graph tensor of `model` when it runs on `feed`, from shape inference at the feed's
    shapes (`base`: the model's folder, for small tensors stored outside the file); a tensor whose shape or type
    is not known is left out (shape inference failing leaves out all)."""
    light = _with_shapes(_shape_only(model, base), feed)
    try:
        inferred = onnx.shape_inference.infer_shapes(light, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, RuntimeError) as exc:
        # A graph ONNX cannot infer (a contrib op it does not know gives no error, only no shape): every
        # tensor is then of unknown size: one group, as before grouping.
        log.debug("tensor sizes by shape inference failed (%s); every tensor in one group", exc)
        return {}
    sizes: dict[str, int] = {}
    for value in (*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input):
        tensor = value.type.tensor_type
        if not tensor.elem_type or not tensor.HasField("shape"):
            continue
        dims = tensor.shape.dim
        if not all(d.HasField("dim_value") and d.dim_value >= 0 for d in dims):
            continue
        try:
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).itemsize
        except (KeyError, ValueError, TypeError):  # a type this onnx cannot map to numpy: unknown
            continue
        sizes[value.name] = int(np.prod([d.dim_value for d in dims], dtype=np.int64)) * itemsize
    return sizes


def graph_order(model: onnx.ModelProto) -> dict[str, int]:
    """Each main-graph tensor's position: the index of the node that makes it (inputs and initializers -1)."""
    order = {name: -1 for name in (*(i.name for i in model.graph.input), *(i.name for i in model.graph.initializer))}
    for index, node in enumerate(model.graph.node):
        for name in node.output:
            if name:
                order.setdefault(name, index)
    return order


def groups(names: Sequence[str], sizes: Mapping[str, int], *, budget: int | None = None,
           order: Mapping[str, int] | None = None) -> list[list[str]]:
    """`names` (each once), in graph order where `order` is given, cut into groups of at most `budget` bytes
    (GROUP_BYTES when None), tensors of unknown size counting nothing (a tensor larger than the budget is a group
    of its own)."""
    budget = GROUP_BYTES if budget is None else budget
    unique = list(dict.fromkeys(names))
    if order is not None:
        last = len(order)
        unique.sort(key=lambda n: order.get(n, last))
    cut: list[list[str]] = []
    held = 0
    for name in unique:
        grows = sizes.get(name, 0)
        if cut and cut[-1] and held + grows > budget:
            cut.append([])
            held = 0
        if not cut:
            cut.append([])
        cut[-1].append(name)
        held += grows
    return cut


def _reads(node: onnx.NodeProto) -> set[str]:
    """What `node` reads: its inputs, and the outer names its subgraphs read (an If branch's captures)."""
    read = {name for name in node.input if name}
    for sub in onnx_model.subgraphs(node):
        inner = {i.name for i in sub.input} | {i.name for i in sub.initializer}
        inner |= {name for n in sub.node for name in n.output if name}
        for n in sub.node:
            read |= _reads(n) - inner
        read |= {o.name for o in sub.output} - inner
    return read


def pruned(model: onnx.ModelProto, outputs: Sequence[str]) -> onnx.ModelProto:
    """A new model of `model`'s nodes that `outputs` depend on, with `outputs` as its only graph outputs: ONNX
    Runtime runs every node of a graph whether or not its outputs are asked for. Every graph input stays (a feed
    names them all); only the initializers the kept nodes read are copied (by reference where stored outside the
    file)."""
    graph = model.graph
    producer = {name: index for index, node in enumerate(graph.node) for name in node.output if name}
    needed, pending = set(), list(outputs)
    while pending:
        name = pending.pop()
        index = producer.get(name)
        if index is None or index in needed:
            continue
        needed.add(index)
        pending.extend(_reads(graph.node[index]))
    kept = [graph.node[i] for i in sorted(needed)]
    read = set(outputs).union(*(_reads(node) for node in kept))
    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    light.graph.name = graph.name
    light.graph.node.extend(kept)
    initializers = {t.name for t in graph.initializer}
    # Inputs that are initializers too (IR < 4, or an export keeping initializers as inputs) only where read: one
    # left without its value would be a required feed.
    light.graph.input.extend(i for i in graph.input if i.name not in initializers or i.name in read)
    light.graph.initializer.extend(t for t in graph.initializer if t.name in read)
    light.graph.sparse_initializer.extend(t for t in graph.sparse_initializer if t.values.name in read)
    for name in outputs:
        light.graph.output.add().name = name
    return light


def group_sessions(model: onnx.ModelProto, cut: Sequence[Sequence[str]],
                   open_session: Callable[[onnx.ModelProto], Any]) -> Iterator[tuple[Sequence[str], Any]]:
    """(group, a session of `model` pruned to that group's tensors, which it exposes) for each group of `cut`, one
    at a time: the caller lets go of a session before asking for the next. The graph's own inputs in a group are
    fetched from the feed (see run_group), so a group of inputs alone gets no session (None)."""
    for group in cut:
        session = group_session(model, group, open_session)
        yield group, session
        del session


def group_session(model: onnx.ModelProto, group: Sequence[str], open_session: Callable[[onnx.ModelProto], Any]
                  ) -> Any:
    """A session of `model` pruned to `group`'s tensors, or None where they are all graph inputs."""
    initializers = {t.name for t in model.graph.initializer}
    inputs = {i.name for i in model.graph.input if i.name not in initializers}
    wanted = [n for n in dict.fromkeys(group) if n not in inputs]
    return open_session(pruned(model, wanted)) if wanted else None


def run_group(session: Any, feed: Mapping[str, NDArray[Any]], group: Sequence[str]) -> dict[str, Any]:
    """Each tensor of `group` on `feed`: one run of the group's session; a name that is one of the feed's inputs
    is the feed's own array (a session returns no input)."""
    wanted = [n for n in group if n not in feed]
    values = dict(zip(wanted, session.run(wanted, dict(feed)), strict=True)) if wanted else {}
    return {name: feed[name] if name in feed else values[name] for name in group}


def largest_bytes(model: onnx.ModelProto, feeds: Iterable[Mapping[str, NDArray[Any]]], base: Path | None = None
                  ) -> dict[str, int]:
    """tensor_bytes over every distinct set of input shapes among `feeds`, the largest per tensor (a tensor
    unknown at any of them stays unknown)."""
    seen: set[tuple[tuple[str, tuple[int, ...]], ...]] = set()
    largest: dict[str, int] | None = None
    for feed in feeds:
        shapes = tuple(sorted((k, tuple(np.shape(v))) for k, v in feed.items()))
        if shapes in seen:
            continue
        seen.add(shapes)
        sizes = tensor_bytes(model, feed, base)
        largest = sizes if largest is None else {n: max(b, sizes[n]) for n, b in largest.items() if n in sizes}
    return largest or {}
