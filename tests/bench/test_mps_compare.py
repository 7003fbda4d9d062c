"""bench/gpu/mps_compare.py with a stand-in MPS control daemon and a stand-in bench_ort.py: runs alternate off/on
then on/off, only the `on` runs see the daemon's private folders, the daemon is quit after each, and the table's
same-round ratios come from the runs' own figures."""

from __future__ import annotations

import json
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import mps_daemon
from tests.helpers.mps_daemon import calls_of
from tests.helpers.scripts import loaded_script

ROOT = Path(__file__).resolve().parents[2]

# Stand-in bench_ort.py: faster under MPS, and it reports a client to the stand-in daemon's log as MPS would.
BENCH = """import json, os, sys
out = sys.argv[sys.argv.index("--out") + 1]
mps = os.environ.get("CUDA_MPS_LOG_DIRECTORY")
if mps:
    open(os.path.join(mps, "control.log"), "a").write("[x] NEW CLIENT 17 from user 0: Server already exists\\n")
rate = 12000.0 if mps else 9000.0
row = {"model": "fp16_batched", "concurrency": 256, "shared_memory": "cuda", "throughput": rate,
       "latency_us": {"p50": 20000.0, "p99": 26000.0}, "power": {"j_per_infer": 300.0 / rate},
       "server": {"compute_input_us": 150.0}}
doc = {"in_process": {"fp16": {"ceiling_iobinding": {"infer_per_s": 16000.0}}}, "served": [row]}
open(os.path.join(out, "ort_gpu_bench.json"), "w").write(json.dumps(doc))
"""


@pytest.fixture()
def mps_compare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "bench_ort.py").write_text(BENCH)
    with mps_daemon.installed(tmp_path, monkeypatch), \
            loaded_script("mps_compare", ROOT / "bench" / "gpu" / "mps_compare.py") as module:
        monkeypatch.setattr(module, "HERE", scripts)
        monkeypatch.setattr(module.triton_server, "gpu_ids", lambda: [0])
        yield module


def _runs(mps_compare: ModuleType, monkeypatch: pytest.MonkeyPatch, out: Path, *flags: str) -> list[dict[str, object]]:
    """mps_compare.main with these flags (and the stand-in bench's arguments): it succeeds; the runs it recorded."""
    monkeypatch.setattr(sys, "argv", ["mps_compare.py", "--out", str(out), *flags, "--", "--models", "m"])
    assert mps_compare.main() == 0
    runs: list[dict[str, object]] = json.loads((out / "mps-compare.json").read_text())
    return runs


def test_runs_alternate_and_only_the_on_runs_use_mps(mps_compare: ModuleType, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    runs = _runs(mps_compare, monkeypatch, out, "--rounds", "2")
    assert [(r["mode"], r["round"]) for r in runs] == [("off", 1), ("on", 1), ("on", 2), ("off", 2)]
    assert [r["mps"] for r in runs if r["mode"] == "on"] == [{"clients": 1, "quit": True}] * 2
    # Each on run: the daemon started with its own pipe folder (run under the stand-in bench), then quit.
    assert calls_of(tmp_path / "calls") == ["-d", "quit"] * 2
    pipes = [line.split()[1] for line in (tmp_path / "calls").read_text().splitlines() if line.startswith("-d")]
    assert pipes == [str((out / run / "mps" / "pipe").resolve()) for run in ("on-1", "on-2")]
    text = (out / "mps-compare.md").read_text()
    assert "| fp16_batched@256 | off | 2 | 9000 (9000-9000) | 0.56 (0.56-0.56) | 1.30 (1.30-1.30) |" in text
    assert "| fp16_batched@256 | on | 2 | 12000 (12000-12000) | 0.75 (0.75-0.75) |" in text
    assert "- fp16_batched@256: 1.33x, J 0.75x; 1.33x, J 0.75x" in text
    with tarfile.open(out / "runs.tar.gz") as tar:
        assert {"off-1/ort_gpu_bench.json", "on-2/mps/log/control.log"} <= set(tar.getnames())


def test_first_on_starts_with_the_daemon_and_still_alternates(mps_compare: ModuleType, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _runs(mps_compare, monkeypatch, tmp_path / "out", "--rounds", "2", "--first", "on")
    assert [(r["mode"], r["round"]) for r in runs] == [("on", 1), ("off", 1), ("off", 2), ("on", 2)]
    assert [r["mps"] is not None for r in runs] == [True, False, False, True]


def test_no_daemon_on_the_machine_is_one_line(mps_compare: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    (tmp_path / "bin" / mps_compare.mps.CONTROL).unlink()
    monkeypatch.setattr(sys, "argv", ["mps_compare.py", "--out", str(tmp_path / "o"), "--", "--models", "m"])
    assert mps_compare.main() == 1
    assert capsys.readouterr().err.strip() == ("mps_compare: nvidia-cuda-mps-control not on PATH: no CUDA MPS on "
                                               "this machine")


def test_only_on_runs_every_round_under_the_daemon(mps_compare: ModuleType, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    runs = _runs(mps_compare, monkeypatch, out, "--rounds", "2", "--only", "on")
    assert [(r["mode"], r["round"]) for r in runs] == [("on", 1), ("on", 2)]
    assert [r["mps"] for r in runs] == [{"clients": 1, "quit": True}] * 2
    assert "- fp16_batched@256: no pair" in (out / "mps-compare.md").read_text()


def test_only_off_needs_no_daemon_and_only_excludes_first(mps_compare: ModuleType, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bin" / mps_compare.mps.CONTROL).unlink()  # a machine without MPS can still run the off runs
    out = tmp_path / "out"
    runs = _runs(mps_compare, monkeypatch, out, "--rounds", "1", "--only", "off")
    assert [(r["mode"], r["round"], r["mps"]) for r in runs] == [("off", 1, None)]
    assert not (tmp_path / "calls").exists() or calls_of(tmp_path / "calls") == []
    monkeypatch.setattr(sys, "argv", ["mps_compare.py", "--out", str(out), "--only", "on", "--first", "on", "--",
                                      "--models", "m"])
    with pytest.raises(SystemExit) as exit_:
        mps_compare.main()
    assert exit_.value.code == 2
    assert "not allowed with argument --only" in capsys.readouterr().err.splitlines()[-1]


def test_a_level_without_answers_is_left_out_of_the_comparison(mps_compare: ModuleType) -> None:
    doc = {"in_process": {"fp16": {"ceiling_iobinding": {"infer_per_s": 16000.0}}}, "served": [
        {"model": "fp16_batched", "concurrency": 32, "shared_memory": "cuda", "throughput": 0.0,
         "latency_us": None, "errors": {"UNAVAILABLE": 9}, "power": {}, "server": {}},
        {"model": "fp16_batched", "concurrency": 256, "shared_memory": "cuda", "throughput": 9000.0,
         "latency_us": {"p50": 20000.0, "p99": 26000.0}, "power": {"j_per_infer": 0.03}, "server": {}}]}
    assert list(mps_compare.levels(doc)) == ["fp16_batched@256"]


def test_only_on_without_the_daemon_binary_is_one_line(mps_compare: ModuleType, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bin" / mps_compare.mps.CONTROL).unlink()
    monkeypatch.setattr(sys, "argv", ["mps_compare.py", "--out", str(tmp_path / "o"), "--only", "on", "--",
                                      "--models", "m"])
    assert mps_compare.main() == 1
    assert "not on PATH" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
