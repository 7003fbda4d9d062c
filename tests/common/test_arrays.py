"""A served output is fitted to the one expected of it: a scalar's [1], and a data-sized output (a TTS model's
audio) shorter than the zero-padded expected one; anything else is refused, not reshaped into a traceback."""

from __future__ import annotations

import numpy as np

from client.validate import outputs_match
from common.arrays import fitted


def test_a_scalar_answer_takes_the_expected_shape() -> None:
    have = fitted(np.array([2.5], np.float32), np.array(2.5, np.float32))
    assert have is not None and have.shape == () and float(have) == 2.5


def test_a_shorter_data_sized_answer_is_padded_with_zeros_like_the_expected_one() -> None:
    # The local run stacked two samples of 5 and 3 values into [2, 5]; the server answers the second alone.
    want = np.array([0.5, -0.25, 1.0, 0.0, 0.0], np.float32)
    have = fitted(np.array([0.5, -0.25, 1.0], np.float32), want)  # before: ValueError cannot reshape size 3 into (5,)
    assert have is not None and have.tolist() == want.tolist()
    assert outputs_match({"audio": np.array([0.5, -0.25, 1.0], np.float32)}, {"audio": want})
    assert not outputs_match({"audio": np.array([0.5, -0.25, 1.5], np.float32)}, {"audio": want})


def test_a_truncated_answer_against_real_values_or_a_missing_batch_row_is_refused() -> None:
    want = np.array([0.5, -0.25, 1.0, 8e-5, 0.0], np.float32)  # the tail holds a value, however small
    assert fitted(np.array([0.5, -0.25, 1.0], np.float32), want) is None
    assert not outputs_match({"audio": np.array([0.5, -0.25, 1.0], np.float32)}, {"audio": want})
    rows = np.zeros((4, 3), np.float32)  # a batch of 4 whose outputs happen to be all zero
    assert fitted(np.zeros((2, 3), np.float32), rows, batched=True) is None
    assert fitted(np.zeros((4, 2), np.float32), rows, batched=True) is not None


def test_an_answer_larger_or_of_another_rank_is_refused() -> None:
    want = np.zeros((2, 3), np.float32)
    assert fitted(np.zeros((2, 4), np.float32), want) is None
    assert fitted(np.zeros((1, 2, 2), np.float32), want) is None
    assert fitted(np.zeros((3,), np.float32), want) is None
