"""The KAI follower: rebuilds KAI's decision from a BindRequest, checks what the binder wrote,
reports each difference as a pod event; and its list/watch loop (410 Gone -> relist)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from fractions import Fraction
from pathlib import Path

import pytest
from kubernetes import client as k8s

from kai_fractions.contract import Dialect
from kai_fractions.kube.client import Kube
from kai_fractions.kube.errors import Gone, Transient
from kai_fractions.kube.retry import NO_DEADLINE, Backoff
from kai_fractions.mirror.bindrequest_view import BindRequestView
from kai_fractions.mirror.bindrequests import bindrequest_source, follow
from kai_fractions.mirror.errors import PodReplaced
from kai_fractions.mirror.follower import Follower
from kai_fractions.mirror.kube_store import KubePodStore
from kai_fractions.mirror.service import MirrorService
from kai_fractions.signing import Keyring
from tests.support.fake_store import FakePodStore, RecordedEvent
from tests.support.mirror_kube import honour_label_selectors, register_bindrequests

NS = "team-a"
GPU_A = "GPU-1111aaaa-0000-4000-8000-000000000001"
GPU_B = "GPU-2222bbbb-0000-4000-8000-000000000002"
T = "nvidia.com/container.trainer"
SIGNATURE = "kai-fractions.io/container.trainer.signature"
# What upstream KAI main's binder writes for gpu-fraction 0.5 on a 40960 MiB GPU: the request
# as a canonical quantity, no compute portion, no reserve (KAI-Scheduler
# pkg/binder/plugins/nvfractions/nv_fractions.go).
BOUND = {
    f"{T}.gpu-memory.request": "20Gi", f"{T}.gpus.devices": GPU_A,
    "received-resource-type": "Fraction"}


def bind_request(name: str, pod: str, *, phase: str = "Succeeded", groups=("group-a",),
                 mode: str = "", legacy: bool = False, portion: str = "0.5") -> dict:
    spec = {"podName": pod, "selectedNode": "gpu-node-1", "receivedResourceType": "Fraction",
            "receivedGPU": {"count": len(groups), "portion": portion}, "backoffLimit": 3}
    if legacy:
        spec["selectedGPUGroups"] = list(groups)
    else:
        spec["selectedFractionalGpuGroups"] = [{"id": g, "computeSharingMode": mode}
                                               for g in groups]
    return {"apiVersion": "scheduling.run.ai/v1alpha2", "kind": "BindRequest",
            "metadata": {"name": name, "namespace": NS}, "spec": spec,
            "status": {"phase": phase}}


def failed_for_good(br: dict) -> dict:
    """`br` with its bind attempts used up (status.failedAttempts at spec.backoffLimit)."""
    return {**br, "status": {**br["status"], "failedAttempts": br["spec"]["backoffLimit"]}}


def reservation_pod(group: str, gpu: str | None) -> dict:
    annotations = {"run.ai/reserve_for_gpu_index": gpu} if gpu else {}
    return {"metadata": {"name": f"gpu-reservation-{group}", "namespace":
                         "kai-resource-reservation", "labels": {"runai-gpu-group": group},
                         "annotations": annotations},
            "spec": {"containers": [{"name": "reserve"}]}}


def pod(name: str, annotations: dict[str, str]) -> dict:
    return {"metadata": {"name": name, "namespace": NS, "annotations": annotations},
            "spec": {"containers": [{"name": "trainer"}]}}


def one_group_store() -> FakePodStore:
    """The node and group-a's reservation pod (GPU_A): what a one-group BindRequest needs."""
    store = FakePodStore()
    store.nodes["gpu-node-1"] = {"nvidia.com/gpu.memory": "40960"}
    store.add_pod(reservation_pod("group-a", GPU_A))
    return store


@pytest.fixture
def store() -> FakePodStore:
    store = one_group_store()
    store.add_pod(reservation_pod("group-b", GPU_B))
    return store


async def verify(store: FakePodStore, br: dict, **kw):
    return await Follower(store, **kw).verify(BindRequestView.from_object(br))


async def test_correct_annotations_raise_no_event(store):
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    result = await verify(store, bind_request("br-1", "train-0"))
    assert (result.mismatches, result.errors, result.skipped) == ((), (), "")
    assert store.events == []


async def test_each_wrong_or_missing_key_is_an_event(store):
    wrong = {**BOUND, f"{T}.gpus.devices": GPU_B}
    del wrong["received-resource-type"]
    created = store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **wrong}))
    result = await verify(store, bind_request("br-1", "train-0"))
    assert [m.key for m in result.mismatches] == [f"{T}.gpus.devices", "received-resource-type"]
    assert store.events == [
        RecordedEvent(NS, "train-0", created.uid, "Warning", "NvFractionsMismatch",
                      f"annotation {T}.gpus.devices: expected '{GPU_A}', found '{GPU_B}' "
                      "(BindRequest team-a/br-1)"),
        RecordedEvent(NS, "train-0", created.uid, "Warning", "NvFractionsMismatch",
                      "annotation received-resource-type: expected 'Fraction', found nothing "
                      "(BindRequest team-a/br-1)"),
    ]


@pytest.mark.parametrize("spelling", ["20Gi", "20480Mi", "21474836480", "0.01953125Ti"])
async def test_values_are_compared_by_meaning_not_spelling(store, spelling):
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND,
                                  f"{T}.gpu-memory.request": spelling}))
    assert (await verify(store, bind_request("br-1", "train-0"))).mismatches == ()


async def test_a_compute_portion_upstream_kai_never_writes_is_a_mismatch(store):
    created = store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND,
                                            f"{T}.gpu-compute.portion": "1"}))
    result = await verify(store, bind_request("br-1", "train-0"))
    assert [(m.key, m.expected, m.actual) for m in result.mismatches] == [
        (f"{T}.gpu-compute.portion", None, "1")]
    assert store.events[0].pod_uid == created.uid
    assert "--kai-dialect patched" in store.events[0].message


async def test_the_patched_dialect_expects_the_compute_portion(store):
    patched = {**BOUND, f"{T}.gpu-compute.portion": "0.5"}
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **patched}))
    result = await verify(store, bind_request("br-1", "train-0"), dialect=Dialect.PATCHED)
    assert result.mismatches == ()
    store.add_pod(pod("train-1", {"gpu-fraction": "0.5", **BOUND}))
    result = await verify(store, bind_request("br-2", "train-1"), dialect=Dialect.PATCHED)
    assert [(m.key, m.expected, m.actual) for m in result.mismatches] == [
        (f"{T}.gpu-compute.portion", "0.5", None)]


# Upstream KAI main reads a container's own request before gpu-fraction (kai-scheduler/api
# utilities/resources/gpu_sharing.go, ParsePodGPUFractionRequest: "NvFractions request takes
# priority"; KAI-Scheduler's binder and webhook import it from there), sizes such a pod as
# ceil(MiB / (M - M % 100) * 100) / 100 (KAI-Scheduler pkg/scheduler/api/node_info/
# node_info.go, gpu_sharing_node_info.go) and its binder keeps the request it finds
# (pkg/binder/plugins/nvfractions/nv_fractions.go, setNvFractionsMemoryAnnotation).


async def test_a_request_beside_gpu_fraction_is_what_kai_sized_the_pod_by(store):
    # The user wrote both: KAI's webhook accepts them, its scheduler sizes 10Gi on the
    # 40960 MiB GPU as ceil(10240 / 40900 * 100) / 100 = 0.26, its binder keeps the 10Gi.
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND,
                                  f"{T}.gpu-memory.request": "10Gi"}))
    result = await verify(store, bind_request("br-1", "train-0", portion="0.26"))
    assert (result.mismatches, result.errors, result.skipped) == ((), (), "")
    assert result.complete and store.events == []


