"""INT8 mixes derived from one calibrated Q/DQ graph: some of its quantized nodes read their inputs in FP32
again, every other Quantize/Dequantize pair keeps its calibrated scale.

Why: a tensor's calibrated range depends on the FP32 graph and the calibration data, not on which nodes are
quantized, so the INT8 guard's candidates need not each be calibrated again (one ModelOpt calibration of a
1.3 MB VAD took 62 s). A candidate here costs a graph edit.

A node reads, at each input a DequantizeLinear feeds, the FP32 value the float graph (the graph the
quantizer was given) feeds it there, rebuilt in the quantized graph where the quantizer changed the way to it:
ONNX Runtime's recipe stores weights already quantized (the float initializer is taken from the float graph)
and removes a Relu or Clip that its Quantize clamp replaces (the activation is put back for the excluded
node). Where that cannot be done safely (a node the quantizer renamed or fused), MixError says why and the
caller quantizes that candidate the slow way instead.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable

import numpy as np
import onnx
from onnx import numpy_helper

from builder.steps.onnx_model import subgraphs

_QDQ = frozenset({"QuantizeLinear", "DequantizeLinear"})
# Float-graph nodes rebuilt in a row in front of an excluded node at most (a removed activation is one).
_MAX_DEPTH = 8


# Dynamic quantization's integer ops, named after the float node they replace plus this suffix.
DYNAMIC_OPS = frozenset({"MatMulInteger", "ConvInteger"})
_DYNAMIC_SUFFIX = "_quant"


def quantized_nodes(model: onnx.ModelProto) -> list[str]:
    """The nodes this quantization touched, in graph order, by the names the quantizer excludes them by: compute
    nodes fed by a DequantizeLinear (Q/DQ), or the float nodes dynamic quantization replaced by integer ops."""
    dq_outputs = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    return [n.name.removesuffix(_DYNAMIC_SUFFIX) if n.op_type in DYNAMIC_OPS else n.name for n in model.graph.node
            if n.name and (n.op_type in DYNAMIC_OPS
                           or (n.op_type not in _QDQ and any(i in dq_outputs for i in n.input)))]


class MixError(Exception):
    """This mix cannot be derived from the quantized graph (the reason is the message)."""


def _used_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name a node of `graph` or of its subgraphs reads, and the graph's outputs."""
    used = {out.name for out in graph.output}
    stack = [graph]
    while stack:
        current = stack.pop()
        for node in current.node:
            used.update(name for name in node.input if name)
            stack.extend(subgraphs(node))
    return used


class _Rebuild:
    """Where the float graph's tensors are in the quantized graph, rebuilding the nodes the quantizer removed."""

    def __init__(self, model: onnx.ModelProto, float_model: onnx.ModelProto) -> None:
        self.graph = model.graph
        self.initializers = {init.name: init for init in self.graph.initializer}
        self.nodes = {node.name: node for node in self.graph.node if node.name}
        self.float_initializers = {init.name: init for init in float_model.graph.initializer}
        self.float_producers = {out: (node, index) for node in float_model.graph.node
                                for index, out in enumerate(node.output) if out}
        self.float_inputs = {value.name for value in float_model.graph.input}
        self.names = {out for node in self.graph.node for out in node.output} | set(self.initializers) | \
            {value.name for value in self.graph.input}
        self.added: list[onnx.NodeProto] = []  # rebuilt nodes, in dependency order
        self.cache: dict[str, str] = {}

    def _fresh(self, name: str) -> str:
        candidate, index = f"{name}_fp32", 0
        while candidate in self.names:
            index += 1
            candidate = f"{name}_fp32_{index}"
        self.names.add(candidate)
        return candidate

    def _same_initializer(self, name: str) -> bool:
        mine, theirs = self.initializers.get(name), self.float_initializers[name]
        if mine is None:
            return False
        return bool(mine.data_type == theirs.data_type and list(mine.dims) == list(theirs.dims)
                    and np.array_equal(numpy_helper.to_array(mine), numpy_helper.to_array(theirs)))

    def tensor(self, name: str, depth: int = 0) -> str:
        """The quantized graph's name for the float graph's tensor `name`, computed as the float graph does."""
        if name not in self.cache:
            self.cache[name] = self._find(name, depth)
        return self.cache[name]

    def _find(self, name: str, depth: int) -> str:
        if name in self.float_initializers:
            if self._same_initializer(name):
                return name
            copy = onnx.TensorProto()
            copy.CopyFrom(self.float_initializers[name])
            copy.name = self._fresh(name) if name in self.names else name
            self.names.add(copy.name)
            self.graph.initializer.append(copy)
            self.initializers[copy.name] = copy
            return copy.name
        if name in self.float_inputs:
            return name
        if name not in self.float_producers:
            raise MixError(f"tensor {name!r} is neither computed, an input nor a weight of the float graph")
        producer, index = self.float_producers[name]
        mine = self.nodes.get(producer.name) if producer.name else None
        if mine is not None and mine.op_type not in _QDQ:
            if mine.op_type != producer.op_type or index >= len(mine.output) or not mine.output[index]:
                raise MixError(f"node {producer.name!r} is {producer.op_type} in the float graph, "
                               f"{mine.op_type} in the quantized one")
            return str(mine.output[index])
        # The quantizer removed this node (a Relu its Quantize clamp replaced): rebuilt for the excluded node.
        if depth >= _MAX_DEPTH or list(subgraphs(producer)):
            raise MixError(f"tensor {name!r} would need more of the float graph rebuilt ({producer.op_type} "
                           f"{producer.name!r})")
        rebuilt = onnx.NodeProto()
        rebuilt.CopyFrom(producer)
        del rebuilt.input[:]
        rebuilt.input.extend(self.tensor(i, depth + 1) if i else "" for i in producer.input)
        rebuilt.name = self._fresh(producer.name or producer.op_type)
        del rebuilt.output[:]
        rebuilt.output.extend(self._fresh(out) if out else "" for out in producer.output)
        self.added.append(rebuilt)
        return str(rebuilt.output[index])


