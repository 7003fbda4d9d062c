"""graph_kind decides TF32 and the NHWC layout per graph in the build's accuracy run
(builder.runtimes.onnxruntime_cuda.graph_kind) and where Triton loads the model (the python runner's
_graph_kind, which the former calls). Both must give the same answer on every graph, including FP16 that
lives only in Constant nodes, graph inputs or value_info, Q/DQ or FP16 inside If/Loop bodies or local
functions, and weights in an external data file that is never read. The build writes its answer into the
config (parameter graph_kind) and the runner takes it from there, reading the graph only without one."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from google.protobuf import json_format
from onnx import TensorProto, helper, numpy_helper

from builder.repository import python_model
from builder.repository.triton_config import ConfigInputs, build, parse, to_text
from builder.runtimes.base import CompileTarget
from builder.runtimes.onnxruntime_cuda import (
    CudaLayout,
    CudaOptions,
    CudaTF32,
    OnnxRuntimeCUDA,
    cuda_backend_config,
    graph_kind,
)
from builder.spec import DimRange, ServingBackend, ServingSpec, TensorSpec

RUNNER: Any = python_model  # untyped: copied into model folders, where Triton imports it
F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _model(nodes: list[onnx.NodeProto], *, x_type: int = F32, y_type: int = F32,
           initializer: list[onnx.TensorProto] | None = None, value_info: list[onnx.ValueInfoProto] | None = None,
           functions: list[onnx.FunctionProto] | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", x_type, ["batch", 4])],
                              [helper.make_tensor_value_info("y", y_type, ["batch", 4])],
                              initializer=initializer or [], value_info=value_info or [])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("local", 1)] if functions else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=8, functions=functions or [])


def _w(dtype: Any, name: str = "w") -> onnx.TensorProto:
    return numpy_helper.from_array(np.arange(16, dtype=dtype).reshape(4, 4) / 16, name)


def _branch(nodes: list[onnx.NodeProto], out: str, dtype: int = F32) -> onnx.GraphProto:
    return helper.make_graph(nodes, "branch", [], [helper.make_tensor_value_info(out, dtype, ["batch", 4])])


def _cases() -> dict[str, tuple[onnx.ModelProto, str]]:
    """name → (model, the kind it must get)."""
    matmul = helper.make_node("MatMul", ["x", "w"], ["y"])
    f16_const = helper.make_node("Constant", [], ["wh"], value=numpy_helper.from_array(
        np.ones((4, 4), np.float16), "wh"))
    cases: dict[str, tuple[onnx.ModelProto, str]] = {
        "fp32": (_model([matmul], initializer=[_w(np.float32)]), "fp32"),
        "fp32 with a Constant": (_model([helper.make_node("Constant", [], ["w"], value=_w(np.float32)), matmul]),
                                 "fp32"),
        "fp16 initializer": (_model([helper.make_node("Cast", ["x"], ["xh"], to=F16),
                                     helper.make_node("MatMul", ["xh", "w"], ["yh"]),
                                     helper.make_node("Cast", ["yh"], ["y"], to=F32)],
                                    initializer=[_w(np.float16)]), "fp16"),
        "fp16 io, weights in a Constant": (_model([f16_const, helper.make_node("MatMul", ["x", "wh"], ["y"])],
                                                  x_type=F16, y_type=F16), "fp16"),
        "fp16 only in a Constant": (_model([f16_const, helper.make_node("Cast", ["wh"], ["w"], to=F32), matmul]),
                                    "fp16"),
        "fp16 only in value_info": (_model([helper.make_node("Identity", ["x"], ["t"]),
                                            helper.make_node("Identity", ["t"], ["y"])],
                                           value_info=[helper.make_tensor_value_info("t", F16, ["batch", 4])]),
                                    "fp16"),
        "fp16 ConstantOfShape": (_model([helper.make_node("Shape", ["x"], ["s"]),
                                         helper.make_node("ConstantOfShape", ["s"], ["h"], value=helper.make_tensor(
                                             "v", F16, [1], [1.0])),
                                         helper.make_node("CastLike", ["h", "x"], ["y"])]), "fp16"),
        "qdq": (_model([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
                        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])],
                       initializer=[numpy_helper.from_array(np.array(0.1, np.float32), "s"),
                                    numpy_helper.from_array(np.array(0, np.int8), "z")]), "qdq"),
        "qdq with fp16 too": (_model([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
                                      helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])],
                                     x_type=F16, y_type=F16,
                                     initializer=[numpy_helper.from_array(np.array(0.1, np.float16), "s"),
                                                  numpy_helper.from_array(np.array(0, np.int8), "z")]), "qdq"),
    }
    cond = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(True), "c"))
    qdq_then = _branch([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
                        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["t"])], "t")
    plain_else = _branch([helper.make_node("Identity", ["x"], ["e"])], "e")
    scales = [numpy_helper.from_array(np.array(0.1, np.float32), "s"),
              numpy_helper.from_array(np.array(0, np.int8), "z")]
    cases["qdq inside If"] = (_model([cond, helper.make_node("If", ["c"], ["y"], then_branch=qdq_then,
                                                             else_branch=plain_else)], initializer=scales), "qdq")
    f16_then = _branch([f16_const, helper.make_node("Cast", ["wh"], ["w2"], to=F32),
                        helper.make_node("MatMul", ["x", "w2"], ["t"])], "t")
    cases["fp16 Constant inside If"] = (_model([cond, helper.make_node("If", ["c"], ["y"], then_branch=f16_then,
                                                                       else_branch=plain_else)]), "fp16")
    body = helper.make_graph([helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                              helper.make_node("QuantizeLinear", ["acc", "s", "z"], ["q"]),
                              helper.make_node("DequantizeLinear", ["q", "s", "z"], ["acc_out"])], "body",
                             [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                              helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("acc", F32, ["batch", 4])],
                             [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("acc_out", F32, ["batch", 4])])
    trip = numpy_helper.from_array(np.array(2, np.int64), "n")
    cases["qdq inside Loop"] = (_model([helper.make_node("Loop", ["n", "", "x"], ["y"], body=body)],
                                       initializer=[trip, *scales]), "qdq")
    fn = helper.make_function("local", "Half", ["a"], ["b"],
                              [helper.make_node("Cast", ["a"], ["ah"], to=F16),
                               helper.make_node("Cast", ["ah"], ["b"], to=F32)],
                              [helper.make_opsetid("", 17)])
    cases["fp16 in a local function"] = (_model([helper.make_node("Half", ["x"], ["y"], domain="local")],
                                                functions=[fn]), "fp16")
    for dtype, name in ((F32, "fp32 conv"), (F16, "fp16 conv")):
        x = helper.make_tensor_value_info("x", F32, ["batch", 1, 4, 4])
        y = helper.make_tensor_value_info("y", F32, ["batch", 1, 4, 4])
        cast_in = [helper.make_node("Cast", ["x"], ["xc"], to=dtype)]
        weight = numpy_helper.from_array(np.ones((1, 1, 1, 1), np.float16 if dtype == F16 else np.float32), "k")
        nodes = [*cast_in, helper.make_node("Conv", ["xc", "k"], ["yc"]),
                 helper.make_node("Cast", ["yc"], ["y"], to=F32)]
        graph = helper.make_graph(nodes, "g", [x], [y], initializer=[weight])
        cases[name] = (helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
                       "fp16" if dtype == F16 else "fp32")
    return cases


CASES = _cases()
DECIDERS: dict[str, Callable[[Path], str]] = {"builder": graph_kind,
                                              "runner": lambda p: str(RUNNER._graph_kind(str(p)))}


@pytest.mark.parametrize("name", sorted(CASES))
def test_both_copies_give_each_graph_its_kind(tmp_path: Path, name: str) -> None:
    model, want = CASES[name]
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    got = {who: decide(path) for who, decide in DECIDERS.items()}
    assert got == {"builder": want, "runner": want}, name


@pytest.mark.parametrize("name", ["fp32", "fp16 initializer", "qdq", "fp16 io, weights in a Constant"])
def test_external_data_is_never_read(tmp_path: Path, name: str) -> None:
    """A model over 2 GB keeps its weights beside it: the kind comes from the graph alone (the data file is
    deleted before asking, so reading it would fail)."""
    model, want = CASES[name]
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=0, convert_attribute=True)
    (tmp_path / "model.onnx.data").unlink()
    assert {who: decide(path) for who, decide in DECIDERS.items()} == {"builder": want, "runner": want}


def _effective(options: dict[str, str]) -> tuple[bool, bool]:
    """(NHWC, TF32) as ONNX Runtime runs these provider options (its defaults: NCHW, TF32 on)."""
    return options.get("prefer_nhwc", "0") == "1", options.get("use_tf32", "1") != "0"


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_accuracy_run_and_the_runner_resolve_auto_alike(tmp_path: Path, name: str) -> None:
    """Every --cuda-layout x --cuda-tf32 setting: the provider options of the build's accuracy run and those the
    runner derives from the config's parameters (as make_runner does) run the same math and layout."""
    path = tmp_path / "model.onnx"
    onnx.save(CASES[name][0], str(path))
    for layout, tf32 in itertools.product(CudaLayout, CudaTF32):
        options = CudaOptions(layout=layout, tf32=tf32)
        params = dict(cuda_backend_config(ServingBackend.PYTHON, options).parameters)
        served = RUNNER._resolve_auto(str(path), {k: params[k] for k in RUNNER.PROVIDER_PASSTHROUGH if params.get(k)})
        assert _effective(served) == _effective(options.provider_options(path)), (name, layout, tf32)


