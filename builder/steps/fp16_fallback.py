"""FP16 that runs: ModelOpt autocast first (steps.precision.to_fp16); where autocast fails (its "Sanity
Check Failed" on a model with If subgraphs) or its graph does not run at the min, opt and max shapes,
onnxconverter-common's float16 (FP32 inputs and outputs, an op block list, the subgraphs of If/Loop/Scan
kept in FP32). A variant that still misses its tolerance then goes to the FP16 guard (steps.variant.Gate).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx
from numpy.typing import NDArray

from builder.errors import OnnxModelError, ToolError, tool_cause
from builder.repository import onnx_files
from builder.runtimes.onnxruntime import ORT_ERRORS
from builder.steps import onnx_model, precision

log = logging.getLogger(__name__)

CONTROL_FLOW = ("If", "Loop", "Scan")
TOOL = "onnxconverter_common.float16"

# Checks a converted graph (e.g. runs it at the min, opt and max shapes); raises OnnxModelError where it fails.
Check = Callable[[Path], None]


def to_fp16_checked(fp32_path: Path, out_path: Path, *, feeds: Sequence[Mapping[str, NDArray[Any]]], what: str,
                    check: Check, log_file: Path | None) -> dict[str, object]:
    """The FP16 variant at `out_path`, from the first converter whose graph passes `check`; its settings as
    build.json records them (with the reason autocast's graph was set aside, where it was)."""
    try:
        settings = precision.to_fp16(fp32_path, out_path, feeds=feeds, what=what, log_file=log_file)
        check(out_path)
        return settings
    except (ToolError, OnnxModelError) as exc:
        first = exc
    log.debug("%s; trying onnxconverter-common's FP16", first)
    try:
        settings = to_fp16_onnxconverter(fp32_path, out_path, what=what, log_file=log_file)
        check(out_path)
    except (ToolError, OnnxModelError) as exc:
        record = precision.failure_log(f"fp16 onnxconverter-common {what}", "", exc, log_file=log_file)
        raise ToolError(f"{what}: {precision.reason(first, what)}; onnxconverter-common's FP16 neither: "
                        f"{precision.reason(exc, what)} (full output: {record})") from exc
    log.warning("%s; the FP16 variant is onnxconverter-common's instead", first)  # one line, once it holds
    return {**settings, "instead_of": "modelopt.onnx.autocast", "why": precision.reason(first, what)}


def to_fp16_onnxconverter(fp32_path: Path, out_path: Path, *, what: str, log_file: Path | None) -> dict[str, object]:
    """onnxconverter-common's float16 with FP32 inputs and outputs. Control-flow nodes are blocked (their
    subgraphs stay FP32) and each outer value their subgraphs read gets an FP32 copy where the conversion
    made it FP16; the converter's shape annotations are dropped and inferred again."""
    from onnxconverter_common import float16  # type: ignore[import-untyped]

    model = onnx_files.load(fp32_path)
    # ONNX Runtime names a refused node by its name: unnamed ones get one here ("" would block nothing, and
    # onnxconverter-common fails on an empty name in its node block list).
    named = _name_unnamed_nodes(model.graph)
    # Ops of other domains (com.microsoft's DynamicQuantizeLSTM, ...) rarely take FP16: kept in FP32 from the start.
    custom = {node.op_type for node in model.graph.node if node.domain not in ("", "ai.onnx")}
    ops = {*float16.DEFAULT_OP_BLOCK_LIST, *CONTROL_FLOW, *custom}
    nodes: set[str] = set()
    initial = set(ops)
    refused: tuple[str | None, str | None] | None = None
    try:
        with _quiet() as sink:
            for _ in range(MAX_REPAIRS + 1):
                source = onnx.ModelProto()
                source.CopyFrom(model)  # the converter edits the model it is given
                converted = float16.convert_float_to_float16(source, keep_io_types=True,
                                                             op_block_list=sorted(ops), node_block_list=sorted(nodes))
                feed_subgraphs_fp32(converted.graph)
                converted = onnx_model.refresh_value_info(converted)
                refused = _type_error(converted)
                if refused is None:
                    break
                op_type, node = refused
                if op_type is not None and op_type not in ops:
                    ops.add(op_type)
                elif node and node not in nodes:
                    nodes.add(node)
                else:
                    break  # blocking cannot mend it: the graph goes to the check, which says why it fails
            if refused is not None:
                log.warning("%s: onnxconverter-common's FP16: ONNX Runtime still refuses %s after %d repair rounds",
                            what, f"node {refused[1]!r}" if refused[1] else f"op {refused[0]!r}" if refused[0]
                            else "the graph", len(nodes) + len(ops - initial))
            if converted.ByteSize() < onnx_files.PROTOBUF_LIMIT:
                onnx.checker.check_model(converted)
    except precision.TOOL_ERRORS as exc:
        record = precision.failure_log(f"fp16 onnxconverter-common {what}", sink.getvalue(), exc,
                                       log_file=log_file)
        # onnx's checker puts its reason over several lines: one line here.
        cause = " ".join(str(exc).split()) if isinstance(exc, onnx.checker.ValidationError) else \
            tool_cause(exc, hide={fp32_path: "the model"})
        raise ToolError(f"{what}: FP16 conversion (onnxconverter-common) failed: {cause[:300]} "
                        f"(full output: {record})") from exc
    if nodes or ops - {*float16.DEFAULT_OP_BLOCK_LIST, *CONTROL_FLOW}:
        log.debug("%s: onnxconverter-common's FP16 keeps in FP32 the op types %s and the nodes %s (ONNX Runtime "
                  "refused their mixed or FP16 inputs)", what, sorted(ops - set(float16.DEFAULT_OP_BLOCK_LIST)),
                  sorted(nodes))
    # The repair can keep every weighted op in FP32 (each blocked node leaves its shared weight FP32, and the next
    # consumer is refused in turn): then this "FP16" computes in FP32. Said in one line and recorded.
    compute = [n for n in model.graph.node if n.op_type in _COMPUTE_OPS]
    fp16_compute = sum(1 for n in compute if n.op_type not in ops and n.name not in nodes)
    if compute and fp16_compute == 0:
        log.warning("%s: onnxconverter-common's FP16 keeps every one of the %d Conv/MatMul/Gemm nodes in FP32 "
                    "(ONNX Runtime refused them in FP16): this variant computes in FP32", what, len(compute))
    onnx_model.dedupe_initializers(converted)
    onnx_files.save(converted, out_path)
    return {"tool": TOOL, "keep_io_types": True, "op_block_list": sorted(ops), "node_block_list": sorted(nodes),
            "named_nodes": named, "fp16_compute_nodes": fp16_compute, "compute_nodes": len(compute)}


# The ops whose FP16 pays (the weighted, compute-bound ones), counted in the top-level graph.
_COMPUTE_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "Attention", "LSTM", "GRU"})


