"""TensorRT's failures as one line: the variant ONNX's file (a temporary path of the build) is never named,
TensorRT's messages are where they went (the build log), not "above". TensorRT cannot be installed here
(DESIGN), so the engine module is imported over a stand-in `tensorrt` whose parser or builder fails."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.errors import BuilderError
from builder.runtimes.tensorrt_plan import ProfileShapes, TrtBuildOptions


class _ParserError:
    def node_name(self) -> str:
        return "cast_3"

    def node_operator(self) -> str:
        return "Cast"

    def desc(self) -> str:
        return "unsupported data type"


def _stand_in(*, parses: bool) -> types.ModuleType:
    """Just what build_plan touches up to its failure."""
    trt = types.ModuleType("tensorrt")

    class Logger:
        WARNING = 2

        def __init__(self, level: int) -> None:
            self.level = level

    class OnnxParser:
        num_errors = 0 if parses else 1

        def __init__(self, network: object, logger: Logger) -> None:
            pass

        def parse_from_file(self, path: str) -> bool:
            return parses

        def get_error(self, index: int) -> _ParserError:
            return _ParserError()

    class Config:
        def set_memory_pool_limit(self, pool: object, size: int) -> None:
            pass

        def set_flag(self, flag: object) -> None:
            pass

        def add_optimization_profile(self, profile: object) -> None:
            pass

        def create_timing_cache(self, data: bytes) -> object:
            return object()

        def set_timing_cache(self, cache: object, ignore_mismatch: bool) -> None:
            pass

    class Profile:
        def set_shape(self, name: str, *dims: object) -> None:
            pass

    class Builder:
        def __init__(self, logger: Logger) -> None:
            pass

        def create_network(self, flags: int) -> object:
            return object()

        def create_builder_config(self) -> Config:
            return Config()

        def create_optimization_profile(self) -> Profile:
            return Profile()

        def build_serialized_network(self, network: object, config: Config) -> None:
            return None  # what TensorRT returns when the build fails

    trt.Logger = Logger  # type: ignore[attr-defined]
    trt.OnnxParser = OnnxParser  # type: ignore[attr-defined]
    trt.Builder = Builder  # type: ignore[attr-defined]
    trt.Dims = list  # type: ignore[attr-defined]
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=0)  # type: ignore[attr-defined]
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE=0)  # type: ignore[attr-defined]
    return trt


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[types.ModuleType]:
    monkeypatch.setitem(sys.modules, "tensorrt", _stand_in(parses=request.param))
    monkeypatch.delitem(sys.modules, "builder.runtimes.tensorrt_engine", raising=False)
    yield importlib.import_module("builder.runtimes.tensorrt_engine")
    sys.modules.pop("builder.runtimes.tensorrt_engine", None)  # the next import takes the real TensorRT


@pytest.mark.parametrize(("engine", "expected"), [
    (False, "TensorRT's ONNX parser failed on the int8 ONNX: node cast_3 (Cast): unsupported data type "
            "(TensorRT's messages: {log})"),
    (True, "TensorRT could not build an engine from the int8 ONNX (TensorRT's messages: {log})"),
], indirect=["engine"])
def test_a_tensorrt_failure_names_the_variant_and_the_log_never_a_temporary_path(
        engine: types.ModuleType, expected: str, tmp_path: Path) -> None:
    work = tmp_path / "trtbuild-m-abc123"
    work.mkdir()
    log = tmp_path / "build.log"  # given, as the runtime passes its build log on (no global set)
    with pytest.raises(BuilderError) as caught:
        engine.build_plan(work / "int8.onnx", work / "model.plan", ProfileShapes({"x": ((1, 8), (4, 8), (8, 8))}),
                          TrtBuildOptions(), tmp_path / "cache", log_file=log)
    assert str(caught.value) == expected.format(log=log)
    assert str(work) not in str(caught.value)
