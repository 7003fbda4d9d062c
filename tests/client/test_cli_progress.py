"""perfclient's window progress (common.progress): plain lines off a terminal, none with -q."""

from __future__ import annotations

import pytest

from client.cli import main as perfclient
from tests.helpers.cli_state import cli_progress_restored  # noqa: F401 - autouse fixture
from tests.helpers.servers import Endpoints

QUICK = ["--measurement-interval", "300", "--max-trials", "3", "--stability-percentage", "60", "--warmup", "5"]


def test_perfclient_prints_window_progress_off_a_terminal(endpoints: Endpoints,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert perfclient(["-m", "mlp_fp32", "-u", endpoints.grpc, *QUICK]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "[start] mlp_fp32 concurrency 1: windows (3 steps)" in err
    assert any(line.startswith("[done] mlp_fp32 concurrency 1: windows (") for line in err), err


def test_perfclient_quiet_prints_no_progress(endpoints: Endpoints, capsys: pytest.CaptureFixture[str]) -> None:
    assert perfclient(["-m", "mlp_fp32", "-u", endpoints.grpc, *QUICK, "-q"]) == 0
    captured = capsys.readouterr()
    assert not any(line.startswith("[") for line in captured.err.splitlines()), captured.err
    assert "mlp_fp32" in captured.out  # the table still prints


def test_perfclient_simultaneous_prints_each_models_window_progress(endpoints: Endpoints,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Models loaded at once get one progress task counting all their windows (it printed none)."""
    assert perfclient(["-m", "mlp_fp32", "-m", "mlp_int8", "--simultaneous", "-u", endpoints.grpc,
                       "--power-source", "none", *QUICK]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "[start] 2 models concurrency 1: windows (6 steps)" in err, err
    assert any(line.startswith("[done] 2 models concurrency 1: windows (") for line in err), err
