"""bench/tune_ab.py: a point that fails is recorded with its reason and the rounds go on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.scripts import loaded_script

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "tune_ab.py"

# Appended to the variant's Python model: the same model, refusing to load with max_batch_size 4.
PICKY = '''

_Model = TritonPythonModel


class TritonPythonModel(_Model):  # noqa: F811
    def initialize(self, args):
        if json.loads(args["model_config"]).get("max_batch_size") == 4:
            raise RuntimeError("max_batch_size 4 refused on purpose")
        super().initialize(args)
'''


@pytest.fixture(scope="module")
def tune_ab() -> Iterator[ModuleType]:
    with loaded_script("tune_ab", SCRIPT) as module:
        yield module


def _ab_with_max_batch_4_patched(tune_ab: ModuleType, repo_copy: Path, patch: str, *, rounds: int,
                                 capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """tune_ab's a (max batch 8) against b (max batch 4) with `patch` appended to the variant's Python model:
    the exit status and the lines printed."""
    model = repo_copy / "mlp_fp32" / "1" / "model.py"
    model.write_text(model.read_text() + patch)
    status = tune_ab.main(["--repository", str(repo_copy), "--model", "mlp_fp32", "--a", "8,0,1", "--b", "4,off,1",
                           "--concurrency", "2", "--measurement-interval", "300", "--max-trials", "2",
                           "--rounds", str(rounds)])
    return status, capsys.readouterr().out.splitlines()


@pytest.mark.server
def test_a_failing_point_is_recorded_with_its_reason_and_the_rounds_go_on(
        tune_ab: ModuleType, repo_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _ab_with_max_batch_4_patched(tune_ab, repo_copy, PICKY, rounds=2, capsys=capsys)
    assert status == 1  # one side has no median
    a = next(line for line in out if line.startswith("a: mlp_fp32 mbs=8 batching=0us inst=1"))
    assert "median -" not in a and a.count(",") == 1  # two throughputs, both measured
    failures = [line for line in out if line.strip().startswith("failed:")]
    assert len(failures) == 2 and all("max_batch_size 4 refused on purpose" in line for line in failures)
    assert out[-1] == "no ratio: b measured nothing in 2 of 2 rounds"


@pytest.mark.parametrize(("args", "message"), [
    (["--a", "8,0"], "argument --a: '8,0': expected MAX_BATCH,QUEUE_DELAY_US,INSTANCES"),
    (["--b", "8,soon,1"], "argument --b: '8,soon,1': expected MAX_BATCH,QUEUE_DELAY_US,INSTANCES"),
    (["--b", "8,0,0"], "argument --b: '8,0,0': expected max batch >= 0, delay >= 0 or off, instances >= 1"),
    (["--rounds", "0"], "argument --rounds: '0': expected a positive integer"),
    (["--model", "absent"], "--model absent: expected a variant folder with config.pbtxt"),
])
def test_bad_arguments_are_one_line_naming_the_flag(
        tune_ab: ModuleType, args: list[str], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        tune_ab.main(["--repository", str(tmp_path), *args])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0]


# Appended to the variant's Python model: loading it with max_batch_size 4 kills the server (the stub's
# parent), as an out-of-memory kill or a crash in a backend would.
FATAL = '''

_Model = TritonPythonModel


class TritonPythonModel(_Model):  # noqa: F811
    def initialize(self, args):
        if json.loads(args["model_config"]).get("max_batch_size") == 4:
            import os
            import signal
            os.kill(os.getppid(), signal.SIGKILL)
        super().initialize(args)
'''


@pytest.mark.server
def test_a_server_that_dies_mid_run_keeps_what_was_measured_and_says_how_far_it_got(
        tune_ab: ModuleType, repo_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out = _ab_with_max_batch_4_patched(tune_ab, repo_copy, FATAL, rounds=3, capsys=capsys)
    assert status == 1
    a = next(line for line in out if line.startswith("a: mlp_fp32 mbs=8 batching=0us inst=1"))
    assert "median -" not in a and a.count(",") == 0  # the one round measured before b killed the server
    assert "no ratio: b measured nothing in 1 of 3 rounds" in out
    assert out[-1].startswith("partial: tune: the tuning server exited") and "mbs=4" in out[-1]