def _name_unnamed_nodes(graph: onnx.GraphProto) -> int:
    """Give every unnamed node of the graph (its subgraphs too) a name not used elsewhere; how many were named."""
    nodes = list(onnx_model.all_nodes(graph))
    used = {node.name for node in nodes if node.name}
    count = 0
    for node in nodes:
        if not node.name:
            index = count
            while f"{node.op_type}_{index}" in used:
                index += 1
            node.name = f"{node.op_type}_{index}"
            used.add(node.name)
            count += 1
    return count


# Rounds of "convert, let ONNX Runtime type-check the graph, keep the node it refuses in FP32": each round
# mends one node (the converter misjudges the type of a value an If, a custom op or an FP32-only op such as
# DynamicQuantizeLinear produces, and leaves a node with FP16 and FP32 inputs).
MAX_REPAIRS = 64

# ONNX Runtime's type errors when it loads a graph: an op that does not take FP16 at all, or a node whose
# inputs are bound to two types ("Type parameter (T) of Optype (Add) bound to different types ... in node (/Add)").
_REFUSED_OP = re.compile(r"of operator \((\w+)\) in node")
_REFUSED_NODE = re.compile(r"Type Error: .* in node \((.*)\)\.?\s*$", re.DOTALL)


def _type_error(model: onnx.ModelProto) -> tuple[str | None, str | None] | None:
    """None where ONNX Runtime loads the graph, else what its type check refused: (op type that takes no FP16,
    None) or (None, the node with mixed inputs); (None, None) for any other refusal. Models over protobuf's
    limit are not checked here (the run check after the conversion still is)."""
    import onnxruntime as ort  # ONNX Runtime itself, not the reference executor: its type check's own messages

    if model.ByteSize() >= onnx_files.PROTOBUF_LIMIT:
        return None
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except ORT_ERRORS as exc:
        text = str(exc)
        if "Type Error" not in text:
            return None, None
        op = _REFUSED_OP.search(text)
        if op is not None and "is invalid" in text:
            return op.group(1), None
        node = _REFUSED_NODE.search(text)
        return None, node.group(1) if node is not None else None
    return None