async def test_a_rebind_after_a_failed_bind_checks_complete(store):
    # A failed BindRequest's binder patch stays on the pod (the nvfractions plugin's Rollback
    # undoes nothing): on the rebind the scheduler reads that 20Gi request, not gpu-fraction
    # 0.5, and binds ceil(20480 / 40900 * 100) / 100 = 0.51; the binder keeps the 20Gi. Before,
    # the follower took the request for the binder's and refused the bind as granting more
    # than 0.5, so a signing cluster never started the pod.
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    result = await verify(store, bind_request("br-2", "train-0", portion="0.51"))
    assert (result.mismatches, result.errors, result.skipped) == ((), (), "")
    assert result.complete and store.events == []


# A failed bind's patch stays on the pod (KAI-Scheduler pkg/binder/controllers/
# bindrequest_controller.go, Reconcile: Rollback after a failed Bind; pkg/binder/plugins/
# nvfractions/nv_fractions.go, Rollback removes nothing), and on the rebind the binder keeps
# the limit it finds as it keeps the request (nv_fractions.go, setGpuMemoryPortionLimitAnnotation
# returns early when the container's gpu-memory.limit is on the pod): sized for the first node.
# The scheduler sizes the kept request on the new node (as_scheduler_sizes).
FIRST_BIND_ON_40960 = {  # gpu-fraction 0.5, limit 0.8 on a 40960 MiB GPU
    "gpu-fraction": "0.5", "gpu-fraction.limit": "0.8",
    "kai.scheduler/container.trainer.gpu-memory.portion.limit": "0.8",
    f"{T}.gpu-memory.request": "20Gi", f"{T}.gpu-memory.limit": "32Gi",
    f"{T}.gpus.devices": GPU_B, "received-resource-type": "Fraction"}


def on_node(br: dict, node: str) -> dict:
    return {**br, "spec": {**br["spec"], "selectedNode": node}}


async def test_a_rebind_keeps_the_limit_of_the_failed_bind(store):
    store.nodes["gpu-node-2"] = {"nvidia.com/gpu.memory": "81920"}
    store.add_pod(pod("train-0", FIRST_BIND_ON_40960))
    # ceil(20480 / 81900 * 100) / 100 = 0.26: the scheduler decided by the kept 20Gi
    rebind = on_node(bind_request("br-2", "train-0", groups=("group-b",), portion="0.26"),
                     "gpu-node-2")
    result = await verify(store, rebind, signer=Keys(Keyring.of(b"k" * 32)))
    assert (result.mismatches, result.errors, result.skipped) == ((), (), "")
    assert result.complete and result.signed == (SIGNATURE,) and store.events == []
    # Not a rebind (the portion is the fraction's, not the request's): the binder of this
    # bind wrote both, from 0.5 and 0.8 of this node's 81920 MiB.
    first = on_node(bind_request("br-3", "train-0", groups=("group-b",)), "gpu-node-2")
    found = (await verify(store, first)).mismatches
    assert [(m.key, m.expected, m.actual, m.rule) for m in found] == [
        (f"{T}.gpu-memory.limit", "64Gi", "32Gi", ""),
        (f"{T}.gpu-memory.request", "40Gi", "20Gi", "")]


@pytest.mark.parametrize(("limit", "rule"), [
    ("64Gi", ""),  # 0.8 of the first node's 81920 MiB: more than this GPU has
    ("16Gi", ""),  # below the request
    ("lots", ", and it must be a Kubernetes quantity such as 8Gi, 7680Mi or 1000M"),
])
async def test_a_kept_limit_this_node_cannot_honour_is_a_mismatch_naming_the_rule(
        store, limit, rule):
    # First bound on an 81920 MiB GPU: gpu-fraction 0.3 -> uint64(81920 * 0.3) = 24Gi; then
    # rebound here (40960 MiB) as ceil(24576 / 40900 * 100) / 100 = 0.61.
    store.add_pod(pod("train-0", {**FIRST_BIND_ON_40960, "gpu-fraction": "0.3",
                                  f"{T}.gpu-memory.request": "24Gi",
                                  f"{T}.gpu-memory.limit": limit, f"{T}.gpus.devices": GPU_A}))
    result = await verify(store, bind_request("br-2", "train-0", portion="0.61"),
                          signer=Keys(Keyring.of(b"k" * 32)))
    expected_rule = kept_limit_rule(24576, 40960, "0.8", "0.3") + rule
    assert [(m.key, m.expected, m.actual, m.rule) for m in result.mismatches] == [
        (f"{T}.gpu-memory.limit", "32Gi", limit, expected_rule)]
    assert result.signed == () and not result.recheck
    assert [e.message for e in store.events] == [
        f"annotation {T}.gpu-memory.limit: expected '32Gi', found '{limit}': {expected_rule} "
        "(BindRequest team-a/br-2)"]


def kept_limit_rule(request_mib: int, usable_mib: int, limit_portion: str, portion: str) -> str:
    return (f"a limit kept from an earlier bind must be at least the request ({request_mib} "
            f"MiB), at most the {usable_mib} MiB a GPU of this node shares, and the "
            f"{limit_portion} of a GPU that KAI's binder computes on a node where {portion} of "
            "that GPU is the request")


# KAI-Scheduler's binder computes the request from the bind's portion and the limit from the
# portion limit, both as uint64(node's GPU memory x portion) (pkg/binder/plugins/nvfractions/
# nv_fractions.go, setNvFractionsMemoryAnnotation, setGpuMemoryPortionLimitAnnotation): a
# limit kept from an earlier bind is that node's, and so is the request beside it.
LIMIT_06 = {"gpu-fraction": "0.5", "gpu-fraction.limit": "0.6",
            "kai.scheduler/container.trainer.gpu-memory.portion.limit": "0.6",
            f"{T}.gpus.devices": GPU_A, "received-resource-type": "Fraction"}


@pytest.mark.parametrize(("node_mib", "asked", "limit", "portion", "expected", "rule"), [
    # The binder's own request on a node labelled a multiple of 100 MiB: uint64(40000 x 0.5)
    # = 20000Mi, which the scheduler also sizes as 0.50; its limit is uint64(40000 x 0.6).
    (40000, "20000Mi", "40000Mi", "0.50", "24000Mi", kept_limit_rule(20000, 40000, "0.6", "0.5")),
    # The user's own request beside gpu-fraction, which the scheduler sized the bind by
    # (10240 / 40900 -> 0.26); the binder computes the limit uint64(40960 x 0.6) = 24Gi.
    (40960, "10Gi", "40Gi", "0.26", "24Gi", kept_limit_rule(10240, 40960, "0.6", "0.5")),
])
async def test_a_first_binds_limit_is_the_one_this_bind_computes(
        store, node_mib, asked, limit, portion, expected, rule):
    # Its request sizes the bind as KAI's scheduler would, as a kept one does; but no GPU
    # whose 0.5 is that request has the found limit as its 0.6: not a limit an earlier bind
    # kept, so this bind's binder wrote it, from this node's memory.
    store.nodes["gpu-node-1"] = {"nvidia.com/gpu.memory": str(node_mib)}
    store.add_pod(pod("train-0", {**LIMIT_06, f"{T}.gpu-memory.request": asked,
                                  f"{T}.gpu-memory.limit": limit}))
    result = await verify(store, bind_request("br-1", "train-0", portion=portion),
                          signer=Keys(Keyring.of(b"k" * 32)))
    assert [(m.key, m.expected, m.actual, m.rule) for m in result.mismatches] == [
        (f"{T}.gpu-memory.limit", expected, limit, rule)]
    assert result.signed == () and SIGNATURE not in store.annotations(NS, "train-0")
    assert [e.message for e in store.events] == [
        f"annotation {T}.gpu-memory.limit: expected '{expected}', found '{limit}': {rule} "
        "(BindRequest team-a/br-1)"]
    # The limit this bind computes is signed.
    store.add_pod(pod("train-1", {**LIMIT_06, f"{T}.gpu-memory.request": asked,
                                  f"{T}.gpu-memory.limit": expected}))
    result = await verify(store, bind_request("br-2", "train-1", portion=portion),
                          signer=Keys(Keyring.of(b"k" * 32)))
    assert result.complete and result.signed == (SIGNATURE,)


