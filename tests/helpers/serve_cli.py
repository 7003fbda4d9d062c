"""`trtbuild serve` as the serving tests call it in-process: its arguments on free ports, its error lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.serving.triton_server import free_ports


def serve_args(repository: Path, state: Path, *extra: str) -> list[str]:
    """`serve --background` of `repository` from `state` on three free loopback ports, then `extra`."""
    http, grpc, metrics = free_ports(3)
    return ["serve", "--background", *extra, "--repository", str(repository), "--state-dir", str(state),
            "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--timeout", "120"]


def error_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The `trtbuild: error:` lines written to stderr since the last read."""
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("trtbuild: error:")]
