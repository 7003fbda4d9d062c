import numpy as np
import pytest

from builder.errors import DataError
from builder.spec import DimRange, TensorSpec
from builder.steps import samples as data

INPUTS = (TensorSpec("ids", "int64", (-1, "seq")), TensorSpec("x", "float32", (-1, 4)))
DIMS = {"seq": DimRange(1, 8, 16)}


def good(n: int = 5) -> dict[str, np.ndarray]:
    return {"ids": np.zeros((n, 8), np.int64), "x": np.ones((n, 4), np.float32)}


def test_valid_samples_return_their_count() -> None:
    assert data.validate(good(5), INPUTS, DIMS, "cal") == 5


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ({"ids": np.zeros((5, 8), np.int64)}, r"missing \['x'\]"),
        ({**good(), "extra": np.zeros(5)}, r"unexpected \['extra'\]"),
        ({**good(), "x": np.ones((5, 4), np.float64)}, "'x' has dtype float64, expected float32"),
        ({**good(), "x": np.ones((5, 3), np.float32)}, "'x' axis 1 is 3, expected 4"),
        ({**good(), "ids": np.zeros((5, 40), np.int64)}, r"axis 1 \(seq\) is 40, expected 1..16"),
        ({**good(), "x": np.ones((4, 4), np.float32)}, "same, non-zero number of samples"),
        ({**good(), "x": np.ones((5,), np.float32)}, r"expected \[samples, 4\]"),
    ],
)
def test_mismatches_name_the_input_and_the_expectation(samples: dict[str, np.ndarray], message: str) -> None:
    with pytest.raises(DataError, match=message):
        data.validate(samples, INPUTS, DIMS, "calibration data")


def test_digest_is_stable_and_sensitive_to_content() -> None:
    a, b = good(), good()
    assert data.digest(a) == data.digest(b)
    b["x"][0, 0] = 2.0
    assert data.digest(a) != data.digest(b)


def test_random_samples_refuse_integer_inputs() -> None:
    with pytest.raises(DataError, match="expected evaluation data"):
        data.random_samples(INPUTS, DIMS, 4, 0)
