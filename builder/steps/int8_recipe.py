"""Which INT8 recipe a model gets, from its graph and the runtime that serves it, and the graph rewrites the
ONNX Runtime recipes need.

ONNX Runtime on the CPU runs Q/DQ placements made for TensorRT mostly unfused, so an INT8 variant there is
often slower than FP32 (DESIGN.md). Measured on this project's CPU (bench/int8_recipes.py): transformer
encoders run fastest and closest to FP32 with dynamic quantization (weights int8 per channel, activations
quantized at run time: MatMulInteger / DynamicQuantizeMatMul); CNNs with ONNX Runtime's static per-channel
U8S8 Q/DQ on its default op types, depthwise convolutions included (the explicit `onnxruntime` recipe): faster
than Conv/MatMul/Gemm alone with the depthwise Conv in float on three of six CNNs by a wide margin (2.2x FP32
against 0.8x on EfficientNet-Lite0), level on two, slower on one; it is less accurate, and where it misses the
tolerance (a file-type classifier) the guard keeps the nodes it needs (docs/results/int8_recipes.md). Other
graphs keep ModelOpt's recipe: no faster one was measured for them. TensorRT (and
ONNX Runtime on a GPU, whose TensorRT provider builds the same graph) needs static symmetric Q/DQ.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from builder.errors import ManifestError
from builder.spec.enums import Int8Recipe
from builder.spec.model import CalibrationSpec
from builder.steps import onnx_model
from common.choices import Choice

log = logging.getLogger(__name__)

# The runtime name (Runtime.name) of ONNX Runtime on the CPU: the only one the ONNX Runtime forms are chosen for.
CPU_RUNTIME = "onnxruntime"

_CONV_OPS = frozenset({"Conv", "ConvTranspose"})
_MATMUL_OPS = frozenset({"MatMul", "Gemm", "Einsum", "FusedMatMul"})
_ATTENTION_OPS = frozenset({"Attention", "MultiHeadAttention", "GroupQueryAttention", "QAttention"})
# Ops a weight passes through between its initializer and the compute op (layout changes, a cast, a dequantize).
_WEIGHT_PATH = frozenset({"Transpose", "Reshape", "Cast", "Identity", "Unsqueeze", "Squeeze", "Flatten",
                          "DequantizeLinear"})
# What dynamic quantization quantizes (Gemm is rewritten to MatMul first: ONNX Runtime's dynamic quantizer
# has no Gemm).
TRANSFORMER_OP_TYPES = ("MatMul", "Gemm")


class ModelClass(Choice):
    TRANSFORMER = "transformer"  # MatMul/Gemm weights dominate, and activation x activation MatMuls feed a Softmax
    CNN = "cnn"  # Conv weights dominate
    OTHER = "other"


@dataclass(frozen=True)
class Census:
    """What the class is decided from: op counts and the weight elements each family of compute ops holds."""

    ops: dict[str, int]
    conv_weights: int  # elements of the constant weights of Conv/ConvTranspose
    matmul_weights: int  # of MatMul/Gemm/Einsum/FusedMatMul
    attention_matmuls: int  # MatMul/Einsum/FusedMatMul with no constant input (Q x K^T, scores x V)
    attention_ops: int  # fused attention ops (com.microsoft)

    def record(self) -> dict[str, int]:
        counts = {op: self.ops.get(op, 0) for op in sorted(_CONV_OPS | _MATMUL_OPS | {"Softmax"}) if self.ops.get(op)}
        return {**counts, "conv_weights": self.conv_weights, "matmul_weights": self.matmul_weights,
                "attention_matmuls": self.attention_matmuls, "attention_ops": self.attention_ops}


def _constant_sizes(model: onnx.ModelProto) -> dict[str, int]:
    """Elements of every constant tensor (initializers and Constant nodes, subgraphs included), by name."""
    sizes: dict[str, int] = {}
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        for init in graph.initializer:
            sizes[init.name] = int(np.prod(init.dims, dtype=np.int64))
        for node in graph.node:
            if node.op_type == "Constant" and node.output:
                for attr in node.attribute:
                    if attr.name == "value":
                        sizes[node.output[0]] = int(np.prod(attr.t.dims, dtype=np.int64))
            graphs.extend(onnx_model.subgraphs(node))
    return sizes


def census(model: onnx.ModelProto) -> Census:
    nodes = list(onnx_model.all_nodes(model.graph))
    sizes = _constant_sizes(model)
    producers = {out: node for node in nodes for out in node.output if out}

    def weight(tensor: str) -> int:
        """Elements of the constant behind `tensor` (through layout ops and a dequantize); 0 for an activation."""
        for _ in range(8):
            if tensor in sizes:
                return sizes[tensor]
            node = producers.get(tensor)
            if node is None or node.op_type not in _WEIGHT_PATH or not node.input:
                return 0
            tensor = node.input[0]
        return 0

    conv = matmul = attention_matmuls = 0
    for node in nodes:
        found = [weight(t) for t in node.input if t]
        if node.op_type in _CONV_OPS:
            conv += found[1] if len(found) > 1 else 0
        elif node.op_type in _MATMUL_OPS:
            matmul += sum(found[:2])  # not a Gemm's bias
            if node.op_type != "Gemm" and not any(found):
                attention_matmuls += 1
    ops = Counter(node.op_type for node in nodes)
    return Census(dict(ops), conv, matmul, attention_matmuls, sum(ops[op] for op in _ATTENTION_OPS))


def classify(found: Census) -> tuple[ModelClass, str]:
    """The model's class and why, in words."""
    attention = found.attention_ops > 0 or (found.attention_matmuls > 0 and found.ops.get("Softmax", 0) > 0)
    weights = f"{found.matmul_weights:,} MatMul/Gemm vs {found.conv_weights:,} Conv weight elements"
    if attention and found.matmul_weights > 0 and found.matmul_weights >= found.conv_weights:
        how = (f"{found.attention_ops} fused attention ops" if found.attention_ops else
               f"{found.attention_matmuls} activation x activation MatMuls, {found.ops.get('Softmax', 0)} Softmax")
        return ModelClass.TRANSFORMER, f"transformer encoder ({how}; {weights})"
    if found.conv_weights > found.matmul_weights:
        return ModelClass.CNN, f"CNN ({sum(found.ops.get(op, 0) for op in _CONV_OPS)} Conv; {weights})"
    no_attention = "" if attention else ", no attention"
    return ModelClass.OTHER, f"neither a transformer encoder nor a CNN ({weights}{no_attention})"


