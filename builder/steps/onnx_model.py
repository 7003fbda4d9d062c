"""Loading, checking and describing ONNX files, with errors that name the file."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from builder.errors import ManifestError, OnnxModelError
from builder.spec.dtypes import from_onnx
from builder.spec.model import DimRange, TensorSpec


@dataclass(frozen=True)
class Signature:
    """Graph inputs and outputs; shape[0] is the batch axis (-1), named dims are dynamic."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec:
        for tensor in self.inputs:
            if tensor.name == name:
                return tensor
        raise KeyError(name)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load(path: Path) -> onnx.ModelProto:
    """Read and check an ONNX file; a missing, foreign or truncated file gives one clear error."""
    if not path.exists():
        raise OnnxModelError(f"{path}: file not found")
    if not path.is_file():
        raise OnnxModelError(f"{path}: not a file")
    try:
        model = onnx.load(str(path), load_external_data=True)
    except (DecodeError, ValueError, RuntimeError, OSError) as exc:
        raise OnnxModelError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc})") from exc
    if not model.graph.node or not model.opset_import:
        raise OnnxModelError(f"{path}: not an ONNX model (no graph nodes or opset; truncated or another format?)")
    try:
        onnx.checker.check_model(model, full_check=False)
    except onnx.checker.ValidationError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else "validation failed"
        raise OnnxModelError(f"{path}: ONNX checker rejected the model: {first_line}") from exc
    return model


def infer_shapes(model: onnx.ModelProto, what: str) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except (onnx.shape_inference.InferenceError, RuntimeError) as exc:
        raise OnnxModelError(f"{what}: shape inference failed: {exc}") from exc


def signature(model: onnx.ModelProto, what: str) -> Signature:
    initializers = {init.name for init in model.graph.initializer}
    inputs = tuple(
        _tensor(v, f"{what}: input {v.name!r}") for v in model.graph.input if v.name not in initializers
    )
    outputs = tuple(_tensor(v, f"{what}: output {v.name!r}") for v in model.graph.output)
    if not inputs:
        raise OnnxModelError(f"{what}: the graph has no inputs")
    return Signature(inputs, outputs)


def _tensor(value: onnx.ValueInfoProto, what: str) -> TensorSpec:
    tensor_type = value.type.tensor_type
    if not value.type.HasField("tensor_type"):
        raise OnnxModelError(f"{what}: only tensor inputs and outputs are supported")
    dtype = from_onnx(tensor_type.elem_type, what)
    dims: list[int | str] = []
    for index, dim in enumerate(tensor_type.shape.dim):
        if dim.HasField("dim_value") and dim.dim_value > 0:
            dims.append(int(dim.dim_value))
        else:
            dims.append(-1 if index == 0 else (dim.dim_param or f"{value.name}_dim{index}"))
    return TensorSpec(name=value.name, dtype=dtype, shape=tuple(dims))


def check_batchable(sig: Signature, dims: dict[str, DimRange] | None, what: str) -> None:
    """Every input needs a dynamic batch axis; every other dynamic dim needs a range."""
    ranges = dims or {}
    for tensor in sig.inputs:
        if not tensor.shape:
            raise ManifestError(f"{what}: input {tensor.name!r} is a scalar; expected a batch axis first")
        if tensor.shape[0] != -1:
            raise ManifestError(
                f"{what}: input {tensor.name!r} has a fixed first dim {tensor.shape[0]}; "
                "expected a dynamic batch axis (export with dynamic_axes={name: {0: 'batch'}})"
            )
        for dim in tensor.sample_shape:
            if isinstance(dim, str) and dim not in ranges:
                raise ManifestError(
                    f"{what}: input {tensor.name!r} has dynamic dim {dim!r} without a range; "
                    f"expected --dim {dim}=MIN:OPT:MAX (or dims.{dim} in models.toml)"
                )


def check_manifest_inputs(sig: Signature, declared: tuple[TensorSpec, ...], what: str) -> None:
    """Declared inputs (models.toml) must match the exported graph by name, dtype and rank."""
    if not declared:
        return
    names = [t.name for t in sig.inputs]
    if [t.name for t in declared] != names:
        raise ManifestError(f"{what}: inputs {[t.name for t in declared]} differ from the ONNX graph's {names}")
    for want, have in zip(declared, sig.inputs, strict=True):
        if want.dtype != have.dtype or len(want.shape) != len(have.shape):
            raise ManifestError(
                f"{what}: input {want.name!r} declared {want.dtype}{list(want.shape)}, "
                f"ONNX has {have.dtype}{list(have.shape)}"
            )
