"""GPU workload for the benchmark only (not a product runtime): Triton python-backend model running
a ResNet-50 (random weights; the GPU's work does not depend on them) in FP16 on CUDA with PyTorch.

Requests that arrive together (dynamic batching) run as one batch.
"""

# mypy: ignore-errors
from __future__ import annotations

import numpy as np
import torch
import torchvision
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        # cudnn.benchmark stays off: it re-autotunes at every new batch size and windows never settle.
        torch.backends.cudnn.benchmark = False
        self.device = torch.device("cuda", int(args.get("model_instance_device_id", 0)))
        torch.manual_seed(0)
        self.model = torchvision.models.resnet50(weights=None).eval().half().to(self.device)
        with torch.inference_mode():
            self.model(torch.zeros(1, 3, 224, 224, dtype=torch.half, device=self.device))

    def execute(self, requests):
        arrays = [pb_utils.get_input_tensor_by_name(r, "input").as_numpy() for r in requests]
        sizes = [len(a) for a in arrays]
        with torch.inference_mode():
            batch = torch.from_numpy(np.concatenate(arrays)).to(self.device, non_blocking=True).half()
            logits = self.model(batch).float().cpu().numpy()
        responses, start = [], 0
        for size in sizes:
            out = pb_utils.Tensor("logits", np.ascontiguousarray(logits[start : start + size]))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            start += size
        return responses