@pytest.mark.parametrize("limit", ["30Gi", "32769Mi", "32767Mi"])
async def test_a_kept_limit_no_earlier_gpu_gives_beside_the_request_is_a_mismatch(
        store, limit):
    # Rebound on 81920 MiB (0.26) with the 20Gi a 40960 MiB GPU gave as 0.5, whose 0.8 is
    # 32Gi: any other limit, though this node could honour it, no binder kept.
    store.nodes["gpu-node-2"] = {"nvidia.com/gpu.memory": "81920"}
    store.add_pod(pod("train-0", {**FIRST_BIND_ON_40960, f"{T}.gpu-memory.limit": limit}))
    rebind = on_node(bind_request("br-2", "train-0", groups=("group-b",), portion="0.26"),
                     "gpu-node-2")
    result = await verify(store, rebind, signer=Keys(Keyring.of(b"k" * 32)))
    assert [(m.key, m.expected, m.actual, m.rule) for m in result.mismatches] == [
        (f"{T}.gpu-memory.limit", "64Gi", limit, kept_limit_rule(20480, 81920, "0.8", "0.5"))]
    assert result.signed == ()


async def test_the_price_a_users_request_rebound_with_its_first_limit_is_reported(store):
    # The user's 10Gi beside gpu-fraction 0.5, first bound on 40960 MiB (limit 0.6 -> 24Gi),
    # rebound on 81920 MiB (10240 / 81900 -> 0.13): no GPU gives 10Gi as its 0.5 and 24Gi as
    # its 0.6, so the kept limit is not told from a binder's wrong one: reported, not signed
    # (never more than KAI accounted).
    store.nodes["gpu-node-2"] = {"nvidia.com/gpu.memory": "81920"}
    store.add_pod(pod("train-0", {**LIMIT_06, f"{T}.gpu-memory.request": "10Gi",
                                  f"{T}.gpu-memory.limit": "24Gi", f"{T}.gpus.devices": GPU_B}))
    rebind = on_node(bind_request("br-2", "train-0", groups=("group-b",), portion="0.13"),
                     "gpu-node-2")
    result = await verify(store, rebind, signer=Keys(Keyring.of(b"k" * 32)))
    assert [(m.key, m.expected, m.actual) for m in result.mismatches] == [
        (f"{T}.gpu-memory.limit", "48Gi", "24Gi")]
    assert result.signed == ()


def test_the_earlier_gpu_is_found_with_kais_arithmetic_within_a_bounded_search(monkeypatch):
    from kai_fractions.mirror import kai_binder

    mib = 1 << 20
    # uint64(40960 x 0.5) = 20480, uint64(40960 x 0.8) = 32768
    assert kai_binder.earlier_gpu_memory(20480 * mib, Fraction("0.5"), 32768 * mib,
                                         Fraction("0.8"), 0) == 40960
    # the patched dialect's reserve: uint64(39936 x 0.5) = 19968, uint64(39936 x 0.8) = 31948
    assert kai_binder.earlier_gpu_memory(19968 * mib, Fraction("0.5"), 31948 * mib,
                                         Fraction("0.8"), 1024) == 40960
    # 10000 x 0.57 is 5699 in float64, as KAI computes it: the size is found where KAI's
    # arithmetic gives the request, not where exact arithmetic would
    assert kai_binder.earlier_gpu_memory(5699 * mib, Fraction("0.57"), 8000 * mib,
                                         Fraction("0.8"), 0) == 10000
    assert kai_binder.earlier_gpu_memory(20480 * mib + 1, Fraction("0.5"), 32768 * mib,
                                         Fraction("0.8"), 0) is None  # not whole MiB
    tried = []
    real = kai_binder.memory_mib

    def counted(*args):
        tried.append(args)
        return real(*args)

    monkeypatch.setattr(kai_binder, "memory_mib", counted)
    # A portion far below what KAI's scheduler writes would span a million sizes.
    assert kai_binder.earlier_gpu_memory(5 * mib, Fraction("0.000001"), 7 * mib,
                                         Fraction("0.9"), 0) is None
    assert 0 < len(tried) <= 2 * kai_binder.EARLIER_SIZES_TRIED


async def test_a_request_kai_did_not_size_the_bind_by_is_checked_as_the_binders(store):
    # 30000Mi beside gpu-fraction 0.5: KAI would have sized that request as 0.74, so a bind of
    # 0.5 was decided by the fraction, and the binder should have written 20Gi.
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND,
                                  f"{T}.gpu-memory.request": "30000Mi"}))
    result = await verify(store, bind_request("br-1", "train-0"))
    assert [(m.key, m.expected, m.actual) for m in result.mismatches] == [
        (f"{T}.gpu-memory.request", "20Gi", "30000Mi")]


# Pods as upstream KAI main's mutating webhook (KAI-Scheduler pkg/admission/webhook/v1alpha2/
# nvfractions/mutation.go: gpu-memory, gpu-memory.limit and gpu-fraction.limit copied into the
# NvFractions keys of the container GetFractionContainerRef picks) and then its binder leave
# them: each one checks complete, with nothing to report.
AS_KAI_LEAVES_THEM = [
    pytest.param({"gpu-memory": "2000", "gpu-memory.limit": "8G",
                  f"{T}.gpu-memory.request": "2000Mi", f"{T}.gpu-memory.limit": "8G",
                  f"{T}.gpus.devices": GPU_A, "received-resource-type": "Fraction"},
                 ("trainer",), id="gpu-memory.limit copied as written"),
    pytest.param({"gpu-fraction": "0.5", "gpu-fraction.limit": "0.8",
                  "kai.scheduler/container.trainer.gpu-memory.portion.limit": "0.8",
                  f"{T}.gpu-memory.limit": "32768Mi", **BOUND},
                 ("trainer",), id="gpu-fraction.limit copied to the portion limit"),
    pytest.param({"gpu-fraction": "0.5", f"{T}.gpu-compute.mode": "sm-sharing", **BOUND},
                 ("sidecar", "trainer"), id="the container a compute mode names"),
]


@pytest.mark.parametrize(("annotations", "containers"), AS_KAI_LEAVES_THEM)
async def test_what_an_unmodified_kai_leaves_checks_complete(store, annotations, containers):
    obj = pod("train-0", annotations)
    obj["spec"]["containers"] = [{"name": name} for name in containers]
    store.add_pod(obj)
    result = await verify(store, bind_request("br-1", "train-0", mode="sm-sharing"
                                              if "sm-sharing" in annotations.values() else ""))
    assert (result.mismatches, result.errors, result.skipped) == ((), (), "")
    assert result.complete and store.events == []


async def test_a_fraction_kai_rounds_up_to_two_decimals_checks_complete(store):
    # KAI-Scheduler pkg/scheduler/cache/cache.go (createBindRequest) writes the portion with
    # fmt.Sprintf("%.2f"): gpu-fraction 0.375 is bound as "0.38", and the binder writes
    # uint64(40960 * 0.38) = 15564Mi (pkg/binder/plugins/nvfractions/nv_fractions.go).
    store.add_pod(pod("train-0", {"gpu-fraction": "0.375", **BOUND,
                                  f"{T}.gpu-memory.request": "15564Mi"}))
    result = await verify(store, bind_request("br-1", "train-0", portion="0.38"))
    assert (result.mismatches, result.errors, result.skipped) == ((), (), "")
    assert result.complete and store.events == []


