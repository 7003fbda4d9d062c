"""A real Triton server on loopback: every variant answers over gRPC and HTTP exactly as ONNX Runtime does."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from builder.errors import RuntimeUnavailableError
from builder.runtimes import tensorrt_available
from builder.serving.triton_server import TritonServer
from builder.serving.verify import verify_variant
from builder.spec import ModelSpec, variant_name
from builder.steps import samples as data_mod
from client.protocol import Protocol


def urls(server: TritonServer) -> dict[Protocol, str]:
    return {Protocol.GRPC: f"127.0.0.1:{server.ports.grpc}", Protocol.HTTP: f"127.0.0.1:{server.ports.http}"}


def test_every_variant_matches_onnxruntime_over_grpc_and_http(
    triton: TritonServer, tiny_repository: tuple[Path, list[ModelSpec]]
) -> None:
    repository, specs = tiny_repository
    checked = 0
    for spec in specs:
        assert spec.evaluation is not None
        samples = data_mod.load(spec.evaluation, "eval")
        for prec in spec.precisions:
            results = verify_variant(repository, variant_name(spec.name, prec), samples, urls(triton))
            assert {r.protocol for r in results} == {"grpc", "http"}
            for r in results:
                assert r.ok, r
                assert r.max_abs_diff <= 1e-4
                checked += 1
    assert checked == 10


def test_other_sequence_lengths_are_served(triton: TritonServer, tiny_repository: tuple[Path, list[ModelSpec]]) -> None:
    repository, _ = tiny_repository
    ids = np.random.default_rng(0).integers(0, 50, size=(3, 29)).astype(np.int64)
    (grpc, http) = verify_variant(repository, "seq_fp32", {"ids": ids}, urls(triton), batch=3)
    assert grpc.ok and http.ok


def test_health_and_metrics_endpoints(triton: TritonServer) -> None:
    base = f"http://127.0.0.1:{triton.ports.http}"
    with urllib.request.urlopen(f"{base}/v2/health/ready", timeout=5) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{triton.ports.metrics}/metrics", timeout=5) as response:
        assert b"nv_inference_request_success" in response.read()


def test_verify_runs_the_artifact_under_the_runtime_that_built_it(repo_copy: Path) -> None:
    record_path = repo_copy / "mlp_fp32" / "build.json"
    record = json.loads(record_path.read_text())
    record["runtime"] = "tensorrt"
    record_path.write_text(json.dumps(record))
    ids = {"x": np.zeros((2, 4, 32), np.float32)}
    if tensorrt_available():
        pytest.skip("TensorRT is available here")
    with pytest.raises(RuntimeUnavailableError, match="--runtime tensorrt: TensorRT with a CUDA GPU is not available"):
        verify_variant(repo_copy, "mlp_fp32", ids, {})


def test_a_model_without_evaluation_data_is_verified_with_synthetic_samples_and_says_so(
    tiny_repository: tuple[Path, list[ModelSpec]], triton: TritonServer
) -> None:
    from dataclasses import replace

    from builder.serving.verify import verify_models

    repository, specs = tiny_repository
    seq = replace(next(s for s in specs if s.name == "seq"), evaluation=None)
    results = verify_models([seq], repository, urls(triton), samples=5)
    assert {(r.variant, r.protocol) for r in results} == {
        (f"seq_{p}", proto) for p in ("fp32", "fp16") for proto in (Protocol.GRPC, Protocol.HTTP)}
    assert all(r.ok and r.samples == 5 and r.source == "synthetic (opt shape)" for r in results)


def _mlp_manifest(tmp_path: Path, data: Path) -> Path:
    """The tiny repository's `mlp` model as a models.toml (its ONNX and data live beside the repository)."""
    path = tmp_path / "models.toml"
    path.write_text(f'''
[[model]]
name = "mlp"
onnx = "{data / 'mlp.onnx'}"
precisions = ["fp32", "fp16", "int8"]
batch = {{ min = 1, opt = 4, max = 8 }}

[model.calibration]
source = "{data / 'mlp_calib.npz'}"
samples = 64

[model.evaluation]
source = "{data / 'mlp_eval.npz'}"
samples = 32
''')
    return path


def _verify_cli(triton: TritonServer, repository: Path, manifest: Path, *extra: str) -> list[str]:
    return ["verify", "--manifest", str(manifest), "--repository", str(repository),
            "--grpc-url", f"127.0.0.1:{triton.ports.grpc}", "--http-url", f"127.0.0.1:{triton.ports.http}", *extra]


def test_verify_save_writes_the_samples_and_the_outputs_the_server_returns(
    triton: TritonServer, tiny_repository: tuple[Path, list[ModelSpec]], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import tritonclient.grpc as tc

    from builder.cli import main

    repository, _ = tiny_repository
    saved = tmp_path / "out" / "expected.npz"
    code = main(_verify_cli(triton, repository, _mlp_manifest(tmp_path, repository.parent),
                            "--samples", "6", "--save", str(saved)))
    assert code == 0, capsys.readouterr().err
    assert f"to {saved}" in capsys.readouterr().out
    variants = [f"mlp_{p}" for p in ("fp32", "fp16", "int8")]
    with np.load(saved) as archive:
        arrays = {k: archive[k] for k in archive.files}
    assert set(arrays) == {f"{v}/{kind}" for v in variants for kind in ("input/x", "output/logits")}
    evaluation = np.load(repository.parent / "mlp_eval.npz")["x"][:6]
    client = tc.InferenceServerClient(url=f"127.0.0.1:{triton.ports.grpc}")
    try:
        for variant in variants:
            sent, expected = arrays[f"{variant}/input/x"], arrays[f"{variant}/output/logits"]
            assert np.array_equal(sent, evaluation)  # the held-out samples verify sent, leading sample axis
            assert expected.shape == (6, 16) and expected.dtype == np.float32
            item = tc.InferInput("x", list(sent.shape), "FP32")
            item.set_data_from_numpy(sent)
            answer = client.infer(variant, [item]).as_numpy("logits")
            np.testing.assert_allclose(answer, expected, atol=1e-4, rtol=1e-3)
        # The variants differ (int8 is not fp32): each entry is its own variant's run, not a copy.
        assert not np.array_equal(arrays["mlp_int8/output/logits"], arrays["mlp_fp32/output/logits"])
    finally:
        client.close()


@pytest.mark.parametrize("target", ["expected.txt", "blocker/expected.npz"])
def test_verify_save_to_a_bad_path_is_one_line(
    target: str, triton: TritonServer, tiny_repository: tuple[Path, list[ModelSpec]], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from builder.cli import main

    repository, _ = tiny_repository
    (tmp_path / "blocker").write_text("a file where the folder would go\n")
    code = main(_verify_cli(triton, repository, _mlp_manifest(tmp_path, repository.parent),
                            "--samples", "2", "--save", str(tmp_path / target)))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 1 and err[0].startswith(f"trtbuild: error: --save {tmp_path / target}"), err
    assert not (tmp_path / target).exists() and not list(tmp_path.glob("**/.expected*"))
