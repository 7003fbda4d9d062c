"""What to build: models.toml's schema as typed specs, closed value sets, dtypes, names, settings."""

from builder.spec.enums import (
    CalibrationMethod,
    GuardSensitivity,
    Int8Recipe,
    Precision,
    RuntimeChoice,
    ServingBackend,
    Task,
)
from builder.spec.manifest import load_manifest, model_spec, parse_precisions
from builder.spec.model import (
    DEFAULT_TOLERANCES,
    CalibrationSpec,
    DataSpec,
    DimRange,
    ModelSpec,
    ServingSpec,
    TensorSpec,
    Tolerance,
)
from builder.spec.names import check_model_name, variant_name
from builder.spec.settings import default_cache_dir

__all__ = [
    "DEFAULT_TOLERANCES", "CalibrationMethod", "CalibrationSpec", "DataSpec", "DimRange", "GuardSensitivity",
    "Int8Recipe", "ModelSpec",
    "Precision", "RuntimeChoice", "ServingBackend", "ServingSpec", "Task", "TensorSpec", "Tolerance",
    "check_model_name", "default_cache_dir", "load_manifest", "model_spec", "parse_precisions", "variant_name",
]
