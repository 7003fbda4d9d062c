"""One-pass sensitivity for the accuracy guards: which nodes of a converted graph (INT8 Q/DQ, or FP16 by
autocast) add the most error, from one run of the FP32 graph and one of the converted graph on the held-out
samples, with the tensors around each candidate node exposed as graph outputs.

The figure: a node's *added error*, the relative L2 error (‖candidate − FP32‖ / ‖FP32‖ over all samples
used) of its output minus the largest relative error already present at its non-constant inputs. Why this
one: a node that only passes on upstream error scores about 0 however deep it sits, while a node whose own
conversion hurts (its inputs and weights rounded to INT8, its arithmetic in FP16: the cancellation in
x − 300.1 at FP16's spacing of 0.25) scores what it adds; the error is relative, so tensors of any scale
compare. An input is measured where the FP32 graph has it, i.e. before the Quantize/Dequantize pair or the
Cast the conversion put in front of the node: that rounding belongs to the node, which is what excluding
it from the conversion removes. It is a first-order figure (errors of several nodes interact), which is why
the guards' search still checks every candidate with a real conversion and the real tolerance.

Memory: the samples stream through both graphs a batch at a time and only running sums are kept, and the
tensors are exposed a bounded group at a time (builder.steps.fetch_groups), so the cost is one group of one
batch's activations of each graph, whatever the number of samples and the graph's size. The exposed graphs
are written beside their sources without loading weights stored outside the file, which they keep referring to.

`onnxruntime.quantization.qdq_loss_debug` pairs float and Q/DQ activations by tensor name; this pairs them by
node name and output index instead and looks through the Casts autocast adds as well as through Q/DQ pairs,
so one function serves both guards.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from numpy.typing import NDArray

from builder.runtimes.base import feeds as sample_feeds
from builder.runtimes.onnxruntime import ort_session
from builder.spec.enums import GuardSensitivity
from builder.steps import fetch_groups
from common import progress

log = logging.getLogger(__name__)

# Nodes a conversion puts in front of (or after) a node: looked through when finding where an input comes from.
_INSERTED = frozenset({"Cast", "QuantizeLinear", "DequantizeLinear"})
# Held-out samples the pass uses at most, and the batch they run in (bounds one batch's activations).
MAX_SAMPLES = 32
MAX_BATCH = 8
# Elements per slice of the float64 error sums.
_SLICE = 1 << 22
# A relative error at least this large is recorded as this (an FP16 overflow gives inf).
ERROR_CAP = 1e6
_FLOAT_KINDS = "fc"


@dataclass(frozen=True)
class SensitivityRecord:
    """How a guard ranked the nodes, as build.json records it."""

    method: GuardSensitivity
    figure: str  # what the ranking's numbers (most_sensitive's damage) are
    nodes: int  # nodes ranked
    seconds: float  # the ranking alone
    kept: int | None  # nodes the guard kept in higher precision; None: no mix met the tolerance
    # This process's peak RSS so far (monotonic): the INT8 guard reads it when it ends (search included), the
    # FP16 guard when its ranking ends (before its search).
    peak_rss_mib: float | None
    # One pass asked for, but its search found no mix: the exhaustive ranking ran too, and its search decided.
    escalated: bool = False


FIGURES = {
    GuardSensitivity.ONE_PASS: "error added: relative L2 error of the node's output minus its inputs' (one pass)",
    GuardSensitivity.EXHAUSTIVE: "damage with the node alone converted: 1 - mean cosine (+ top-1 disagreement; a "
                                   "detector: 1 - detection agreement)",
}


@dataclass(frozen=True)
class _Pair:
    """One tensor as the FP32 graph and the converted graph name it (the same value, computed both ways)."""

    fp32: str
    candidate: str


@dataclass(frozen=True)
class NodeTensors:
    outputs: tuple[_Pair, ...]
    inputs: tuple[_Pair, ...]  # non-constant inputs, where the FP32 graph has them


def _producers(graph: onnx.GraphProto) -> dict[str, tuple[onnx.NodeProto, int]]:
    return {out: (node, index) for node in graph.node for index, out in enumerate(node.output) if out}


def _constants(graph: onnx.GraphProto) -> set[str]:
    found = {init.name for init in graph.initializer}
    found.update(node.output[0] for node in graph.node if node.op_type == "Constant")
    return found


def node_tensors(fp32: onnx.ModelProto, candidate: onnx.ModelProto, nodes: Sequence[str]) -> dict[str, NodeTensors]:
    """For each named node found in both graphs: its outputs and its non-constant inputs, paired across them."""
    fp32_nodes = {n.name: n for n in fp32.graph.node if n.name}
    cand_nodes = {n.name: n for n in candidate.graph.node if n.name}
    produced = _producers(candidate.graph)
    constant = _constants(candidate.graph)
    graph_inputs = {i.name for i in fp32.graph.input} & {i.name for i in candidate.graph.input}
    # Tensors the FP32 graph computes: a converted graph keeps most names even where it renames or fuses the
    # node (ONNX Runtime's pre-processing fuses Conv + Clip into a Conv named after the Conv's output).
    fp32_tensors = {out for node in fp32.graph.node for out in node.output if out} | graph_inputs

    def source(tensor: str) -> _Pair | None:
        """Where the FP32 graph has this input of a converted node: back through the nodes the conversion
        added (named nowhere in the FP32 graph) to a tensor of the FP32 graph, a graph input or an output of
        a node both graphs have."""
        seen = 0
        while tensor in produced and seen < 64:
            if tensor in fp32_tensors and tensor not in constant:
                return _Pair(tensor, tensor)
            node, index = produced[tensor]
            if node.name in fp32_nodes:
                original = fp32_nodes[node.name]
                if index < len(original.output) and original.output[index]:
                    return _Pair(original.output[index], tensor)
                return None
            if node.op_type not in _INSERTED or not node.input:
                return None
            tensor = node.input[0]
            seen += 1
        if tensor in constant or tensor not in graph_inputs:
            return None
        return _Pair(tensor, tensor)

    candidate_tensors = set(produced) | {i.name for i in candidate.graph.input}
    fp32_constant = _constants(fp32.graph)
    found: dict[str, NodeTensors] = {}
    for name in nodes:
        if name not in cand_nodes:
            # Replaced under other names (dynamic quantization's MatMulInteger and its scale Mul, which writes the
            # float node's output): by the tensors both graphs name alike.
            original = fp32_nodes.get(name)
            kept = tuple(_Pair(t, t) for t in original.output if t in candidate_tensors) if original else ()
            if original is not None and kept:
                found[name] = NodeTensors(kept, tuple(_Pair(t, t) for t in dict.fromkeys(original.input)
                                                      if t in candidate_tensors and t not in fp32_constant))
            continue
        converted = cand_nodes[name]
        if name in fp32_nodes:  # by node name and output index
            original = fp32_nodes[name]
            outputs = tuple(_Pair(a, b) for a, b in zip(original.output, converted.output, strict=False) if a and b)
        else:  # a node the conversion renamed or fused: by the names of its outputs
            outputs = tuple(_Pair(out, out) for out in converted.output if out in fp32_tensors)
        if not outputs:
            continue
        inputs = tuple(pair for pair in (source(t) for t in converted.input if t and t not in constant) if pair)
        found[name] = NodeTensors(outputs, tuple(dict.fromkeys(inputs)))
    return found


def _opener(path: Path) -> Any:
    """Sessions of group graphs of the model at `path`, each written beside it (weights stored outside the file
    stay there: the group graph refers to them by the same relative location) and removed once loaded; no graph
    optimizations, so a tensor's values do not depend on the tensors exposed with it."""
    def open_session(model: onnx.ModelProto) -> Any:
        out = path.with_name(f".{path.stem}.sensitivity.{os.getpid()}.onnx")
        try:
            onnx.save(model, str(out))
            return ort_session(out, arena=False, optimize=False)
        finally:
            out.unlink(missing_ok=True)
    return open_session


