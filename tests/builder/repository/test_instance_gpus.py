"""Serving across several GPUs (issue 26): models.toml `[model.serving] gpus` writes one KIND_GPU instance
group with `instances` per listed GPU (Triton counts per GPU), through Triton's own schema; the python
backend's ONNX Runtime CUDA runner runs each instance on the device Triton gave it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from builder.cli import main
from builder.errors import ManifestError
from builder.repository import python_model
from builder.repository.gpus import place_on_gpus
from builder.repository.triton_config import (
    BackendConfig,
    ConfigInputs,
    InstanceKind,
    TritonBackend,
    build,
    parse,
    to_text,
)
from builder.serving import triton_server
from builder.spec import DimRange, ServingSpec, TensorSpec, load_manifest

RUNNER: Any = python_model

CFG = ConfigInputs(name="m_fp16", inputs=(TensorSpec("x", "float32", (-1, 4)),),
                   outputs=(TensorSpec("y", "float32", (-1, 2)),), batch=DimRange(1, 4, 8),
                   serving=ServingSpec(instances=2, gpus=(0, 3)),
                   backend=BackendConfig(TritonBackend.TENSORRT, "model.plan", instance_kind=InstanceKind.GPU))


def groups(cfg: ConfigInputs) -> Any:
    return json_format.MessageToDict(build(cfg), preserving_proto_field_name=True)["instance_group"]


def test_a_gpu_variant_gets_its_instances_on_each_listed_gpu() -> None:
    assert groups(CFG) == [{"count": 2, "kind": "KIND_GPU", "gpus": [0, 3]}]
    assert "gpus: 0" in to_text(build(CFG)) and "gpus: 3" in to_text(build(CFG))
    every = ConfigInputs(**{**CFG.__dict__, "serving": ServingSpec(instances=2)})
    assert groups(every) == [{"count": 2, "kind": "KIND_GPU"}]  # no list: Triton's default, every GPU it sees


def test_a_cpu_variant_stays_on_the_cpu() -> None:
    cpu = ConfigInputs(**{**CFG.__dict__, "backend": BackendConfig(TritonBackend.PYTHON, "model.onnx")})
    assert groups(cpu) == [{"count": 2, "kind": "KIND_CPU"}]


def test_models_toml_serving_gpus(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    body = '[[model]]\nname = "m"\nonnx = "m.onnx"\nbatch = {{ min = 1, opt = 2, max = 4 }}\n' \
           "[model.serving]\ninstances = 2\ngpus = {gpus}\n"
    path.write_text(body.format(gpus="[1, 3, 1]"))
    (spec,) = load_manifest(path)
    assert spec.serving.gpus == (1, 3) and spec.serving.instances == 2
    path.write_text(body.format(gpus="[-1]"))
    with pytest.raises(ManifestError, match="gpus"):
        load_manifest(path)


@pytest.mark.parametrize(("kind", "device", "expected"), [("GPU", 3, "3"), ("CPU", 0, None)])
def test_the_onnxruntime_runner_binds_each_gpu_instance_to_its_device(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str, device: int, expected: str | None) -> None:
    seen: list[dict[str, str]] = []

    class Stop(Exception):
        pass

    def make_runner(path: str, params: dict[str, str], max_batch: int) -> None:
        seen.append(dict(params))
        raise Stop  # the runner's own construction needs a GPU: what it was asked for is the point

    monkeypatch.setattr(RUNNER, "make_runner", make_runner)
    config = {"max_batch_size": 8, "input": [{"name": "x"}], "output": [{"name": "y"}],
              "parameters": {"provider": {"string_value": "cuda"}}}
    with pytest.raises(Stop):
        RUNNER.TritonPythonModel().initialize({
            "model_config": json.dumps(config), "model_repository": str(tmp_path), "model_version": "1",
            "model_name": "m", "model_instance_kind": kind, "model_instance_device_id": str(device)})
    assert seen[0].get("device_id") == expected


def repository(tmp_path: Path) -> Path:
    """A generated repository: a TensorRT (GPU) variant and an ONNX Runtime CPU one."""
    repo = tmp_path / "model_repository"
    for cfg in (CFG, ConfigInputs(**{**CFG.__dict__, "name": "m_fp32",
                                     "backend": BackendConfig(TritonBackend.PYTHON, "model.onnx")})):
        (repo / cfg.name).mkdir(parents=True)
        (repo / cfg.name / "config.pbtxt").write_text(to_text(build(ConfigInputs(
            **{**cfg.__dict__, "serving": ServingSpec(instances=2)}))))
    return repo


def test_serve_gpus_places_the_gpu_variants_and_leaves_the_cpu_ones(tmp_path: Path) -> None:
    repo = repository(tmp_path)
    cpu_before = (repo / "m_fp32" / "config.pbtxt").read_bytes()
    assert place_on_gpus(repo, (1, 2)) == [repo / "m_fp16" / "config.pbtxt"]
    placed = json_format.MessageToDict(parse((repo / "m_fp16" / "config.pbtxt").read_text()),
                                       preserving_proto_field_name=True)
    assert placed["instance_group"] == [{"count": 2, "kind": "KIND_GPU", "gpus": [1, 2]}]
    assert (repo / "m_fp32" / "config.pbtxt").read_bytes() == cpu_before
    assert place_on_gpus(repo, (1, 2)) == []  # already so: nothing rewritten


class Started(Exception):
    pass


def test_trtbuild_serve_gpus_rewrites_before_the_server_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    repo = repository(tmp_path)

    class NoServer:
        def __init__(self, repository: Path, *args: Any, **kwargs: Any) -> None:
            text = (repository / "m_fp16" / "config.pbtxt").read_text()
            assert "gpus: 0" in text and "gpus: 3" in text  # placed before Triton reads the repository
            raise Started

    monkeypatch.setattr(triton_server, "TritonServer", NoServer)
    # Four GPUs, whatever this host has (on a one-GPU host GPU 3 would be refused, as the next test shows).
    monkeypatch.setattr(triton_server, "gpu_ids", lambda: [0, 1, 2, 3])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(Started):
        main(["serve", "--repository", str(repo), "--state-dir", str(tmp_path / "run"), "--gpus", "0,3"])
    assert "m_fp16: instances on GPUs 0, 3" in capsys.readouterr().out
    assert main(["serve", "--repository", str(repo), "--gpus", "0,x"]) == 1
    assert "--gpus '0,x': expected GPU device ids separated by commas (0,3)" in capsys.readouterr().err


def test_trtbuild_serve_gpus_not_here_is_one_line_and_rewrites_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    repo = repository(tmp_path)
    before = (repo / "m_fp16" / "config.pbtxt").read_bytes()
    monkeypatch.setattr(triton_server, "gpu_ids", lambda: [0, 1, 2, 3])  # NVML's four GPUs
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert main(["serve", "--repository", str(repo), "--state-dir", str(tmp_path / "run"), "--gpus", "0,99"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == ("trtbuild: error: --gpus 0,99: there is no GPU 99 here (device ids: 0, 1, 2, 3); "
                    "no config.pbtxt rewritten")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the server sees two: device ids 0 and 1
    assert main(["serve", "--repository", str(repo), "--state-dir", str(tmp_path / "run"), "--gpus", "3"]) == 1
    assert "there is no GPU 3 here (device ids: 0, 1)" in capsys.readouterr().err
    assert (repo / "m_fp16" / "config.pbtxt").read_bytes() == before
