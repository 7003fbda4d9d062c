"""ONNX Runtime CUDA: chosen by name or by auto only where onnxruntime-gpu and a GPU exist (one clear line
otherwise), GPU configs for both serving backends, and the python runner's bucket logic; the `gpu` tests
run the runner on the device and show that changing batch sizes no longer stalls it."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from builder.errors import RuntimeUnavailableError
from builder.repository import python_model
from builder.repository.triton_config import ConfigInputs, InstanceKind, TritonBackend, build, parse, to_text
from builder.runtimes import OnnxRuntimeCPU, select, tensorrt_available
from builder.runtimes.onnxruntime_cuda import (
    GPU_RUNNER_INSTANCES,
    CudaOptions,
    CudnnSearch,
    OnnxRuntimeCUDA,
    cuda_available,
    cuda_backend_config,
    cuda_unavailable_reason,
)
from builder.spec import DimRange, RuntimeChoice, ServingBackend, ServingSpec, TensorSpec
from tests.helpers.tiny_models import mlp_onnx, mlp_samples, sequence_onnx

RUNNER: Any = python_model  # untyped: copied into model folders, where Triton imports it
needs_cuda = pytest.mark.skipif(not cuda_available(), reason=f"ONNX Runtime CUDA unusable: {cuda_unavailable_reason()}")


def conv_onnx(path: Path, seed: int = 0) -> Path:
    """x[batch, 3, 32, 32] → Conv → Relu → Conv → GlobalAveragePool → Flatten → y[batch, 8]."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((16, 3, 3, 3)) * 0.2).astype(np.float32)
    w2 = (rng.standard_normal((8, 16, 3, 3)) * 0.1).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c2"], ["p"]),
             helper.make_node("Flatten", ["p"], ["y"])]
    graph = helper.make_graph(nodes, "conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 32, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
                              initializer=[numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


@pytest.mark.skipif(cuda_available(), reason="onnxruntime-gpu and a GPU are here")
def test_asked_by_name_without_a_usable_cuda_provider_is_one_clear_line() -> None:
    with pytest.raises(RuntimeUnavailableError) as info:
        select(RuntimeChoice.ONNXRUNTIME_CUDA)
    message = str(info.value)
    assert "\n" not in message and message.startswith("--runtime onnxruntime-cuda: ")
    assert "CUDA provider" in message or "GPU" in message


@pytest.mark.skipif(cuda_available() or tensorrt_available(), reason="a GPU runtime is usable here")
def test_auto_takes_the_cpu_where_no_gpu_runtime_is_usable() -> None:
    assert isinstance(select(RuntimeChoice.AUTO), OnnxRuntimeCPU)
    assert select("auto", serving_backend="onnxruntime").name == "onnxruntime"  # type: ignore[arg-type]


def test_options_name_the_flag_and_record_the_provider() -> None:
    with pytest.raises(RuntimeUnavailableError, match="--cudnn-conv-algo-search 'FAST': expected one of"):
        CudaOptions(cudnn_conv_algo_search="FAST")  # type: ignore[arg-type]
    options = CudaOptions(cudnn_conv_algo_search="HEURISTIC", cuda_graphs=False)  # type: ignore[arg-type]
    assert options.cudnn_conv_algo_search is CudnnSearch.HEURISTIC
    assert options.record() == {"provider": "CUDAExecutionProvider", "device_id": "0", "layout": "auto", "tf32": "auto",
                                "cudnn_conv_algo_search": "HEURISTIC", "cuda_graphs": "false", "tensorrt_fp16": "false"}
    with pytest.raises(RuntimeUnavailableError, match="--cuda-layout 'nhcw': expected one of auto, nhwc, nchw"):
        CudaOptions(layout="nhcw")  # type: ignore[arg-type]
    # Triton's onnxruntime backend numbers the modes: 0 EXHAUSTIVE, 1 HEURISTIC, 2 DEFAULT.
    assert [m.triton_code for m in CudnnSearch] == ["0", "1", "2"]


def _config_text(serving: ServingBackend, options: CudaOptions) -> str:
    config = build(ConfigInputs(
        name="m", inputs=(TensorSpec("x", "float32", (-1, 4, 32)),),
        outputs=(TensorSpec("logits", "float32", (-1, 16)),),
        batch=DimRange(1, 8, 16), serving=ServingSpec(), backend=cuda_backend_config(serving, options)))
    return to_text(config)


def test_python_runner_config_runs_on_a_gpu_instance_with_the_cuda_provider() -> None:
    config = parse(_config_text(ServingBackend.PYTHON, CudaOptions(device_id=0)))
    assert config.backend == "python" and [g.kind for g in config.instance_group] == [1]  # KIND_GPU
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["provider"] == "cuda" and params["cudnn_conv_algo_search"] == "HEURISTIC"
    assert params["cuda_graphs"] == "1" and params["onnx_file"] == "model.onnx"
    assert params["FORCE_CPU_ONLY_INPUT_TENSORS"] == "no"  # CUDA shared-memory inputs stay on the device
    assert params["prefer_nhwc"] == "auto" and params["use_tf32"] == "auto"  # resolved per graph at load
    assert not config.optimization.execution_accelerators.gpu_execution_accelerator


@pytest.mark.parametrize(("backend", "named", "count"), [
    (ServingBackend.PYTHON, None, GPU_RUNNER_INSTANCES), (ServingBackend.PYTHON, 1, 1), (ServingBackend.PYTHON, 3, 3),
    (ServingBackend.ONNXRUNTIME, None, 1)])
def test_the_python_runner_on_cuda_defaults_to_several_instances_per_gpu(
        backend: ServingBackend, named: int | None, count: int) -> None:
    # One runner instance serializes each batch's Python work with its GPU run (0.31x of the in-process ceiling
    # at concurrency 256 on an H100; 4 instances 0.61x): where models.toml names no count, the python runner on
    # CUDA gets 4 per GPU; a named count, and the native backend's default, stay as they are.
    config = build(ConfigInputs(
        name="m", inputs=(TensorSpec("x", "float32", (-1, 4, 32)),),
        outputs=(TensorSpec("logits", "float32", (-1, 16)),), batch=DimRange(1, 8, 16),
        serving=ServingSpec(instances=named),
        backend=cuda_backend_config(backend, CudaOptions(device_id=0))))
    assert GPU_RUNNER_INSTANCES == 4 and [g.count for g in config.instance_group] == [count]


@pytest.mark.parametrize("tensorrt_fp16", [False, True])
def test_native_onnxruntime_config_for_the_ngc_image(tensorrt_fp16: bool) -> None:
    text = _config_text(ServingBackend.ONNXRUNTIME, CudaOptions(
        cudnn_conv_algo_search=CudnnSearch.HEURISTIC, tensorrt_fp16=tensorrt_fp16))
    config = parse(text)
    assert config.platform == "onnxruntime_onnx" and config.instance_group[0].kind == 1  # KIND_GPU
    assert config.parameters["cudnn_conv_algo_search"].string_value == "1"
    accelerators = config.optimization.execution_accelerators.gpu_execution_accelerator
    if tensorrt_fp16:
        assert [a.name for a in accelerators] == ["tensorrt"]
        assert accelerators[0].parameters["precision_mode"] == "FP16"
    else:
        assert not accelerators
    assert InstanceKind.GPU.value in text and TritonBackend.ONNXRUNTIME.value in text


def test_buckets_cover_every_batch_with_under_half_padding() -> None:
    for max_batch in (1, 2, 5, 16, 64, 100):
        sizes = python_model.buckets(max_batch)  # type: ignore[no-untyped-call]
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch
        for rows in range(1, max_batch + 1):
            bucket = next(s for s in sizes if s >= rows)
            assert bucket < 2 * rows or bucket == 1


def test_fine_buckets_never_pad_more_than_pow2_and_stay_few() -> None:
    for max_batch in (*range(1, 200), 255, 256, 257, 1000, 2048):
        fine = python_model.buckets(max_batch, fine=True)  # type: ignore[no-untyped-call]
        pow2 = python_model.buckets(max_batch)  # type: ignore[no-untyped-call]
        assert fine == sorted(set(fine)) and fine[-1] == max_batch and len(fine) <= 16
        for rows in range(1, max_batch + 1):
            assert next(s for s in fine if s >= rows) <= next(s for s in pow2 if s >= rows), (max_batch, rows)
    assert python_model.buckets(16, fine=True) == python_model.buckets(16)  # type: ignore[no-untyped-call]
    assert python_model.buckets(64, fine=True) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]  # type: ignore[no-untyped-call]
    assert python_model.buckets(96, fine=True) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96]  # type: ignore[no-untyped-call]
    assert python_model.parse_buckets("fine", 64) == python_model.buckets(64, fine=True)  # type: ignore[no-untyped-call]


