import numpy as np
import pytest

from builder.accuracy import check, compare
from builder.errors import AccuracyError
from builder.manifest import Tolerance


def test_metrics_on_known_values() -> None:
    ref = {"y": np.array([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]], np.float32)}
    cand = {"y": np.array([[1.0, 0.5, 0.0], [0.0, 2.0, 0.0]], np.float32)}
    m = compare(ref, cand, "classification")
    assert m["max_abs"] == pytest.approx(0.5)
    assert m["max_rel"] == pytest.approx(0.25)
    assert m["cosine_min"] == pytest.approx(1 / np.sqrt(1.25), rel=1e-6)
    assert m["top1_agreement"] == 1.0
    cand["y"][0] = [0.0, 3.0, 0.0]
    assert compare(ref, cand, "classification")["top1_agreement"] == 0.5


def test_check_names_variant_metric_value_and_limit() -> None:
    metrics = {"max_abs": 0.2, "max_rel": 0.1, "cosine_min": 0.9, "cosine_mean": 0.95, "top1_agreement": 0.7}
    check(metrics, Tolerance(max_abs=0.3, cosine_min=0.85), "m_int8")
    below = r"m_int8: top1_agreement = 0.7 is below the limit top1_agreement_min = 0.8"
    with pytest.raises(AccuracyError, match=below):
        check(metrics, Tolerance(top1_agreement_min=0.8), "m_int8")
    with pytest.raises(AccuracyError, match=r"m_fp16: max_abs = 0.2 is above the limit max_abs = 0.1"):
        check(metrics, Tolerance(max_abs=0.1), "m_fp16")
    with pytest.raises(AccuracyError, match="needs metric top1_agreement"):
        check({"max_abs": 0.0}, Tolerance(top1_agreement_min=0.5), "emb_int8")
