"""build.json, tuned.toml and repository folders crafted by someone else: sizes bounded, names checked,
no path out of the repository, symlinks out of it refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from builder.cli import main
from builder.errors import ManifestError
from builder.repository.model_folder import RECORD, read_record
from builder.spec.tuned import load_tuned
from builder.spec.untrusted import MAX_RECORD_BYTES, MAX_TUNED_BYTES, UnsafeInput, check_tree, inside
from builder.tuning.targets import read_configs


def record(model_dir: Path, **fields: object) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    data = {"build_key": "k", "artifact": f"{model_dir.name}/1/model.onnx", "runtime": "onnxruntime",
            "inputs": {}, **fields}
    path = model_dir / RECORD
    path.write_text(json.dumps(data))
    return path


def test_a_plain_record_is_read(tmp_path: Path) -> None:
    record(tmp_path / "repo" / "m_fp32")
    got = read_record(tmp_path / "repo" / "m_fp32")
    assert got is not None and got.artifact == "m_fp32/1/model.onnx"


@pytest.mark.parametrize("artifact", ["../../../etc/passwd", "/etc/passwd", "m_fp32/../../outside.onnx", ""])
def test_a_record_whose_artifact_leaves_the_repository_is_ignored(
        tmp_path: Path, artifact: str, caplog: pytest.LogCaptureFixture) -> None:
    record(tmp_path / "repo" / "m_fp32", artifact=artifact)
    assert read_record(tmp_path / "repo" / "m_fp32") is None
    assert "artifact" in caplog.text


def test_a_record_whose_artifact_is_a_symlink_out_of_the_repository_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "secret.onnx").write_bytes(b"x")
    version = tmp_path / "repo" / "m_fp32" / "1"
    version.mkdir(parents=True)
    (version / "model.onnx").symlink_to(tmp_path / "secret.onnx")
    record(tmp_path / "repo" / "m_fp32")
    assert read_record(tmp_path / "repo" / "m_fp32") is None


def test_an_oversized_or_symlinked_record_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = record(tmp_path / "repo" / "m_fp32", padding="x" * MAX_RECORD_BYTES)
    assert read_record(tmp_path / "repo" / "m_fp32") is None
    assert f"over {MAX_RECORD_BYTES} bytes" in caplog.text
    outside = record(tmp_path / "elsewhere")
    path.unlink()
    path.symlink_to(outside)
    assert read_record(tmp_path / "repo" / "m_fp32") is None
    assert "outside" in caplog.text


def test_inside_refuses_every_way_out(tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    assert inside(tmp_path / "repo", "a/b", "x") == (tmp_path / "repo" / "a" / "b").resolve()
    for bad in ("..", "a/../../b", "/abs", "a\0b"):
        with pytest.raises(UnsafeInput):
            inside(tmp_path / "repo", bad, "x")


def test_tuned_toml_is_bounded_and_its_names_checked(tmp_path: Path) -> None:
    path = tmp_path / "tuned.toml"
    path.write_text("# " + "x" * MAX_TUNED_BYTES + "\n")
    with pytest.raises(UnsafeInput, match="over"):
        load_tuned(path)
    path.write_text('["../evil"]\nvariant = "../evil_fp32"\nmax_batch_size = 4\n')
    with pytest.raises(ManifestError, match="table name"):
        load_tuned(path)
    path.write_text('[m]\nvariant = "m_../../etc"\nmax_batch_size = 4\n')
    with pytest.raises(ManifestError, match="variant"):
        load_tuned(path)
    path.write_text('[m]\nvariant = "m_fp32"\nmax_batch_size = 4\n')
    assert set(load_tuned(path)) == {"m_fp32"}


def test_a_repository_with_a_symlink_out_of_it_is_refused(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "m_fp32" / "1").mkdir(parents=True)
    (repo / "m_fp32" / "config.pbtxt").write_text('name: "m_fp32"\n')
    (repo / "m_fp32" / "1" / "inside.txt").write_text("ok")
    (repo / "m_fp32" / "1" / "link_in").symlink_to(repo / "m_fp32" / "1" / "inside.txt")  # fine: stays inside
    assert check_tree(repo) == 5
    (tmp_path / "outside").mkdir()
    (repo / "m_fp32" / "1" / "model.py").symlink_to(tmp_path / "outside" / "model.py")
    with pytest.raises(UnsafeInput, match="outside the repository"):
        check_tree(repo)
    # tune reads and copies a variant's folder: refused too
    with pytest.raises(UnsafeInput, match="outside the repository"):
        read_configs(repo, ["m_fp32"])
    with pytest.raises(UnsafeInput, match="over 3 files"):
        check_tree(repo, limit=3)


@pytest.mark.server  # goes through TritonServer.start (refused before any process starts)
def test_serve_refuses_a_repository_with_a_symlink_out_of_it(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "evil").symlink_to(tmp_path)
    assert main(["serve", "--repository", str(repo), "--state-dir", str(tmp_path / "run")]) == 1
    assert "a symlink to" in capsys.readouterr().err


def test_a_symlink_loop_is_refused_in_one_line_not_a_traceback(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    repo = tmp_path / "repo"
    (repo / "m_fp32" / "1").mkdir(parents=True)
    (repo / "m_fp32" / "1" / "loop").symlink_to("loop")
    with pytest.raises(UnsafeInput, match="symlink loop"):
        check_tree(repo)
    (repo / "m_fp32" / "1" / "loop").unlink()
    (repo / "m_fp32" / RECORD).symlink_to(RECORD)  # build.json pointing at itself
    assert read_record(repo / "m_fp32") is None
    assert "symlink loop" in caplog.text


def test_a_record_that_is_a_fifo_is_ignored_without_waiting_for_a_writer(tmp_path: Path) -> None:
    model_dir = tmp_path / "repo" / "m_fp32"
    model_dir.mkdir(parents=True)
    os.mkfifo(model_dir / RECORD)
    assert read_record(model_dir) is None  # before: open() blocked until someone wrote to the FIFO
