"""A fractional container that mounts `/tmp/nvidia-mps`, CUDA's default MPS pipe directory, as
upstream KAI's MPS example does (docs/gpu-sharing/mps/gpu-sharing-with-mps.yaml: a hostPath
there, for a daemon someone runs on the host), asks for an MPS daemon kai_fractions does not
manage. Before, both webhooks admitted it silently: the container ran time-sliced, or, where a
host daemon ran, joined a daemon outside kai_fractions' limits. Now both warn (the manifest
keeps working), naming the key that asks kai_fractions for sm-sharing.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest

from kai_fractions.admission.mutate import mutate
from kai_fractions.admission.validate import validate

from .reviews import CONFIG, SM, TS, pod, request

KEY = "nvidia.com/container.gpu-workload.gpu-compute.mode: sm-sharing"


def upstream_mps_example() -> dict[str, Any]:
    """Upstream KAI's MPS example, as published (a pod-level `gpu-fraction`)."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "gpu-sharing-with-mps", "namespace": "ns",
                     "labels": {"kai.scheduler/queue": "default-queue"},
                     "annotations": {"gpu-fraction": "0.5"}},
        "spec": {
            "schedulerName": "kai-scheduler",
            "containers": [{
                "name": "gpu-workload", "image": "nvidia/cuda:13.0.2-base-ubi8",
                "command": ["nvidia-smi"], "args": ["-L"],
                "resources": {"limits": {"memory": "1Gi"}},
                "volumeMounts": [{"name": "mps", "mountPath": "/tmp/nvidia-mps"}]}],
            "volumes": [{"name": "mps", "hostPath": {"path": "/tmp/nvidia-mps",
                                                     "type": "DirectoryOrCreate"}}],
        },
    }