async def test_a_limit_only_pod_as_admission_leaves_it_checks_complete(store):
    # Our mutating webhook writes a limit-only container's request as its limit, so KAI's
    # binder writes none (setNvFractionsMemoryAnnotation skips a pod with a request), whatever
    # portion the scheduler rounded up to (ceil(10000 / 40960 * 100) / 100 = 0.25).
    store.add_pod(pod("train-0", {f"{T}.gpu-memory.limit": "10000Mi",
                                  f"{T}.gpu-memory.request": "10000Mi",
                                  f"{T}.gpus.devices": GPU_A,
                                  "received-resource-type": "Fraction"}))
    result = await verify(store, bind_request("br-1", "train-0", portion="0.25"))
    assert (result.mismatches, result.errors, result.skipped) == ((), (), "")
    assert result.complete and store.events == []


async def test_reservation_pods_are_read_where_kai_creates_them():
    """KAI's binder.resourceReservation.namespace is configurable (kai-scheduler/api
    kai/v1/binder/binder.go, ResourceReservation.Namespace): --reservation-namespace."""
    store = FakePodStore()
    store.nodes["gpu-node-1"] = {"nvidia.com/gpu.memory": "40960"}
    reservation = reservation_pod("group-a", GPU_A)
    reservation["metadata"]["namespace"] = "gpu-reservations"
    store.add_pod(reservation)
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    br = bind_request("br-1", "train-0")
    result = await verify(store, br, reservation_namespace="gpu-reservations")
    assert result.complete
    elsewhere = await verify(store, br)
    assert "kai-resource-reservation" in elsewhere.skipped


async def test_a_users_own_request_is_not_the_binders(store):
    user = {f"{T}.gpu-memory.request": "8Gi"}
    store.add_pod(pod("train-0", {**user, **{k: v for k, v in BOUND.items()
                                            if k != f"{T}.gpu-memory.request"}}))
    assert (await verify(store, bind_request("br-1", "train-0"))).mismatches == ()


async def test_findings_are_reported_once(store):
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5"}))
    follower = Follower(store)
    view = BindRequestView.from_object(bind_request("br-1", "train-0"))
    await follower.verify(view)
    await follower.verify(view)  # a relist replays every BindRequest
    assert len(store.events) == 3


@pytest.mark.parametrize(("br", "skipped"), [
    # No creationTimestamp: taken as Pending for long (tests/mirror/test_follower_pending.py).
    (bind_request("br-1", "train-0", phase="Pending"),
     "phase Pending: pod team-a/train-0 is not bound yet"),
    (bind_request("br-1", "train-0", phase=""),
     "phase Pending: pod team-a/train-0 is not bound yet"),
    # Failed with no attempts left (tests/mirror/test_follower_failed_retries.py).
    (failed_for_good(bind_request("br-1", "train-0", phase="Failed")), "phase Failed"),
    (bind_request("br-1", "gone-pod"), "pod not found"),
    (bind_request("br-1", "train-0", groups=("group-unknown",)),
     "the GPU reserved for group(s) group-unknown is not known yet: no pod labelled "
     "runai-gpu-group in kai-resource-reservation carries run.ai/reserve_for_gpu_index"),
    ({**bind_request("br-1", "train-0"), "spec": {"podName": "train-0",
                                                  "receivedResourceType": "Regular"}},
     "not a fractional bind"),
])
async def test_nothing_is_checked_before_the_binder_is_done(store, br, skipped):
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5"}))
    assert (await verify(store, br)).skipped == skipped
    assert store.events == []


async def test_older_plain_group_ids_mean_time_slicing(store):
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    assert (await verify(store, bind_request("br-1", "train-0", legacy=True))).mismatches == ()


async def test_cdi_device_names_are_compared_as_written(store):
    cdi = {**BOUND, f"{T}.gpus.devices": f"k8s.device-plugin.nvidia.com/gpu={GPU_A}"}
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **cdi}))
    assert (await verify(store, bind_request("br-1", "train-0"))).mismatches == ()


async def test_a_reservation_pod_is_read_from_the_watch_cache_and_again_only_on_a_miss(store):
    """A consistent list reads the whole reservation namespace from etcd (before Kubernetes
    1.31), once per BindRequest: the watch cache first; a cache a moment behind costs one
    consistent read, not a pod left unsigned until the next resync."""
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    assert (await verify(store, bind_request("br-1", "train-0"))).complete
    assert store.lists == [True]
    listed = store.list_pods

    async def behind(namespace, labels, deadline=NO_DEADLINE, *, cached=False):
        found = await listed(namespace, labels, deadline, cached=cached)
        return [] if cached else found  # the watch cache has not seen it yet

    store.list_pods = behind
    store.lists.clear()
    assert (await verify(store, bind_request("br-1", "train-0"))).complete
    assert store.lists == [True, False]


async def test_reserve_is_configuration(store):
    bound = {**BOUND, f"{T}.gpu-memory.request": "19968Mi"}
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **bound}))
    result = await verify(store, bind_request("br-1", "train-0"), default_reserve_mib=1024)
    assert result.mismatches == ()


async def test_contract_errors_are_one_invalid_event(store):
    store.nodes["gpu-node-1"] = {}
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    result = await verify(store, bind_request("br-1", "train-0"))
    assert [e.key for e in result.errors] == ["node_gpu_memory_mib"]
    assert [(e.reason, e.message.split(":")[0]) for e in store.events] == [
        ("NvFractionsInvalid", "cannot check the binder's annotations for BindRequest "
         "team-a/br-1")]


def versioned(br: dict, rv: str = "7") -> dict:
    """`br` as the API server sends it: with a uid and a resourceVersion."""
    return {**br, "metadata": {**br["metadata"], "uid": "br-uid-1", "resourceVersion": rv}}


class Keys:
    """A signing key source whose keys the test changes (a rotation)."""

    def __init__(self, keyring: Keyring) -> None:
        self.keyring = keyring

    def current(self) -> Keyring:
        return self.keyring


def requests_of(store: FakePodStore) -> list[str]:
    seen: list[str] = []
    store.faults.append(lambda operation, *_: seen.append(operation))
    return seen


async def test_a_complete_check_is_not_repeated_for_the_same_version(store):
    # KAI keeps a Succeeded BindRequest for as long as its pod lives (KAI-Scheduler
    # pkg/scheduler/cache/cache.go, cleanStaleBindRequest deletes only the failed ones and
    # those of deleted nodes), so every resync's list replays it.
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    follower = Follower(store)
    requests = requests_of(store)
    first = await follower.follow_one(BindRequestView.from_object(
        versioned(bind_request("br-1", "train-0"))))
    assert first is not None and first.complete and requests
    requests.clear()
    again = BindRequestView.from_object(versioned(bind_request("br-1", "train-0")))
    assert await follower.follow_one(again) is None and requests == []
    newer = BindRequestView.from_object(versioned(bind_request("br-1", "train-0"), rv="9"))
    assert (await follower.follow_one(newer)).complete and requests
    unversioned = BindRequestView.from_object(bind_request("br-1", "train-0"))
    assert await follower.follow_one(unversioned) is not None  # nothing to recognise it by
    assert await follower.follow_one(unversioned) is not None


