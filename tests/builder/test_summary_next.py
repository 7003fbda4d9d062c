"""The perfclient command the build summary proposes runs as printed (but for the server's address)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from builder.serving.triton_server import TritonServer
from builder.spec import ModelSpec
from builder.summary import perf_command
from client.cli import main as perfclient

QUICK = ["--measurement-interval", "300", "--max-trials", "2", "--stability-percentage", "90", "--warmup", "5"]


@pytest.mark.parametrize(("variants", "expected"), [
    (["seq_fp32", "seq_fp16"], "perfclient -m seq_fp32 -m seq_fp16 -u localhost:8001 --concurrency 8 --shape ids:12"),
    (["mlp_fp32", "seq_fp32", "mlp_fp16"], "perfclient -m mlp_fp32 -m mlp_fp16 -u localhost:8001 --concurrency 8"),
])
def test_the_proposed_perfclient_command_runs(variants: list[str], expected: str, triton: TritonServer,
                                              tiny_repository: tuple[Path, list[ModelSpec]],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A model with a free dim needs --shape (perfclient refuses it without); variants whose requests differ
    in shape are not loaded in one command."""
    repository, _ = tiny_repository
    command = perf_command(repository, variants)
    assert command == expected
    argv = shlex.split(command)[1:]
    argv[argv.index("-u") + 1] = f"127.0.0.1:{triton.ports.grpc}"
    argv[argv.index("--concurrency") + 1] = "1"
    assert perfclient([*argv, *QUICK, "-q"]) == 0, capsys.readouterr().err