def _made(model: onnx.ModelProto) -> set[str]:
    return {name for node in model.graph.node for name in node.output if name}


class _Errors:
    """Running sums per tensor pair: Σ(candidate − FP32)² and Σ FP32²."""

    def __init__(self) -> None:
        self.diff: dict[_Pair, float] = {}
        self.ref: dict[_Pair, float] = {}
        self.count: dict[_Pair, int] = {}

    def add(self, pair: _Pair, reference: NDArray[Any], candidate: NDArray[Any]) -> None:
        if reference.shape != candidate.shape or reference.dtype.kind not in _FLOAT_KINDS + "iub":
            return
        # In float64, a slice at a time: four float64 temporaries of a whole 100 MB activation held 800 MB at once.
        flat_ref, flat_cand = reference.reshape(-1), candidate.reshape(-1)
        diff = ref_sum = 0.0
        for start in range(0, flat_ref.size, _SLICE):
            ref = flat_ref[start : start + _SLICE].astype(np.float64)
            with np.errstate(over="ignore", invalid="ignore"):
                diff += float(np.sum(np.square(flat_cand[start : start + _SLICE].astype(np.float64) - ref)))
            ref_sum += float(np.sum(np.square(ref)))
        if math.isnan(diff):
            diff = math.inf
        self.diff[pair] = self.diff.get(pair, 0.0) + diff
        self.ref[pair] = self.ref.get(pair, 0.0) + ref_sum
        self.count[pair] = self.count.get(pair, 0) + flat_ref.size

    def relative(self, pair: _Pair) -> float | None:
        if pair not in self.diff:
            return None
        diff, ref, count = self.diff[pair], self.ref[pair], max(1, self.count[pair])
        if math.isinf(diff):
            return ERROR_CAP
        return min(ERROR_CAP, math.sqrt(diff / (ref + 1e-30 * count)))


