"""`--objective infer_per_joule` without a power source: one line before any server starts or any
point is measured. The power sources are replaced here so that the tests say the same on a machine
with a GPU (NVML) or readable RAPL counters as on one without."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest

from builder.cli import main
from builder.errors import BuilderError
from builder.serving.triton_server import free_ports
from builder.tuning import energy, targets
from builder.tuning.control import Endpoints
from builder.tuning.objective import Goal, Objective
from builder.tuning.points import Space
from builder.tuning.run import TuneConfig, tune
from builder.tuning.strategies import Search
from client import power

MANIFEST = '''[[model]]
name = "mlp"
onnx = "mlp.onnx"
precisions = ["fp32"]
batch = { min = 1, opt = 4, max = 8 }
'''


def unavailable(name: str) -> type:
    class Missing:
        def __init__(self, *args: object, **kwargs: object) -> None:  # NvmlMeter(gpus=...) since issue 26
            raise RuntimeError(f"no {name} on this test's machine")

    return Missing


class FakeNvml:
    """An energy counter that works; it remembers being closed."""

    source = power.PowerSource.NVML
    trace = None
    reason = None
    closed: ClassVar[list[bool]] = []

    def __init__(self, *, gpus: power.GpuSelection | None = None) -> None:  # open_meter passes --gpus
        self.gpus = gpus

    def read(self) -> power.Reading:
        return power.Reading(0.0, 1.0)

    def close(self) -> None:
        FakeNvml.closed.append(True)


class ServerStarted(Exception):
    """The run got past the checks to the point of starting a server."""


@pytest.fixture
def no_power(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(power, "NvmlMeter", unavailable("NVML"))
    monkeypatch.setattr(power, "RaplMeter", unavailable("RAPL"))


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each server the run would start or attach to, and stops the run there."""
    started: list[str] = []

    def enter(self: object) -> object:
        started.append(type(self).__name__)
        raise ServerStarted

    monkeypatch.setattr(targets.LocalTarget, "__enter__", enter)
    monkeypatch.setattr(targets.RemoteTarget, "__enter__", enter)
    return started


def run(repository: Path, attach: Endpoints | None = None) -> None:
    tune(TuneConfig(repository, Space(("mlp_fp32",), (8,), (0,), (1,)), Objective(Goal.INFER_PER_JOULE),
         search=Search.EXHAUSTIVE, concurrencies=[1], measurement_ms=300, default_variant="mlp_fp32",
         report_path=None, plot_path=None, attach=attach))


def test_no_power_source_is_one_line_before_any_server_starts(
        no_power: None, servers: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "models.toml"
    manifest.write_text(MANIFEST)
    repository = tmp_path / "repository"
    (repository / "mlp_fp32").mkdir(parents=True)
    files = ["--manifest", str(manifest), "--repository", str(repository), "--report", str(tmp_path / "t.json"),
             "--plot", str(tmp_path / "t.png"), "--html", str(tmp_path / "t.html")]
    assert main(["tune", "mlp", *files, "--precisions", "fp32", "--objective", "infer_per_joule"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trtbuild: error: --objective infer_per_joule: expected a power "
                                               "source (an NVIDIA GPU readable through NVML, or RAPL")
    assert "no NVML on this test's machine" in err[0] and "no RAPL on this test's machine" in err[0]
    assert servers == [] and not (tmp_path / "t.json").exists()


def test_attach_mode_names_the_servers_metrics_too(no_power: None, servers: list[str], repo_copy: Path) -> None:
    http, grpc, metrics = free_ports(3)  # nothing listens there
    url = f"http://127.0.0.1:{metrics}/metrics"
    with pytest.raises(BuilderError, match=r"--objective infer_per_joule: expected a power source") as error:
        run(repo_copy, Endpoints(f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", url))
    assert f"nv_energy_consumption on {url}" in str(error.value) and "\n" not in str(error.value)
    assert servers == []


def test_with_a_power_source_the_run_goes_on_and_the_probe_is_closed(
        no_power: None, servers: list[str], repo_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(power, "NvmlMeter", FakeNvml)
    FakeNvml.closed.clear()
    with pytest.raises(ServerStarted):
        run(repo_copy)
    assert servers == ["LocalTarget"] and FakeNvml.closed == [True]


@pytest.mark.parametrize(("grpc", "expected"), [
    ("127.0.0.1:8001", power.PowerSource.AUTO), ("localhost:8001", power.PowerSource.AUTO),
    ("[::1]:8001", power.PowerSource.AUTO), ("triton.inference.svc:8001", power.PowerSource.TRITON),
    ("10.1.2.3:8001", power.PowerSource.TRITON),
    # Loopback and "any" addresses however they are spelled are this machine too.
    ("[::]:8001", power.PowerSource.AUTO), ("[0:0:0:0:0:0:0:1]:8001", power.PowerSource.AUTO),
    ("[::ffff:127.0.0.1]:8001", power.PowerSource.AUTO), ("LOCALHOST.:8001", power.PowerSource.AUTO),
    ("[fe80::1]:8001", power.PowerSource.TRITON),
])
def test_a_server_on_another_host_is_metered_by_its_own_energy_counter(grpc: str, expected: power.PowerSource) -> None:
    # This machine's NVML or RAPL would meter the wrong hardware for a server in a pod or on a GPU host.
    assert energy.power_source(Endpoints("unused:8000", grpc)) is expected
    assert energy.power_source(None) is power.PowerSource.AUTO


def test_a_remote_server_without_energy_metrics_is_refused_even_with_power_here(
    monkeypatch: pytest.MonkeyPatch, servers: list[str], repo_copy: Path,
) -> None:
    monkeypatch.setattr(power, "NvmlMeter", lambda *args: FakeNvml())  # this machine has a GPU
    monkeypatch.setattr(power, "RaplMeter", unavailable("RAPL"))
    http, grpc, metrics = free_ports(3)
    url = f"http://127.0.0.1:{metrics}/metrics"  # nothing listens: the remote server exports no energy
    with pytest.raises(BuilderError, match=r"the server is on another host"):
        run(repo_copy, Endpoints(f"10.255.255.1:{http}", f"10.255.255.1:{grpc}", url))
    assert servers == []
