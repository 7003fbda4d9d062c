"""`trtbuild serve --gpus LIST`: the GPU variants of a repository placed on those GPUs.

Each config.pbtxt whose instance groups run on GPUs (KIND_GPU) gets `gpus: [LIST]` on those groups;
Triton starts each group's `count` instances on every GPU listed, so the count (what `instances` and
`trtbuild tune` set) stays per GPU. CPU variants are left as they are. Written through Triton's schema,
atomically, under the repository lock; a config already so is not rewritten.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from builder.errors import BuilderError
from builder.repository.lock import repository_lock
from builder.repository.triton_config import parse, to_text
from common.files import write_atomic

log = logging.getLogger(__name__)

CONFIG = "config.pbtxt"


def parse_gpu_list(text: str, flag: str = "--gpus") -> tuple[int, ...]:
    """`0,3` -> (0, 3); BuilderError naming `flag` for anything but device ids."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise BuilderError(f"{flag} {text!r}: expected GPU device ids separated by commas (0,3)")
    return tuple(dict.fromkeys(int(p) for p in parts))


def check_present(gpus: Sequence[int], present: Sequence[int], flag: str = "--gpus") -> None:
    """BuilderError naming the first of `gpus` that is not among `present` (the device ids the server will
    see); no check where none are known (no NVML here: Triton says so as it loads the variants)."""
    missing = [g for g in gpus if g not in present]
    if present and missing:
        raise BuilderError(f"{flag} {','.join(map(str, gpus))}: there is no GPU {missing[0]} here (device ids: "
                           f"{', '.join(map(str, present))}); no config.pbtxt rewritten")


def visible_gpus(nvml_ids: Sequence[int], cuda_visible: str | None) -> list[int]:
    """The CUDA device ids a server started from here sees: NVML's, narrowed by CUDA_VISIBLE_DEVICES."""
    if cuda_visible is None or not nvml_ids:
        return list(nvml_ids)
    listed = [p for p in cuda_visible.split(",") if p.strip()]
    return list(range(min(len(listed), len(nvml_ids))))


def placed(config: model_config_pb2.ModelConfig, gpus: Sequence[int]) -> bool:
    """Set `gpus` on the config's KIND_GPU instance groups; whether it had any."""
    found = False
    for group in config.instance_group:
        if group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU:
            found = True
            del group.gpus[:]
            group.gpus.extend(gpus)
    return found


def place_on_gpus(repository: Path, gpus: Sequence[int], *, wait: bool = True) -> list[Path]:
    """Every GPU variant of `repository` served on `gpus`; the config.pbtxt files rewritten."""
    if not gpus:
        raise BuilderError("--gpus: expected at least one GPU")
    written = []
    with repository_lock(repository, what="serve --gpus", wait=wait):
        for path in sorted(repository.glob(f"*/{CONFIG}")):
            text = path.read_text(encoding="utf-8")
            try:
                config = parse(text)
            except text_format.ParseError as exc:  # a folder this tool did not write: left to Triton to judge
                log.warning("%s: not placed on GPUs (%s)", path, exc)
                continue
            before = to_text(config)
            if placed(config, gpus) and to_text(config) != before:
                write_atomic(path, to_text(config))
                written.append(path)
    return written