def test_make_runner_takes_the_batch_buckets_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[dict[str, Any]] = []
    monkeypatch.setattr(RUNNER, "CudaBucketRunner", lambda path, **kw: made.append(kw) or kw)
    monkeypatch.setattr(RUNNER, "_resolve_auto", lambda path, options, kind=None, convolutions=None: options)
    RUNNER.make_runner("m.onnx", {"provider": "cuda", "batch_buckets": "fine"}, 64)
    RUNNER.make_runner("m.onnx", {"provider": "cuda"}, 64)
    assert [kw["sizes"] for kw in made] == [python_model.buckets(64, fine=True),  # type: ignore[no-untyped-call]
                                            python_model.buckets(64)]  # type: ignore[no-untyped-call]
    with pytest.raises(ValueError, match=re.escape("parameter batch_buckets 'fin': 'fin' is not a whole number")):
        RUNNER.make_runner("m.onnx", {"provider": "cuda", "batch_buckets": "fin"}, 64)


def test_batch_buckets_parameter_names_sizes_and_always_covers_max_batch() -> None:
    parse = python_model.parse_buckets
    assert parse("", 64) == parse("auto", 64) == parse("pow2", 64) == python_model.buckets(64)  # type: ignore[no-untyped-call]
    assert parse(" 8, 1,24,8 ", 32) == [1, 8, 24, 32]  # sorted, once each, max_batch added
    for text, said in (("0,4", "0 is outside 1..max_batch_size (16)"), ("4,17", "17 is outside"),
                       ("4,x", "'x' is not a whole number")):
        with pytest.raises(ValueError, match=re.escape(said)):
            parse(text, 16)


