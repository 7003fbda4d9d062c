"""Shared fixtures: marker skips, a tiny model repository, and a real Triton server on free ports."""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.pipeline import BuildOptions, build_all
from builder.runtimes import OnnxRuntimeCPU, tensorrt_available
from builder.serving.triton_server import Ports, TritonServer, free_ports
from builder.spec import ModelSpec
from tests.helpers.servers import SharedServerRestarted, revive
from tests.helpers.tiny_models import tiny_specs

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _has_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        count = int(pynvml.nvmlDeviceGetCount())
        pynvml.nvmlShutdown()
        return count > 0
    except Exception:  # noqa: BLE001
        return False


# Fixtures that start a real tritonserver (directly or through one of these): a test that asks for any of
# them, at any depth, is in the `server` tier. Tests that start one in their body carry the marker
# themselves; _unmarked_tests_start_no_server below fails a test that does so unmarked.
SERVER_FIXTURES = frozenset({"triton", "endpoints", "private_server", "h2_server", "server"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = _has_gpu()
    trt = gpu and tensorrt_available()
    for item in items:
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="no NVIDIA GPU here"))
        if "tensorrt" in item.keywords and not trt:
            item.add_marker(pytest.mark.skip(reason="TensorRT with a GPU is not available here"))


@pytest.fixture(scope="session", autouse=True)
def build_logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """trtbuild's default build logs go to a temporary folder, not the checkout's .logs/; the CLIs show no
    progress (tests read their stderr line by line; tests/client/test_progress.py turns it on)."""
    folder = tmp_path_factory.mktemp("logs")
    saved = {name: os.environ.get(name) for name in ("TRTBUILD_LOG_DIR", "TRTSERVE_PROGRESS")}
    os.environ["TRTBUILD_LOG_DIR"] = str(folder)
    os.environ["TRTSERVE_PROGRESS"] = "off"
    yield folder
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def tiny_repository(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[ModelSpec]]:
    root = tmp_path_factory.mktemp("tiny")
    specs = tiny_specs(root)
    repository = root / "repository"
    options = BuildOptions(repository=repository, runtime=OnnxRuntimeCPU(), cache_dir=root / "cache")
    build_all(specs, options, repository / "build_report.json", ["pytest"])
    return repository, specs


_SHARED: list[TritonServer] = []  # the session's shared server, once a test has asked for it


@pytest.fixture(scope="session")
def triton(tiny_repository: tuple[Path, list[ModelSpec]],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    repository, _ = tiny_repository
    http, grpc, metrics = free_ports(3)
    server = TritonServer(repository, tmp_path_factory.mktemp("triton"), Ports(http, grpc, metrics))
    server.start(timeout=120)
    _SHARED.append(server)
    yield server
    _SHARED.clear()
    server.stop()


@pytest.fixture(autouse=True)
def _unmarked_tests_start_no_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make test-fast` deselects the `server` tier; a test that starts Triton without the marker would
    slip into it (and make it slow), so in a run that deselects the tier, starting one fails that test."""
    if "not server" not in str(request.config.option.markexpr) or request.node.get_closest_marker("server"):
        return

    def refuse(self: TritonServer, *args: object, **kwargs: object) -> None:
        raise AssertionError(f"{request.node.nodeid} starts a Triton server but is not marked "
                             "pytest.mark.server (the fast tier runs without servers)")

    monkeypatch.setattr(TritonServer, "start", refuse)


@pytest.fixture(autouse=True)
def _shared_triton_alive() -> None:
    """Before each test: the shared server is still up. Triton 2.51 itself once died of a segfault between
    tests (`Signal (11) received`, in pthread_mutex_lock, in a fresh-clone CI run): its gRPC front end's race
    with a request cancelled in flight (docs/triton-crash.md; perfclient now drains before it cancels, but
    a test's own cancellations can still hit it), and every later test that used the server failed with
    'connection refused'. It is started again on the
    same ports, and a warning in pytest's summary carries what the dead one wrote, so the crash stays
    visible without failing tests it did not concern."""
    for server in _SHARED:
        tail = revive(server)
        if tail is not None:
            warnings.warn(f"the shared tritonserver had exited and was started again ({tail})",
                          SharedServerRestarted, stacklevel=1)


@pytest.fixture
def repo_copy(tiny_repository: tuple[Path, list[ModelSpec]], tmp_path: Path) -> Path:
    """A private copy of the built tiny repository, for tests that try to change it."""
    repository, _ = tiny_repository
    target = tmp_path / "repository"
    shutil.copytree(repository, target)
    return target
