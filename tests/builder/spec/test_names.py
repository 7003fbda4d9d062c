"""Model names: the default name of `trtbuild build --onnx FILE` follows the naming rule."""

from __future__ import annotations

import pytest

from builder.errors import ManifestError
from builder.spec.names import check_model_name, name_from_path


@pytest.mark.parametrize(("path", "expected"), [
    ("models/yolov8n-640.onnx", "yolov8n-640"),
    ("ch_PP-OCRv4 det.onnx", "ch_PP-OCRv4_det"),
    ("/tmp/_private.model.onnx", "m_private"),
    ("silero_vad.onnx", "silero_vad"),
])
def test_a_name_from_the_file_stem_always_passes_the_rule(path: str, expected: str) -> None:
    name = name_from_path(path)
    assert name == expected
    assert check_model_name(name, "--name") == name


def test_a_bad_explicit_name_is_refused_naming_the_flag() -> None:
    with pytest.raises(ManifestError, match="--name 'a b'"):
        check_model_name("a b", "--name")