def one_pass(fp32_path: Path, candidate_path: Path, nodes: Sequence[str], evaluation: Mapping[str, NDArray[Any]],
             batch_size: int | None, *, what: str = "guard") -> dict[str, float]:
    """Each of `nodes` (named in both graphs) → the error it adds in the candidate (see the module's text);
    a node whose tensors could not be paired gets 0."""
    fp32 = onnx.load(str(fp32_path), load_external_data=False)
    candidate = onnx.load(str(candidate_path), load_external_data=False)
    pairs = node_tensors(fp32, candidate, nodes)
    wanted = {p for t in pairs.values() for p in (*t.outputs, *t.inputs)}
    count = len(next(iter(evaluation.values())))
    used = {k: v[: min(count, MAX_SAMPLES)] for k, v in evaluation.items()}
    batch = None if batch_size is None else min(batch_size, MAX_BATCH)
    errors = _Errors()
    feeds = list(sample_feeds(used, batch))
    first = feeds[0] if feeds else {}
    made = (_made(fp32), _made(candidate))
    # Pairs whose two tensors are a feed's input or made by a node of the main graph.
    returned = [p for p in wanted if (p.fp32 in made[0] or p.fp32 in first)
                and (p.candidate in made[1] or p.candidate in first)]
    by_fp32: dict[str, list[_Pair]] = {}
    for pair in returned:
        by_fp32.setdefault(pair.fp32, []).append(pair)
    # The tensors a bounded group at a time, each group a session of each graph pruned to that group
    # (builder.steps.fetch_groups); sizes by shape inference at the feeds' shapes, the FP32 graph's counted twice.
    cut = fetch_groups.groups(list(by_fp32), fetch_groups.largest_bytes(fp32, feeds, fp32_path.parent),
                              budget=fetch_groups.GROUP_BYTES // 2, order=fetch_groups.graph_order(fp32))
    groups = [[p for name in group for p in by_fp32[name]] for group in cut] if feeds else []
    names = [([p.fp32 for p in group], [p.candidate for p in group]) for group in groups]
    description = (f"{what}: sensitivity, one pass over {len(feeds)} held-out batches"
                   + (f" in {len(groups)} groups of tensors" if len(groups) > 1 else ""))
    # ONNX Runtime itself, not the reference executor: batches stream through the sessions and only running sums
    # of the exposed tensors are kept (an executor's run() returns every sample's outputs at once).
    open_fp32, open_candidate = _opener(fp32_path), _opener(candidate_path)
    with progress.task(description, total=len(feeds) * len(groups)) as bar:
        for (fp32_names, candidate_names), group in zip(names, groups, strict=True):
            # Two sessions at a time: the last group's are let go before these are made.
            fp32_session = fetch_groups.group_session(fp32, fp32_names, open_fp32)
            candidate_session = fetch_groups.group_session(candidate, candidate_names, open_candidate)
            for feed in feeds:
                reference = fetch_groups.run_group(fp32_session, feed, fp32_names)
                converted = fetch_groups.run_group(candidate_session, feed, candidate_names)
                for pair in group:
                    errors.add(pair, np.asarray(reference[pair.fp32]), np.asarray(converted[pair.candidate]))
                del reference, converted
                bar.advance()
            del fp32_session, candidate_session
    del fp32, candidate
    scores: dict[str, float] = {}
    for name in nodes:
        tensors = pairs.get(name)
        if tensors is None:
            scores[name] = 0.0
            continue
        out = [e for e in (errors.relative(p) for p in tensors.outputs) if e is not None]
        inherited = [e for e in (errors.relative(p) for p in tensors.inputs) if e is not None]
        added = (max(out) if out else 0.0) - (max(inherited) if inherited else 0.0)
        scores[name] = 0.0 if math.isnan(added) else added
    log.debug("one-pass sensitivity: %d nodes, %d tensor pairs, %d samples", len(nodes), len(wanted),
              len(next(iter(used.values()))))
    return scores
