"""The fake pb_utils every runner test here installs (tests/helpers/fake_pb_utils.py)."""

from __future__ import annotations

import types

import pytest

from builder.repository import python_model
from tests.helpers.fake_pb_utils import install


@pytest.fixture
def pb_utils(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    return install(monkeypatch, python_model)