def both_webhooks(obj: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The warnings of the mutating webhook, then of the validating one on the wired pod; both
    admit it."""
    m = mutate(request(obj), CONFIG)
    assert m.allowed, m
    wired = jsonpatch.apply_patch(copy.deepcopy(obj), list(m.patch))
    v = validate(request(wired), CONFIG)
    assert v.allowed, v
    return m.warnings, v.warnings


def mps_warnings(warnings: tuple[str, ...]) -> list[str]:
    return [w for w in warnings if "CUDA's default MPS pipe directory" in w]


def test_upstream_kais_mps_example_is_admitted_with_a_warning() -> None:
    """Before: admitted with no warning at all. Now: admitted, and both webhooks say, in the
    same words (kubectl shows a repeated warning once), that the mount asks for a daemon
    kai_fractions does not manage and which key asks it for sm-sharing."""
    mutating, validating = both_webhooks(upstream_mps_example())
    [warning] = mps_warnings(mutating)
    assert mps_warnings(validating) == [warning]
    assert warning.startswith("container 'gpu-workload' mounts the host's '/tmp/nvidia-mps', "
                              "CUDA's default MPS pipe directory"), warning
    assert "an MPS daemon kai_fractions does not manage" in warning
    assert KEY in warning


@pytest.mark.parametrize(("volume", "mount_path"), [
    # a hostPath of that directory, mounted elsewhere and pointed at with its own env
    ({"hostPath": {"path": "//tmp/./nvidia-mps/"}}, "/mps"),
    # any volume at CUDA's default pipe directory
    ({"emptyDir": {}}, "/tmp/nvidia-mps/"),
    # the host's /tmp where it is: the host's /tmp/nvidia-mps comes with it (a second look)
    ({"hostPath": {"path": "/tmp"}}, "/tmp"),
    ({"hostPath": {"path": "/tmp", "type": "Directory"}}, "/tmp/"),
])
def test_any_volume_there_or_host_directory_of_that_name_warns(volume, mount_path) -> None:
    """Before: no warning. Now: the host directory is compared as the node resolves it, the
    mount path once cleaned."""
    obj = upstream_mps_example()
    obj["spec"]["volumes"] = [{"name": "mps", **volume}]
    obj["spec"]["containers"][0]["volumeMounts"] = [{"name": "mps", "mountPath": mount_path}]
    mutating, validating = both_webhooks(obj)
    assert len(mps_warnings(mutating)) == 1 and mps_warnings(validating) == mps_warnings(mutating)


def test_an_sm_sharing_container_is_told_the_mount_is_unused() -> None:
    """Before: no warning. Now: an sm-sharing container reaches kai_fractions' own daemon (its
    CUDA_MPS_PIPE_DIRECTORY), so the warning says the mount is unused."""
    obj = pod(dict(SM), volumes=[{"name": "mps", "hostPath": {"path": "/tmp/nvidia-mps"}}])
    obj["spec"]["containers"][0]["volumeMounts"] = [{"name": "mps",
                                                     "mountPath": "/tmp/nvidia-mps"}]
    mutating, validating = both_webhooks(obj)
    [warning] = mps_warnings(mutating)
    assert mps_warnings(validating) == [warning]
    assert "an MPS daemon kai_fractions does not manage" in warning
    assert "unused" in warning and "sm-sharing" in warning


def test_only_the_fractional_container_is_warned_and_only_at_creation() -> None:
    """Before: no warning. Now: one, about the container that has the GPU: a sidecar
    (NVIDIA_VISIBLE_DEVICES void) or a pod without a fraction mounting the directory is no
    concern of kai_fractions. The pod's mounts cannot change after creation, so the warning
    comes with its creation, not with every later update (a label, the kubelet's status)."""
    at = {"name": "mps", "mountPath": "/tmp/nvidia-mps"}
    volumes = [{"name": "mps", "hostPath": {"path": "/tmp/nvidia-mps"}}]
    obj = pod(dict(TS), containers=("main", "side"), volumes=copy.deepcopy(volumes))
    for c in obj["spec"]["containers"]:
        c["volumeMounts"] = [dict(at)]
    mutating, validating = both_webhooks(obj)
    [warning] = mps_warnings(mutating)
    assert mps_warnings(validating) == [warning] and warning.startswith("container 'main' ")
    unkeyed = pod({}, volumes=copy.deepcopy(volumes))
    unkeyed["spec"]["containers"][0]["volumeMounts"] = [dict(at)]
    assert not mps_warnings(sum(both_webhooks(unkeyed), ()))
    m = mutate(request(obj), CONFIG)
    wired = jsonpatch.apply_patch(copy.deepcopy(obj), list(m.patch))
    relabelled = copy.deepcopy(wired)
    relabelled["metadata"]["labels"] = {"team": "a"}
    v = validate(request(relabelled, old=wired), CONFIG)
    assert v.allowed and not mps_warnings(v.warnings)


def test_a_deployment_says_it_when_it_is_applied() -> None:
    """Before: no warning. Now: a Deployment's pods are created by its ReplicaSet controller,
    which alone would see their warnings, so the workloads webhook warns on the template, where
    the user applying it sees it."""
    template = upstream_mps_example()
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "mps", "namespace": "ns"},
        "spec": {"selector": {"matchLabels": {"app": "mps"}},
                 "template": {"metadata": {**template["metadata"], "labels": {"app": "mps"}},
                              "spec": template["spec"]}},
    }
    d = validate(request(deployment, kind="Deployment", group="apps"), CONFIG)
    assert d.allowed, d
    [warning] = mps_warnings(d.warnings)
    assert warning.startswith("container 'gpu-workload' mounts the host's '/tmp/nvidia-mps'")


def test_a_parent_mounted_where_it_is_names_what_comes_with_it() -> None:
    obj = upstream_mps_example()
    obj["spec"]["volumes"] = [{"name": "mps", "hostPath": {"path": "/tmp"}}]
    obj["spec"]["containers"][0]["volumeMounts"] = [{"name": "mps", "mountPath": "/tmp"}]
    [warning] = mps_warnings(both_webhooks(obj)[0])
    assert warning.startswith("container 'gpu-workload' mounts the host's '/tmp' at '/tmp' and "
                              "with it the host's '/tmp/nvidia-mps', CUDA's default MPS pipe "
                              "directory"), warning


def test_a_parent_mounted_elsewhere_is_no_concern() -> None:
    obj = upstream_mps_example()
    obj["spec"]["volumes"] = [{"name": "mps", "hostPath": {"path": "/tmp"}}]
    obj["spec"]["containers"][0]["volumeMounts"] = [{"name": "mps", "mountPath": "/host-tmp"}]
    assert mps_warnings(both_webhooks(obj)[0]) == []