@pytest.mark.parametrize("annotations,groups", [
    ({"gpu-fraction": "0.5"}, ("group-a",)),  # a mismatch: reported, never complete
    ({"gpu-fraction": "0.5", **BOUND}, ("group-unknown",)),  # skipped: the GPU not known yet
])
async def test_what_was_not_complete_is_checked_again(store, annotations, groups):
    store.add_pod(pod("train-0", annotations))
    follower = Follower(store)
    view = BindRequestView.from_object(versioned(bind_request("br-1", "train-0",
                                                              groups=groups)))
    for _ in range(2):
        result = await follower.follow_one(view)
        assert result is not None and not result.complete


async def test_new_signing_keys_make_every_bind_request_be_checked_and_signed_again(store):
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    keys = Keys(Keyring.of(b"o" * 32))
    follower = Follower(store, signer=keys)
    view = BindRequestView.from_object(versioned(bind_request("br-1", "train-0")))
    assert (await follower.follow_one(view)).signed == (SIGNATURE,)
    assert await follower.follow_one(view) is None
    keys.keyring = Keyring.of(b"n" * 32)  # the old key retired: its signatures fail
    assert (await follower.follow_one(view)).signed == (SIGNATURE,)
    assert await follower.follow_one(view) is None


def owned_by(br: dict, uid: str) -> dict:
    """`br` as KAI's scheduler creates it: owned by the pod it decided for (KAI-Scheduler
    pkg/scheduler/cache/cache.go, createBindRequest)."""
    owner = {"apiVersion": "v1", "kind": "Pod", "name": br["spec"]["podName"], "uid": uid}
    return {**br, "metadata": {**br["metadata"], "ownerReferences": [owner]}}


async def test_a_pod_created_again_under_the_name_gets_no_signature_of_the_old_decision(store):
    """KAI decided for one pod; a user who deletes it (the BindRequest outlives it with
    --cascade=orphan, or until the garbage collector runs) and creates another of the same
    name, bound by hand with the binder's annotations copied, must not get that decision
    signed: the GPU share it names was freed."""
    first = store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    br = owned_by(bind_request("br-1", "train-0"), first.uid)
    assert (await verify(store, br, signer=Keys(Keyring.of(b"k" * 32)))).signed == (SIGNATURE,)
    store.delete_pod(NS, "train-0")
    again = store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    result = await verify(store, br, signer=Keys(Keyring.of(b"k" * 32)))
    assert result.signed == () and not result.complete
    assert result.skipped == (
        f"pod {NS}/train-0 (uid {again.uid}) is not the pod BindRequest {NS}/br-1 was made for "
        f"(uid {first.uid}): it was created again under that name")
    assert SIGNATURE not in store.annotations(NS, "train-0") and store.events == []


async def test_without_an_owner_a_pod_newer_than_the_bind_request_is_not_its_pod(store):
    br = bind_request("br-1", "train-0")
    br["metadata"]["creationTimestamp"] = "2026-12-06T10:00:00Z"
    newer = pod("train-0", {"gpu-fraction": "0.5", **BOUND})
    newer["metadata"]["creationTimestamp"] = "2026-12-06T10:00:01Z"
    store.add_pod(newer)
    result = await verify(store, br, signer=Keys(Keyring.of(b"k" * 32)))
    assert result.signed == () and "was created after BindRequest" in result.skipped
    store.delete_pod(NS, "train-0")
    newer["metadata"]["creationTimestamp"] = "2026-12-06T10:00:05"  # no zone: UTC, and newer
    store.add_pod(newer)
    assert "was created after" in (await verify(store, br)).skipped
    store.delete_pod(NS, "train-0")
    newer["metadata"]["creationTimestamp"] = "2026-12-06T10:00:00Z"  # the same second: its pod
    store.add_pod(newer)
    assert (await verify(store, br, signer=Keys(Keyring.of(b"k" * 32)))).signed == (SIGNATURE,)


async def test_a_signature_broken_by_an_edit_is_not_signed_again(store):
    """A user-owned key raised after signing (where admission does not run) breaks the
    signature, and the binder's keys still match KAI's decision: signing again would make the
    node apply the raised limit. Only a signature under a retired key is replaced."""
    keys = Keys(Keyring.of(b"k" * 32))
    # a pod sized in memory by its user (request and limit), a half GPU to KAI
    created = store.add_pod(pod("train-0", {**BOUND, f"{T}.gpu-memory.limit": "20Gi"}))
    br = owned_by(bind_request("br-1", "train-0"), created.uid)
    assert (await verify(store, br, signer=keys)).signed == (SIGNATURE,)
    signature = store.annotations(NS, "train-0")[SIGNATURE]
    edited = store.pods[(NS, "train-0")]["metadata"]["annotations"]
    edited[f"{T}.gpu-memory.limit"] = "40Gi"
    for follower in (Follower(store, signer=keys), Follower(store, signer=keys)):  # a restart
        result = await follower.follow_one(BindRequestView.from_object(versioned(br)))
        assert result is not None and not result.complete and result.signed == ()
        assert "no longer matches its GPU annotations" in result.unsigned
    assert store.annotations(NS, "train-0")[SIGNATURE] == signature
    unsigned = [e.message for e in store.events if e.reason == "NvFractionsUnsigned"]
    assert len(unsigned) == 2  # one per follower process: each reports it once
    assert all("were changed after they were signed" in m for m in unsigned)
    keys.keyring = Keyring.of(b"n" * 32, b"k" * 32)  # rotated, the old key kept as previous
    assert (await verify(store, br, signer=keys)).signed == ()
    keys.keyring = Keyring.of(b"n" * 32)  # the old key retired: now it is replaced
    assert (await verify(store, br, signer=keys)).signed == (SIGNATURE,)


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
async def test_a_pod_that_ran_to_its_end_is_complete_with_nothing_to_read(store, phase):
    # Once a fractional pod has ended, KAI's binder deletes its group's reservation pod
    # (KAI-Scheduler pkg/binder/controllers/pod_controller.go, isCompletionEvent ->
    # syncReservationIfNeeded; pkg/binder/binding/resourcereservation/resource_reservation.go,
    # SyncForGpuGroup: a Succeeded or Failed pod holds no reservation), while its BindRequest
    # stays as long as the pod does: a new leader's list, and every resync, replay it.
    done = pod("job-0", {"gpu-fraction": "0.5", **BOUND})
    done["status"] = {"phase": phase}
    store.add_pod(done)
    store.delete_pod("kai-resource-reservation", "gpu-reservation-group-a")
    requests = requests_of(store)
    follower = Follower(store, signer=Keys(Keyring.of(b"k" * 32)))
    view = BindRequestView.from_object(versioned(bind_request("br-1", "job-0")))
    result = await follower.follow_one(view)
    assert result is not None and result.complete and result.signed == ()
    assert requests == ["get"] and store.lists == [] and store.events == []
    assert SIGNATURE not in store.annotations(NS, "job-0")
    assert await follower.follow_one(view) is None  # the next list's replay reads nothing
    assert requests == ["get"]


async def test_a_deleted_bind_request_is_forgotten(store):
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    follower = Follower(store)
    obj = versioned(bind_request("br-1", "train-0"))
    await follower.follow_one(BindRequestView.from_object(obj))
    follower.forget(BindRequestView.from_object(obj))
    assert await follower.follow_one(BindRequestView.from_object(obj)) is not None


async def test_decide_is_the_servicers_decision(store):
    """The follower's decision, handed to MirrorService, writes exactly what it expects the
    binder to have written (plus the derived keys): the hook for a writing follower."""
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5"}))
    follower = Follower(store)
    decision = await follower.decide(BindRequestView.from_object(bind_request("br-1", "train-0")))
    assert decision is not None
    written = await MirrorService(store).mirror(
        decision, idempotency_key="bindrequest/br-1")
    assert {k: v for k, v in written.annotations.items() if k in BOUND} == BOUND
    assert (await verify(store, bind_request("br-1", "train-0"))).mismatches == ()


