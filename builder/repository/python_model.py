"""Triton python-backend model: runs the ONNX file beside it with ONNX Runtime on CPU.

Copied into each model version folder as `model.py` by the repository writer. Requests that
arrive together (dynamic batching) and share non-batch shapes run as one batch.
"""

# mypy: ignore-errors
from __future__ import annotations

import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        path = os.path.join(args["model_repository"], args["model_version"], params.get("onnx_file", "model.onnx"))
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        threads = int(params.get("intra_op_threads", "0") or 0)
        if threads:
            options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
        self.input_names = [i["name"] for i in config["input"]]
        self.output_names = [o["name"] for o in config["output"]]

    def execute(self, requests):
        feeds = []
        for request in requests:
            feeds.append({n: pb_utils.get_input_tensor_by_name(request, n).as_numpy() for n in self.input_names})
        responses = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for index, feed in enumerate(feeds):
            key = tuple((n, feed[n].dtype.str, feed[n].shape[1:]) for n in self.input_names)
            groups.setdefault(key, []).append(index)
        for indices in groups.values():
            try:
                merged = {n: np.concatenate([feeds[i][n] for i in indices]) for n in self.input_names}
                results = self.session.run(self.output_names, merged)
            except Exception as exc:  # noqa: BLE001 - report to each client instead of crashing the stub
                for i in indices:
                    responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc)))
                continue
            start = 0
            for i in indices:
                size = len(feeds[i][self.input_names[0]])
                tensors = [
                    pb_utils.Tensor(name, np.ascontiguousarray(value[start : start + size]))
                    for name, value in zip(self.output_names, results, strict=True)
                ]
                responses[i] = pb_utils.InferenceResponse(output_tensors=tensors)
                start += size
        return responses
