"""The kubectl the deployment tests render with: the project's own (`make test` installs it into .tools/kubectl
from requirements/kubectl.txt), else one on PATH for a bare `pytest` run."""

from __future__ import annotations

import shutil
from pathlib import Path

PROJECT_KUBECTL = Path(__file__).resolve().parents[2] / ".tools" / "kubectl" / "bin" / "kubectl"


def kubectl() -> str:
    if PROJECT_KUBECTL.is_file():
        return str(PROJECT_KUBECTL)
    found = shutil.which("kubectl")
    assert found, "kubectl not found: run `make test` (it installs .tools/kubectl), or put kubectl on PATH"
    return found
