"""builder.runtimes.onnxruntime and select(): the variant ONNX is the artifact, runs match ONNX Runtime
itself however the samples are batched, and the Triton backend follows the serving backend asked for."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from builder.errors import RuntimeUnavailableError
from builder.repository.triton_config import BackendConfig, InstanceKind, TritonBackend
from builder.runtimes import (
    CompileTarget,
    OnnxRuntimeCPU,
    OnnxRuntimeCUDA,
    cuda_available,
    select,
    tensorrt_available,
)
from builder.runtimes.onnxruntime import ort_session, run_file, run_session
from builder.spec import DimRange, RuntimeChoice, ServingBackend, TensorSpec
from tests.helpers.tiny_models import mlp_onnx, mlp_samples, sequence_onnx


def target(onnx_path: Path) -> CompileTarget:
    return CompileTarget(inputs=(TensorSpec("x", "float32", (-1, 4, 32)),), batch=DimRange(1, 4, 8), dims={},
                         onnx_sha256=hashlib.sha256(onnx_path.read_bytes()).hexdigest())


def test_compile_copies_the_variant_onnx_byte_for_byte(tmp_path: Path) -> None:
    source = mlp_onnx(tmp_path / "variant.onnx")
    version_dir = tmp_path / "1"
    version_dir.mkdir()
    runtime = OnnxRuntimeCPU()
    out = version_dir / runtime.artifact
    runtime.compile(source, out, target(source))
    assert runtime.artifact == "model.onnx" and out.read_bytes() == source.read_bytes()
    runtime.carry_over(tmp_path / "previous", version_dir, target(source))  # nothing to carry: changes nothing
    assert sorted(p.name for p in version_dir.iterdir()) == ["model.onnx"]


def test_runs_match_onnx_runtime_itself_however_the_samples_are_batched(tmp_path: Path) -> None:
    path = mlp_onnx(tmp_path / "model.onnx")
    samples = mlp_samples(8, seed=3)
    direct = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["logits"], samples)[0]
    session = ort_session(path)
    by_three = run_session(session, samples, 3)  # batches of 3, 3 and 2
    assert set(by_three) == {"logits"} and by_three["logits"].shape == (8, 16)
    np.testing.assert_allclose(by_three["logits"], direct, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(run_session(session, samples, 8)["logits"], by_three["logits"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(OnnxRuntimeCPU().run(path, samples, 1)["logits"], direct, rtol=1e-5, atol=1e-6)
    # Integer inputs with a named dynamic dim go through unchanged.
    seq = sequence_onnx(tmp_path / "seq.onnx")
    ids = {"ids": np.random.default_rng(0).integers(0, 50, size=(5, 7)).astype(np.int64)}
    seq_direct = ort.InferenceSession(str(seq), providers=["CPUExecutionProvider"]).run(["out"], ids)[0]
    np.testing.assert_allclose(run_file(seq, ids, 2)["out"], seq_direct, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("serving", "backend"), [(ServingBackend.PYTHON, TritonBackend.PYTHON),
                                                  (ServingBackend.ONNXRUNTIME, TritonBackend.ONNXRUNTIME)])
def test_backend_config_follows_the_serving_backend(serving: ServingBackend, backend: TritonBackend,
                                                    tmp_path: Path) -> None:
    source = mlp_onnx(tmp_path / "model.onnx")
    runtime = OnnxRuntimeCPU(serving)
    # Served from model.onnx on the CPU; no batch limit of its own, no warm-up, no per-GPU plans.
    assert runtime.backend_config(target(source), tmp_path) == BackendConfig(
        backend=backend, artifact="model.onnx", instance_kind=InstanceKind.CPU)
    assert runtime.identity() == {"onnxruntime": ort.__version__, "serving_backend": serving.value}


@pytest.mark.parametrize("serving", list(ServingBackend))
def test_select_onnxruntime_keeps_the_serving_backend(serving: ServingBackend) -> None:
    runtime = select(RuntimeChoice.ONNXRUNTIME, serving_backend=serving)
    assert isinstance(runtime, OnnxRuntimeCPU) and runtime.serving_backend is serving
    default = select(RuntimeChoice.ONNXRUNTIME)
    assert isinstance(default, OnnxRuntimeCPU) and default.serving_backend is ServingBackend.PYTHON  # bundled server


@pytest.mark.skipif(tensorrt_available(), reason="TensorRT is available here")
def test_select_without_tensorrt() -> None:
    auto = select(RuntimeChoice.AUTO, serving_backend=ServingBackend.ONNXRUNTIME)
    # auto takes ONNX Runtime's CUDA provider where it and a GPU exist (a GPU host), else the CPU
    expected = OnnxRuntimeCUDA if cuda_available() else OnnxRuntimeCPU
    assert type(auto) is expected and auto.serving_backend is ServingBackend.ONNXRUNTIME
    with pytest.raises(RuntimeUnavailableError, match=r"^--runtime tensorrt: TensorRT with a CUDA GPU is not"):
        select(RuntimeChoice.TENSORRT)


@pytest.mark.skipif(tensorrt_available(), reason="TensorRT is available here")
def test_select_with_a_plain_string_is_the_same_as_with_the_member() -> None:
    with pytest.raises(RuntimeUnavailableError):
        select("tensorrt")  # type: ignore[arg-type]