def test_auto_takes_nhwc_only_where_convolutions_run_on_tensor_cores(tmp_path: Path) -> None:
    """H200, batch 64: NHWC ran FP16 1.20x and FP32 with TF32 1.26x, but FP32 without TF32 (auto's FP32 math)
    0.95x at 9 % more J and the Q/DQ graph 0.52x: auto's (NHWC, TF32) per kind, and with TF32 asked for. A
    graph with no convolution (MiniLM FP16: served 0.25x in NHWC, 50 host-device copies added) stays NCHW."""
    got: dict[str, tuple[bool, bool]] = {}
    for name in ("fp32 conv", "fp16 conv", "qdq", "fp32", "fp16 initializer"):
        path = tmp_path / f"{len(got)}.onnx"
        onnx.save(CASES[name][0], str(path))
        got[name] = _effective(CudaOptions().provider_options(path))
        got[name + ", tf32 on"] = _effective(CudaOptions(tf32=CudaTF32.ON).provider_options(path))
    assert got == {"fp32 conv": (False, False), "fp32 conv, tf32 on": (True, True),
                   "fp16 conv": (True, True), "fp16 conv, tf32 on": (True, True),
                   "qdq": (False, True), "qdq, tf32 on": (False, True),
                   "fp32": (False, False), "fp32, tf32 on": (False, True),
                   "fp16 initializer": (False, True), "fp16 initializer, tf32 on": (False, True)}


