"""common.logs: libraries' lines (Python logging, warnings, native writes to fd 2) go to the log file,
not the terminal, unless -v; ours reach the terminal at the level the flags set."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.logs import active_log_file, close_log_file, configure_logging, native_stderr_to_log
from tests.helpers.cli_state import restored
from tests.helpers.tiny_models import mlp_onnx


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    with restored("builder"):
        yield


def _emit() -> None:
    logging.getLogger("onnxruntime").warning("ort library warning")
    # A library logger nothing here has configured (ModelOpt sets its own logger's level once imported).
    logging.getLogger("onnxscript.rewriter").info("library info")
    logging.getLogger("builder.pipeline").info("our info line")
    logging.getLogger("builder.pipeline").debug("our debug line")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a library's python warning", UserWarning, stacklevel=1)


def test_library_lines_land_in_the_log_file_not_on_stderr(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "logs" / "build.log"
    configure_logging(["builder"], verbose=0, quiet=False, log_file=log)
    assert active_log_file() == log
    _emit()
    err = capsys.readouterr().err
    assert err.splitlines() == ["INFO builder.pipeline: our info line"]
    text = log.read_text()
    for line in ("WARNING onnxruntime: ort library warning", "INFO onnxscript.rewriter: library info",
                 "INFO builder.pipeline: our info line", "DEBUG builder.pipeline: our debug line",
                 "a library's python warning"):
        assert line in text, line
    close_log_file()
    assert active_log_file() is None


def test_verbose_brings_library_warnings_to_the_terminal(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(["builder"], verbose=1, quiet=False, log_file=tmp_path / "b.log")
    _emit()
    err = capsys.readouterr().err
    assert "WARNING onnxruntime: ort library warning" in err and "DEBUG builder.pipeline: our debug line" in err
    assert "library info" not in err  # -vv for everything


def test_quiet_shows_warnings_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(["builder"], verbose=0, quiet=True, log_file=tmp_path / "b.log")
    _emit()
    logging.getLogger("builder.steps").warning("our warning")
    assert capsys.readouterr().err.splitlines() == ["WARNING builder.steps: our warning"]
    assert "our info line" in (tmp_path / "b.log").read_text()


def test_native_writes_to_fd2_go_to_the_log_python_stderr_stays(tmp_path: Path,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "b.log"
    configure_logging(["builder"], verbose=0, quiet=False, log_file=log)
    with native_stderr_to_log():
        os.write(2, b"\x1b[1;31m2026 [E:onnxruntime] native error line\x1b[m\n")
        print("our message", file=sys.stderr, flush=True)
    os.write(2, b"after the block\n")
    err = capfd.readouterr().err
    assert "native error line" not in err
    assert "our message" in err and "after the block" in err
    assert "native error line" in log.read_text()


def test_trtbuild_keeps_library_output_off_the_terminal(tmp_path: Path) -> None:
    model = mlp_onnx(tmp_path / "mlp.onnx")
    log = tmp_path / "build.log"
    # A real build in a fresh interpreter: ONNX Runtime, onnxslim and ModelOpt (FP16) all run.
    proc = subprocess.run([sys.executable, "-m", "builder", "build", "--onnx", str(model), "--name", "m",
                           "--precision", "fp32,fp16", "--repository", str(tmp_path / "repo"), "--log", str(log)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for line in proc.stderr.splitlines():
        # Ours (INFO builder...), progress lines ([start] ...) and nothing else.
        assert line.startswith(("INFO builder.", "WARNING builder.", "[")), line
    assert f"build log:  {log}" in proc.stdout
    text = log.read_text()
    assert "DEBUG builder." in text
