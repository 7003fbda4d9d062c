"""client.inputs: the --input-data choice and request payloads built from a model's metadata."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from client.errors import PerfClientError
from client.inputs import InputData, InputKind, build_payloads, parse_shapes
from client.protocol import ModelMeta, TensorMeta

MLP = ModelMeta("mlp", 8, (TensorMeta("x", "FP32", (4, 32)),), (TensorMeta("logits", "FP32", (16,)),))
MIXED = ModelMeta("mixed", 4, (TensorMeta("ids", "INT64", (-1,)), TensorMeta("mask", "BOOL", (-1,)),
                               TensorMeta("scale", "FP16", (1,))), ())
UNBATCHED = ModelMeta("flat", 0, (TensorMeta("x", "FP32", (3,)),), ())


def test_input_data_choices(tmp_path: Path) -> None:
    assert InputData.parse("random") == InputData() == InputData(InputKind.RANDOM)
    assert InputData.parse("zero").kind is InputKind.ZERO
    assert InputData.parse(str(tmp_path / "a.npz")) == InputData(InputKind.NPZ, tmp_path / "a.npz")
    assert InputData.parse(str(tmp_path)) == InputData(InputKind.FOLDER, tmp_path)
    assert str(InputData.parse("zero")) == "zero" and str(InputData.parse(str(tmp_path))) == str(tmp_path)
    with pytest.raises(PerfClientError, match=r"expected random, zero, a \.npz file or a folder"):
        InputData.parse(str(tmp_path / "missing"))
    with pytest.raises(PerfClientError):
        InputData(InputKind.NPZ)  # a file kind without a path


def test_random_payloads_follow_the_metadata() -> None:
    payloads = build_payloads(MIXED, 3, InputData(), {"ids": (12,), "mask": (12,)})
    assert len(payloads) == 8  # distinct payloads to rotate through
    first = payloads[0]
    assert first["ids"].dtype == np.int64 and first["ids"].shape == (3, 12)
    assert first["mask"].dtype == np.bool_ and first["scale"].dtype == np.float16 and first["scale"].shape == (3, 1)
    assert not all(np.array_equal(first["ids"], p["ids"]) for p in payloads[1:])


def test_zero_payload_and_a_model_that_does_not_batch() -> None:
    (payload,) = build_payloads(UNBATCHED, 1, InputData(InputKind.ZERO), {})
    assert payload["x"].shape == (3,) and not payload["x"].any()
    with pytest.raises(PerfClientError, match="does not batch"):
        build_payloads(UNBATCHED, 2, InputData(), {})


@pytest.mark.parametrize(
    ("meta", "batch", "shapes", "message"),
    [
        (MLP, 9, {}, "-b 9: model mlp accepts at most 8"),
        (MIXED, 1, {"ids": (5,)}, "input 'mask' of mixed has dynamic dims [-1]; expected --shape mask:DIMS"),
        (MLP, 1, {"x": (4, 31)}, "--shape x:4,31: model mlp expects [4, 32]"),
        (MLP, 1, {"pixels": (3,)}, "--shape pixels: not inputs of mlp"),
        (ModelMeta("s", 1, (TensorMeta("t", "BYTES", (1,)),), ()), 1, {}, "datatype BYTES is not supported"),
    ],
)
def test_bad_requests_are_refused_before_sending(meta: ModelMeta, batch: int, shapes: dict[str, tuple[int, ...]],
                                                 message: str) -> None:
    with pytest.raises(PerfClientError) as caught:
        build_payloads(meta, batch, InputData(), shapes)
    assert message in str(caught.value)


def test_real_samples_from_npz_and_from_a_folder(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((6, 4, 32)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    payloads = build_payloads(MLP, 2, InputData.parse(str(tmp_path / "in.npz")), {})
    assert len(payloads) == 3 and all(p["x"].shape == (2, 4, 32) for p in payloads)
    np.testing.assert_array_equal(np.concatenate([p["x"] for p in payloads]), x)
    folder = tmp_path / "npy"
    folder.mkdir()
    np.save(folder / "x.npy", x)
    assert len(build_payloads(MLP, 4, InputData.parse(str(folder)), {})) == 1


def test_a_scalar_sample_feeds_an_input_triton_declares_as_one_value(tmp_path: Path) -> None:
    """silero VAD's sample rate: the .npz holds one 0-d value per sample, the served config declares it [1]
    (the builder's form of an ONNX scalar). The corpus run refused it: "'sr' samples are [], model expects [1]"."""
    vad = ModelMeta("vad", 0, (TensorMeta("input", "FP32", (1, 512)), TensorMeta("sr", "INT64", (1,))), ())
    np.savez(tmp_path / "vad.npz", input=np.zeros((3, 1, 512), np.float32), sr=np.full(3, 16000, np.int64))
    payloads = build_payloads(vad, 1, InputData.parse(str(tmp_path / "vad.npz")), {})
    assert len(payloads) == 3 and all(p["sr"].shape == (1,) and p["sr"][0] == 16000 for p in payloads)
    assert all(p["input"].shape == (1, 512) for p in payloads)


def test_real_samples_that_do_not_fit_name_the_problem(tmp_path: Path) -> None:
    np.savez(tmp_path / "names.npz", pixels=np.zeros((8, 4, 32), np.float32))
    np.savez(tmp_path / "dtype.npz", x=np.zeros((8, 4, 32), np.float64))
    np.savez(tmp_path / "few.npz", x=np.zeros((1, 4, 32), np.float32))
    for name, batch, message in (("names", 1, "holds ['pixels'], model mlp expects ['x']"),
                                 ("dtype", 1, "'x' is float64, model expects FP32"),
                                 ("few", 2, "'x' has 1 samples, fewer than -b 2"),
                                 ("absent", 1, "file not found")):
        with pytest.raises(PerfClientError) as caught:
            build_payloads(MLP, batch, InputData.parse(str(tmp_path / f"{name}.npz")), {})
        assert message in str(caught.value)


def test_shape_flags() -> None:
    assert parse_shapes(["ids:12", "img:3,224,224"]) == {"ids": (12,), "img": (3, 224, 224)}
    for bad in ("ids", "ids:", "ids:0", "ids:a,b", ":3"):
        with pytest.raises(PerfClientError, match="expected NAME:D1,D2"):
            parse_shapes([bad])