def unquantize(model: onnx.ModelProto, nodes: Collection[str], float_model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the Q/DQ graph `model` in which each of `nodes` reads every input a DequantizeLinear feeds in
    FP32 (as `float_model`, the graph the quantizer was given, computes it there); Quantize/Dequantize pairs
    and weights nothing reads any more are dropped. Raises MixError where it cannot be done safely."""
    mix = onnx.ModelProto()
    mix.CopyFrom(model)
    graph = mix.graph
    producers = {out: node for node in graph.node for out in node.output if out}
    float_nodes = {node.name: node for node in float_model.graph.node if node.name}
    float_producer = {out: node.name for node in float_model.graph.node for out in node.output if out}
    inputs = {value.name for value in graph.input} & {value.name for value in float_model.graph.input}
    weights = {init.name for init in graph.initializer
               if init.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)}

    def as_given(tensor: str) -> bool:
        """Whether a Quantize reads the value the float graph has: a graph input, a float weight, or the output
        of the node the float graph computes it with (not one whose Relu the quantizer removed)."""
        producer = producers.get(tensor)
        if producer is None:
            return tensor in inputs or tensor in weights
        return bool(producer.name) and float_producer.get(tensor) == producer.name

    by_name = {node.name: node for node in graph.node if node.name}
    rebuild = _Rebuild(mix, float_model)
    for name in dict.fromkeys(nodes):
        node = by_name.get(name)
        if node is None:
            raise MixError(f"node {name!r} is not in the quantized graph")
        for index, tensor in enumerate(node.input):
            dq = producers.get(tensor)
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            quantize = producers.get(dq.input[0])
            if quantize is not None and quantize.op_type == "QuantizeLinear" and as_given(quantize.input[0]):
                node.input[index] = quantize.input[0]
                continue
            # A weight stored quantized, or an activation the quantizer changed: from the float graph's node.
            original = float_nodes.get(name)
            if original is None or original.op_type != node.op_type or len(original.input) != len(node.input):
                raise MixError(f"node {name!r} is not the same node in the float graph (renamed or fused)")
            node.input[index] = rebuild.tensor(original.input[index])
    graph.node.extend(rebuild.added)
    _toposort(graph)
    _drop_unread(graph)
    try:
        onnx.checker.check_model(mix)
    except onnx.checker.ValidationError as exc:
        raise MixError(f"the derived graph fails the ONNX checker: {str(exc).splitlines()[0]}") from exc
    except ValueError as exc:  # a model over 2 GB cannot be checked in memory: quantized again instead
        raise MixError(f"the derived graph cannot be checked in memory: {str(exc).splitlines()[0]}") from exc
    return mix


def _reads(node: onnx.NodeProto) -> set[str]:
    """The tensors a node reads, those its subgraphs read from the outer graph included."""
    found = {name for name in node.input if name}
    for sub in subgraphs(node):
        found |= _used_names(sub)
    return found


def _toposort(graph: onnx.GraphProto) -> None:
    """The graph's nodes in dependency order, each as early as its original place allows (rebuilt nodes,
    appended at the end, move up to just before their first reader)."""
    nodes = list(graph.node)
    producer = {out: index for index, node in enumerate(nodes) for out in node.output if out}
    waits_on = [{producer[name] for name in _reads(node) if name in producer} - {index}
                for index, node in enumerate(nodes)]
    readers: dict[int, list[int]] = {}
    for index, deps in enumerate(waits_on):
        for dep in deps:
            readers.setdefault(dep, []).append(index)
    ready = [index for index, deps in enumerate(waits_on) if not deps]
    heapq.heapify(ready)
    ordered: list[int] = []
    while ready:
        index = heapq.heappop(ready)
        ordered.append(index)
        for reader in readers.get(index, []):
            waits_on[reader].discard(index)
            if not waits_on[reader]:
                heapq.heappush(ready, reader)
    if len(ordered) != len(nodes):
        raise MixError("the derived graph has a cycle")
    del graph.node[:]
    graph.node.extend(nodes[index] for index in ordered)


def _drop_unread(graph: onnx.GraphProto) -> None:
    """Quantize/Dequantize nodes whose outputs nothing reads, then initializers nothing reads, removed."""
    while True:
        used = _used_names(graph)
        dead = [node for node in graph.node if node.op_type in _QDQ and not any(o in used for o in node.output)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    used = _used_names(graph) | {value.name for value in graph.input}
    keep = [init for init in graph.initializer if init.name in used]
    if len(keep) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(keep)


def without(model: onnx.ModelProto, keep: Iterable[str], quantized: Collection[str],
            float_model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with only the quantized nodes in `keep` left quantized (unquantize the others)."""
    kept = set(keep)
    return unquantize(model, [name for name in quantized if name not in kept], float_model)
