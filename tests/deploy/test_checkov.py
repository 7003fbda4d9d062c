"""Every rendered Kubernetes overlay, the docker compose file and the image's Dockerfile pass checkov with
no failed check; each check waived in a manifest says why there (checkov's skip annotation or comment).

checkov lives in its own virtualenv (`make scan-tools`: .tools/checkov; installed into .venv it would
downgrade packaging, networkx and python-dateutil); an importable checkov is used first."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.kubectl import kubectl as find_kubectl

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ROOT / "deploy" / "kubernetes" / "overlays"
ALL_OVERLAYS = sorted(p.name for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())
TOOL = ROOT / ".tools" / "checkov" / "bin" / "checkov"

# About 30 s per scan: `make test` and `make scan` run them, the fast tier (`make test-fast`) does not.
pytestmark = pytest.mark.slow


def checkov() -> list[str]:
    if importlib.util.find_spec("checkov") is not None:
        return [sys.executable, "-m", "checkov.main"]
    if TOOL.is_file():
        return [str(TOOL)]
    pytest.skip("checkov is neither importable nor in .tools/checkov (make scan-tools installs it)")


def scan(files: list[Path], frameworks: str, cwd: Path) -> list[dict[str, Any]]:
    """checkov's JSON report, one entry per framework (offline: --skip-download)."""
    argv = [*checkov(), "--skip-download", "--framework", frameworks, "-o", "json"]
    for path in files:
        argv += ["-f", str(path)]
    env = {**os.environ, "LOG_LEVEL": "WARNING"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False, cwd=cwd, env=env)
    assert proc.stdout.strip(), f"checkov printed no report (status {proc.returncode}):\n{proc.stderr[-2000:]}"
    report = json.loads(proc.stdout)
    return report if isinstance(report, list) else [report]


def failed(reports: list[dict[str, Any]]) -> list[str]:
    return [f"{c['check_id']} {c['check_name']} ({c['resource']}, {c['file_path']})"
            for r in reports for c in r.get("results", {}).get("failed_checks", [])]


def unexplained_skips(reports: list[dict[str, Any]]) -> list[str]:
    """Waived checks whose waiver carries no reason."""
    out = []
    for report in reports:
        for check in report.get("results", {}).get("skipped_checks", []):
            comment = (check.get("check_result") or {}).get("suppress_comment") or ""
            if len(comment.strip()) < 20:
                out.append(f"{check['check_id']} ({check['resource']}): {comment!r}")
    return out


def passed(reports: list[dict[str, Any]]) -> int:
    return sum(int(r.get("summary", {}).get("passed", 0)) for r in reports)


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_a_rendered_overlay_passes_checkov(overlay: str, tmp_path: Path) -> None:
    kubectl = find_kubectl()
    proc = subprocess.run([kubectl, "kustomize", str(OVERLAYS / overlay)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    rendered = tmp_path / f"{overlay}.yaml"
    rendered.write_text(proc.stdout)
    reports = scan([rendered], "kubernetes", tmp_path)
    assert failed(reports) == []
    assert unexplained_skips(reports) == []
    assert passed(reports) > 50  # the Kubernetes checks ran (88 per overlay with checkov 3.3.30)


def test_compose_and_the_image_pass_checkov() -> None:
    """checkov 3.3 has no docker-compose ruleset (it runs no check on the file; its secrets scan does
    run); the Dockerfile compose builds is scanned with its own."""
    files = [ROOT / "deploy" / "compose" / "docker-compose.yml", ROOT / "deploy" / "docker" / "Dockerfile"]
    reports = scan(files, "dockerfile,secrets,yaml", ROOT)
    assert failed(reports) == []
    assert unexplained_skips(reports) == []
    assert passed(reports) > 20  # the Dockerfile checks ran
