"""Tuned settings survive a rebuild: `trtbuild tune` writes tuned.toml beside the manifest, and
`trtbuild engines` (forced or not) layers it over models.toml and says so."""

from __future__ import annotations

import json
import logging
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

from builder.cli import main
from builder.errors import ManifestError
from builder.repository.tuned_serving import Serving, layer, serving_of
from builder.spec.tuned import TunedServing, load_tuned
from tests.helpers.files import snapshot
from tests.helpers.servers import served as served_requests
from tests.helpers.tiny_models import mlp_onnx

MANIFEST = '''# the user's own comment stays theirs
[[model]]
name = "mlp"
onnx = "mlp.onnx"
precisions = ["fp32"]
batch = { min = 1, opt = 4, max = 8 }

[model.serving]
instances = 1
max_queue_delay_us = 0
'''

TUNE = ["--precisions", "fp32", "--max-batch", "2,64", "--queue-delay-us", "500", "--instances", "2",
        "--search", "exhaustive", "--concurrency", "2", "--measurement-interval", "300", "--max-trials", "2",
        "--no-compare"]


def served(repository: Path) -> Serving:
    return serving_of((repository / "mlp_fp32" / "config.pbtxt").read_text())


@pytest.mark.server
def test_tune_then_engines_force_keeps_the_tuned_settings(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    mlp_onnx(tmp_path / "mlp.onnx")
    manifest = tmp_path / "models.toml"
    manifest.write_text(MANIFEST)
    repository = tmp_path / "repository"
    assert main(["engines", "--manifest", str(manifest), "--repository", str(repository)]) == 0
    assert served(repository) == Serving(8, 0, 1)
    files = ["--manifest", str(manifest), "--repository", str(repository), "--report", str(tmp_path / "t.json"),
             "--plot", str(tmp_path / "t.png"), "--html", str(tmp_path / "t.html")]

    # --dry-run: measured and shown, nothing written.
    before = snapshot(repository)
    capsys.readouterr()
    assert main(["tune", "mlp", *files, *TUNE, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "+max_batch_size = 2" in out and "+max_batch_size: 2" in out and "not written (--dry-run" in out
    assert snapshot(repository) == before and not (tmp_path / "tuned.toml").exists()

    # The engine takes batches of at most 8: 64 is left out of the space.
    assert main(["tune", "mlp", *files, *TUNE]) == 0
    assert served(repository) == Serving(2, 500, 2)
    assert json.loads((tmp_path / "t.json").read_text())["space"]["max_batch_sizes"] == [2]
    page = (tmp_path / "t.html").read_text()
    assert "<h2>Pick: mlp_fp32 mbs=2 batching=500us inst=2</h2>" in page and "data:image/png;base64,iVBOR" in page
    assert page.count("<tr class=") == 1 and "src='http" not in page  # one point; nothing fetched
    tuned = load_tuned(tmp_path / "tuned.toml")
    assert set(tuned) == {"mlp_fp32"} and tuned["mlp_fp32"].max_batch_size == 2
    assert tuned["mlp_fp32"].measured["objective"] == "throughput"
    assert manifest.read_text() == MANIFEST  # the user's file is theirs
    record = json.loads((repository / "mlp_fp32" / "build.json").read_text())
    assert record["tuned"]["max_batch_size"] == 2 and record["serving_as_built"]["max_batch_size"] == 8
    # A second tune starts from, and compares against, the builder's settings, not the last winner.
    assert main(["tune", "mlp", *files, *TUNE, "--dry-run"]) == 0
    assert json.loads((tmp_path / "t.json").read_text())["default"] == {
        "variant": "mlp_fp32", "max_batch_size": 8, "queue_delay_us": 0, "instances": 1}

    caplog.set_level(logging.INFO, logger="builder")
    assert main(["engines", "--manifest", str(manifest), "--repository", str(repository), "--force"]) == 0
    assert served(repository) == Serving(2, 500, 2)
    kept = [r.getMessage() for r in caplog.records if "keeping the tuned settings" in r.getMessage()]
    assert kept == ["mlp_fp32: keeping the tuned settings from tuned.toml (mbs=2 batching=500us inst=2)"]
    record = json.loads((repository / "mlp_fp32" / "build.json").read_text())
    assert record["tuned"]["instances"] == 2 and record["serving_as_built"] == Serving(8, 0, 1).to_json()

    # Without the entry, an unchanged build goes back to models.toml's settings; an entry for a
    # precision models.toml does not build is named, not applied.
    (tmp_path / "tuned.toml").write_text('# edited by hand\n[mlp]\nvariant = "mlp_int8"\nmax_batch_size = 4\n')
    caplog.clear()
    assert main(["engines", "--manifest", str(manifest), "--repository", str(repository)]) == 0
    assert served(repository) == Serving(8, 0, 1)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"{tmp_path / 'tuned.toml'}: [mlp] names mlp_int8, which models.toml does not build; not applied"]
    assert json.loads((repository / "mlp_fp32" / "build.json").read_text())["tuned"] is None


def test_a_bad_tuned_file_is_one_line_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "tuned.toml"
    path.write_text('[mlp]\nvariant = "mlp_fp32"\nmax_batch_size = -1\n')
    with pytest.raises(ManifestError, match=r"tuned.toml: \[mlp\].max_batch_size: expected an integer >= 0, got -1"):
        load_tuned(path)
    path.write_text('[mlp]\nvariant = "mlp_fp32"\nmax_batch_size = 0\n')  # no batching: no dynamic batching
    with pytest.raises(ManifestError, match=r"\[mlp\].dynamic_batching: expected false with max_batch_size 0"):
        load_tuned(path)
    path.write_text('[mlp]\nvariant = "mlp_fp32"\nmax_batch_size = 0\ndynamic_batching = false\n')
    assert load_tuned(path)["mlp_fp32"].queue_delay_us is None
    path.write_text('[mlp]\nvariant = "other_fp32"\nmax_batch_size = 4\n')
    with pytest.raises(ManifestError, match=r"\[mlp\].variant: expected a variant name mlp_<precision>"):
        load_tuned(path)
    path.write_text('[mlp]\nvariant = "mlp_fp32"\nmax_batch_size = 4\nmax_batch = 4\n')
    with pytest.raises(ManifestError, match="unknown key 'max_batch'"):
        load_tuned(path)


@pytest.mark.parametrize(("args", "message"), [
    (["serve", "--model-control", "poll"], "--model-control 'poll': expected one of none, explicit"),
    (["tune", "mlp", "--grpc-url", "h:1"], "--grpc-url/--metrics-url/--admin-key-file: only with --url"),
    (["tune", "mlp", "--url", "nohost"], "--url 'nohost': expected HOST:PORT"),
    (["tune", "mlp", "--search", "random"], "--search"),
    (["tune", "mlp", "--trials", "0"], "--trials 0: expected a positive integer"),
])
def test_tune_and_serve_flags_are_checked_in_one_line(
        args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*args, "--repository", str(tmp_path / "absent")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trtbuild: error: ") and message in err[0]


def test_a_bad_tuned_file_or_report_path_is_one_line_before_any_measurement(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mlp_onnx(tmp_path / "mlp.onnx")
    manifest = tmp_path / "models.toml"
    manifest.write_text(MANIFEST)
    repository = tmp_path / "repository"
    (repository / "mlp_fp32").mkdir(parents=True)  # no config: a measurement would fail differently
    files = ["--manifest", str(manifest), "--repository", str(repository), "--plot", str(tmp_path / "t.png"),
             "--html", str(tmp_path / "t.html")]
    (tmp_path / "tuned.toml").write_text('[mlp]\nvariant = "mlp_fp32"\nmax_batch_size = 4\nmeasured = 3\n')
    assert main(["tune", "mlp", *files, "--report", str(tmp_path / "t.json"), *TUNE]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "[mlp].measured: expected a table" in err[0]

    (tmp_path / "tuned.toml").unlink()
    (tmp_path / "file").write_text("")
    assert main(["tune", "mlp", *files, "--report", str(tmp_path / "file" / "t.json"), *TUNE]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"trtbuild: error: --report {tmp_path / 'file' / 't.json'}: ")
    assert not (tmp_path / "tuned.toml").exists() and not (tmp_path / "t.png").exists()


def test_tuned_settings_on_a_model_rebuilt_without_batching_turn_batching_off(repo_copy: Path) -> None:
    folder = repo_copy / "mlp_fp32"
    record = json.loads((folder / "build.json").read_text())
    record["serving_as_built"] = Serving(0, None, 1).to_json()  # as a build with max_batch_size 0 records it
    (folder / "build.json").write_text(json.dumps(record))
    line = layer(folder, TunedServing("mlp", "mlp_fp32", 8, 500, 2))
    assert line is not None and served(repo_copy) == Serving(0, None, 2)
    # The same settings again: build.json is not rewritten.
    stamp = (folder / "build.json").stat().st_mtime_ns
    layer(folder, TunedServing("mlp", "mlp_fp32", 8, 500, 2))
    assert (folder / "build.json").stat().st_mtime_ns == stamp


def _private_server_answered(tmp: Path) -> bool:
    """Whether tune's private server (its state folder under `tmp`) has answered requests for mlp_fp32: its
    own statistics say so; False while it has no record or does not answer yet."""
    for record in tmp.glob("trtbuild-tune-*/state/tritonserver.json"):
        try:
            return served_requests(f"127.0.0.1:{json.loads(record.read_text())['ports']['http']}", "mlp_fp32") > 0
        except (OSError, ValueError, KeyError):  # the record half written, the server starting or loading
            return False
    return False


def _terminate_once_measuring(tmp: Path, stop: threading.Event) -> None:
    """SIGTERM to this process once the private server has answered the first point's requests."""
    deadline = time.monotonic() + 120
    while not stop.is_set() and time.monotonic() < deadline:
        if _private_server_answered(tmp):
            os.kill(os.getpid(), signal.SIGTERM)
            return
        stop.wait(0.1)


@pytest.mark.server
def test_sigterm_stops_a_tune_run_cleanly_and_the_report_says_partial(
        repo_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    mlp_onnx(tmp_path / "mlp.onnx")
    (tmp_path / "models.toml").write_text(MANIFEST)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    tempfile.tempdir = None  # re-read TMPDIR
    before = snapshot(repo_copy)
    stop = threading.Event()
    killer = threading.Thread(target=_terminate_once_measuring, args=(tmp, stop), daemon=True)
    killer.start()
    try:
        code = main(["tune", "mlp", "--manifest", str(tmp_path / "models.toml"), "--repository", str(repo_copy),
                     "--report", str(tmp_path / "t.json"), "--plot", str(tmp_path / "t.png"),
                     "--html", str(tmp_path / "t.html"), "--precisions", "fp32", "--max-batch", "1,2,4,8",
                     "--queue-delay-us", "off,0,500",
                     "--instances", "1", "--search", "exhaustive", "--concurrency", "1",
                     "--measurement-interval", "1000", "--max-trials", "3"])
    finally:
        stop.set()
        killer.join()
        tempfile.tempdir = None
    assert code == 130 and "trtbuild: interrupted" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the CLI's handler is gone
    assert list(tmp.glob("trtbuild-tune-*")) == []  # the private server's folder (and the server) are gone
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["partial"] == "interrupted" and report["winner"] is None
    # No pick because the run stopped, not because the points measured missed the constraints.
    assert report["why"] == "no pick: the run stopped before the search ended (interrupted)"
    assert "Partial run: interrupted" in (tmp_path / "t.html").read_text()
    assert snapshot(repo_copy) == before and not (tmp_path / "tuned.toml").exists()
