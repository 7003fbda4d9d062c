"""ONNX files on disk: read (with one line for a missing, foreign or truncated file), written and copied
atomically with the data file that holds the weights of a model over protobuf's 2 GB, measured and hashed.

Below the steps and the runtimes, which both move ONNX files (a runtime's artifact can be the variant ONNX
itself); what a graph means (signature, shapes, runs) is builder/steps/onnx_model.py.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from builder.errors import OnnxModelError
from common.files import copy_atomic


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load(path: Path) -> onnx.ModelProto:
    """Read and check an ONNX file, with its external data (if any); a missing, foreign or truncated file,
    or external data missing beside it, gives one clear error."""
    if not path.exists():
        raise OnnxModelError(f"{path}: file not found")
    if not path.is_file():
        raise OnnxModelError(f"{path}: not a file")
    try:
        external = has_external_data(path)
        model = onnx.load(str(path), load_external_data=True)
    except (DecodeError, ValueError, RuntimeError, OSError, onnx.checker.ValidationError) as exc:
        # onnx checks an external data file's path while loading it: a missing one is a ValidationError.
        raise OnnxModelError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {_first_line(exc)})") from exc
    if not model.graph.node or not model.opset_import:
        raise OnnxModelError(f"{path}: not an ONNX model (no graph nodes or opset; truncated or another format?)")
    try:
        # By path where the weights live beside it: the checker takes no message over 2 GB.
        onnx.checker.check_model(str(path) if external else model, full_check=False)
    except onnx.checker.ValidationError as exc:
        raise OnnxModelError(f"{path}: ONNX checker rejected the model: {_first_line(exc)}") from exc
    return model


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "validation failed"


# protobuf cannot serialize one message over 2 GB: larger models keep their weights in a data file
# (a module attribute, so a test can lower it and take the data-file branch with a small model).
PROTOBUF_LIMIT = 2**31 - 1


def data_file(path: Path) -> Path:
    """Where `save` puts the weights of a model too large for one protobuf: `NAME.onnx.data` beside it."""
    return path.with_name(path.name + ".data")


def save(model: onnx.ModelProto, path: Path) -> None:
    """Write `model` to `path`: one file when it fits in a protobuf, else with its weights in
    `data_file(path)` (the tensors then move out of `model`). The data is written first and the .onnx
    last, by rename, so a reader finding the .onnx finds its data; a stale data file is removed."""
    try:
        external = model.ByteSize() >= PROTOBUF_LIMIT
    except (ValueError, OverflowError):  # too large even to measure
        external = True
    data = data_file(path)
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if external:
            onnx.save(model, str(temporary), save_as_external_data=True, all_tensors_to_one_file=True,
                      location=data.name)
            # onnx creates the data file private (0600); it gets the model file's mode (the umask's), so
            # a server running as another user (a container's) can read it.
            os.chmod(data, stat.S_IMODE(temporary.stat().st_mode))
        else:
            onnx.save(model, str(temporary))
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def copy_model(source: Path, target: Path) -> None:
    """The model at `source` written to `target` with its external data (if any) loaded and written
    again (`save`: inline when the whole fits in one protobuf, else in `data_file(target)`). Atomic:
    `target` appears whole, its data first."""
    if not has_external_data(source):
        data_file(target).unlink(missing_ok=True)
        copy_atomic(source, target)
        return
    save(load(source), target)


def move_model(source: Path, target: Path) -> None:
    """`copy_model`, then the source and its data files removed."""
    if has_external_data(source):
        copy_model(source, target)
        remove_model(source)
    else:
        data_file(target).unlink(missing_ok=True)
        os.replace(source, target)


def remove_model(path: Path) -> None:
    """The model file and the data files it points to."""
    if path.is_file():
        for data in _external_files(path):
            data.unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def _external_files(path: Path) -> list[Path]:
    """The data files the model's tensors point to (none for a self-contained model): initializers, those
    of subgraphs (If, Loop) and Constant nodes' values, as onnx's own loader walks them."""
    model = onnx.load(str(path), load_external_data=False)
    tensors = onnx.external_data_helper._get_all_tensors(model)  # the walk onnx.load uses (private)
    found = {entry.value for t in tensors if onnx.external_data_helper.uses_external_data(t)
             for entry in t.external_data if entry.key == "location"}
    return [path.parent / name for name in sorted(found)]


def has_external_data(path: Path) -> bool:
    """Whether the model keeps weights in data files beside it."""
    return bool(_external_files(path))


def model_size(path: Path) -> int:
    """Bytes of an ONNX file and the data files it points to; of any other file (a plan), its own."""
    size = path.stat().st_size
    if path.suffix == ".onnx":
        size += sum(data.stat().st_size for data in _external_files(path))
    return size


def sha256_model(path: Path) -> str:
    """The model's digest: its file's, and where it keeps weights in data files, theirs too (new weights
    in the same graph are a new model). A self-contained model's (or a plan's) is its file's sha256."""
    files = _external_files(path) if path.suffix == ".onnx" else []
    if not files:
        return sha256_file(path)
    digest = hashlib.sha256(sha256_file(path).encode())
    for data in files:
        digest.update(f"{data.name}:{sha256_file(data)}".encode())
    return digest.hexdigest()
