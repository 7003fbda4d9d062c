"""Render every overlay with plain kubectl kustomize (offline, no flags: what `kubectl apply -k`,
Argo CD and Flux do), validate it strictly against the Kubernetes schemas, and check the
properties a platform team reviews."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from builder.serving.triton_server import Ports, TritonServer, free_ports
from tests.deploy.kubectl import kubectl as find_kubectl

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
OVERLAYS = KUSTOMIZE / "overlays"
KUBERNETES_VERSION = "1.37.0"
ALL_OVERLAYS = sorted(p.name for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())
# Where deploy/docker/Dockerfile puts the manifest and the build script (compose uses them too).
IMAGE_MANIFEST = "/opt/trt-serve-kit/models.toml"
IMAGE_BUILD_SCRIPT = "/usr/local/bin/build-engines"


def render(overlay: str) -> list[dict[str, Any]]:
    """`kubectl kustomize DIR` with no flags: kustomize's default load restrictor applies."""
    kubectl = find_kubectl()
    proc = subprocess.run([kubectl, "kustomize", str(OVERLAYS / overlay)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"kubectl kustomize {overlay} failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def test_both_overlays_exist() -> None:
    assert {"gpu-production", "cpu-trial"} <= set(ALL_OVERLAYS)


@pytest.fixture(scope="module", params=ALL_OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container(deployment: dict[str, Any], name: str, init: bool = False) -> dict[str, Any]:
    spec = deployment["spec"]["template"]["spec"]
    return next(c for c in spec["initContainers" if init else "containers"] if c["name"] == name)


def test_every_object_validates_strictly(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy",
            "PodMonitor", "PersistentVolumeClaim", "ServiceAccount"} <= kinds
    assert "Secret" not in kinds  # the admin key is created by the operator, never shipped
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no bundled schema; its fields are checked below
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_security_context_is_restricted(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    for c in [*pod["initContainers"], *pod["containers"]]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}
        for mount in c["volumeMounts"]:
            volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
            writable_kinds = {"emptyDir", "persistentVolumeClaim"}
            assert mount.get("readOnly") or writable_kinds & set(volume), f"{c['name']}: {mount} is writable"
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"


def test_triton_args_probes_and_shutdown(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    deployment = one(objects, "Deployment")
    triton = container(deployment, "triton")
    args = triton["args"]
    assert "--model-control-mode=none" in args
    exit_timeout = int(next(a for a in args if a.startswith("--exit-timeout-secs=")).split("=")[1])
    for flag in ("--http-restricted-api=", "--grpc-restricted-protocol="):
        value = next(a for a in args if a.startswith(flag))
        apis, _, key = value[len(flag):].partition(":")
        assert set(apis.split(",")) == {"model-repository", "shared-memory", "logging", "trace"}
        assert key == "triton-admin-key=$(TRITON_ADMIN_KEY)"
    env = {e["name"]: e for e in triton["env"]}
    assert env["TRITON_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "triton-admin-key"
    assert triton["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert triton["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert triton["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    pre_stop = int(triton["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > exit_timeout + pre_stop
    assert {p["name"]: p["containerPort"] for p in triton["ports"]} == {"http": 8000, "grpc": 8001, "metrics": 8002}
    assert triton["resources"]["requests"]["cpu"] and triton["resources"]["requests"]["memory"]
    builder = container(deployment, "build-engines", init=True)
    assert builder["command"] == ["build-engines", IMAGE_MANIFEST, "/cache", "/models"]
    assert builder["image"] == triton["image"]  # the manifest comes with the image that serves
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["engine-cache"]["persistentVolumeClaim"]["claimName"] == "triton-engine-cache"


def test_gpu_overlay_requests_gpus_on_the_right_nodes() -> None:
    objects = render("gpu-production")
    deployment = one(objects, "Deployment")
    for c in (container(deployment, "triton"), container(deployment, "build-engines", init=True)):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    terms = deployment["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["key"] == "nvidia.com/gpu.product"
    assert container(deployment, "build-engines", init=True)["args"] == ["--runtime", "tensorrt"]
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)


def test_cpu_overlay_has_no_gpu() -> None:
    objects = render("cpu-trial")
    deployment = one(objects, "Deployment")
    assert "nvidia.com/gpu" not in str(deployment)
    assert container(deployment, "build-engines", init=True)["args"] == [
        "--runtime", "onnxruntime", "--serving-backend", "onnxruntime"]


def test_autoscaling_disruption_network_and_monitoring(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "triton_queue_time_per_request_us"
    rules = yaml.safe_load((ROOT / "deploy/kubernetes/monitoring/prometheus-adapter-rules.yaml").read_text())
    rule = yaml.safe_load(rules["data"]["config.yaml"])["rules"][0]
    assert rule["name"]["as"] == "triton_queue_time_per_request_us"
    assert "nv_inference_queue_duration_us" in rule["metricsQuery"]
    assert "nv_inference_request_success" in rule["metricsQuery"]
    pdb = one(objects, "PodDisruptionBudget")
    labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    policy = one(objects, "NetworkPolicy")
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    ingress_ports = {p["port"] for rule_ in policy["spec"]["ingress"] for p in rule_["ports"]}
    assert ingress_ports == {8000, 8001, 8002}
    assert all(p["port"] == 53 for rule_ in policy["spec"]["egress"] for p in rule_["ports"])
    monitor = one(objects, "PodMonitor")
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    service = one(objects, "Service")
    assert {p["name"] for p in service["spec"]["ports"]} == {"http", "grpc", "metrics"}


def _kustomization_files(directory: Path) -> list[str]:
    """Every file path a kustomization loads (generators, patches, resources that are files)."""
    doc = yaml.safe_load((directory / "kustomization.yaml").read_text())
    paths: list[str] = []
    for generator in [*doc.get("configMapGenerator", []), *doc.get("secretGenerator", [])]:
        paths += [entry.partition("=")[2] or entry for entry in generator.get("files", [])]
        paths += generator.get("envs", []) + ([generator["env"]] if "env" in generator else [])
    paths += [patch["path"] for patch in doc.get("patches", []) if "path" in patch]
    paths += doc.get("patchesStrategicMerge", []) + doc.get("components", [])
    paths += [r for r in doc.get("resources", []) if (directory / r).is_file()]
    return paths


@pytest.mark.parametrize("directory", [KUSTOMIZE / "base", *(OVERLAYS / o for o in ALL_OVERLAYS)],
                         ids=lambda p: p.name)
def test_no_kustomization_loads_a_file_outside_its_folder(directory: Path) -> None:
    """The default load restrictor's rule, checked on the files so the failure names the path."""
    for path in _kustomization_files(directory):
        resolved = (directory / path).resolve()
        assert resolved.is_relative_to(directory.resolve()), f"{directory.name} loads {path} from outside itself"
        assert resolved.exists(), f"{directory.name}: {path} does not exist"


def test_the_init_container_finds_the_manifest_and_script_in_the_image() -> None:
    """models.toml and build-engines reach the cluster inside the image: the Dockerfile copies the
    repository's own files to the paths the init container (and compose's builder) runs."""
    dockerfile = (ROOT / "deploy/docker/Dockerfile").read_text()
    workdir = re.findall(r"^WORKDIR\s+(\S+)", dockerfile, re.MULTILINE)
    assert workdir and workdir[0].rstrip("/") == str(Path(IMAGE_MANIFEST).parent)
    copies = [line.split()[1:] for line in dockerfile.splitlines() if line.startswith("COPY ")]
    assert any("models.toml" in args[:-1] and args[-1] in ("./", ".") for args in copies), copies
    assert ["deploy/scripts/build-engines.sh", IMAGE_BUILD_SCRIPT] in copies
    script = ROOT / "deploy/scripts/build-engines.sh"
    assert os.access(script, os.X_OK), "COPY keeps the mode: the script must be executable in the repository"
    assert (ROOT / "models.toml").is_file()
    compose = yaml.safe_load((ROOT / "deploy/compose/docker-compose.yml").read_text())
    for overlay in ALL_OVERLAYS:
        builder = container(one(render(overlay), "Deployment"), "build-engines", init=True)
        assert builder["command"] == compose["services"]["builder"]["command"][:4]
        for mount in builder["volumeMounts"]:
            for baked in (IMAGE_MANIFEST, IMAGE_BUILD_SCRIPT):
                assert not baked.startswith(mount["mountPath"].rstrip("/") + "/"), f"{mount} hides {baked}"


def test_plain_render_refuses_files_outside_the_folder(tmp_path: Path) -> None:
    """The check above can fail: kubectl's default load restrictor is in force for `render`."""
    (tmp_path / "outside.toml").write_text("x = 1\n")
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "configMapGenerator:\n  - name: m\n    files:\n      - models.toml=../outside.toml\n")
    kubectl = find_kubectl()
    proc = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode != 0 and "is not in or below" in proc.stderr


def test_make_k8s_render_uses_plain_kustomize() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("\nk8s-render:"):].split("\n\n")[0]
    assert "$(KUBECTL) kustomize deploy/kubernetes/overlays/" in recipe and "load-restrictor" not in recipe


@pytest.mark.server
def test_restricted_api_flags_work_on_a_real_server(tiny_repository: tuple[Path, Any]) -> None:
    """The Deployment's own restricted-API arguments, given to the bundled Triton."""
    repository, _ = tiny_repository
    args = container(one(render("cpu-trial"), "Deployment"), "triton")["args"]
    restricted = [a.replace("$(TRITON_ADMIN_KEY)", "k3y") for a in args if "restricted" in a]
    http, grpc, metrics = free_ports(3)
    server = TritonServer(repository, Path(tempfile.mkdtemp()), Ports(http, grpc, metrics), extra_args=restricted)
    server.start(timeout=120)
    try:
        def status(headers: dict[str, str]) -> int:
            request = urllib.request.Request(f"http://127.0.0.1:{http}/v2/repository/index", data=b"{}",
                                             headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    return int(response.status)
            except urllib.error.HTTPError as exc:
                return int(exc.code)

        assert status({}) == 403
        assert status({"triton-admin-key": "wrong"}) == 403
        assert status({"triton-admin-key": "k3y"}) == 200
    finally:
        server.stop()
