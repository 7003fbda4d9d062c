"""The multi-GPU production overlay (issue 26): one pod with N GPUs, the GPU variants' instance groups on
GPUs 0..N-1 (written by build-engines from SERVE_GPU_COUNT, as `trtbuild serve --gpus` writes them), N set
in one place, and the HPA adding such pods across nodes. Rendered with plain `kubectl kustomize`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from tritonclient.grpc import model_config_pb2

from builder.repository.triton_config import parse
from builder.serving.triton_server import gpu_ids
from tests.deploy.kubectl import kubectl as find_kubectl
from tests.deploy.test_kubernetes import ALL_OVERLAYS, KUSTOMIZE, OVERLAYS, ROOT, container, one, render

OVERLAY = "gpu-multi"
PATCH = OVERLAYS / OVERLAY / "deployment-multi-gpu.yaml"
SCRIPT = ROOT / "deploy" / "scripts" / "build-engines.sh"
GPU = "nvidia.com/gpu"


def gpu_count(objects: list[dict[str, Any]]) -> int:
    """N: the triton container's GPU limit, after checking the init container and SERVE_GPU_COUNT agree."""
    deployment = one(objects, "Deployment")
    triton, builder = container(deployment, "triton"), container(deployment, "build-engines", init=True)
    n = int(triton["resources"]["limits"][GPU])
    assert int(builder["resources"]["limits"][GPU]) == n
    env = {e["name"]: e.get("value") for e in builder["env"]}
    assert env["SERVE_GPU_COUNT"] == str(n)
    return n


def test_the_overlay_renders_under_the_default_load_restrictor() -> None:
    """render() runs `kubectl kustomize DIR` with no flag (what `kubectl apply -k` does); `make k8s-render`
    and the checkov and schema tests take every folder of overlays/, this one included."""
    assert OVERLAY in ALL_OVERLAYS
    objects = render(OVERLAY)
    assert one(objects, "Deployment")["metadata"]["namespace"] == "inference"
    overlay_dir = (OVERLAYS / OVERLAY).resolve()
    doc = yaml.safe_load((overlay_dir / "kustomization.yaml").read_text())
    for patch in doc.get("patches", []):
        if "path" in patch:
            assert (overlay_dir / patch["path"]).resolve().is_relative_to(overlay_dir)
    assert doc["resources"] == ["../gpu-production"]  # a kustomization folder, which the restrictor allows


def test_one_pod_has_n_gpus_default_two_on_gpu_production_nodes() -> None:
    objects = render(OVERLAY)
    assert gpu_count(objects) == 2
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["key"] == "nvidia.com/gpu.product"
    assert container(deployment, "build-engines", init=True)["args"] == ["--runtime", "tensorrt"]


def test_n_is_set_in_one_place(tmp_path: Path) -> None:
    """Changing the triton container's limit alone changes the init container's and SERVE_GPU_COUNT."""
    assert PATCH.read_text().count(f'{GPU}: "2"') == 1
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUSTOMIZE, copy)
    patch = copy / "overlays" / OVERLAY / PATCH.name
    patch.write_text(patch.read_text().replace(f'{GPU}: "2"', f'{GPU}: "4"'))
    proc = subprocess.run([find_kubectl(), "kustomize", str(copy / "overlays" / OVERLAY)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert gpu_count([d for d in yaml.safe_load_all(proc.stdout) if d]) == 4


def _fake_tools(bin_dir: Path, gpus: int) -> None:
    """nvidia-smi listing `gpus` GPUs; trtbuild writing what `trtbuild engines` writes for a TensorRT and a
    CPU variant (instance groups without `gpus`); python3 this interpreter, which imports the builder."""
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    lines = "\n".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i:08d})" for i in range(gpus))
    smi.write_text(f"#!/bin/sh\nif [ \"$1\" = -L ]; then printf '%s\\n' '{lines}'; else echo 'NVIDIA H200'; fi\n"
                   if gpus else "#!/bin/sh\nexit 9\n")
    trtbuild = bin_dir / "trtbuild"
    trtbuild.write_text("""#!/bin/sh
while [ $# -gt 0 ]; do [ "$1" = --repository ] && repo=$2; shift; done
mkdir -p "$repo/m_fp16/1" "$repo/m_cpu/1"
groups='max_batch_size: 8\\ninstance_group [{ count: %s kind: %s }]\\n'
printf "name: \\"m_fp16\\"\\nplatform: \\"tensorrt_plan\\"\\n$groups" 3 KIND_GPU > "$repo/m_fp16/config.pbtxt"
printf "name: \\"m_cpu\\"\\nbackend: \\"onnxruntime\\"\\n$groups" 1 KIND_CPU > "$repo/m_cpu/config.pbtxt"
echo '{}' > "$repo/build_report.json"
""")
    python = bin_dir / "python3"  # a wrapper, not a link: a link outside the virtualenv loses its packages
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for tool in (smi, trtbuild, python):
        tool.chmod(0o755)