def _mounting(volume: dict[str, Any], mount: dict[str, Any]) -> dict[str, Any]:
    """Upstream's example with its volume and mount replaced."""
    obj = upstream_mps_example()
    obj["spec"]["volumes"] = [{"name": "mps", **volume}]
    obj["spec"]["containers"][0]["volumeMounts"] = [{"name": "mps", **mount}]
    return obj


def test_a_mount_with_a_subpath_expression_warns_only_at_the_default_directory() -> None:
    """Before: the host's /tmp at /tmp with `subPathExpr: $(POD_NAME)` (a per-pod scratch
    directory under the host's /tmp) was warned as bringing the host's /tmp/nvidia-mps, which
    it does not. Now: its host side is known only on the node, so only a mount at
    /tmp/nvidia-mps itself warns."""
    scratch = _mounting({"hostPath": {"path": "/tmp"}},
                        {"mountPath": "/tmp", "subPathExpr": "$(POD_NAME)"})
    assert mps_warnings(sum(both_webhooks(scratch), ())) == []
    there = _mounting({"hostPath": {"path": "/tmp"}},
                      {"mountPath": "/tmp/nvidia-mps", "subPathExpr": "$(POD_NAME)"})
    [warning] = mps_warnings(both_webhooks(there)[0])
    assert warning.startswith("container 'gpu-workload' mounts '/tmp/nvidia-mps', CUDA's "
                              "default MPS pipe directory"), warning


def test_an_sm_sharing_container_with_the_hosts_tmp_at_tmp_is_not_warned() -> None:
    """Before: an sm-sharing container with the host's /tmp at /tmp (a scratch mount) was told
    the mount was unused and to remove it: wrong, CUDA there uses kai_fractions' injected pipe
    directory, and removing the mount breaks the scratch space. Now: no warning; the host's
    /tmp/nvidia-mps itself, mounted anywhere, still warns."""
    obj = pod(dict(SM), volumes=[{"name": "t", "hostPath": {"path": "/tmp"}}])
    obj["spec"]["containers"][0]["volumeMounts"] = [{"name": "t", "mountPath": "/tmp"}]
    assert mps_warnings(sum(both_webhooks(obj), ())) == []
    obj["spec"]["volumes"].append({"name": "mps", "hostPath": {"path": "/tmp/nvidia-mps"}})
    obj["spec"]["containers"][0]["volumeMounts"].append({"name": "mps", "mountPath": "/mps"})
    mutating, validating = both_webhooks(obj)
    [warning] = mps_warnings(mutating)
    assert mps_warnings(validating) == [warning]
    assert warning.startswith("container 'main' mounts the host's '/tmp/nvidia-mps' at '/mps', "
                              "CUDA's default MPS pipe directory"), warning
    assert "unused" in warning


@pytest.mark.parametrize(("volume", "mount", "mounts"), [
    ({"hostPath": {"path": "/tmp"}}, {"mountPath": "/mps", "subPath": "nvidia-mps"},
     "the host's '/tmp/nvidia-mps' at '/mps', CUDA's default MPS pipe directory"),
    ({"hostPath": {"path": "/tmp"}}, {"mountPath": "/tmp/nvidia-mps", "subPath": "nvidia-mps"},
     "the host's '/tmp/nvidia-mps', CUDA's default MPS pipe directory"),
    ({"hostPath": {"path": "/"}}, {"mountPath": "/tmp", "subPath": "tmp"},
     "the host's '/tmp' at '/tmp' and with it the host's '/tmp/nvidia-mps', CUDA's default MPS "
     "pipe directory"),
])
def test_a_subpath_is_part_of_the_host_directory_named(volume, mount, mounts) -> None:
    """Before: a subPath reaching the default directory was worded from the volume's path
    alone: "mounts '/mps', CUDA's default MPS pipe directory" (the host's /tmp with subPath
    nvidia-mps at /mps), "the host's '/' at '/tmp'" (the host's / with subPath tmp). Now: the
    host directory named is the volume's path joined with the subPath, as the node resolves
    it. (The mutating webhook's warning: the validating one refuses the host's `/`.)"""
    [warning] = mps_warnings(mutate(request(_mounting(volume, mount)), CONFIG).warnings)
    assert warning.startswith(f"container 'gpu-workload' mounts {mounts}: "), warning
