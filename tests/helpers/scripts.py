"""Stand-ins tests install: a bench script loaded as a module, cuda-python's runtime module faked."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest


@contextmanager
def loaded_script(name: str, path: Path) -> Iterator[types.ModuleType]:
    """The script at `path` imported as module `name` (registered while in use: dataclasses look their module
    up while the script runs), removed from sys.modules afterwards."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


def install_cuda_runtime(monkeypatch: pytest.MonkeyPatch, runtime: Any) -> None:
    """`runtime` as cuda-python's `cuda.bindings.runtime` (with its parent packages) for this test."""
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = runtime  # type: ignore[attr-defined]
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings  # type: ignore[attr-defined]
    for name, module in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.runtime", runtime)):
        monkeypatch.setitem(sys.modules, name, module)
