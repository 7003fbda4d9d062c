"""The sample ModelOpt's entropy calibration sees first (steps/calibration_order.py) keeps its histograms within
MAX_GROWTH times the bins they start with, however quiet the data's first sample."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnxruntime.quantization import calibrate

from builder.repository.onnx_files import sha256_file
from builder.runtimes.base import feeds
from builder.spec import CalibrationMethod, CalibrationSpec, DataSpec, Int8Recipe
from builder.steps import calibration_order, precision
from tests.helpers.tiny_models import mlp_samples, outlier_mlp_onnx


def quiet_first(count: int) -> dict[str, np.ndarray]:
    """Samples whose first is 1000x quieter than the rest (silence before speech, a dark frame)."""
    samples = mlp_samples(count, seed=0)
    samples["x"][0] *= 1e-3
    return samples


def test_growth_is_how_far_a_samples_ranges_fall_short_of_all_samples() -> None:
    ranges = np.array([[0.01, np.nan, 0.0],
                       [1.0, np.nan, 2.0],
                       [0.5, np.nan, 1.0]])
    # Not float (NaN) and all-zero tensors do not count: a histogram begun on zeros starts over.
    np.testing.assert_allclose(calibration_order.growth(ranges), [100.0, 1.0, 2.0])
    np.testing.assert_allclose(calibration_order.growth(np.zeros((2, 0))), [1.0, 1.0])


def test_a_quiet_first_sample_gives_way_and_the_set_and_the_rest_of_the_order_are_unchanged(tmp_path: Path) -> None:
    model = outlier_mlp_onnx(tmp_path / "outlier.onnx")
    samples = quiet_first(6)
    order = calibration_order.entropy_order(model, list(feeds(samples, 1)))
    factors = calibration_order.growth(calibration_order.sample_ranges(model, list(feeds(samples, 1))))
    assert factors[0] > calibration_order.MAX_GROWTH
    assert order[0] == int(np.argmin(factors)) and order[1:] == [i for i in range(6) if i != order[0]]
    # Where the first sample keeps every histogram within MAX_GROWTH, the data's order stays.
    assert calibration_order.entropy_order(model, list(feeds(mlp_samples(6, seed=0), 1))) == list(range(6))
    assert not list(tmp_path.glob(".*ranges*"))  # the exposed copy is removed


def test_modelopt_entropy_histograms_stay_small_with_a_quiet_first_sample(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = outlier_mlp_onnx(tmp_path / "outlier.onnx")
    samples = quiet_first(16)
    # In the data's order, a histogram begun on the quiet sample would grow ~1000x its 128 bins, and ONNX
    # Runtime's entropy search costs the square of the bins (silero VAD: 36 868 bins, 62 s).
    ranges = calibration_order.sample_ranges(model, list(feeds(samples, 1)))
    assert calibration_order.growth(ranges)[0] > 100
    sizes: list[int] = []
    real = calibrate.HistogramCollector.get_entropy_threshold

    def recording(self: Any, histogram: Any, num_quantized_bins: int) -> Any:
        sizes.append(int(histogram[0].size))
        return real(self, histogram, num_quantized_bins)

    monkeypatch.setattr(calibrate.HistogramCollector, "get_entropy_threshold", recording)
    spec = CalibrationSpec(DataSpec("unused.npz", 16), method=CalibrationMethod.ENTROPY, recipe=Int8Recipe.MODELOPT)
    precision.to_int8(model, fp32_sha=sha256_file(model), calibration=samples, data_digest="quiet", spec=spec,
                      out_path=tmp_path / "int8.onnx", cache_dir=tmp_path / "cache", log_file=None)
    assert sizes and max(sizes) <= 128 * calibration_order.MAX_GROWTH + 2, sizes
