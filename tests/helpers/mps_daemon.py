"""A stand-in `nvidia-cuda-mps-control` for tests without a GPU, behaving as the real one did on an H200:
`-d` makes the control socket and runs; `quit` ends the daemon but leaves the socket behind; any command
without a live daemon exits non-zero. Every call is logged (first word: `-d` or the command)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from builder.serving import mps

SCRIPT = """#!/bin/sh
pipe="$CUDA_MPS_PIPE_DIRECTORY"
if [ "$1" = "-d" ]; then
  echo "-d $pipe ${CUDA_VISIBLE_DEVICES-unset}" >> "$CALLS"
  mkdir -p "$pipe" && : > "$pipe/control" && echo up > "$pipe/.alive"
  echo "[t] Starting control daemon using socket $pipe/control" >> "$CUDA_MPS_LOG_DIRECTORY/control.log"
  exit 0
fi
read cmd
echo "$cmd $pipe" >> "$CALLS"
[ -f "$pipe/.alive" ] || { echo "Cannot find MPS control daemon process" >&2; exit 1; }
case "$cmd" in
  quit) rm -f "$pipe/.alive" ;;
  get_server_list) echo 4242 ;;
esac
"""


def install(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in first on PATH (a GPU host's real one stays behind it); the file its calls are logged to."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    control = bin_dir / mps.CONTROL
    control.write_text(SCRIPT)
    control.chmod(control.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    calls = folder / "calls"
    calls.touch()
    monkeypatch.setenv("CALLS", str(calls))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    return calls


def calls_of(log: Path) -> list[str]:
    return [line.split()[0] for line in log.read_text().splitlines()]
