"""The build steps: export, ONNX loading and checks, clean-up, samples, precision (FP16/INT8), the
INT8 accuracy guard, accuracy, and the per-variant step sequence over one context."""
