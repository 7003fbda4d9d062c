"""Real sample data for the packaged models.

Photos come from `skimage.data` (shipped with scikit-image); calibration and held-out evaluation
use disjoint photos, so no evaluation pixel was seen by calibration. Sentences were written for
this project and live in `builder/examples/data/`; the two files are disjoint too.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import numpy as np
from numpy.typing import NDArray

from builder.steps.samples import Samples

_CALIBRATION_PHOTOS = (
    "astronaut", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry",
    "stereo_motorcycle", "camera", "coins", "brick", "grass", "gravel",
)
_HELDOUT_PHOTOS = ("chelsea", "retina", "clock", "moon", "logo", "page", "colorwheel")

IMAGE_SIZE = 224
SEQUENCE_LENGTH = 64


def _photo(name: str) -> NDArray[Any]:
    import skimage.data

    image = getattr(skimage.data, name)()
    if isinstance(image, tuple):  # stereo pairs: take the left view
        image = image[0]
    image = np.asarray(image)
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    image = image[..., :3]
    if image.dtype != np.uint8:
        image = (image.astype(np.float32) * 255).clip(0, 255).astype(np.uint8)
    return np.asarray(image)


def _crops(names: tuple[str, ...], count: int, seed: int) -> NDArray[Any]:
    """Random square crops (35-100 % of the short side), flips, resized to 224, EfficientNet-Lite normalised."""
    from skimage.transform import resize

    rng = np.random.default_rng(seed)
    photos = [_photo(n) for n in names]
    batch = np.empty((count, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    for i in range(count):
        image = photos[i % len(photos)]
        h, w = image.shape[:2]
        side = int(min(h, w) * rng.uniform(0.35, 1.0))
        top = int(rng.integers(0, h - side + 1))
        left = int(rng.integers(0, w - side + 1))
        crop = image[top : top + side, left : left + side]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        pixels = resize(crop, (IMAGE_SIZE, IMAGE_SIZE), preserve_range=True, anti_aliasing=True)  # type: ignore[no-untyped-call]
        batch[i] = ((pixels.astype(np.float32) - 127.0) / 128.0).transpose(2, 0, 1)
    return batch


def imagenet_calibration(count: int, seed: int) -> Samples:
    return {"input": _crops(_CALIBRATION_PHOTOS, count, seed)}


def imagenet_heldout(count: int, seed: int) -> Samples:
    return {"input": _crops(_HELDOUT_PHOTOS, count, seed)}


@cache
def _sentences(filename: str) -> tuple[str, ...]:
    text = resources.files("builder.examples").joinpath("data", filename).read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def _tokenize(sentences: list[str]) -> Samples:
    from builder.examples.models import minilm_tokenizer

    encoded = minilm_tokenizer()(
        sentences, padding="max_length", truncation=True, max_length=SEQUENCE_LENGTH, return_tensors="np"
    )
    return {
        "input_ids": encoded["input_ids"].astype(np.int64),
        "attention_mask": encoded["attention_mask"].astype(np.int64),
    }


def _pick(filename: str, count: int, seed: int) -> list[str]:
    pool = list(_sentences(filename))
    order = np.random.default_rng(seed).permutation(len(pool))
    # Past the pool size, sentences repeat: say so through the count in the build report.
    return [pool[order[i % len(pool)]] for i in range(count)]


def sentences_calibration(count: int, seed: int) -> Samples:
    return _tokenize(_pick("sentences_calibration.txt", count, seed))


def sentences_heldout(count: int, seed: int) -> Samples:
    return _tokenize(_pick("sentences_heldout.txt", count, seed))
