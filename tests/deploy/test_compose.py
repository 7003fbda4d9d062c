"""The docker compose file parses and says what a one-GPU host needs (no Docker engine here)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_compose_builds_first_then_serves_with_health_checks() -> None:
    doc = yaml.safe_load((ROOT / "deploy/compose/docker-compose.yml").read_text())
    builder, triton = doc["services"]["builder"], doc["services"]["triton"]
    assert triton["depends_on"]["builder"]["condition"] == "service_completed_successfully"
    assert builder["image"] == triton["image"]  # engines are built in the image that serves them
    assert builder["command"][0] == "build-engines"
    assert "curl" in triton["healthcheck"]["test"] and "/v2/health/ready" in triton["healthcheck"]["test"][-1]
    assert triton["restart"] == "unless-stopped" and builder["restart"] == "no"
    assert triton["shm_size"] and {"8000:8000", "8001:8001", "8002:8002"} == set(triton["ports"])
    assert "--model-control-mode=none" in triton["command"]
    for service in (builder, triton):
        assert service["read_only"] is True and service["cap_drop"] == ["ALL"] and service["user"] == "1000:1000"
        gpus = service["deploy"]["resources"]["reservations"]["devices"][0]
        assert gpus["driver"] == "nvidia" and "gpu" in gpus["capabilities"]
    assert "models:/models:ro" in triton["volumes"]
    assert all("${TRITON_ADMIN_KEY:?" in a for a in triton["command"] if "restricted" in a)


def test_image_pins_a_triton_release_without_known_critical_cves() -> None:
    dockerfile = (ROOT / "deploy/docker/Dockerfile").read_text()
    match = re.search(r"nvcr\.io/nvidia/tritonserver:(\d+)\.(\d+)-py3", dockerfile)
    assert match, "the Dockerfile must pin an NGC Triton release"
    assert (int(match.group(1)), int(match.group(2))) >= (26, 6)
    assert "USER 1000" in dockerfile