# The build hands its answer to the runner (config parameter graph_kind), so a model that loads does not parse
# its graph again; a repository built before the parameter existed still loads, the runner reading the graph.

KINDS = {"fp32": "fp32", "fp16 initializer": "fp16", "qdq": "qdq", "fp16 conv": "fp16"}


class Stop(Exception):
    """Raised by the stand-in for the CUDA runner, whose construction needs a GPU."""


def _version(tmp_path: Path, name: str) -> Path:
    """A model version folder holding the case's graph as model.onnx."""
    version = tmp_path / "1"
    version.mkdir(exist_ok=True)
    onnx.save(CASES[name][0], str(version / "model.onnx"))
    return version


def _built_config(version: Path, options: CudaOptions,
                  serving: ServingBackend = ServingBackend.PYTHON) -> dict[str, Any]:
    """The config the build writes for the artifact in `version`, as JSON (what Triton gives the runner)."""
    runtime = object.__new__(OnnxRuntimeCUDA)  # the constructor wants a GPU; backend_config only reads the graph
    runtime.options, runtime.serving_backend = options, serving
    x, y = TensorSpec("x", "float32", (-1, 4)), TensorSpec("y", "float32", (-1, 4))
    target = CompileTarget(inputs=(x,), batch=DimRange(1, 4, 8), dims={}, onnx_sha256="0" * 64)
    config = build(ConfigInputs(name="m", inputs=(x,), outputs=(y,), batch=DimRange(1, 4, 8), serving=ServingSpec(),
                                backend=runtime.backend_config(target, version)))
    doc: dict[str, Any] = json_format.MessageToDict(parse(to_text(config)), preserving_proto_field_name=True)
    return doc


def _served(monkeypatch: pytest.MonkeyPatch, version: Path, config: dict[str, Any]) -> dict[str, str]:
    """The CUDA provider options the runner's initialize() asks for, loading `config` from `version`."""
    seen: list[dict[str, str]] = []

    def bucket_runner(path: str, *, provider_options: dict[str, str], **kwargs: object) -> None:
        seen.append(dict(provider_options))
        raise Stop

    monkeypatch.setattr(RUNNER, "CudaBucketRunner", bucket_runner)
    with pytest.raises(Stop):
        RUNNER.TritonPythonModel().initialize({
            "model_config": json.dumps(config), "model_repository": str(version.parent),
            "model_version": version.name, "model_name": "m", "model_instance_kind": "GPU",
            "model_instance_device_id": "0"})
    return seen[0]


