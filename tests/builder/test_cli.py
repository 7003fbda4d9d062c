"""Bad input through `trtbuild`: one line on stderr naming the input, exit 1, repository unchanged."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from builder.cli import main
from tests.helpers.files import snapshot
from tests.helpers.tiny_models import mlp_onnx, mlp_samples, sequence_onnx


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("trtbuild: error:")]
    return code, errors[-1] if errors else ""


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    mlp = mlp_onnx(tmp_path / "mlp.onnx")
    text = tmp_path / "text.onnx"
    text.write_text("hello\n" * 50)
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(mlp.read_bytes()[:300])
    np.savez(tmp_path / "cal.npz", **mlp_samples(64))
    np.savez(tmp_path / "wrong_name.npz", pixels=mlp_samples(64)["x"])
    np.savez(tmp_path / "wrong_shape.npz", x=np.zeros((64, 4, 15), np.float32))
    np.savez(tmp_path / "wrong_dtype.npz", x=np.zeros((64, 4, 32), np.int32))
    return {"mlp": mlp, "text": text, "cut": cut, "seq": sequence_onnx(tmp_path / "seq.onnx"),
            "cal": tmp_path / "cal.npz", "wrong_name": tmp_path / "wrong_name.npz",
            "wrong_shape": tmp_path / "wrong_shape.npz", "wrong_dtype": tmp_path / "wrong_dtype.npz"}


CASES = [
    (["--onnx", "{tmp}/absent.onnx"], "absent.onnx: file not found"),
    (["--onnx", "{text}"], "text.onnx: not"),
    (["--onnx", "{cut}"], "cut.onnx: not"),
    (["--onnx", "{mlp}", "--precision", "fp32,fp4"], '--precision: expected one of fp32, fp16, int8, got "fp4"'),
    (["--onnx", "{mlp}", "--precision", "int8"], "--precision: int8 needs --calibration FILE.npz"),
    (["--onnx", "{mlp}", "--calibration", "{wrong_name}"], "input names ['pixels'] do not match the model's ['x']"),
    (["--onnx", "{mlp}", "--calibration", "{wrong_shape}"], "input 'x' axis 2 is 15, expected 32"),
    (["--onnx", "{mlp}", "--calibration", "{wrong_dtype}"], "input 'x' has dtype int32, expected float32"),
    (["--onnx", "{seq}", "--precision", "fp32"], "axis 1 ('seq') is dynamic and has no range"),
    (["--onnx", "{mlp}", "--max-batch", "0"], "--max-batch: expected an integer >= 1, got 0"),
    (["--onnx", "{seq}", "--precision", "fp32", "--dim", "seq=8:4:16"], "--dim seq: expected min <= opt <= max"),
    (["--onnx", "{mlp}", "--runtime", "tensorrt"], "--runtime tensorrt:"),
    (["--onnx", "{mlp}", "--name", "bad name"], '--name: expected a name of letters, digits'),
    (["--onnx", "{mlp}", "--calibration-method", "max"], "--calibration-method: only with --calibration FILE.npz"),
    (["--onnx", "{mlp}", "--calibration", "cal.txt"],
     '--calibration: expected module:function or a .npz file, got "cal.txt"'),
]


@pytest.mark.parametrize(("args", "message"), CASES)
def test_bad_input_is_one_line_exit_1_and_repository_untouched(
    args: list[str], message: str, files: dict[str, Path], repo_copy: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    filled = [a.format(tmp=tmp_path, **files) for a in args]
    if "--name" not in filled:
        filled += ["--name", "mlp"]
    before = snapshot(repo_copy)
    code, line = run_cli(["build", *filled, "--repository", str(repo_copy)], capsys)
    assert code == 1
    assert message in line, line
    # No model is touched (a build that got as far as build_all leaves its report, which lists the failure).
    assert {k: v for k, v in snapshot(repo_copy).items() if k != "build_report.json"} == \
        {k: v for k, v in before.items() if k != "build_report.json"}


def test_user_onnx_builds_with_calibration_split_for_evaluation(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = tmp_path / "repo"
    code = main(["build", "--onnx", str(files["mlp"]), "--name", "user_mlp", "--calibration", str(files["cal"]),
                 "--task", "classification", "--repository", str(repo), "--report", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "user_mlp_int8" in out and (repo / "user_mlp_int8" / "config.pbtxt").is_file()
    import json

    report = json.loads((tmp_path / "r.json").read_text())
    int8 = report["models"][0]["variants"][2]
    assert int8["calibration"]["samples"] == 48 and int8["accuracy"]["samples"] == 16.0


def test_manifest_errors_and_unknown_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, line = run_cli(["engines", "--manifest", str(tmp_path / "none.toml")], capsys)
    assert code == 1 and "manifest not found" in line
    root = Path(__file__).resolve().parents[2]
    code, line = run_cli(["engines", "--manifest", str(root / "models.toml"), "--only", "resnet"], capsys)
    assert code == 1 and "--only resnet: not in" in line


@pytest.mark.server
def test_port_in_use_is_reported(tmp_path: Path, repo_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        code, line = run_cli(["serve", "--repository", str(repo_copy), "--state-dir", str(tmp_path / "run"),
                              "--http-port", str(port), "--grpc-port", "0", "--metrics-port", "0"], capsys)
    assert code == 1
    assert f"--http-port {port}: port is in use" in line


def test_user_errors_print_no_traceback(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "builder", "build", "--onnx", str(tmp_path / "x.onnx"),
                           "--name", "x"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"trtbuild: error: {tmp_path / 'x.onnx'}: file not found"


@pytest.mark.parametrize(("flags", "info", "debug"), [([], True, False), (["-q"], False, False),
                                                      (["-v"], True, True)])
def test_verbosity_flags_change_what_the_builder_logs(
    flags: list[str], info: bool, debug: bool, files: dict[str, Path], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = tmp_path / "build.log"
    code = main([*flags, "build", "--onnx", str(files["mlp"]), "--name", "v", "--precision", "fp32",
                 "--repository", str(tmp_path / "repo"), "--log", str(log)])
    err = capsys.readouterr().err.splitlines()
    assert code == 0, err
    # The terminal shows what the flags allow; the build log holds our debug lines whatever the flags.
    assert any(line.startswith("INFO builder.") for line in err) is info
    assert any(line.startswith("DEBUG builder.") for line in err) is debug
    assert " DEBUG builder." in log.read_text()
