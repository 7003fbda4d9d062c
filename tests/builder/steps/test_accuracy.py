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


# Detectors (Task.DETECTION): rows x1, y1, x2, y2, score, class, their order and count the model's.

def _dets(*rows: tuple[float, ...], k: int = 6) -> np.ndarray:
    """One sample's [K, 6] detections, padded with zero-score rows as a top-K output is."""
    out = np.zeros((k, 6), np.float32)
    if rows:
        out[: len(rows)] = rows
    return out


def test_detections_that_reorder_agree_though_their_cosine_does_not() -> None:
    """Two boxes whose scores swap order in FP16 (0.801 vs 0.799): the rows swap, the element-wise cosine drops,
    and every detection still has its match."""
    a, b = (10, 10, 50, 50, 0.801, 3), (100, 100, 160, 140, 0.799, 7)
    ref = np.stack([_dets(a, b)])
    cand = np.stack([_dets((b[0] + 0.4, *b[1:4], 0.802, 7), (a[0], a[1] - 0.3, *a[2:4], 0.798, 3))])
    metrics = compare({"det": ref}, {"det": cand}, Task.DETECTION)
    assert metrics.detection_agreement == 1.0
    assert metrics.cosine_min < 0.9  # what the default tolerance of another task would have judged by
    check(metrics, Tolerance(detection_agreement_min=0.97), "m_fp16")


def test_a_missed_box_a_changed_class_and_a_score_at_the_threshold() -> None:
    a, b = (10, 10, 50, 50, 0.9, 3), (100, 100, 160, 140, 0.6, 7)
    ref = np.stack([_dets(a, b)])
    # b missed: 2 of 3 detections (a on both sides) have a match.
    assert compare({"d": ref}, {"d": np.stack([_dets(a)])}, Task.DETECTION).detection_agreement == pytest.approx(2 / 3)
    # b's class changed: no match for either b.
    moved = np.stack([_dets(a, (*b[:5], 8))])
    assert compare({"d": ref}, {"d": moved}, Task.DETECTION).detection_agreement == pytest.approx(0.5)
    # A box scoring 0.26 in FP32 and 0.24 in the variant is the same box: it counts once and has its match.
    edge = np.stack([_dets((*a[:4], 0.26, 3))]), np.stack([_dets((*a[:4], 0.24, 3))])
    assert compare({"d": edge[0]}, {"d": edge[1]}, Task.DETECTION).detection_agreement == 1.0
    # Nothing detected on either side: full agreement, not a division by zero.
    empty = np.stack([_dets()])
    assert compare({"d": empty}, {"d": empty}, Task.DETECTION).detection_agreement == 1.0


def test_a_detector_without_a_detection_output_is_one_line() -> None:
    with pytest.raises(AccuracyError, match=r"task detection: no output of shape \[batch, K, 6\+\].*logits \[2, 10\]"):
        compare({"logits": np.zeros((2, 10))}, {"logits": np.zeros((2, 10))}, Task.DETECTION)


def test_a_detectors_default_tolerances_bound_detection_agreement() -> None:
    from pathlib import Path

    from builder.spec import DimRange, ModelSpec, Precision

    spec = ModelSpec(name="det", onnx=Path("det.onnx"), batch=DimRange(1, 1, 1), precisions=(Precision.FP16,),
                     task=Task.DETECTION)
    assert spec.tolerance(Precision.FP16) == Tolerance(detection_agreement_min=0.97)
    assert spec.tolerance(Precision.INT8) == Tolerance(detection_agreement_min=0.9)
    ref = np.stack([_dets((10, 10, 50, 50, 0.9, 3), (100, 100, 160, 140, 0.6, 7))])
    missed = compare({"d": ref}, {"d": np.stack([_dets((10, 10, 50, 50, 0.9, 3))])}, Task.DETECTION)
    with pytest.raises(AccuracyError, match=r"detection_agreement = 0\.666667 is below the limit "
                                            r"detection_agreement_min = 0\.97"):
        check(missed, spec.tolerance(Precision.FP16), "det_fp16")


def test_a_match_needs_the_iou_each_partner_once_and_the_class_id_whatever_float_carries_it() -> None:
    box = (0, 0, 10, 10, 0.9, 3)
    shifted = lambda dx, score=0.9, cls=3.0: (dx, 0, 10 + dx, 10, score, cls)  # noqa: E731 - IoU (10-dx)/(10+dx)
    one = lambda *rows: np.stack([_dets(*rows)])  # noqa: E731
    assert compare({"d": one(box)}, {"d": one(shifted(2))}, Task.DETECTION).detection_agreement == 1.0  # IoU 0.67
    assert compare({"d": one(box)}, {"d": one(shifted(4))}, Task.DETECTION).detection_agreement == 0.0  # IoU 0.43
    # Two FP32 boxes on one object, one variant box: it is the partner of one of them only.
    assert compare({"d": one(box, box)}, {"d": one(box)}, Task.DETECTION).detection_agreement == pytest.approx(2 / 3)
    # A class id carried in a float that moved in its last bits (3.0000002): the same class.
    assert compare({"d": one(box)}, {"d": one(shifted(0, cls=3.0000002))},
                   Task.DETECTION).detection_agreement == 1.0