def _no_analysis(path: str) -> tuple[str, bool]:
    raise AssertionError(f"the runner read the graph {path}")


@pytest.mark.parametrize("name", sorted(KINDS))
def test_the_config_carries_the_graphs_kind(tmp_path: Path, name: str) -> None:
    version = _version(tmp_path, name)
    params = {k: v["string_value"] for k, v in _built_config(version, CudaOptions())["parameters"].items()}
    assert params["graph_kind"] == KINDS[name] and params["graph_kind"] in RUNNER.GRAPH_KINDS
    native = _built_config(version, CudaOptions(layout=CudaLayout.NCHW, tf32=CudaTF32.ON), ServingBackend.ONNXRUNTIME)
    assert "graph_kind" not in native.get("parameters", {})  # no runner there to hand it to


@pytest.mark.parametrize("name", sorted(KINDS))
def test_the_runner_takes_the_kind_from_the_config_and_reads_no_graph(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    version = _version(tmp_path, name)
    for layout, tf32 in itertools.product(CudaLayout, CudaTF32):
        options = CudaOptions(layout=layout, tf32=tf32)
        config = _built_config(version, options)
        accuracy_run = options.provider_options(version / "model.onnx")
        with monkeypatch.context() as patch:
            patch.setattr(RUNNER, "_graph_facts", _no_analysis)
            served = _served(patch, version, config)
        assert _effective(served) == _effective(accuracy_run), (name, layout, tf32)


def _count_graph_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths the runner's graph analysis (kind and convolutions, one parse) reads from now on, in order."""
    read: list[str] = []
    analysis = RUNNER._graph_facts

    def counted(path: str) -> tuple[str, bool]:
        read.append(path)
        kind, convolutions = analysis(path)
        return str(kind), bool(convolutions)

    monkeypatch.setattr(RUNNER, "_graph_facts", counted)
    return read


@pytest.mark.parametrize("value", [None, "int4"])
def test_without_a_known_kind_in_the_config_the_runner_reads_the_graph(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    """None: a repository built before the parameter existed; int4: a value this runner does not know."""
    version = _version(tmp_path, "fp16 conv")
    config = _built_config(version, CudaOptions())
    del config["parameters"]["graph_kind"]
    if value is not None:
        config["parameters"]["graph_kind"] = {"string_value": value}
    read = _count_graph_reads(monkeypatch)
    served = _served(monkeypatch, version, config)
    assert read == [str(version / "model.onnx")]  # once, though use_tf32 and prefer_nhwc both asked
    assert _effective(served) == (True, True)  # FP16: NHWC on tensor cores, as the build decided


def test_the_build_reads_each_artifact_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The accuracy run, the config and build.json ask about the same file: one analysis; a rewritten file
    is analysed again."""
    read = _count_graph_reads(monkeypatch)
    version = _version(tmp_path, "fp32")
    config = _built_config(version, CudaOptions())
    CudaOptions().provider_options(version / "model.onnx")
    assert config["parameters"]["graph_kind"]["string_value"] == graph_kind(version / "model.onnx") == "fp32"
    assert len(read) == 1
    onnx.save(CASES["qdq"][0], str(version / "model.onnx"))
    assert graph_kind(version / "model.onnx") == "qdq" and len(read) == 2


@pytest.mark.parametrize("name", ["fp16 conv", "fp16 initializer"])
def test_the_config_says_whether_the_graph_has_convolutions_and_an_older_one_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The build writes graph_convolutions; a config from before it (none) has the runner read the graph, and
    both give the accuracy run's layout: NHWC for the FP16 convolution, NCHW for the FP16 MatMul."""
    version = _version(tmp_path, name)
    config = _built_config(version, CudaOptions())
    convs = name == "fp16 conv"
    assert config["parameters"]["graph_convolutions"]["string_value"] == ("1" if convs else "0")
    del config["parameters"]["graph_convolutions"]
    read = _count_graph_reads(monkeypatch)
    served = _served(monkeypatch, version, config)
    assert read == [str(version / "model.onnx")]
    assert _effective(served) == _effective(CudaOptions().provider_options(version / "model.onnx")) == (convs, True)
    # Neither parameter (a repository built before both): kind and convolutions from one parse.
    del config["parameters"]["graph_kind"]
    read.clear()
    assert _effective(_served(monkeypatch, version, config)) == (convs, True)
    assert read == [str(version / "model.onnx")]