@contextlib.contextmanager
def _quiet() -> Iterator[io.StringIO]:
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        yield sink


def outer_reads(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from the scopes around it (not its own inputs, initializers or node outputs),
    its nested subgraphs' included."""
    local = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    local |= {o for node in graph.node for o in node.output}
    reads: set[str] = set()
    for node in graph.node:
        reads |= {name for name in node.input if name}
        for sub in onnx_model.subgraphs(node):
            reads |= outer_reads(sub)
    reads |= {o.name for o in graph.output}
    return reads - local


def _rename_reads(graph: onnx.GraphProto, old: str, new: str) -> None:
    local = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    local |= {o for node in graph.node for o in node.output}
    if old in local:  # shadowed here: this scope's own value
        return
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name == old:
                node.input[index] = new
        for sub in onnx_model.subgraphs(node):
            _rename_reads(sub, old, new)
    for output in graph.output:
        if output.name == old:  # a subgraph passing an outer value straight through: an Identity reads it
            renamed = f"{old}_passed_fp32"
            graph.node.append(onnx.helper.make_node("Identity", [new], [renamed], name=f"{renamed}_identity"))
            output.name = renamed


def _float16_names(graph: onnx.GraphProto) -> set[str]:
    half = onnx.TensorProto.FLOAT16
    found = {v.name for v in (*graph.value_info, *graph.input, *graph.output) if v.type.tensor_type.elem_type == half}
    found |= {t.name for t in graph.initializer if t.data_type == half}
    for node in graph.node:
        if node.op_type == "Cast" and any(a.name == "to" and a.i == half for a in node.attribute):
            found.update(node.output)
        if node.op_type == "Constant" and any(a.name == "value" and a.t.data_type == half for a in node.attribute):
            found.update(node.output)
    return found


def feed_subgraphs_fp32(graph: onnx.GraphProto) -> None:
    """Give each control-flow node's subgraphs FP32 copies of the outer values they read that the conversion
    made FP16 (a Cast before the node), as the subgraphs themselves were kept in FP32."""
    half = _float16_names(graph)
    index = 0
    while index < len(graph.node):
        node = graph.node[index]
        if node.op_type not in CONTROL_FLOW:
            index += 1
            continue
        reads = set().union(*(outer_reads(sub) for sub in onnx_model.subgraphs(node))) & half
        for name in sorted(reads):
            copy = f"{name}_fp32_for_{node.name or node.op_type}"
            graph.node.insert(index, onnx.helper.make_node("Cast", [name], [copy], to=onnx.TensorProto.FLOAT,
                                                           name=f"{copy}_cast"))
            index += 1
            for sub in onnx_model.subgraphs(node):
                _rename_reads(sub, name, copy)
        index += 1
    _sort(graph)


def _sort(graph: onnx.GraphProto) -> None:
    """Nodes in an order where each comes after the producers of what it reads, the values its subgraphs read
    from this graph included (onnxconverter-common's sort sees only a node's own inputs, so it can put an If
    before the producer of a value its branches read)."""
    nodes = list(graph.node)
    producer = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    needs = []
    for node in nodes:
        reads = {name for name in node.input if name}
        for sub in onnx_model.subgraphs(node):
            reads |= outer_reads(sub)
        needs.append({producer[name] for name in reads if name in producer})
    done: list[int] = []
    placed: set[int] = set()
    while len(done) < len(nodes):
        ready = [i for i in range(len(nodes)) if i not in placed and needs[i] <= placed]
        if not ready:  # a cycle: leave the order as the converter wrote it
            return
        done.append(ready[0])
        placed.add(ready[0])
    ordered = [nodes[i] for i in done]
    del graph.node[:]
    graph.node.extend(ordered)