async def test_decide_names_the_pod_by_the_uid_its_bind_request_carries(store):
    """KAI's scheduler makes the pod the BindRequest's owner (KAI-Scheduler
    pkg/scheduler/cache/cache.go, createBindRequest: OwnerReferences [{Kind: Pod, Name, UID}]):
    the decision carries that uid, as a scheduler calling the mirror sends `pod.uid`, so a pod
    created again under the name is refused (POD_REPLACED), not written (the reviewer's probe
    p8_owner_uid.py: decide() handed on pod_uid "")."""
    first = store.add_pod(pod("train-0", {"gpu-fraction": "0.5"}))
    view = BindRequestView.from_object(owned_by(bind_request("br-1", "train-0"), first.uid))
    decision = await Follower(store).decide(view)
    assert decision is not None and decision.pod_uid == first.uid
    store.delete_pod(NS, "train-0")
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5"}))
    with pytest.raises(PodReplaced):
        await MirrorService(store).mirror(decision, idempotency_key="bindrequest/br-1")
    assert store.patches == []
    unowned = await Follower(store).decide(BindRequestView.from_object(
        bind_request("br-1", "train-0")))
    assert unowned is not None and unowned.pod_uid == ""  # none to send: not checked


def test_the_docs_say_where_a_bind_request_carries_its_pods_uid():
    root = Path(__file__).resolve().parents[2]
    for path in ("docs/mirror.md", "protos/kai_fractions/v1/allocation.proto"):
        text = " ".join((root / path).read_text().split())
        assert "ownerReferences[kind=Pod].uid" in text, path
        assert "carries only the name" not in text, path


# -- the list/watch loop ----------------------------------------------------------------------

class ScriptedSource:
    """list() and watch() play a script (a Collection's two coroutines); once the script is
    played, the next watch sets `played` and waits to be cancelled."""

    what = "BindRequest(s)"

    def __init__(self, lists, watches) -> None:
        self.lists, self.watches = list(lists), list(watches)
        self.calls: list[tuple[str, str]] = []
        self.played = asyncio.Event()

    async def list(self, resource_version: str = ""):
        self.calls.append(("list", resource_version))
        item = self.lists.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    async def watch(self, resource_version: str) -> AsyncIterator:
        self.calls.append(("watch", resource_version))
        if not self.watches:
            self.played.set()
            await asyncio.Event().wait()
        step = self.watches.pop(0)
        if isinstance(step, Exception):
            raise step
        for event in step:
            if event[0] == "WAIT":  # the script goes on once the test says so
                await event[1].wait()
                continue
            yield event


async def play(source: ScriptedSource, handle, until=lambda: True, settle: float = 0.0,
               **options) -> None:
    """follow() over `source` until its script is played and `until()` holds (the listed
    BindRequests are handled in the background), then cancelled; one BindRequest at a time
    unless `concurrency` says otherwise (the loop then waits for each event's handling before it
    reads on, so the events handled and when it listed or watched come in one order)."""
    options.setdefault("concurrency", 1)
    task = asyncio.create_task(follow(source, handle, backoff=Backoff(base=0.001, cap=0.001),
                                      **options))

    async def done() -> None:
        await source.played.wait()
        while not until():
            await asyncio.sleep(0.005)

    finished = asyncio.create_task(done())
    await asyncio.wait([task, finished], timeout=10, return_when=asyncio.FIRST_COMPLETED)
    assert finished.done(), task.exception() if task.done() else "still playing"
    await asyncio.sleep(settle)  # time for what should not happen
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def obj(name: str, rv: str, created: str = "") -> dict:
    """A fractional BindRequest, as far as the loop reads it (it hands over no other)."""
    return {"metadata": {"name": name, "namespace": NS, "resourceVersion": rv,
                         "creationTimestamp": created},
            "spec": {"receivedResourceType": "Fraction"}}


async def test_watch_resumes_from_the_last_version_and_relists_on_gone():
    source = ScriptedSource(
        lists=[([obj("a", "5")], "10"), ([obj("a", "5"), obj("b", "12")], "20")],
        watches=[[("ADDED", obj("b", "12")), ("BOOKMARK", obj("", "15"))],
                 Gone("too old"),
                 [("MODIFIED", obj("b", "21")), ("DELETED", obj("a", "22"))]])
    seen: list[tuple[str, str]] = []

    async def handle(o):
        seen.append((o.name, o.resource_version))

    await play(source, handle, until=lambda: ("b", "21") in seen, settle=0.02)
    assert source.calls == [("list", ""), ("watch", "10"), ("watch", "15"), ("list", ""),
                            ("watch", "20"), ("watch", "22")]
    # The watch's b first (the replay was not waiting yet); the listed a waits for its turn,
    # and before it comes the watch ends (410): the relist and the next watch show b again and
    # a deleted, so a is never handled, and neither is the relist's b (its event carried a
    # newer version).
    assert seen == [("b", "12"), ("b", "21")]


async def test_a_deleted_object_goes_to_forget():
    source = ScriptedSource(lists=[([obj("a", "5")], "10")],
                            watches=[[("DELETED", obj("a", "11")), ("ADDED", obj("b", "12"))]])
    handled: list[str] = []
    forgotten: list[str] = []

    async def handle(o):
        handled.append(o.name)

    await play(source, handle, until=lambda: handled, settle=0.02,
               forget=lambda o: forgotten.append(o.name))
    assert (handled, forgotten) == (["b"], ["a"])  # the listed a, deleted since: not handled


async def test_everything_is_listed_again_after_the_resync_period():
    a_done = asyncio.Event()
    source = ScriptedSource(
        lists=[([obj("a", "5")], "10"), ([obj("a", "5")], "30")],
        watches=[[("WAIT", a_done), ("ADDED", obj("b", "12"))], [("ADDED", obj("c", "14"))]])
    now = [0.0]

    async def handle(o):
        seen.append(o.name)
        if o.name == "a":
            a_done.set()
        else:
            now[0] += 600  # each event's handling "takes" 600 s of the clock

    seen: list[str] = []
    await play(source, handle, until=lambda: seen.count("a") == 2, resync_seconds=1000,
               monotonic=lambda: now[0])
    # a, then b (600 s): the stream ends before 1000 s, the watch resumes; c (1200 s): the
    # next stream end relists, so `a` (whose handling may have failed) is handled again; the
    # scripted source stops the loop at the watch after that.
    assert source.calls == [("list", ""), ("watch", "10"), ("watch", "12"), ("list", ""),
                            ("watch", "30")]
    assert seen == ["a", "b", "c", "a"]


async def test_the_watch_opens_at_once_its_events_go_first_and_the_newest_listed_next():
    # A follower that takes over lists every BindRequest of the cluster (160,000 at 5,000
    # nodes: minutes of checks); a pod bound meanwhile must not wait until they are done.
    source = ScriptedSource(lists=[([obj("a", "1", "2026-12-02T10:00:00Z"),
                                     obj("b", "2", "2026-12-02T11:00:00Z"),
                                     obj("c", "3", "2026-12-02T12:00:00Z")], "3")],
                            watches=[[("ADDED", obj("d", "4"))]])
    steps: list[str] = []
    running = [0]

    async def handle(o):
        running[0] += 1
        assert running[0] == 1  # never two at once
        steps.append(f"start {o.name}, {len(source.calls)} call(s)")
        await asyncio.sleep(0.01)
        running[0] -= 1

    await play(source, handle, until=lambda: len(steps) == 4)
    assert steps == ["start d, 2 call(s)", "start c, 3 call(s)", "start b, 3 call(s)",
                     "start a, 3 call(s)"]


