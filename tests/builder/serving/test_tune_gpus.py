"""`trtbuild tune --gpus` (issue 26): the GPUs whose energy each point's measurement counts reach
perfclient's session; without it perfclient chooses (the variant's instance groups, CUDA_VISIBLE_DEVICES,
every GPU: tests/client/test_power_gpus.py)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from builder.cli import main
from builder.errors import BuilderError
from builder.tuning.control import Endpoints
from builder.tuning.energy import require_gpus
from builder.tuning.measure import Tuner
from builder.tuning.points import Point
from builder.tuning.targets import Target
from client import session
from client.errors import PerfClientError


class StandInTarget(Target):
    endpoints = Endpoints(http="127.0.0.1:1", grpc="127.0.0.1:2", metrics="http://127.0.0.1:3/metrics")

    def __init__(self) -> None:
        self.http = types.SimpleNamespace(live=lambda: True)  # type: ignore[assignment]

    def load(self, point: Point) -> None:
        pass

    def unload(self, variant: str) -> None:
        pass


@pytest.mark.parametrize("gpus", [("1", "3"), None])
def test_each_points_session_meters_the_gpus_given(monkeypatch: pytest.MonkeyPatch,
                                                   gpus: tuple[str, ...] | None) -> None:
    seen: list[session.SessionConfig] = []

    async def measure(config: session.SessionConfig) -> list[session.ModelResult]:
        seen.append(config)
        raise PerfClientError("stand-in: nothing measured")

    monkeypatch.setattr(session, "measure", measure)  # tune calls session.measure through the module
    tuner = Tuner(StandInTarget(), [1], gpus=gpus)
    tuner.measure(Point("m_fp16", 8, 0, 1))
    assert seen[0].gpus == gpus and "stand-in" in tuner.failures[Point("m_fp16", 8, 0, 1)]


def test_a_bad_gpu_list_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "m", "--repository", str(tmp_path), "--gpus", "0,zero"]) == 1
    assert "--gpus '0,zero': expected GPU indices or UUIDs" in capsys.readouterr().err


def test_gpus_no_meter_finds_are_one_line_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.client.test_power import use_nvml
    from tests.client.test_power_gpus import FourGpus

    use_nvml(monkeypatch, FourGpus())
    require_gpus(None, ("1", "3"))  # there: no error
    with pytest.raises(BuilderError, match=r"^--gpus 1,9: no meter counts these GPUs \(nvml: GPU 9 \(--gpus\) is not "
                                           r"here \(GPUs: 0 GPU-"):
        require_gpus(None, ("1", "9"))