def test_cpu_runner_is_todays_session(tmp_path: Path) -> None:
    path = mlp_onnx(tmp_path / "model.onnx")
    samples = mlp_samples(5, seed=2)
    runner = RUNNER.make_runner(str(path), {"intra_op_threads": "1"}, 16)
    assert runner.describe() == {"provider": "cpu"}
    direct = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["logits"], samples)[0]
    np.testing.assert_allclose(runner.run(samples)[0], direct, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="parameter provider 'rocm': expected cpu or cuda"):
        RUNNER.make_runner(str(path), {"provider": "rocm"}, 16)


@pytest.mark.gpu
@needs_cuda
def test_bucket_runner_matches_the_cpu_and_does_not_stall_when_batch_sizes_change(tmp_path: Path) -> None:
    path = conv_onnx(tmp_path / "conv.onnx")
    runner = RUNNER.CudaBucketRunner(str(path), max_batch=16, provider_options={"cudnn_conv_algo_search": "EXHAUSTIVE"})
    assert runner.sizes == [1, 2, 4, 8, 16]
    cpu = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    seconds = []
    for rows in (3, 16, 1, 9, 5, 16, 2, 13, 40):  # 40: more than the largest bucket, run in chunks
        x = rng.standard_normal((rows, 3, 32, 32), dtype=np.float32)
        start = time.perf_counter()
        (y,) = runner.run({"x": x})
        seconds.append(time.perf_counter() - start)
        assert y.shape == (rows, 8)
        np.testing.assert_allclose(y, cpu.run(["y"], {"x": x})[0], rtol=1e-3, atol=1e-4)
    # Every shape was prepared at load: no run pays a cuDNN rebuild (a one-session shape change does).
    assert max(seconds) < 0.25, seconds