async def test_the_watch_supersedes_what_it_shows_before_the_replay_gets_there():
    source = ScriptedSource(lists=[([obj("a", "5"), obj("b", "5"), obj("c", "5")], "5")],
                            watches=[[("MODIFIED", obj("a", "6")), ("DELETED", obj("b", "7"))]])
    handled: list[tuple[str, str]] = []

    async def handle(o):
        handled.append((o.name, o.resource_version))
        await asyncio.sleep(0.01)

    await play(source, handle, until=lambda: len(handled) == 2, settle=0.05,
               forget=lambda o: None)
    assert handled == [("a", "6"), ("c", "5")]  # a at its newer version only; b deleted


async def test_a_listed_one_waiting_for_its_place_is_dropped_when_the_watch_shows_it():
    # y holds the one place; the replay takes x and waits; the watch then shows x at 7: the
    # listed x at 5 must not be checked after it.
    source = ScriptedSource(lists=[([obj("x", "5")], "5")],
                            watches=[[("ADDED", obj("y", "6")), ("MODIFIED", obj("x", "7"))]])
    handled: list[tuple[str, str]] = []

    async def handle(o):
        handled.append((o.name, o.resource_version))
        await asyncio.sleep(0.01)

    await play(source, handle, until=lambda: len(handled) == 2, settle=0.05)
    assert handled == [("y", "6"), ("x", "7")]


async def test_a_relist_in_the_middle_of_a_replay_finishes_the_old_one_first():
    # A relist (here a 410; every 10 minutes a resync) while the replay is under way: what the
    # old list left unstarted goes first, so the oldest are reached even when every replay
    # outlasts the resync period.
    first = [obj("a", "1", "T1"), obj("b", "2", "T2"), obj("c", "3", "T3")]
    b_started = asyncio.Event()
    source = ScriptedSource(lists=[(first, "3"), ([*first, obj("d", "4", "T4")], "4")],
                            watches=[[("WAIT", b_started)], Gone("too old"), []])
    seen: list[str] = []

    async def handle(o):
        seen.append(o.name)
        if o.name == "b" and len(seen) == 2:
            b_started.set()
            while source.lists:  # until the relist
                await asyncio.sleep(0.001)

    await play(source, handle, until=lambda: len(seen) == 6, settle=0.02)
    assert seen == ["c", "b", "a", "d", "c", "b"]


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_the_replay_keeps_a_place_under_a_steady_stream_of_events(concurrency):
    events = [("ADDED", obj(f"e{i}", str(10 + i))) for i in range(30)]
    source = ScriptedSource(lists=[([obj(f"l{i}", "1", f"T{i}") for i in range(3)], "1")],
                            watches=[events])
    seen: list[str] = []

    async def handle(o):
        seen.append(o.name)
        await asyncio.sleep(0.002)

    await play(source, handle, until=lambda: len(seen) == 33, concurrency=concurrency)
    assert max(seen.index(f"l{i}") for i in range(3)) < 15, seen  # not after the stream


async def test_with_one_place_the_watch_and_the_replay_take_turns():
    # --follow-concurrency 1 and 160,000 listed: an event must not wait for the whole replay.
    second = asyncio.Event()
    source = ScriptedSource(
        lists=[([obj(f"l{i:02}", "1", f"T{i:02}") for i in range(50)], "1")],
        watches=[[("WAIT", second), ("ADDED", obj("e", "2")), ("ADDED", obj("f", "3"))]])
    seen: list[str] = []

    async def handle(o):
        seen.append(o.name)
        if len(seen) == 2:
            second.set()
        await asyncio.sleep(0.001)

    await play(source, handle, until=lambda: len(seen) == 52)
    assert seen[:2] == ["l49", "l48"]  # newest first
    assert seen.index("e") <= 3 and seen.index("f") <= seen.index("e") + 2, seen


async def test_a_replay_held_back_for_an_event_is_woken_when_the_event_goes():
    # Three events hold three of four places while the replay runs one; when they end at once
    # the replay must take the places the next event leaves free (it slept with two free).
    release = asyncio.Event()

    class Source(ScriptedSource):
        async def watch(self, resource_version: str):
            self.calls.append(("watch", resource_version))
            for name in ("e1", "e2", "e3"):
                yield "ADDED", obj(name, "2")
            await asyncio.sleep(0.01)
            yield "ADDED", obj("e4", "3")
            self.played.set()
            await asyncio.Event().wait()

    source = Source(lists=[([obj(f"r{i}", "1", f"T{i}") for i in range(1, 4)], "1")],
                    watches=[])
    started: list[str] = []

    async def handle(o):
        started.append(o.name)
        if o.name.startswith("e") and o.name != "e4":
            await release.wait()
        else:
            await asyncio.Event().wait()  # held: only free places let more start

    task = asyncio.create_task(follow(source, handle, concurrency=4))
    await asyncio.sleep(0.05)
    release.set()
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert {"r2", "e4"} <= set(started), started


