"""`trtbuild serve` while Triton loads its models: a progress task, not silence."""

from __future__ import annotations

import io
import re
import shutil
from pathlib import Path

import pytest

from builder.serving.triton_server import Ports, TritonServer, free_ports
from common import progress


@pytest.mark.server
def test_start_shows_a_status_line_until_the_server_is_ready(repo_copy: Path, tmp_path: Path) -> None:
    for child in repo_copy.iterdir():  # one model: one stub, a short start
        if child.is_dir() and child.name != "mlp_fp32":
            shutil.rmtree(child)
    stream = io.StringIO()
    progress.configure(progress.Mode.PLAIN, stream=stream, interval=0.0)
    http, grpc, metrics = free_ports(3)
    server = TritonServer(repo_copy, tmp_path / "run", Ports(http, grpc, metrics))
    try:
        server.start(timeout=120)
    finally:
        server.stop()
        progress.configure(progress.Mode.OFF)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[start] tritonserver: starting (loading 1 model)", lines
    assert re.fullmatch(r"\[done\] tritonserver: starting \(loading 1 model\) \(\d+ s\)", lines[-1]), lines
