"""pid -> (pod UID, container ID) from /proc/<pid>/cgroup, process state, lock holders."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kai_fractions.node.procfs import (
    UNPINNED,
    PidfdPin,
    PodContainer,
    Procfs,
    cgroup_v2_path,
    may_be_a_pod,
    normalize_container_id,
    parse_cgroup_path,
)

UID = "1f2e3d4c-5b6a-4978-8a9b-0c1d2e3f4a5b"
U_ = UID.replace("-", "_")
CID = "4d6f8a0b2c4e6f8a0b2c4e6f8a0b2c4e6f8a0b2c4e6f8a0b2c4e6f8a0b2c4e6f"


@pytest.mark.parametrize(("path", "expected"), [
    # systemd driver, containerd, each QoS class
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice/"
     f"cri-containerd-{CID}.scope", PodContainer(UID, CID, "containerd")),
    (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{U_}.slice/"
     f"cri-containerd-{CID}.scope", PodContainer(UID, CID, "containerd")),
    (f"/kubepods.slice/kubepods-pod{U_}.slice/cri-containerd-{CID}.scope",
     PodContainer(UID, CID, "containerd")),
    # systemd driver, cri-o and docker (cri-dockerd)
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice/"
     f"crio-{CID}.scope", PodContainer(UID, CID, "crio")),
    (f"/kubepods.slice/kubepods-pod{U_}.slice/docker-{CID}.scope",
     PodContainer(UID, CID, "docker")),
    # cgroupfs driver
    (f"/kubepods/burstable/pod{UID}/{CID}", PodContainer(UID, CID, None)),
    (f"/kubepods/besteffort/pod{UID}/{CID}", PodContainer(UID, CID, None)),
    (f"/kubepods/pod{UID}/{CID}", PodContainer(UID, CID, None)),
    (f"/kubepods/burstable/pod{UID}/crio-{CID}", PodContainer(UID, CID, "crio")),
    # a cgroup nested inside the container's, and a cgroup-namespace relative path
    (f"/kubepods.slice/kubepods-pod{U_}.slice/cri-containerd-{CID}.scope/init.scope",
     PodContainer(UID, CID, "containerd")),
    (f"/../../kubepods.slice/kubepods-pod{U_}.slice/cri-containerd-{CID}.scope",
     PodContainer(UID, CID, "containerd")),
    # seen from a cgroup namespace of a container's (the agent's with `privileged: false`):
    # systemd slice names still say kubepods; cgroupfs has nothing of it left, with or
    # without the QoS level (the agent's own, another's, a Guaranteed pod's)
    (f"/../../kubepods-burstable-pod{U_}.slice/cri-containerd-{CID}.scope",
     PodContainer(UID, CID, "containerd")),
    (f"/../../pod{UID}/{CID}", PodContainer(UID, CID, None)),
    (f"/../../../besteffort/pod{UID}/{CID}", PodContainer(UID, CID, None)),
    (f"/../../../burstable/pod{UID}/crio-{CID}", PodContainer(UID, CID, "crio")),
    (f"/../../../pod{UID}/{CID}", PodContainer(UID, CID, None)),
    (f"/../../pod{UID}/{CID}/nested", PodContainer(UID, CID, None)),
    (f"/../../pod{UID}", PodContainer(UID, None)),
    # static pods have a 32-hex UID
    (f"/kubepods/pod{'a' * 32}/{CID}", PodContainer("a" * 32, CID, None)),
    # the pod's own cgroup, and cri-o's monitor: a pod but no container
    (f"/kubepods.slice/kubepods-pod{U_}.slice", PodContainer(UID, None)),
    (f"/kubepods.slice/kubepods-pod{U_}.slice/crio-conmon-{CID}.scope", PodContainer(UID, None)),
    (f"/kubepods/burstable/pod{UID}/not-an-id", PodContainer(UID, None)),
    # upper-case hex in the slice name is normalised
    (f"/kubepods.slice/kubepods-pod{U_.upper()}.slice/cri-containerd-{CID}.scope",
     PodContainer(UID, CID, "containerd")),
])
def test_kubernetes_layouts(path, expected):
    assert parse_cgroup_path(path) == expected


@pytest.mark.parametrize("path", [
    "/",
    "/system.slice/containerd.service",
    "/user.slice/user-0.slice/session-1.scope",
    "/init.scope",
    f"/docker/{CID}",  # a plain docker container, no pod
    f"/system.slice/pod{UID}/{CID}",  # looks like a pod but not under kubepods
    f"/kubepods.slice/kubepods-pod{U_}x.slice/cri-containerd-{CID}.scope",
    "/kubepods.slice/kubepods-podnot_a_uid_at_all_not_a_uid_at_all.slice",
    f"/kubepods/burstable/pod{UID[:-1]}/{CID}",
    "",
    "garbage",
    # relative to a cgroup namespace, but not [qos/]pod<uid> right after the `..`s
    "/..",
    "/../../..",
    f"/../../system.slice/pod{UID}/{CID}",
    f"/../../guaranteed/pod{UID}/{CID}",
    f"/../../besteffort/burstable/pod{UID}/{CID}",
    f"/../x/../pod{UID}/{CID}",
    f"/../../pod{UID[:-1]}/{CID}",
    f"../../pod{UID}/{CID}",
    f"/pod{UID}/{CID}",
])
def test_not_a_pod(path):
    assert parse_cgroup_path(path) is None


@pytest.mark.parametrize(("path", "maybe"), [
    # relative, with a pod-shaped component (or kubepods) the parse cannot place: may be a
    # pod's
    ("/../../kubepods-besteffort.slice", True),
    (f"/../../guaranteed/pod{UID}/{CID}", True),
    (f"/../../../../custom-root/pod{UID}/{CID}", True),
    (f"/../../../../custom.slice/custom-burstable-pod{U_}.slice/x-{CID}.scope", True),
    (f"/../../../../kubelet.slice/pod{'a' * 32}", True),
    (f"/../../system.slice/pod{UID}/{CID}", True),
    # placed; the reader's own ancestors; the host's own cgroups; not relative at all
    (f"/../../pod{UID}/{CID}", False),
    ("/..", False),
    ("/../../..", False),
    ("/../../../../system.slice/nvidia-persistenced.service", False),
    ("/../../../../user.slice/user-0.slice/session-1.scope", False),
    ("/../../../../init.scope", False),
    ("/../../../../machine.slice/vm.scope", False),
    ("/", False),
    ("/system.slice/containerd.service", False),
    (f"/docker/{CID}", False),
    # no pod-shaped component past the `..`s: the host's, wherever the distribution puts its
    # services, or the agent's own pod's (a sibling container): no pod's
    ("/../../../../custom-root/something", False),
    ("/../../../../runtime.slice/containerd.service", False),  # EKS AL2023
    ("/../../../../system/ext-nvidia-persistenced", False),  # Talos
    ("/../../../../podman/conmon", False),
    (f"/../../../../docker/{CID}", False),  # cgroupfs Docker, not a kubelet's container
    (f"/../cri-containerd-{CID}.scope", False),  # a sibling of the agent's container
    (f"/../{CID}", False),  # the same with the cgroupfs driver
    # shaped like a pod but not a pod UID: no pod's either
    (f"/../../../../x/pod{UID[:-1]}/{CID}", False),
    (f"/../../../../x/podcast-{CID}", False),
])
def test_which_paths_may_hide_a_pod(path, maybe):
    assert may_be_a_pod(path) is maybe


def test_an_unreadable_cgroup_file_is_an_error_not_a_process_gone(tmp_path, monkeypatch):
    """hidepid=1 or an LSM: the entry is there, its content denied. Read as None, the process
    would pass for one that exited."""
    import pathlib
    write_proc(tmp_path, 100, f"0::/kubepods/pod{UID}/{CID}\n")
    real = pathlib.Path.read_text

    def read_text(self, *args, **kwargs):
        if self.name == "cgroup" and self.parent.name == "100":
            raise PermissionError(13, "Permission denied")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", read_text)
    with pytest.raises(PermissionError):
        Procfs(tmp_path).cgroup_path(100)
    assert Procfs(tmp_path).cgroup_path(999) is None  # gone is still None


def test_cgroup_file_lines():
    v2 = f"0::/kubepods.slice/kubepods-pod{U_}.slice/cri-containerd-{CID}.scope\n"
    assert cgroup_v2_path(v2) == v2[3:].strip()
    hybrid = (f"12:memory:/kubepods/pod{UID}/{CID}\n11:cpu,cpuacct:/kubepods/pod{UID}/{CID}\n"
              f"1:name=systemd:/kubepods/pod{UID}/{CID}\n0::/\n")
    assert cgroup_v2_path(hybrid) == f"/kubepods/pod{UID}/{CID}"  # 0::/ says nothing of pods
    v1 = f"12:memory:/kubepods/pod{UID}/{CID}\n3:cpu:/kubepods/pod{UID}/{CID}\n"
    assert cgroup_v2_path(v1) == f"/kubepods/pod{UID}/{CID}"
    assert cgroup_v2_path("1:name=systemd:/user.slice\n0::/user.slice/x.scope\n") == (
        "/user.slice/x.scope")
    both = f"3:memory:/kubepods/pod{UID}/other\n0::/kubepods/pod{UID}/{CID}\n"
    assert cgroup_v2_path(both) == f"/kubepods/pod{UID}/{CID}"  # v2 wins when it names a pod
    assert cgroup_v2_path("") is None
    assert cgroup_v2_path("garbage\n\x00\x01:::\n0:x\n") is None


def test_normalize_container_id():
    assert normalize_container_id(f"containerd://{CID}") == CID
    assert normalize_container_id(f"cri-o://{CID.upper()}") == CID
    assert normalize_container_id(CID) == CID


def write_proc(root, pid, cgroup=None, state="S", comm="python3"):
    d = root / str(pid)
    d.mkdir(parents=True)
    if cgroup is not None:
        (d / "cgroup").write_text(cgroup)
    (d / "stat").write_text(f"{pid} ({comm}) {state} 1 {pid} {pid} 0 -1 4194560\n")
    (d / "comm").write_text(comm + "\n")


def test_procfs_reads_a_fake_tree(tmp_path):
    write_proc(tmp_path, 100, f"0::/kubepods/pod{UID}/{CID}\n")
    write_proc(tmp_path, 101, "0::/system.slice/sshd.service\n")
    write_proc(tmp_path, 102, f"0::/kubepods/pod{UID}/{CID}\n", state="Z")
    write_proc(tmp_path, 103, comm="weird) name (x")
    fs = Procfs(tmp_path)
    assert fs.container_of(100) == PodContainer(UID, CID, None)
    assert fs.container_of(101) is None  # a host process
    assert fs.container_of(999) is None  # gone
    assert fs.container_of(103) is None  # no cgroup file
    assert fs.cgroup_path(101) == "/system.slice/sshd.service"
    assert (fs.state(100), fs.state(102), fs.state(999)) == ("S", "Z", None)
    assert fs.state(103) == "S"  # parsed after the LAST ')' of the comm
    assert fs.is_alive(100) and not fs.is_alive(102) and not fs.is_alive(999)
    assert fs.comm(100) == "python3" and fs.comm(999) is None


def test_lock_holders(tmp_path):
    (tmp_path / "locks").write_text(
        "1: POSIX  ADVISORY  WRITE 9148 fe:00:2147857 0 EOF\n"
        "1: -> POSIX  ADVISORY  WRITE 9200 fe:00:2147857 0 EOF\n"
        "2: FLOCK  ADVISORY  WRITE 77 08:01:12 0 EOF\n"
        "3: OFDLCK ADVISORY  READ  -1 fe:00:2147857 0 EOF\n"
        "4: POSIX  ADVISORY  WRITE 9148 fe:00:2147857 0 EOF\n"
        "garbage line\n5: POSIX ADVISORY WRITE x y:z 0 EOF\n")
    fs = Procfs(tmp_path)
    assert fs.lock_holders(0xFE, 0, 2147857) == [9148]
    assert fs.lock_holders(8, 1, 12) == [77]
    assert fs.lock_holders(8, 1, 13) == []
    assert fs.lock_holders_of(tmp_path / "missing") == []


def test_real_proc_of_this_process():
    import os
    fs = Procfs()
    assert fs.is_alive(os.getpid())
    assert fs.cgroup_path(os.getpid()) is not None


def test_a_pin_holds_the_process_not_its_pid() -> None:
    """A pidfd turns readable once its process exits, reaped or not: what lets the watchdog
    tell the process it read from one that takes its pid later."""
    procfs = Procfs("/proc")
    assert procfs.own_pid_namespace
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pin = procfs.pin(child.pid)
        assert isinstance(pin, PidfdPin) and not pin.exited()
        child.kill()
        deadline = time.monotonic() + 10
        while not pin.exited():  # a zombie, not reaped yet
            assert time.monotonic() < deadline, "the pin never said the process exited"
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()
    assert pin.exited()
    pin.close()
    pin.close()  # twice is harmless
    assert procfs.pin(child.pid) is None  # reaped: no process has the pid


def test_a_tree_of_another_pid_namespace_pins_nothing(tmp_path) -> None:
    """Its pids are not the ones pidfd_open takes (a fake tree, the demo's simulated node):
    a pin there never says exited, and the watchdog trusts what it read as before."""
    procfs = Procfs(tmp_path)
    assert not procfs.own_pid_namespace
    assert procfs.pin(os.getpid()) is UNPINNED and not UNPINNED.exited()


@pytest.mark.parametrize(("nspid", "own"), [
    (lambda me: f"{me}", True),                # a /proc of our own pid namespace
    (lambda me: f"{me + 7}\t{me}", False),     # one of an outer namespace: our pid in each
    (lambda me: f"{me + 7}", False),           # another process's
])
def test_whose_pid_namespace_a_proc_root_is(tmp_path, nspid, own) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "status").write_text(
        f"Name:\tpython3\nPid:\t{os.getpid()}\nNSpid:\t{nspid(os.getpid())}\n")
    assert Procfs(tmp_path).own_pid_namespace is own