async def test_a_deleted_one_is_forgotten_after_its_handling_in_flight():
    release = asyncio.Event()
    source = ScriptedSource(lists=[([], "1")],
                            watches=[[("ADDED", obj("x", "2")), ("DELETED", obj("x", "3"))]])
    forgotten: list[str] = []
    done: list[str] = []

    async def handle(o):
        await release.wait()
        done.append(o.name)

    task = asyncio.create_task(follow(source, handle, forget=lambda o: forgotten.append(o.name),
                                      concurrency=2))
    await source.played.wait()
    assert forgotten == []  # x's check is still running: what it remembers comes after
    release.set()
    while not forgotten:
        await asyncio.sleep(0.001)
    assert done == ["x"] and forgotten == ["x"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


MALFORMED = [  # parts of the wrong type, which KAI's CRD schema should refuse
    {"metadata": ["x"], "spec": "y", "status": 3},
    {"metadata": {"name": "bad", "namespace": NS}, "spec": {"receivedGPU": "oops"}},
    {"metadata": {"name": "bad", "namespace": NS}, "spec": [{"podName": "p"}],
     "status": "Succeeded"},
    {"metadata": {"name": "bad", "namespace": NS, "ownerReferences": {"kind": "Pod"}},
     "spec": {"receivedResourceType": "Fraction", "receivedGPU": {"count": True},
              "selectedFractionalGpuGroups": "group-a", "selectedGPUGroups": 5}},
]


@pytest.mark.parametrize("bad", MALFORMED)
async def test_a_malformed_bind_request_neither_stops_the_follower_nor_gets_signed(store, bad):
    view = BindRequestView.from_object(bad)
    assert view.gpu_count == 0 and view.group_ids == () and view.owner_uid == ""
    result = await Follower(store, signer=Keys(Keyring.of(b"k" * 32))).verify(view)
    assert result.skipped and result.signed == ()
    handled: list[str] = []

    async def handle(br: BindRequestView) -> None:
        handled.append(br.name)

    source = ScriptedSource(lists=[([], "1")],
                            watches=[[("ADDED", bad), ("ADDED", bind_request("good", "p"))]])
    await play(source, handle, until=lambda: "good" in handled)
    assert handled[-1] == "good"


async def test_a_bind_request_with_too_many_groups_is_invalid_without_a_read_for_each(store):
    store.add_pod(pod("train-0", {"gpu-fraction": "0.5", **BOUND}))
    requests = requests_of(store)
    groups = tuple(f"group-{i}" for i in range(5000))
    result = await verify(store, bind_request("br-1", "train-0", groups=groups),
                          signer=Keys(Keyring.of(b"k" * 32)))
    (too_many,) = [e for e in result.errors if e.key == "selected_fractional_gpu_groups"]
    assert too_many.rule == "must list at most 64 (got 5000)"
    assert result.signed == () and len(requests) < 10
    assert [e.reason for e in store.events] == ["NvFractionsInvalid"]


async def test_a_follower_cancelled_twice_leaves_no_handling_running():
    source = ScriptedSource(lists=[([obj("a", "1"), obj("b", "1")], "1")],
                            watches=[[("ADDED", obj("c", "2"))]])
    running, stopped = [], []

    async def handle(o):
        running.append(o.name)
        try:
            await asyncio.Event().wait()
        finally:
            stopped.append(o.name)

    task = asyncio.create_task(follow(source, handle, concurrency=3))
    await source.played.wait()
    while len(running) < 2:
        await asyncio.sleep(0.001)
    task.cancel()
    await asyncio.sleep(0)
    task.cancel()  # the Lease lost, then the process stopping
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(stopped) == sorted(running)


async def test_several_bind_requests_are_handled_at_once_each_ones_in_order():
    # A Job's pods bound at once: each check waits on the API server, so they overlap; two
    # events of one BindRequest never do, and run in the order seen. The listed ones leave a
    # place to the watch's.
    names = [f"br-{i}" for i in range(6)]
    source = ScriptedSource(lists=[([obj(n, "1") for n in names], "2")],
                            watches=[[("MODIFIED", obj("x", "3")),
                                      ("MODIFIED", obj("x", "4"))]])
    running: list[str] = []
    listed_most, most = [0], [0]
    order: list[tuple[str, str]] = []

    async def handle(o):
        name, rv = o.name, o.resource_version
        assert name not in running  # never two of one BindRequest at once
        running.append(name)
        most[0] = max(most[0], len(running))
        listed_most[0] = max(listed_most[0], sum(n != "x" for n in running))
        await asyncio.sleep(0.02)  # the API server's answers
        order.append((name, rv))
        running.remove(name)

    async def all_handled() -> None:
        while len(order) < 8:
            await asyncio.sleep(0.005)

    task = asyncio.create_task(follow(source, handle, concurrency=4))
    await asyncio.wait_for(all_handled(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert most[0] <= 4 and listed_most[0] == 3  # the listed ones leave a place to events
    assert [rv for name, rv in order if name == "x"] == ["3", "4"]
    assert sorted(name for name, _ in order) == sorted([*names, "x", "x"])


async def test_a_stopped_follower_cancels_the_handlings_in_progress():
    source = ScriptedSource(lists=[([obj("a", "1"), obj("b", "1")], "2")], watches=[])
    started: list[str] = []
    cancelled: list[str] = []

    async def handle(o):
        started.append(o.name)
        try:
            await asyncio.Event().wait()  # an API server that never answers
        except asyncio.CancelledError:
            cancelled.append(o.name)
            raise

    await play(source, handle, concurrency=8)  # the Lease lost, or the mirror stops
    assert sorted(started) == sorted(cancelled) == ["a", "b"]


def test_the_concurrency_is_at_least_one():
    with pytest.raises(ValueError, match="concurrency 0: at least 1"):
        asyncio.run(follow(ScriptedSource(lists=[], watches=[]), None, concurrency=0))


async def test_failures_back_off_and_a_bad_object_does_not_stop_the_loop():
    source = ScriptedSource(lists=[Transient("connection refused"), ([obj("x", "1")], "1")],
                            watches=[])

    async def handle(_obj):
        raise RuntimeError("boom")

    await play(source, handle)
    assert source.calls == [("list", ""), ("list", ""), ("watch", "1")]


# -- against kmock ----------------------------------------------------------------------------

async def wait_for(predicate, timeout: float = 10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError("timed out waiting")


@pytest.mark.integration
async def test_follower_reports_a_mismatch_as_a_pod_event(kube):
    honour_label_selectors(kube)
    register_bindrequests(kube)
    custom = k8s.CustomObjectsApi(kube.api_client)
    kube.core.create_node({"metadata": {"name": "gpu-node-1",
                                        "labels": {"nvidia.com/gpu.memory": "40960"}}})
    for group, gpu in (("group-a", GPU_A), ("group-b", GPU_B)):
        kube.core.create_namespaced_pod("kai-resource-reservation", reservation_pod(group, gpu))
    kube.core.create_namespaced_pod(NS, pod("good-0", {"gpu-fraction": "0.5", **BOUND}))
    kube.core.create_namespaced_pod(NS, pod("bad-0", {"gpu-fraction": "0.5", **{
        **BOUND, f"{T}.gpus.devices": GPU_B}}))
    # The first list is refused as expired: the follower lists again.
    gone = kube.fail("GET", "/apis/scheduling.run.ai/v1alpha2/bindrequests", 410, times=1)
    custom.create_namespaced_custom_object("scheduling.run.ai", "v1alpha2", NS, "bindrequests",
                                           bind_request("br-good", "good-0"))

    client = Kube(k8s.ApiClient(kube.configuration()))
    store = KubePodStore(client, backoff=Backoff(attempts=3, base=0.01, cap=0.05))
    follower = Follower(store)
    checked: list = []

    async def handle(o):
        checked.append(await follower.verify(o))

    task = asyncio.create_task(follow(
        bindrequest_source(client, watch_seconds=1, read_timeout=1.0), handle,
        backoff=Backoff(base=0.01, cap=0.05)))
    try:
        await wait_for(lambda: any(v.bind_request == "team-a/br-good" for v in checked))
        # Arrives through the watch, after the list:
        custom.create_namespaced_custom_object("scheduling.run.ai", "v1alpha2", NS,
                                               "bindrequests", bind_request("br-bad", "bad-0"))
        events = await wait_for(lambda: kube.core.list_namespaced_event(NS).items)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
    assert gone.hits == 1
    assert [(e.involved_object.name, e.type, e.reason, e.message, e.source.component)
            for e in events] == [(
        "bad-0", "Warning", "NvFractionsMismatch",
        f"annotation {T}.gpus.devices: expected '{GPU_A}', found '{GPU_B}' "
        "(BindRequest team-a/br-bad)", "kai-fractions-mirror")]
    assert events[0].involved_object.uid == kube.core.read_namespaced_pod(
        "bad-0", NS).metadata.uid
    good = [v for v in checked if v.bind_request == "team-a/br-good"]
    assert all(v.mismatches == () and v.skipped == "" for v in good)
    # The reservation lookup used a label selector the (reaction-enhanced) server honoured.
    lists = kube.requests("GET", "/api/v1/namespaces/kai-resource-reservation/pods")
    assert {(r.params.get("labelSelector"), r.params.get("resourceVersion")) for r in lists} == {
        ("runai-gpu-group=group-a", "0")}  # from the watch cache, not etcd


async def test_a_gpu_memory_pods_limit_is_still_checked_against_its_legacy_limit(store):
    # A gpu-memory pod is sized by its memory whatever the request says (KAI's webhook copies
    # gpu-memory and gpu-memory.limit into the NvFractions keys), so its request is never taken
    # for "the pod's own" beside it: a limit key that differs from gpu-memory.limit is a
    # mismatch, as before cabdc3a (second review).
    store.add_pod(pod("train-0", {"gpu-memory": "10240", "gpu-memory.limit": "20Gi",
                                  f"{T}.gpu-memory.limit": "40Gi", **BOUND,
                                  f"{T}.gpu-memory.request": "10Gi"}))
    result = await verify(store, bind_request("br-1", "train-0", portion="0.26"))
    assert [(m.key, m.expected, m.actual) for m in result.mismatches] == [
        (f"{T}.gpu-memory.limit", "20Gi", "40Gi")]