@pytest.mark.gpu
@needs_cuda
def test_the_runtime_runs_padded_batches_like_the_cpu(tmp_path: Path) -> None:
    path = conv_onnx(tmp_path / "conv.onnx")
    samples = {"x": np.random.default_rng(1).standard_normal((10, 3, 32, 32), dtype=np.float32)}
    runtime = select(RuntimeChoice.ONNXRUNTIME_CUDA)
    assert isinstance(runtime, OnnxRuntimeCUDA)
    identity = runtime.identity()
    assert identity["provider"] == "CUDAExecutionProvider" and identity["gpu"]
    got = runtime.run(path, samples, 4)["y"]  # batches 4, 4 and 2 padded to 4
    want = OnnxRuntimeCPU().run(path, samples, 4)["y"]
    assert got.shape == (10, 8)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    assert select(RuntimeChoice.AUTO).name in ("onnxruntime-cuda", "tensorrt")


def test_a_model_whose_other_dims_vary_gets_one_cuda_session_not_a_failed_load(tmp_path: Path) -> None:
    """A sequence length that varies (MiniLM's) leaves no one shape per bucket to preallocate: the runner
    falls back to one session and says why, instead of failing the model's load. (Without a GPU the
    session runs on ONNX Runtime's CPU fallback; the choice of runner is the same.)"""
    path = sequence_onnx(tmp_path / "model.onnx")
    runner = RUNNER.make_runner(str(path), {"provider": "cuda"}, 8)
    described = runner.describe()
    # Without a GPU its one session runs on the CPU, and says so.
    assert described["provider"] == ("cuda" if cuda_available() else "cpu (the CUDA provider did not start)")
    assert described["buckets"] is None
    assert "input ids has dynamic non-batch dims" in described["buckets_off_reason"]
    ids = np.random.default_rng(0).integers(0, 50, size=(3, 7), dtype=np.int64)
    direct = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["out"], {"ids": ids})[0]
    np.testing.assert_allclose(runner.run_many([{"ids": ids[:1]}, {"ids": ids[1:]}])[0], direct, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(cuda_available(), reason="onnxruntime-gpu and a GPU are here")
def test_tensorrt_fp16_on_another_runtime_is_one_line_not_silently_dropped() -> None:
    with pytest.raises(RuntimeUnavailableError, match=r"--ort-tensorrt-fp16: needs --runtime onnxruntime-cuda"):
        select(RuntimeChoice.AUTO, serving_backend=ServingBackend.ONNXRUNTIME,
               cuda_options=CudaOptions(tensorrt_fp16=True))
    with pytest.raises(RuntimeUnavailableError, match=r"on onnxruntime\)"):
        select(RuntimeChoice.ONNXRUNTIME, cuda_options=CudaOptions(tensorrt_fp16=True))
    assert isinstance(select(RuntimeChoice.ONNXRUNTIME, cuda_options=CudaOptions()), OnnxRuntimeCPU)


class _HostDeviceInput(python_model.DeviceInput):  # type: ignore[misc]
    """DeviceInput's capsule parsing, checked on a host (DLPack CPU) capsule: the layout is the same."""

    devices = (1,)


def test_a_dlpack_capsule_gives_the_tensors_address_shape_and_dtype() -> None:
    array = np.arange(2 * 3 * 4, dtype=np.float16).reshape(2, 3, 4)
    view = _HostDeviceInput(array.__dlpack__())
    assert view.ptr == array.ctypes.data and view.shape == (2, 3, 4) and view.dtype == np.float16
    assert view.nbytes == array.nbytes and len(view) == 2
    ints = np.zeros((5, 7), dtype=np.int64)[1:]  # an offset view: its own address, still contiguous
    assert _HostDeviceInput(ints.__dlpack__()).ptr == ints.ctypes.data


def test_a_host_or_strided_dlpack_tensor_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="DLPack device type 1 is not a CUDA device"):
        RUNNER.DeviceInput(np.zeros((2, 3), dtype=np.float32).__dlpack__())
    with pytest.raises(ValueError, match=r"non-contiguous device tensor \(shape \(3, 2\)\)"):
        _HostDeviceInput(np.zeros((2, 3), dtype=np.float32).T.__dlpack__())


