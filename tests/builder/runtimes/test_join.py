"""runtimes.base.join: outputs whose size depends on the data (a TTS model's audio) are put together padded, not
a traceback from np.stack (kokoro's Japanese voice: 23 400, 55 200 and 152 400 samples for 16, 48, 128 tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from builder.runtimes.base import OutputShapeError, join


def test_whole_samples_of_different_lengths_are_stacked_padded_with_zeros() -> None:
    audio = [np.arange(3, dtype=np.float32), np.arange(5, dtype=np.float32)]
    joined = join({"audio": audio}, None)["audio"]
    assert joined.shape == (2, 5)
    assert joined[0].tolist() == [0, 1, 2, 0, 0] and joined[1].tolist() == [0, 1, 2, 3, 4]


def test_batches_whose_trailing_dims_differ_are_concatenated_padded_and_equal_shapes_untouched() -> None:
    first, second = np.ones((2, 3, 4), np.float32), np.ones((1, 5, 4), np.float32)
    joined = join({"y": [first, second]}, 2)["y"]
    assert joined.shape == (3, 5, 4) and joined[:2, 3:].sum() == 0 and joined[2].sum() == 20
    same = [np.ones((2, 3)), np.zeros((2, 3))]
    assert join({"z": same}, 2)["z"].shape == (4, 3)


def test_outputs_of_another_rank_per_sample_are_one_line() -> None:
    with pytest.raises(OutputShapeError, match="output 'y' has a different rank per sample") as raised:
        join({"y": [np.ones(3), np.ones((3, 2))]}, None)
    assert "\n" not in str(raised.value)
