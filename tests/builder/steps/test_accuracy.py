import numpy as np
import pytest

from builder.errors import AccuracyError
from builder.spec import Task, Tolerance
from builder.steps.accuracy import Metrics, check, compare


def test_metrics_on_known_values() -> None:
    ref = {"y": np.array([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]], np.float32)}
    cand = {"y": np.array([[1.0, 0.5, 0.0], [0.0, 2.0, 0.0]], np.float32)}
    m = compare(ref, cand, Task.CLASSIFICATION)
    assert m.max_abs == pytest.approx(0.5)
    assert m.max_rel == pytest.approx(0.25)
    assert m.cosine_min == pytest.approx(1 / np.sqrt(1.25), rel=1e-6)
    assert m.samples == 2 and m.top1_agreement == 1.0
    cand["y"][0] = [0.0, 3.0, 0.0]
    assert compare(ref, cand, Task.CLASSIFICATION).top1_agreement == 0.5
    assert compare(ref, cand, Task.EMBEDDING).top1_agreement is None  # not a classifier: not measured


def test_damage_is_zero_only_for_identical_outputs() -> None:
    same = Metrics(0.0, 0.0, 1.0, 1.0, 4, top1_agreement=1.0)
    assert same.damage() == 0.0
    assert Metrics(0.1, 0.1, 0.9, 0.95, 4, top1_agreement=0.5).damage() == pytest.approx(0.55)
    assert Metrics(0.1, 0.1, 0.9, 0.95, 4).damage() == pytest.approx(0.05)


def test_check_names_variant_metric_value_and_limit() -> None:
    metrics = Metrics(max_abs=0.2, max_rel=0.1, cosine_min=0.9, cosine_mean=0.95, samples=8, top1_agreement=0.7)
    check(metrics, Tolerance(max_abs=0.3, cosine_min=0.85), "m_int8")
    below = r"m_int8: top1_agreement = 0.7 is below the limit top1_agreement_min = 0.8"
    with pytest.raises(AccuracyError, match=below):
        check(metrics, Tolerance(top1_agreement_min=0.8), "m_int8")
    with pytest.raises(AccuracyError, match=r"m_fp16: max_abs = 0.2 is above the limit max_abs = 0.1"):
        check(metrics, Tolerance(max_abs=0.1), "m_fp16")
    embedding = Metrics(max_abs=0.0, max_rel=0.0, cosine_min=1.0, cosine_mean=1.0, samples=8)
    with pytest.raises(AccuracyError, match="needs metric top1_agreement"):
        check(embedding, Tolerance(top1_agreement_min=0.5), "emb_int8")


def test_outputs_whose_length_the_data_decides_are_compared_padded_where_the_lengths_differ() -> None:
    # A TTS variant that returns one frame more than FP32 for a sample: scored, not an AccuracyError.
    reference = {"audio": np.array([[1.0, 2.0, 3.0, 0.0], [1.0, 1.0, 0.0, 0.0]])}
    longer = {"audio": np.array([[1.0, 2.0, 3.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0]])}
    found = compare(reference, longer, Task.EMBEDDING)
    assert found.max_abs == 1.0 and found.cosine_min < 0.9 and found.cosine_mean < 1.0
    same = compare(reference, {"audio": np.pad(reference["audio"], [(0, 0), (0, 2)])}, Task.EMBEDDING)
    assert same.max_abs == 0.0 and same.cosine_min == pytest.approx(1.0)
    with pytest.raises(AccuracyError, match="output 'audio': shape"):
        compare(reference, {"audio": np.ones((3, 4))}, Task.EMBEDDING)  # another sample count