@pytest.mark.gpu
@needs_cuda
def test_bucket_runner_gathers_device_and_host_inputs_on_the_gpu(tmp_path: Path) -> None:
    """Requests whose inputs arrive on the GPU (CUDA shared memory) are copied device to device into the
    bound input, mixed in one batch with host ones, and give what the CPU gives."""
    from client.cuda_memory import DeviceBuffer, runtime
    from client.errors import PerfClientError

    try:  # onnxruntime-gpu without the [gpu] extra's cuda-python: nothing here can make a device buffer
        runtime("test")
    except PerfClientError as exc:
        pytest.skip(str(exc))
    path = conv_onnx(tmp_path / "conv.onnx")
    runner = RUNNER.CudaBucketRunner(str(path), max_batch=16, provider_options={}, sizes=[8, 16])
    cpu = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    parts = [rng.standard_normal((rows, 3, 32, 32), dtype=np.float32) for rows in (3, 1, 5, 2)]
    buffers = []
    feeds: list[dict[str, Any]] = []
    for index, part in enumerate(parts):
        if index % 2 == 1:
            feeds.append({"x": part})
            continue
        buffer = DeviceBuffer(runtime("test"), part.nbytes, 0)
        buffer.write(part.tobytes())
        buffers.append(buffer)
        device = object.__new__(RUNNER.DeviceInput)  # what DeviceInput reads from a backend's capsule
        device.ptr, device.shape, device.dtype, device.nbytes = buffer.ptr, part.shape, part.dtype, part.nbytes
        device.device_id = 0
        feeds.append({"x": device})
    try:
        (y,) = runner.run_many(feeds)
        want = cpu.run(["y"], {"x": np.concatenate(parts)})[0]
        np.testing.assert_allclose(y, want, rtol=1e-3, atol=1e-4)
        np.testing.assert_array_equal(feeds[0]["x"].numpy(), parts[0])  # the host copy of a device input
        # A runner without buckets (varying sequence length) takes device inputs through a host copy.
        plain = RUNNER.make_runner(str(sequence_onnx(tmp_path / "seq.onnx")), {"provider": "cuda"}, 8)
        ids = np.random.default_rng(3).integers(0, 50, size=(2, 7), dtype=np.int64)
        buffer = DeviceBuffer(runtime("test"), ids.nbytes, 0)
        buffers.append(buffer)
        buffer.write(ids.tobytes())
        device = object.__new__(RUNNER.DeviceInput)
        device.ptr, device.shape, device.dtype, device.nbytes = buffer.ptr, ids.shape, ids.dtype, ids.nbytes
        device.device_id = 0
        np.testing.assert_allclose(plain.run_many([{"ids": device}])[0], plain.run({"ids": ids})[0], rtol=1e-6)
    finally:
        for buffer in buffers:
            buffer.free()


