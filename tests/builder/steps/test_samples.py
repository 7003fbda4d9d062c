import numpy as np
import pytest

from builder.errors import DataError
from builder.runtimes.base import feeds, join
from builder.spec import DimRange, TensorSpec
from builder.spec.shapes import Level, ModelShapes, ShapeRange, ValueRange, resolve
from builder.steps import samples as data

INPUTS = (TensorSpec("ids", "int64", (-1, "seq")), TensorSpec("x", "float32", (-1, 4)))
DIMS = {"seq": DimRange(1, 8, 16)}
SHAPES = resolve(INPUTS, batch=DimRange(1, 2, 4), dims=DIMS, shapes={}, what="m")
# A model that does not batch: a state with the batch on axis 1 and a scalar.
STATE_INPUTS = (TensorSpec("state", "float32", (2, "batch", 8)), TensorSpec("sr", "int64", ()))
STATE = resolve(STATE_INPUTS, batch=DimRange(1, 1, 1), dims={"batch": DimRange(1, 1, 3)}, shapes={}, what="m")


def good(n: int = 5) -> dict[str, np.ndarray]:
    return {"ids": np.zeros((n, 8), np.int64), "x": np.ones((n, 4), np.float32)}


def test_valid_samples_return_their_count() -> None:
    assert data.validate(good(5), INPUTS, SHAPES, "cal") == 5


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ({"ids": np.zeros((5, 8), np.int64)}, r"missing \['x'\]"),
        ({**good(), "extra": np.zeros(5)}, r"unexpected \['extra'\]"),
        ({**good(), "x": np.ones((5, 4), np.float64)}, "'x' has dtype float64, expected float32"),
        ({**good(), "x": np.ones((5, 3), np.float32)}, "'x' axis 1 is 3, expected 4"),
        ({**good(), "ids": np.zeros((5, 40), np.int64)}, r"axis 1 is 40, expected 1..16"),
        ({**good(), "x": np.ones((4, 4), np.float32)}, "same, non-zero number of samples"),
        ({**good(), "x": np.ones((5,), np.float32)}, r"expected \[samples, 4\]"),
    ],
)
def test_mismatches_name_the_input_and_the_expectation(samples: dict[str, np.ndarray], message: str) -> None:
    with pytest.raises(DataError, match=message):
        data.validate(samples, INPUTS, SHAPES, "calibration data")


def test_digest_is_stable_and_sensitive_to_content() -> None:
    a, b = good(), good()
    assert data.digest(a) == data.digest(b)
    b["x"][0, 0] = 2.0
    assert data.digest(a) != data.digest(b)


def test_synthetic_integer_inputs_need_a_declared_range_named_in_the_error() -> None:
    with pytest.raises(DataError, match=r"--input-range ids:LOW:HIGH.*input_ranges.ids"):
        data.synthetic(INPUTS, SHAPES, 4, 0)
    made = data.synthetic(INPUTS, SHAPES, 64, 0, value_ranges={"ids": ValueRange(3, 5)})
    assert made["ids"].dtype == np.int64 and set(np.unique(made["ids"])) == {3, 4, 5}


def test_shape_sets_cover_min_opt_and_max_shapes() -> None:
    sets = data.shape_sets(INPUTS, SHAPES, 3, 0, integers=True)
    assert {level: s["ids"].shape for level, s in sets.items()} == {
        Level.MIN: (3, 1), Level.OPT: (3, 8), Level.MAX: (3, 16)}
    assert all(s["x"].shape == (3, 4) for s in sets.values())
    for one in sets.values():
        data.validate(one, INPUTS, SHAPES, "synthetic")


def test_fixed_shapes_give_one_set() -> None:
    fixed = resolve(INPUTS, batch=DimRange(1, 2, 4), batch_given=False, dims={}, what="m",
                    shapes={"ids": ShapeRange.fixed((2, 8))})
    assert list(data.shape_sets(INPUTS, fixed, 2, 0, integers=True)) == [Level.OPT]


def test_whole_samples_of_a_model_that_does_not_batch() -> None:
    made = data.synthetic(STATE_INPUTS, STATE, 5, 0, level=Level.MAX, value_ranges={"sr": ValueRange(8000, 8000)})
    assert made["state"].shape == (5, 2, 3, 8) and made["sr"].shape == (5,)
    assert data.validate(made, STATE_INPUTS, STATE, "cal") == 5
    whole = list(feeds(made, None))
    assert len(whole) == 5 and whole[0]["state"].shape == (2, 3, 8) and whole[0]["sr"].shape == ()
    joined = join({"y": [f["state"] for f in whole]}, None)
    assert np.array_equal(joined["y"], made["state"])
    with pytest.raises(DataError, match=r"expected \[samples, 2, 1..3, 8\] \(one sample per leading index"):
        data.validate({**made, "state": made["state"][:, 0]}, STATE_INPUTS, STATE, "cal")


def test_feeds_in_batches_join_back() -> None:
    made = good(5)
    parts = list(feeds(made, 2))
    assert [len(p["x"]) for p in parts] == [2, 2, 1]
    assert np.array_equal(join({"x": [p["x"] for p in parts]}, 2)["x"], made["x"])


def test_synthetic_samples_refuse_a_shape_beyond_memory_and_a_range_beyond_the_dtype() -> None:
    inputs = (TensorSpec("x", "float32", (-1, 3, 48, -1)),)
    huge = ModelShapes(True, {"x": ShapeRange((1, 3, 48, 64), (1, 3, 48, 64), (1, 3, 48, 2_000_000_000))})
    with pytest.raises(DataError, match=r"^m: input 'x': 16 synthetic samples at the max shape 3x48x2000000000 "
                                        r"would take [0-9.]+ GiB; expected shapes whose samples fit in 4 GiB$"):
        data.synthetic(inputs, huge, 16, seed=0, level=Level.MAX, what="m")
    ids = (TensorSpec("ids", "int32", (-1, 8)),)
    shapes = ModelShapes(True, {"ids": ShapeRange.fixed((1, 8))})
    with pytest.raises(DataError, match=r"--input-range ids:0:5000000000: input 'ids' is int32; expected values "
                                        r"within -2147483648..2147483647"):
        data.synthetic(ids, shapes, 4, seed=0, value_ranges={"ids": ValueRange(0, 5_000_000_000)}, what="m")