@dataclass(frozen=True)
class RecipeChoice:
    """The INT8 recipe a model gets and why; `chosen`: picked by class (recipe "auto"), not as asked."""

    requested: Int8Recipe
    recipe: Int8Recipe
    model_class: ModelClass
    why: str
    chosen: bool
    runtime: str
    census: Census

    def record(self) -> dict[str, object]:
        """As build.json's precision_settings and the build key hold it."""
        return {"requested": self.requested.value, "recipe": self.recipe.value, "class": self.model_class.value,
                "why": self.why, "runtime": self.runtime, "graph": self.census.record()}

    def line(self) -> str:
        return f"INT8 recipe {self.recipe} ({'chosen: ' if self.chosen else ''}{self.why})"


def choose(model: onnx.ModelProto, requested: Int8Recipe, runtime: str) -> RecipeChoice:
    """The recipe for `model` served by `runtime` (a Runtime.name): as asked, or for "auto" by runtime and class.
    Dynamic quantization only runs on ONNX Runtime on the CPU (TensorRT builds no DynamicQuantizeLinear)."""
    requested = Int8Recipe.parse(requested, "calibration.recipe", error=ManifestError)
    found = census(model)
    model_class, described = classify(found)
    cpu = runtime == CPU_RUNTIME
    if requested is not Int8Recipe.AUTO:
        if requested is Int8Recipe.ONNXRUNTIME_DYNAMIC and not cpu:
            raise ManifestError(f"calibration.recipe {requested.value!r}: runs on ONNX Runtime on the CPU only "
                                f"(this build runs on {runtime}, which needs static Q/DQ)")
        return RecipeChoice(requested, requested, model_class, f"as asked; {described}", False, runtime, found)
    if not cpu:
        return RecipeChoice(requested, Int8Recipe.MODELOPT, model_class,
                            f"{runtime} builds static symmetric Q/DQ; {described}", True, runtime, found)
    if model_class is ModelClass.TRANSFORMER:
        recipe, why = Int8Recipe.ONNXRUNTIME_DYNAMIC, "dynamic quantization of MatMul/Gemm runs fastest on ORT CPU"
    elif model_class is ModelClass.CNN:
        recipe, why = Int8Recipe.ONNXRUNTIME, "static per-channel U8S8 Q/DQ runs fastest on ORT CPU"
    else:
        recipe, why = Int8Recipe.MODELOPT, "no faster recipe measured for this class"
    return RecipeChoice(requested, recipe, model_class, f"{described}: {why}", True, runtime, found)


