"""ONNX → FP32/FP16/INT8 variants → accuracy check → Triton model repository."""

import logging

__version__ = "0.1.0"

logger = logging.getLogger("builder")
logger.addHandler(logging.NullHandler())
