"""perfclient --validate under load catches a model that is wrong for one input only: a python-backend
model of our own that doubles its input, except for rows starting with 7.0, where it adds 1 more.
The tolerances, the checked fraction and the mix with --input-data come from the command line."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from builder.serving.triton_server import Ports, TritonServer, free_ports
from client.cli import main
from client.validate import MISMATCH, Check, ValidateOptions

MODEL = "wrong_for_one"
SAMPLES = 8
BAD = 3  # the sample the model gets wrong

CONFIG = f"""
name: "{MODEL}"
backend: "python"
max_batch_size: 8
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""

MODEL_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            y = 2 * x
            y[x[:, 0] == 7.0] += 1.0  # deliberately wrong for one input
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", y.astype(np.float32))]))
        return responses
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """gRPC HOST:PORT of a server holding only the wrong-for-one model."""
    root = tmp_path_factory.mktemp("wrong_for_one")
    folder = root / "repository" / MODEL
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(textwrap.dedent(CONFIG))
    (folder / "1" / "model.py").write_text(MODEL_PY)
    triton = TritonServer(root / "repository", root / "state", Ports(*free_ports(3)))
    triton.start(timeout=120)
    try:
        yield f"127.0.0.1:{triton.ports.grpc}"
    finally:
        triton.stop()


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Inputs and the right answers (2x) for 8 samples; sample 3 starts with 7.0, so the model errs on it."""
    x = np.random.default_rng(0).uniform(-1, 1, size=(SAMPLES, 4)).astype(np.float32)
    x[BAD, 0] = 7.0
    path = tmp_path_factory.mktemp("expected") / "expected.npz"
    np.savez(path, **{f"{MODEL}/input/x": x, f"{MODEL}/output/y": 2 * x})
    return path


def perfclient(url: str, expected: Path, tmp_path: Path, quick_args: list[str], capsys: pytest.CaptureFixture[str],
               *extra: str) -> dict[str, Any]:
    out_json = tmp_path / "r.json"
    code = main(["-m", MODEL, "-u", url, "--concurrency", "2", "--validate", str(expected), "--power-source", "none",
                 "--json", str(out_json), *quick_args, *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    (result,) = json.loads(out_json.read_text())["results"]
    return dict(result)


def share_wrong(result: dict[str, Any]) -> float:
    wrong = result["errors"].get(MISMATCH, 0)
    return float(wrong / (wrong + result["requests"]))


def test_the_one_wrong_input_is_caught_under_load(server: str, expected: Path, tmp_path: Path,
                                                  quick_args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    result = perfclient(server, expected, tmp_path, quick_args, capsys)
    assert set(result["errors"]) == {MISMATCH} and result["requests"] > 0
    # Eight payloads in rotation, one of them wrong: an eighth of the answers, give or take the window edges.
    assert 0.08 <= share_wrong(result) <= 0.17, result


def test_a_tolerance_wider_than_the_error_passes_it(server: str, expected: Path, tmp_path: Path,
                                                    quick_args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # The wrong answer is off by 1.0 in one element: atol 1.5 accepts it, atol 0.5 does not.
    assert perfclient(server, expected, tmp_path, quick_args, capsys, "--validate-atol", "1.5")["errors"] == {}
    strict = perfclient(server, expected, tmp_path, quick_args, capsys, "--validate-atol", "0.5",
                        "--validate-rtol", "0")
    assert set(strict["errors"]) == {MISMATCH}


def test_a_fraction_checks_that_share_and_the_mix_adds_the_load_payloads(
    server: str, expected: Path, tmp_path: Path, quick_args: list[str], capsys: pytest.CaptureFixture[str],
) -> None:
    half = perfclient(server, expected, tmp_path, quick_args, capsys, "--validate-fraction", "0.5")
    assert 0.03 <= share_wrong(half) <= 0.09, half  # half the wrong payload's answers are compared
    # With --input-data, its 8 random payloads are sent too: one wrong in 16 payloads.
    mixed = perfclient(server, expected, tmp_path, quick_args, capsys, "--input-data", "random")
    assert 0.035 <= share_wrong(mixed) <= 0.09, mixed


def test_check_compares_every_nth_answer_from_the_first() -> None:
    want = {"y": np.ones(3, np.float32)}
    every = Check(want, ValidateOptions())
    assert all(every.due() for _ in range(5))
    third = Check(want, ValidateOptions(fraction=1 / 3))
    assert [third.due() for _ in range(9)] == [True, False, False] * 3
    assert Check(want, ValidateOptions(atol=0.2, rtol=0)).matches({"y": want["y"] + 0.1})
    assert not Check(want, ValidateOptions(atol=0.05, rtol=0)).matches({"y": want["y"] + 0.1})


@pytest.mark.parametrize(("args", "message"), [
    (["--validate-atol", "-1"], "--validate-atol -1.0: expected a finite number >= 0"),
    (["--validate-rtol", "inf"], "--validate-rtol inf: expected a finite number >= 0"),
    (["--validate-fraction", "0"], "--validate-fraction 0.0: expected 0 < F <= 1"),
    (["--validate-fraction", "1.5"], "--validate-fraction 1.5: expected 0 < F <= 1"),
])
def test_bad_validate_options_are_one_line(args: list[str], message: str, expected: Path, dead_url: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["-m", MODEL, "-u", dead_url, "--validate", str(expected), *args])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 1 and captured.out == "" and err == [f"perfclient: error: {message}"]