def choose_for(path: Path, requested: Int8Recipe, runtime: str) -> RecipeChoice:
    return choose(onnx.load(str(path), load_external_data=False), requested, runtime)


def apply(choice: RecipeChoice, spec: CalibrationSpec) -> CalibrationSpec:
    """The calibration settings the chosen recipe runs with: the recipe, and for chosen dynamic quantization its
    op types (unless the spec names its own). A chosen static ONNX Runtime recipe is the explicit one's."""
    spec = replace(spec, recipe=choice.recipe)
    if not choice.chosen:
        return spec
    if choice.recipe is Int8Recipe.ONNXRUNTIME_DYNAMIC and not spec.op_types_to_quantize:
        return replace(spec, op_types_to_quantize=TRANSFORMER_OP_TYPES)
    return spec


# --- graph rewrites for ONNX Runtime's quantizers (exact: the outputs do not change) -------------------------------

def _attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def flatten_gemm_bias(model: onnx.ModelProto) -> int:
    """Gemm biases of shape [1, N] made [N] (the same broadcast): ONNX Runtime 1.31's static quantizer fails on
    a 2-D bias with per-channel weights ("The truth value of an array ... is ambiguous"). Returns how many."""
    inits = {init.name: init for init in model.graph.initializer}
    uses = Counter(name for node in onnx_model.all_nodes(model.graph) for name in node.input)
    changed = 0
    for node in model.graph.node:
        if node.op_type != "Gemm" or len(node.input) < 3 or node.input[2] not in inits:
            continue
        bias = inits[node.input[2]]
        if len(bias.dims) != 2 or bias.dims[0] != 1:
            continue
        values = numpy_helper.to_array(bias).reshape(-1)
        if uses[bias.name] == 1:
            bias.CopyFrom(numpy_helper.from_array(values, bias.name))
        else:
            flat = numpy_helper.from_array(values, f"{bias.name}_flat")
            model.graph.initializer.append(flat)
            node.input[2] = flat.name
        changed += 1
    return changed


def gemm_as_matmul(model: onnx.ModelProto) -> int:
    """Each Gemm of the main graph with a constant B (no transA, alpha = beta = 1) rewritten as MatMul (+ Add of
    its bias): ONNX Runtime's dynamic quantizer quantizes MatMul, not Gemm. The MatMul keeps the Gemm's name (so
    nodes named for exclusion still match) and the Add writes the Gemm's output. Returns how many."""
    inits = {init.name: init for init in model.graph.initializer}
    uses = Counter(name for node in onnx_model.all_nodes(model.graph) for name in node.input)
    nodes: list[onnx.NodeProto] = []
    changed = 0
    for node in model.graph.node:
        attrs = _attrs(node)
        if (node.op_type != "Gemm" or node.input[1] not in inits or attrs.get("transA", 0)
                or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0):
            nodes.append(node)
            continue
        weight = inits[node.input[1]]
        name = node.input[1]
        if attrs.get("transB", 0):
            transposed = numpy_helper.to_array(weight).T.copy()
            if uses[weight.name] == 1:
                weight.CopyFrom(numpy_helper.from_array(transposed, weight.name))
            else:
                name = f"{weight.name}_transposed"
                model.graph.initializer.append(numpy_helper.from_array(transposed, name))
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        product = f"{node.output[0]}_matmul" if bias else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], name], [product], name=node.name))
        if bias:
            nodes.append(helper.make_node("Add", [product, bias], [node.output[0]],
                                          name=f"{node.name}_bias" if node.name else ""))
        changed += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return changed