def test_layout_auto_takes_nhwc_for_tensor_core_graphs_only(tmp_path: Path) -> None:
    """NHWC convolutions ran FP16 and FP32-with-TF32 1.2x faster, FP32 without TF32 0.95x and the INT8 Q/DQ graph
    0.52x (H200): auto picks by graph and TF32, in the build's accuracy run and in the served runner alike
    (tests/builder/runtimes/test_graph_kind.py compares the two on every setting)."""
    plain = conv_onnx(tmp_path / "conv.onnx")
    model = onnx.load(str(plain))
    scale, zero = numpy_helper.from_array(np.float32(0.05), "s"), numpy_helper.from_array(np.int8(0), "z")
    model.graph.initializer.extend([scale, zero])
    model.graph.node.insert(0, helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]))
    model.graph.node.insert(1, helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]))
    model.graph.node[2].input[0] = "xd"
    qdq = tmp_path / "qdq.onnx"
    onnx.save(model, str(qdq))
    auto = CudaOptions()
    assert "prefer_nhwc" not in auto.provider_options(plain)  # FP32 math (TF32 auto: off) runs NCHW
    assert CudaOptions(tf32="on").provider_options(plain)["prefer_nhwc"] == "1"  # type: ignore[arg-type]
    assert "prefer_nhwc" not in auto.provider_options(qdq)
    assert CudaOptions(layout="nchw").provider_options(plain).get("prefer_nhwc") is None  # type: ignore[arg-type]
    assert CudaOptions(layout="nhwc").provider_options(qdq)["prefer_nhwc"] == "1"  # type: ignore[arg-type]
    assert (RUNNER._has_qdq(str(plain)), RUNNER._has_qdq(str(qdq))) == (False, True)


def test_the_cuda_artifact_keeps_its_external_data(tmp_path: Path) -> None:
    """A model whose weights live beside it (over 2 GB in real life) is served with its data file: the copy
    kept only the .onnx before."""
    (tmp_path / "src").mkdir()
    source = conv_onnx(tmp_path / "src" / "conv.onnx")
    model = onnx.load(str(source))
    onnx.save(model, str(source), save_as_external_data=True, all_tensors_to_one_file=True, location="conv.onnx.data",
              size_threshold=0)
    runtime = object.__new__(OnnxRuntimeCUDA)  # compile needs no GPU; the constructor checks for one
    out = tmp_path / "served" / "model.onnx"
    out.parent.mkdir()
    runtime.compile(source, out, None)  # type: ignore[arg-type]
    x = np.random.default_rng(4).standard_normal((2, 3, 32, 32), dtype=np.float32)
    want = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)


def test_the_native_backend_checks_accuracy_in_the_layout_it_serves() -> None:
    """Triton's onnxruntime backend gets no layout parameter from us: NCHW there, so the accuracy run too."""
    if not cuda_available():
        pytest.skip(f"ONNX Runtime CUDA unusable: {cuda_unavailable_reason()}")
    runtime = OnnxRuntimeCUDA(ServingBackend.ONNXRUNTIME, CudaOptions())
    assert runtime.options.layout.value == "nchw"
    with pytest.raises(RuntimeUnavailableError, match="--cuda-layout nhwc: the native onnxruntime backend"):
        OnnxRuntimeCUDA(ServingBackend.ONNXRUNTIME, CudaOptions(layout="nhwc"))  # type: ignore[arg-type]


def test_tf32_auto_keeps_fp32_graphs_in_fp32_math(tmp_path: Path) -> None:
    """TF32 put the FP32 EfficientNet outside its FP32 gate on an H200 (logits off by 0.0093): auto turns it
    off for FP32 graphs only; FP16 and Q/DQ graphs keep ONNX Runtime's default."""
    fp32 = conv_onnx(tmp_path / "fp32.onnx")
    model = onnx.load(str(fp32))
    model.graph.node.insert(0, helper.make_node("Cast", ["x"], ["xh"], to=TensorProto.FLOAT16))
    model.graph.node.insert(1, helper.make_node("Cast", ["xh"], ["xf"], to=TensorProto.FLOAT))
    model.graph.node[2].input[0] = "xf"
    fp16 = tmp_path / "fp16.onnx"
    onnx.save(model, str(fp16))
    with pytest.raises(RuntimeUnavailableError, match="--cuda-tf32 'yes': expected one of auto, on, off"):
        CudaOptions(tf32="yes")  # type: ignore[arg-type]
    auto = CudaOptions()
    assert auto.provider_options(fp32)["use_tf32"] == "0" and "use_tf32" not in auto.provider_options(fp16)
    assert "use_tf32" not in CudaOptions(tf32="on").provider_options(fp32)  # type: ignore[arg-type]
    assert CudaOptions(tf32="off").provider_options(fp16)["use_tf32"] == "0"  # type: ignore[arg-type]
    assert (RUNNER._graph_kind(str(fp32)), RUNNER._graph_kind(str(fp16))) == ("fp32", "fp16")


