"""The closed sets of values a build is described with; each prints as its models.toml / flag value."""

from __future__ import annotations

from common.choices import Choice


class Precision(Choice):
    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"


class Task(Choice):
    CLASSIFICATION = "classification"
    # Detections as rows of x1, y1, x2, y2, score, class ([batch, K, 6+]: Ultralytics' end-to-end and NMS exports);
    # their order and count are the model's, so they are matched as sets (steps/accuracy.detection_agreement).
    DETECTION = "detection"
    EMBEDDING = "embedding"
    GENERIC = "generic"


class CalibrationMethod(Choice):
    ENTROPY = "entropy"
    MAX = "max"


class Int8Recipe(Choice):
    # Chosen per build by the runtime and the model's class (steps/int8_recipe.py).
    AUTO = "auto"
    # Symmetric INT8 Q/DQ, the form TensorRT builds strongly typed.
    MODELOPT = "modelopt"
    # ONNX Runtime's static per-channel Q/DQ: U8S8 (the form its CPU kernels fuse) for ONNX Runtime on the CPU,
    # symmetric S8S8 for TensorRT.
    ONNXRUNTIME = "onnxruntime"
    # ONNX Runtime's dynamic quantization (int8 weights, activations quantized at run time): ORT CPU only.
    ONNXRUNTIME_DYNAMIC = "onnxruntime-dynamic"


class ServingBackend(Choice):
    """How Triton serves an ONNX artifact: the bundled server's python backend running ONNX Runtime,
    or the NGC image's native onnxruntime backend. (TensorRT plans always go to `tensorrt`.)"""

    PYTHON = "python"
    ONNXRUNTIME = "onnxruntime"


class RuntimeChoice(Choice):
    AUTO = "auto"
    ONNXRUNTIME = "onnxruntime"
    ONNXRUNTIME_CUDA = "onnxruntime-cuda"  # ONNX Runtime's CUDA provider (onnxruntime-gpu)
    TENSORRT = "tensorrt"


class GuardSensitivity(Choice):
    """How the accuracy guards rank nodes before their search (steps/sensitivity.py)."""

    # One run of the FP32 graph and one of the fully converted graph; nodes ranked by the error each adds.
    ONE_PASS = "one-pass"
    # One full conversion per node (quantized or converted alone), measured with the accuracy gate's figure.
    EXHAUSTIVE = "exhaustive"
