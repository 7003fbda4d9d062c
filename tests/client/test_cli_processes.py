"""--processes N and the options it does not combine with: refused from the command line as one line naming
both options, exit 2, before any connection (no server needed: the run itself must never start). SessionConfig
decides them (tests/client/test_workers.py: the same refusals without the CLI)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from client import cli
from client.cli import main, parse_config


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a measurement (connecting) fails the test: a refusal must come before."""
    def measure(config: cli.CliConfig) -> list[object]:
        raise AssertionError(f"the run started: {config}")

    monkeypatch.setattr(cli, "_measure", measure)


@pytest.mark.parametrize(("args", "other"), [
    (["-m", "a", "-m", "b", "--simultaneous", "--concurrency", "4"], "--simultaneous"),
    (["--concurrency", "4", "--request-count", "100"], "--request-count 100"),
    (["--request-intervals", "gaps.txt"], "--request-intervals gaps.txt"),
    (["--concurrency", "4", "--validate", "expected.npz"], "--validate expected.npz"),
    (["--concurrency", "1"], "--concurrency 1"),
    ([], "--concurrency 1 (the default)"),
    (["--concurrency-range", "1:8"], "--concurrency-range 1:8"),
    # Quoted as typed, not rebuilt from the levels (1:7:3, or --concurrency 1 for a one-level range).
    (["--concurrency-range", "1:9:3"], "--concurrency-range 1:9:3 "),
    (["--concurrency-range", "1:1"], "--concurrency-range 1:1 "),
    (["-m", "b", "--concurrency", "4", "--model-concurrency", "b=1"], "--model-concurrency b=1"),
])
def test_refused_combinations_are_one_line_naming_both_and_exit_2(
        args: list[str], other: str, no_run: None, dead_url: str, capsys: pytest.CaptureFixture[str],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The file exists: SessionConfig decides the conflict once the options are read (a missing file is its own error).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gaps.txt").write_text("1000\n", encoding="utf-8")
    code = main(["-m", "a", "-u", dead_url, "--processes", "2", "--no-progress", *args])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.count("\n") == 1 and captured.out == ""
    line = captured.err.strip()
    assert line.startswith("perfclient: error: --processes 2: not with ") and other in line, line
    assert ("(the default)" in line) == (args == []), line  # a typed --concurrency 1 is no default


@pytest.mark.parametrize("args", [
    ["--concurrency", "2"],
    ["--concurrency-range", "2:8:2"],
    ["--request-rate", "100"],
    ["--request-rate", "100", "--distribution", "poisson"],
    ["--concurrency", "4", "--shared-memory", "system"],  # the workers send through the parent's regions
    ["--concurrency", "4", "--time-limit", "5"],
    # b's own concurrency is what b is driven at; the shared default (1) is nobody's.
    ["-m", "b", "--model-concurrency", "a=2", "--model-request-rate", "b=50"],
])
def test_supported_combinations_pass(args: list[str]) -> None:
    config = parse_config(["-m", "a", "--processes", "2", *args])
    assert config.session.processes == 2


def test_one_process_combines_with_everything() -> None:
    # The refusals are --processes' own: without it the same flags parse.
    config = parse_config(["-m", "a", "--concurrency", "1", "--request-count", "100", "--processes", "1"])
    assert config.session.measurement.request_count == 100


def test_the_installed_entry_point_exits_2(dead_url: str, tmp_path: Path) -> None:
    # `python -m client` itself: the exit status a shell script sees, and no traceback.
    (tmp_path / "gaps.txt").write_text("1000\n", encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, "-m", "client", "-m", "a", "-u", dead_url, "--processes", "2", "--request-intervals",
         str(tmp_path / "gaps.txt"), "--no-progress"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"perfclient: error: --processes 2: not with --request-intervals {tmp_path / 'gaps.txt'} "
        "(one replayed schedule, one process)"]
