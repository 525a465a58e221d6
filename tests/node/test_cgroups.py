"""Kubernetes cgroup paths (systemd and cgroupfs layouts), the cgroup-fs seam and QoS classes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.node.cgroups import (
    CgroupDriver,
    CgroupLayout,
    ContainerId,
    ContainerRuntime,
    HostCgroupFs,
    PodCgroup,
    QosClass,
    compute_qos_class,
    qos_class_of,
)
from kai_fractions.sim.cgroups import FakeCgroupFs

UID = "1f2e3d4c-5b6a-4789-8abc-def012345678"
CID = "0123456789abcdef" * 4

SYSTEMD = CgroupLayout("/sys/fs/cgroup", CgroupDriver.SYSTEMD)
CGROUPFS = CgroupLayout("/sys/fs/cgroup", CgroupDriver.CGROUPFS)


@pytest.mark.parametrize(("qos", "expected"), [
    (QosClass.BURSTABLE, "/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/"
     "kubepods-burstable-pod1f2e3d4c_5b6a_4789_8abc_def012345678.slice"),
    (QosClass.BEST_EFFORT, "/sys/fs/cgroup/kubepods.slice/kubepods-besteffort.slice/"
     "kubepods-besteffort-pod1f2e3d4c_5b6a_4789_8abc_def012345678.slice"),
    (QosClass.GUARANTEED, "/sys/fs/cgroup/kubepods.slice/"
     "kubepods-pod1f2e3d4c_5b6a_4789_8abc_def012345678.slice"),
])
def test_systemd_pod_paths(qos: QosClass, expected: str) -> None:
    assert SYSTEMD.pod_path(UID, qos) == expected


@pytest.mark.parametrize(("qos", "expected"), [
    (QosClass.BURSTABLE, f"/sys/fs/cgroup/kubepods/burstable/pod{UID}"),
    (QosClass.BEST_EFFORT, f"/sys/fs/cgroup/kubepods/besteffort/pod{UID}"),
    (QosClass.GUARANTEED, f"/sys/fs/cgroup/kubepods/pod{UID}"),
])
def test_cgroupfs_pod_paths(qos: QosClass, expected: str) -> None:
    assert CGROUPFS.pod_path(UID, qos) == expected


@pytest.mark.parametrize(("container_id", "systemd_leaf", "cgroupfs_leaf"), [
    (f"containerd://{CID}", f"cri-containerd-{CID}.scope", CID),
    (f"cri-o://{CID}", f"crio-{CID}.scope", f"crio-{CID}"),
    (f"docker://{CID}", f"docker-{CID}.scope", CID),
])
def test_container_paths_by_runtime(container_id: str, systemd_leaf: str,
                                    cgroupfs_leaf: str) -> None:
    assert SYSTEMD.container_path(UID, QosClass.GUARANTEED, container_id) == (
        f"/sys/fs/cgroup/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/{systemd_leaf}")
    assert CGROUPFS.container_path(UID, QosClass.BURSTABLE, container_id) == (
        f"/sys/fs/cgroup/kubepods/burstable/pod{UID}/{cgroupfs_leaf}")


def test_root_is_configurable_and_normalised() -> None:
    layout = CgroupLayout("/tmp/x/cgroup/", "cgroupfs")
    assert layout.driver is CgroupDriver.CGROUPFS
    assert layout.pod_path(UID, QosClass.GUARANTEED) == f"/tmp/x/cgroup/kubepods/pod{UID}"
    with pytest.raises(ValueError, match="absolute"):
        CgroupLayout("relative/root")


def test_container_id_parse_and_errors() -> None:
    assert ContainerId.parse(f"cri-o://{CID}") == ContainerId(ContainerRuntime.CRIO, CID)
    assert str(ContainerId.parse(f"docker://{CID}")) == f"docker://{CID}"
    with pytest.raises(ValueError, match=r"container runtime 'rkt' .* is not supported; "
                       r"supported: containerd, cri-o, docker"):
        ContainerId.parse("rkt://abc")
    with pytest.raises(ValueError, match="is not <runtime>://<id>"):
        ContainerId.parse("abc")
    with pytest.raises(ValueError, match="cannot hold"):
        ContainerId.parse("containerd://../../etc")
    for name in (".", ".."):  # with cgroupfs, the pod's own cgroup or its QoS parent
        with pytest.raises(ValueError, match="cannot hold"):
            ContainerId.parse(f"containerd://{name}")


def test_pod_uid_must_be_a_uuid() -> None:
    with pytest.raises(ValueError, match="is not a UUID"):
        SYSTEMD.pod_path("default/p", QosClass.BURSTABLE)


def _tree(root: Path, layout: CgroupLayout) -> dict[str, str]:
    uids = {
        "g": "00000000-0000-4000-8000-000000000001",
        "b": "00000000-0000-4000-8000-000000000002",
        "e": "00000000-0000-4000-8000-000000000003",
    }
    qos = {"g": QosClass.GUARANTEED, "b": QosClass.BURSTABLE, "e": QosClass.BEST_EFFORT}
    for key, uid in uids.items():
        Path(layout.container_path(uid, qos[key], f"containerd://{key * 12}")).mkdir(parents=True)
    # things a scan must ignore
    (root / "system.slice" / "kubepods-podnot_a_pod.slice").mkdir(parents=True)
    Path(layout.pod_path(uids["g"], qos["g"])).parent.joinpath("junk").mkdir(exist_ok=True)
    return uids


@pytest.mark.parametrize("driver", list(CgroupDriver))
def test_scan_finds_every_pod_with_its_qos_and_children(tmp_path: Path,
                                                        driver: CgroupDriver) -> None:
    layout = CgroupLayout(str(tmp_path), driver)
    uids = _tree(tmp_path, layout)
    found = layout.scan(HostCgroupFs())
    by_uid = {p.uid: p for p in found}
    assert set(by_uid) == set(uids.values())
    assert by_uid[uids["g"]].qos is QosClass.GUARANTEED
    assert by_uid[uids["b"]].qos is QosClass.BURSTABLE
    assert by_uid[uids["e"]].qos is QosClass.BEST_EFFORT
    g = by_uid[uids["g"]]
    assert g.path == layout.pod_path(uids["g"], QosClass.GUARANTEED)
    assert g.children == (layout.container_path(uids["g"], QosClass.GUARANTEED,
                                                "containerd://" + "g" * 12),)
    # the in-memory fake sees the same tree the same way
    fake = FakeCgroupFs(str(p) for p in tmp_path.rglob("*") if p.is_dir())
    assert layout.scan(fake) == found


def test_host_fs_on_missing_paths(tmp_path: Path) -> None:
    fs = HostCgroupFs()
    assert fs.list_dirs(str(tmp_path / "nope")) == ()
    assert not fs.exists(str(tmp_path / "nope"))
    assert CgroupLayout(str(tmp_path)).scan(fs) == ()


def test_fake_fs_add_remove() -> None:
    fs = FakeCgroupFs(["/r/kubepods/pod1/c1"])
    assert fs.exists("/r/kubepods") and fs.exists("/r/kubepods/pod1/c1/")
    assert fs.list_dirs("/r/kubepods/pod1") == ("c1",)
    fs.remove("/r/kubepods/pod1")
    assert not fs.exists("/r/kubepods/pod1/c1") and fs.exists("/r/kubepods")
    assert PodCgroup("u", QosClass.GUARANTEED, "/p").children == ()


def _c(limits=None, requests=None):
    res = {}
    if limits is not None:
        res["limits"] = limits
    if requests is not None:
        res["requests"] = requests
    return {"name": "c", "resources": res}


@pytest.mark.parametrize(("containers", "expected"), [
    ([_c()], QosClass.BEST_EFFORT),
    ([_c(limits={"nvidia.com/gpu": "1"})], QosClass.BEST_EFFORT),
    ([_c(limits={"cpu": "1", "memory": "1Gi"})], QosClass.GUARANTEED),
    ([_c(limits={"cpu": "1", "memory": "1Gi"}, requests={"cpu": "1000m", "memory": "1Gi"})],
     QosClass.GUARANTEED),
    ([_c(limits={"cpu": "1", "memory": "1Gi"}, requests={"cpu": "500m"})], QosClass.BURSTABLE),
    ([_c(limits={"cpu": "1"})], QosClass.BURSTABLE),
    ([_c(requests={"memory": "1Gi"})], QosClass.BURSTABLE),
    ([_c(limits={"cpu": "1", "memory": "1Gi"}), _c()], QosClass.BURSTABLE),
])
def test_compute_qos_class(containers, expected) -> None:
    assert compute_qos_class({"containers": containers}) is expected


def test_init_containers_count_for_qos() -> None:
    spec = {"containers": [_c(limits={"cpu": "1", "memory": "1Gi"})],
            "initContainers": [_c(requests={"cpu": "1"})]}
    assert compute_qos_class(spec) is QosClass.BURSTABLE


def test_qos_class_prefers_the_status() -> None:
    spec = {"containers": [_c(limits={"cpu": "1", "memory": "1Gi"})]}
    assert qos_class_of({"spec": spec}) is QosClass.GUARANTEED
    assert qos_class_of({"spec": spec, "status": {"qosClass": "BestEffort"}}) is \
        QosClass.BEST_EFFORT
    assert qos_class_of({"spec": spec, "status": {"qosClass": "bogus"}}) is QosClass.GUARANTEED


def test_fake_fs_can_stand_in_for_a_kubelet() -> None:
    fs = FakeCgroupFs(assume_present=True)
    assert fs.exists("/sys/fs/cgroup/kubepods.slice/anything")
    assert fs.list_dirs("/sys/fs/cgroup/kubepods.slice") == ()