def test_the_native_backend_checks_accuracy_in_the_tf32_mode_it_serves(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    """Triton's onnxruntime backend gets no use_tf32 parameter from us, so it serves FP32 graphs with ONNX
    Runtime's default, TF32 on; the accuracy run turned TF32 off for them under auto, gating math the server
    never runs. The GPU check is our own function, stood in so the choice is tested on any host."""
    from builder.runtimes import onnxruntime_cuda

    monkeypatch.setattr(onnxruntime_cuda, "cuda_unavailable_reason", lambda: None)
    fp32 = conv_onnx(tmp_path / "fp32.onnx")
    native = OnnxRuntimeCUDA(ServingBackend.ONNXRUNTIME, CudaOptions())
    assert "use_tf32" not in native.options.provider_options(fp32)  # ONNX Runtime's default: on
    assert native.options.record()["tf32"] == "on" and native.options.record()["layout"] == "nchw"
    config = cuda_backend_config(ServingBackend.ONNXRUNTIME, native.options)
    assert not any(k == "use_tf32" for k, _ in config.parameters)  # what makes the server run TF32
    with pytest.raises(RuntimeUnavailableError, match=r"^--cuda-tf32 off: the native onnxruntime backend") as info:
        OnnxRuntimeCUDA(ServingBackend.ONNXRUNTIME, CudaOptions(tf32="off"))  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
    python = OnnxRuntimeCUDA(ServingBackend.PYTHON, CudaOptions())  # the runner resolves auto as the build does
    assert python.options.provider_options(fp32)["use_tf32"] == "0"
    assert dict(cuda_backend_config(ServingBackend.PYTHON, python.options).parameters)["use_tf32"] == "auto"


def test_build_json_gets_each_graphs_resolved_cuda_options(tmp_path: Path) -> None:
    """build.json kept layout and TF32 as 'auto'; the options each artifact runs with are recorded too."""
    runtime = object.__new__(OnnxRuntimeCUDA)  # the constructor wants a GPU; served_options reads the graph
    runtime.options = CudaOptions()
    served = runtime.served_options(conv_onnx(tmp_path / "fp32.onnx"))
    assert served == {"device_id": "0", "cudnn_conv_algo_search": "HEURISTIC", "use_tf32": "0"}
    assert OnnxRuntimeCPU().served_options(tmp_path / "fp32.onnx") == {}


def test_cuda_session_quiets_onnx_runtime_but_not_when_the_provider_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from builder.runtimes import onnxruntime_cuda

    levels: list[int] = []
    made: list[int] = []
    started: list[list[str]] = [["CUDAExecutionProvider", "CPUExecutionProvider"]]

    class Session:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(levels[-1])

        def get_providers(self) -> list[str]:
            return started[0]

    monkeypatch.setattr(onnxruntime_cuda.ort, "InferenceSession", Session)
    monkeypatch.setattr(onnxruntime_cuda.ort, "set_default_logger_severity", levels.append)
    path = mlp_onnx(tmp_path / "m.onnx")
    onnxruntime_cuda.cuda_session(path, CudaOptions(), log_file=None)
    assert made == [3] and levels == [3, 2]  # created with the process-wide warnings off, then ONNX Runtime's default
    started[0] = ["CPUExecutionProvider"]
    with pytest.raises(RuntimeUnavailableError, match="did not start its CUDA provider"):
        onnxruntime_cuda.cuda_session(path, CudaOptions(), log_file=tmp_path / "build.log")
    assert made == [3, 3, 2] and levels[-1] == 2  # the failed start again, with the warnings that say why