def run_build_engines(tmp_path: Path, env_count: str, gpus_seen: int) -> subprocess.CompletedProcess[str]:
    _fake_tools(tmp_path / "bin", gpus_seen)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SERVE_GPU_COUNT": env_count,
           "PYTHONPATH": str(ROOT)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(["sh", str(SCRIPT), "models.toml", str(tmp_path / "cache"), str(tmp_path / "serve")],
                          capture_output=True, text=True, timeout=120, check=False, env=env)


def test_the_gpu_limit_equals_the_instance_groups_gpu_list(tmp_path: Path) -> None:
    """The init container's own command and SERVE_GPU_COUNT, run with a fake 2-GPU nvidia-smi and trtbuild:
    every KIND_GPU group of the served configs lists GPUs 0..N-1 (N = the pod's GPU limit), its count per
    GPU kept; CPU variants untouched; the build cache keeps the configs as built."""
    objects = render(OVERLAY)
    n = gpu_count(objects)
    present = gpu_ids()
    if present and len(present) < n:
        pytest.skip(f"this host's NVML lists {len(present)} GPUs, fewer than the overlay's {n}")
    builder = container(one(objects, "Deployment"), "build-engines", init=True)
    env_count = {e["name"]: e.get("value") for e in builder["env"]}["SERVE_GPU_COUNT"]
    proc = run_build_engines(tmp_path, env_count, gpus_seen=n)
    assert proc.returncode == 0, proc.stderr
    served = parse((tmp_path / "serve" / "m_fp16" / "config.pbtxt").read_text())
    (group,) = served.instance_group
    assert group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    assert list(group.gpus) == list(range(n)) and len(group.gpus) == n == int(
        container(one(objects, "Deployment"), "triton")["resources"]["limits"][GPU])
    assert group.count == 3  # per GPU: Triton starts 3 on each listed GPU
    (cpu_group,) = parse((tmp_path / "serve" / "m_cpu" / "config.pbtxt").read_text()).instance_group
    assert list(cpu_group.gpus) == [] and cpu_group.kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    cached = next((tmp_path / "cache").glob("*/model_repository/m_fp16/config.pbtxt"))
    assert list(parse(cached.read_text()).instance_group[0].gpus) == []
    assert sorted(p.name for p in (tmp_path / "serve").iterdir()) == ["build_report.json", "m_cpu", "m_fp16"]
    assert "m_fp16: instances on GPUs 0,1" in proc.stdout


def test_build_engines_refuses_a_count_the_container_does_not_see(tmp_path: Path) -> None:
    proc = run_build_engines(tmp_path, "2", gpus_seen=1)
    assert proc.returncode == 1
    assert "SERVE_GPU_COUNT=2 but this container sees 1 GPUs" in proc.stderr


def test_without_serve_gpu_count_build_engines_places_nothing(tmp_path: Path) -> None:
    """compose and the other overlays: configs served as built."""
    _fake_tools(tmp_path / "bin", 0)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    env.pop("SERVE_GPU_COUNT", None)
    proc = subprocess.run(["sh", str(SCRIPT), "models.toml", str(tmp_path / "cache"), str(tmp_path / "serve")],
                          capture_output=True, text=True, timeout=120, check=False, env=env)
    assert proc.returncode == 0, proc.stderr
    group = parse((tmp_path / "serve" / "m_fp16" / "config.pbtxt").read_text()).instance_group[0]
    assert list(group.gpus) == []
    for overlay in ALL_OVERLAYS:
        if overlay != OVERLAY:
            assert "SERVE_GPU_COUNT" not in str(one(render(overlay), "Deployment"))


def test_the_hpa_scales_the_deployment_with_per_pod_metrics_across_nodes() -> None:
    objects = render(OVERLAY)
    deployment, hpa = one(objects, "Deployment"), one(objects, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        "apps/v1", "Deployment", deployment["metadata"]["name"])
    assert hpa["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert all(m["type"] == "Pods" for m in hpa["spec"]["metrics"])  # averaged per pod, whatever N
    (spread,) = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert spread["labelSelector"]["matchLabels"].items() <= labels.items()
