"""A KAI bind, end to end: BindRequest and pod annotations exactly as a KAI binder writes them,
checked and signed by the follower, then applied by the node agent (signatures required).

Upstream KAI main (kai-scheduler/KAI-Scheduler pkg/binder/plugins/nvfractions/nv_fractions.go
@0caa3bd4): canonical quantity strings, float64 truncation, no reserve, no compute portion. The
patched KAI (the same file @e396c876): a 1024 MiB reserve and `.gpu-compute.portion`.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from kai_fractions.contract import Dialect
from kai_fractions.mirror.bindrequest_view import BindRequestView
from kai_fractions.mirror.follower import Follower
from kai_fractions.signing import Keyring, KeyringSource
from tests.agent.builders import CID, MIB, Rig, leaf_of, marker_of
from tests.support.fake_store import FakePodStore

KEY = b"e2e-signing-key-0123456789abcdef"
NS = "team-a"
NODE_MIB = "81559"  # an H100 80GB's nvidia.com/gpu.memory, as the simulated GPUs report it
P = "nvidia.com/container.main"


def bind_request(groups: list[tuple[str, str]], portion: str) -> dict:
    return {"apiVersion": "scheduling.run.ai/v1alpha2", "kind": "BindRequest",
            "metadata": {"name": "br-1", "namespace": NS},
            "spec": {"podName": "train-0", "selectedNode": "node-a",
                     "receivedResourceType": "Fraction",
                     "receivedGPU": {"count": len(groups), "portion": portion},
                     "selectedFractionalGpuGroups": [{"id": g, "computeSharingMode": m}
                                                     for g, m in groups]},
            "status": {"phase": "Succeeded"}}


def follower_store(rig: Rig, groups: list[str]) -> FakePodStore:
    store = FakePodStore()
    store.nodes["node-a"] = {"nvidia.com/gpu.memory": NODE_MIB}
    for group, gpu in zip(groups, (rig.gpu0, rig.gpu1), strict=False):
        store.add_pod({"metadata": {"name": f"reservation-{group}",
                                    "namespace": "kai-resource-reservation",
                                    "labels": {"runai-gpu-group": group},
                                    "annotations": {"run.ai/reserve_for_gpu_index": gpu}},
                       "spec": {"containers": [{"name": "reserve"}]}})
    return store


def kai_bound_pod(annotations: dict[str, str], uid: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "train-0", "namespace": NS, "uid": uid,
                         "annotations": annotations},
            "spec": {"nodeName": "node-a", "schedulerName": "kai-scheduler",
                     "containers": [{"name": "main", "image": "x"}]},
            "status": {"phase": "Running", "qosClass": "Burstable",
                       "containerStatuses": [{"name": "main", "containerID": CID}]}}


CASES = {
    # 81559 x 0.57 = 46488.63 -> 46488 MiB (truncated), written as KAI writes it; 2 devices.
    "upstream-time-slicing-2-devices": dict(
        dialect=Dialect.UPSTREAM, reserve=0, portion="0.57", modes=["", ""],
        user={"gpu-fraction": "0.57", "gpu-fraction-num-devices": "2"},
        binder={f"{P}.gpu-memory.request": "46488Mi"}, request_mib=46488, atp=None),
    # 81559 x 0.5 = 40779.5 -> 40779; sm-sharing with no portion: no compute cap.
    "upstream-sm-sharing": dict(
        dialect=Dialect.UPSTREAM, reserve=0, portion="0.5", modes=["sm-sharing"],
        user={"gpu-fraction": "0.5", f"{P}.gpu-compute.mode": "sm-sharing"},
        binder={f"{P}.gpu-memory.request": "40779Mi"}, request_mib=40779, atp=100),
    # The MPS namespace our admission webhook named as the pod was created: the follower's
    # signature and the agent's namespace both follow it.
    "upstream-sm-sharing-admitted-namespace": dict(
        dialect=Dialect.UPSTREAM, reserve=0, portion="0.5", modes=["sm-sharing"],
        user={"gpu-fraction": "0.5", f"{P}.gpu-compute.mode": "sm-sharing",
              "kai-fractions.io/container.main.mps-namespace": "kf_" + "5a" * 10},
        binder={f"{P}.gpu-memory.request": "40779Mi"}, request_mib=40779, atp=100,
        namespace="kf_" + "5a" * 10),
    # A user's own request (20Gi) is kept verbatim; the binder adds only devices.
    "upstream-user-request": dict(
        dialect=Dialect.UPSTREAM, reserve=0, portion="0.26", modes=[""],
        user={f"{P}.gpu-memory.request": "20Gi", f"{P}.gpu-memory.limit": "24Gi"},
        binder={}, request_mib=20480, atp=None),
    # gpu-memory + gpu-memory.limit as KAI's mutating webhook leaves them (nvfractions/
    # mutation.go: the request as a canonical quantity, the limit copied as written).
    "upstream-gpu-memory-limit-as-written": dict(
        # the portion KAI's scheduler sizes for 20480 MiB: ceil(20480 / 81559 x 100) / 100
        dialect=Dialect.UPSTREAM, reserve=0, portion="0.26", modes=[""],
        user={"gpu-memory": "20480", "gpu-memory.limit": "24G",
              f"{P}.gpu-memory.request": "20Gi", f"{P}.gpu-memory.limit": "24G"},
        binder={}, request_mib=20480, atp=None, limit_mib=22889),  # 24e9 B, rounded up
    # gpu-fraction.limit copied by the webhook into the portion-limit key; the binder's limit
    # is 81559 x 0.75 = 61169.25 -> 61169 MiB.
    "upstream-gpu-fraction-limit": dict(
        dialect=Dialect.UPSTREAM, reserve=0, portion="0.5", modes=[""],
        user={"gpu-fraction": "0.5", "gpu-fraction.limit": "0.75",
              "kai.scheduler/container.main.gpu-memory.portion.limit": "0.75"},
        binder={f"{P}.gpu-memory.request": "40779Mi", f"{P}.gpu-memory.limit": "61169Mi"},
        request_mib=40779, atp=None, limit_mib=61169),
    # (81559 - 1024) x 0.5 = 40267.5 -> 40267; the portion caps the SMs at 50%.
    "patched-sm-sharing": dict(
        dialect=Dialect.PATCHED, reserve=1024, portion="0.5", modes=["sm-sharing"],
        user={"gpu-fraction": "0.5", f"{P}.gpu-compute.mode": "sm-sharing"},
        binder={f"{P}.gpu-memory.request": "40267Mi", f"{P}.gpu-compute.portion": "0.5"},
        request_mib=40267, atp=50),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_kai_bind_is_signed_by_the_follower_and_applied_by_the_agent(short_tmp: Path, case):
    c = CASES[case]
    keys = short_tmp / "signing-key"
    keys.write_bytes(KEY)
    rig = Rig(short_tmp, sm_sharing=True, options={"signing_hmac_key_files": (str(keys),)})
    groups = [f"group-{i}" for i in range(len(c["modes"]))]
    gpus = [rig.gpu0, rig.gpu1][:len(groups)]
    store = follower_store(rig, groups)
    # What KAI's binder wrote, in ONE patch, beside what the user wrote.
    annotations = {**c["user"], **c["binder"], f"{P}.gpus.devices": ",".join(gpus),
                   "received-resource-type": "Fraction"}
    created = store.add_pod(kai_bound_pod(annotations, uid=str(uuid.uuid4())))
    follower = Follower(store, dialect=c["dialect"], default_reserve_mib=c["reserve"],
                        signer=KeyringSource.fixed(Keyring.of(KEY)))
    result = asyncio.run(follower.verify(BindRequestView.from_object(
        bind_request(list(zip(groups, c["modes"], strict=True)), c["portion"]))))
    assert (result.mismatches, result.errors, result.unsigned) == ((), (), ""), result
    assert result.signed == ("kai-fractions.io/container.main.signature",)
    assert store.events == []

    signed = store.pods[(NS, "train-0")]
    uid = rig.add(kai_bound_pod(dict(signed["metadata"]["annotations"]),
                                uid=created.uid))["metadata"]["uid"]
    rig.cgroups.add(leaf_of(uid))
    rig.step()
    marker = marker_of(rig, uid)
    assert marker["containers"]["main"]["state"] == "applied", marker
    derived = rig.cluster.pods[uid]["metadata"]["annotations"]
    assert derived["kai-fractions.io/container.main.memory-request-mib"] == str(c["request_mib"])
    assert derived.get("kai-fractions.io/container.main.mps-active-thread-percentage") == (
        None if c["atp"] is None else str(c["atp"]))
    soft = {gpu: s for (gpu, path), (s, _hard) in rig.nvml.limits.items()
            if uid.replace("-", "_") in path}
    assert soft and set(soft) == set(gpus)
    assert all(value == c["request_mib"] * MIB for value in soft.values())
    if "limit_mib" in c:
        hard = {h for (gpu, path), (_soft, h) in rig.nvml.limits.items()
                if uid.replace("-", "_") in path}
        assert hard == {c["limit_mib"] * MIB}
    if c["atp"] is not None:
        (namespace,) = rig.mps.control.namespaces.values()
        assert namespace.active_thread_percentage == c["atp"]
    if "namespace" in c:
        assert set(rig.mps.control.namespaces) == {c["namespace"]}
        assert derived["kai-fractions.io/container.main.mps-pipe-directory"].endswith(
            "/shared/" + c["namespace"])


def test_a_mismatch_is_an_event_and_never_signed(short_tmp: Path):
    rig = Rig(short_tmp, sm_sharing=False)
    store = follower_store(rig, ["group-0"])
    # A request computed with exact arithmetic (46489) instead of KAI's float truncation.
    store.add_pod(kai_bound_pod({"gpu-fraction": "0.57", f"{P}.gpu-memory.request": "46489Mi",
                                 f"{P}.gpus.devices": rig.gpu0,
                                 "received-resource-type": "Fraction"}, uid="x"))
    result = asyncio.run(Follower(store, signer=KeyringSource.fixed(Keyring.of(KEY))).verify(
        BindRequestView.from_object(bind_request([("group-0", "")], "0.57"))))
    assert [(m.expected, m.actual) for m in result.mismatches] == [("46488Mi", "46489Mi")]
    assert result.signed == ()
    assert [e.reason for e in store.events] == ["NvFractionsMismatch"]