def test_samples_with_nothing_detected_add_nothing_rather_than_a_perfect_score() -> None:
    """15 samples without detections and one whose only box the variant lost: 0 of 1, not 15/16."""
    empty, lost = _dets(), _dets((0, 0, 10, 10, 0.9, 1))
    ref = np.stack([empty] * 15 + [lost])
    cand = np.stack([empty] * 16)
    assert compare({"d": ref}, {"d": cand}, Task.DETECTION).detection_agreement == 0.0


def test_a_detector_without_a_batch_axis_stacks_its_outputs_as_rank_4() -> None:
    """A static-batch export ([1, 300, 6]) is a model without a batch axis: its samples stack to [S, 1, K, 6]."""
    a, b = (10, 10, 50, 50, 0.801, 3), (100, 100, 160, 140, 0.799, 7)
    ref = np.stack([_dets(a, b)[None]])
    cand = np.stack([_dets(b, a)[None]])
    assert ref.shape == (1, 1, 6, 6)
    assert compare({"d": ref}, {"d": cand}, Task.DETECTION).detection_agreement == 1.0


def test_rows_that_are_not_detections_are_one_line() -> None:
    """A raw head (boxes and class scores per anchor, before NMS) is not taken for detections; xywh rows are
    refused rather than scored as nonsense."""
    head = np.zeros((1, 84, 8400), np.float32)
    with pytest.raises(AccuracyError, match=r"no output of shape \[batch, K, 6\+\].*d \[1, 84, 8400\]"):
        compare({"d": head}, {"d": head}, Task.DETECTION)
    xywh = np.stack([_dets((40, 40, 20, 20, 0.9, 1), (90, 30, 10, 12, 0.8, 2))])
    with pytest.raises(AccuracyError, match="most scored rows have x2 < x1 or y2 < y1"):
        compare({"d": xywh}, {"d": xywh}, Task.DETECTION)


def test_a_detectors_damage_ranks_by_agreement_then_cosine() -> None:
    base = Metrics(max_abs=0.0, max_rel=0.0, cosine_min=0.9, cosine_mean=0.95, samples=4, detection_agreement=1.0)
    worse_cosine = Metrics(max_abs=0.0, max_rel=0.0, cosine_min=0.5, cosine_mean=0.6, samples=4,
                           detection_agreement=1.0)
    missed = Metrics(max_abs=0.0, max_rel=0.0, cosine_min=0.99, cosine_mean=0.99, samples=4, detection_agreement=0.9)
    assert base.damage() < worse_cosine.damage() < missed.damage()


def test_a_models_build_key_stays_as_it_was_without_a_detection_limit() -> None:
    """The tolerance's new limit, unset (every model but a detector), leaves the precision settings, so the
    build key, as before it existed: no repository rebuilds for it."""
    from pathlib import Path

    from builder.spec import DimRange, ModelSpec, Precision
    from builder.steps.build_key import precision_settings

    spec = ModelSpec(name="m", onnx=Path("m.onnx"), batch=DimRange(1, 1, 1), precisions=(Precision.FP16,))
    assert precision_settings(spec, Precision.FP16)["tolerance"] == {
        "max_abs": None, "max_rel": None, "cosine_min": 0.999, "cosine_mean_min": None, "top1_agreement_min": None}
    detector = ModelSpec(name="m", onnx=Path("m.onnx"), batch=DimRange(1, 1, 1), precisions=(Precision.FP16,),
                         task=Task.DETECTION)
    assert precision_settings(detector, Precision.FP16)["tolerance"]["detection_agreement_min"] == 0.97


def test_a_detector_that_detects_nothing_on_its_evaluation_samples_is_said(caplog: pytest.LogCaptureFixture) -> None:
    from builder.steps.prepare import _say_what_detection_checks

    with caplog.at_level("INFO", logger="builder.pipeline"):
        _say_what_detection_checks("det", {"d": np.stack([_dets()] * 3)})
        _say_what_detection_checks("det2", {"d": np.stack([_dets((0, 0, 5, 5, 0.9, 1))])})
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("det: the FP32 model detects nothing (score 0.25 or more)") for line in lines), lines
    assert "det2: the FP32 model makes 1 detections on the evaluation samples" in lines
