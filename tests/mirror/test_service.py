"""MirrorService over the in-memory FakePodStore: what is written, when, and when not."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace

import pytest

from kai_fractions.contract import Dialect
from kai_fractions.kube.retry import Backoff
from kai_fractions.mirror.decision import AllocationInput
from kai_fractions.mirror.errors import (
    AllocationConflict,
    ApiRejected,
    ApiUnavailable,
    InvalidAllocation,
    PodNotFound,
    PodReplaced,
)
from kai_fractions.mirror.node_labels import NODE_LABELS_RETRY, NODE_LABELS_TTL
from kai_fractions.mirror.record import (
    MIRRORED_ANNOTATION,
    ReleasedRecord,
    allocation_digest,
    decode_record,
)
from kai_fractions.mirror.service import MirrorService
from kai_fractions.mirror.signing import signing_annotations
from kai_fractions.mirror.store import NodeLabels, WriteConflict
from kai_fractions.signing import Keyring, KeyringSource
from tests.support.clock import FakeClock
from tests.support.fake_store import FakePodStore

UID = "11111111-2222-3333-4444-555555555555"
NS, POD = "team-a", "train-0"
GPU_A, GPU_B = "GPU-1111aaaa", "GPU-2222bbbb"

SINGLE = {
    "kai-fractions.io/container.trainer.memory-limit-mib": "20480",
    "kai-fractions.io/container.trainer.memory-request-mib": "20480",
    "kai-fractions.io/container.trainer.mps-pinned-mem-limit": "0=20480M",
    "kai-fractions.io/container.trainer.plan-digest":
        "sha256:f56eea6c50b0a08e07c4176f5a1b87c4f99da02d2ef78c5ba81ca5b27ef1e1ea",
    "nvidia.com/container.trainer.gpu-memory.request": "20Gi",
    "nvidia.com/container.trainer.gpus.devices": "GPU-1111aaaa",
    "received-resource-type": "Fraction",
}
"""What the mirror writes for `allocation()` as upstream KAI main would: canonical quantities,
no compute portion."""
SINGLE_PATCHED = {**SINGLE, "nvidia.com/container.trainer.gpu-compute.portion": "0.5"}
"""The same in the patched dialect: its compute portion too (the plan is the same)."""


def pod(annotations: dict[str, str], *, name: str = POD, uid: str = UID,
        containers: tuple[str, ...] = ("trainer",)) -> dict:
    return {"metadata": {"name": name, "namespace": NS, "uid": uid,
                         "annotations": dict(annotations)},
            "spec": {"containers": [{"name": c} for c in containers]}}


def allocation(**changes) -> AllocationInput:
    base = AllocationInput(
        namespace=NS, pod_name=POD, pod_uid=UID, selected_node="node-1",
        resource_type="Fraction", gpu_count=1, portion="0.5", group_ids=("g-1",),
        group_modes=("time-slicing",), gpu_ids=(GPU_A,), node_gpu_memory_mib=40960)
    return replace(base, **changes)


@pytest.fixture
def store() -> FakePodStore:
    return FakePodStore(nodes={"node-1": {}})  # the node every allocation here names


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def service(store: FakePodStore, clock: FakeClock) -> MirrorService:
    return MirrorService(store, clock=clock)


@pytest.fixture
def patched(store: FakePodStore, clock: FakeClock) -> MirrorService:
    return MirrorService(store, clock=clock, dialect=Dialect.PATCHED)


def record_of(store: FakePodStore) -> dict:
    return json.loads(store.annotations(NS, POD)[MIRRORED_ANNOTATION])


async def test_mirror_writes_binder_and_derived_keys_and_the_record_in_one_patch(store, service):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    result = await service.mirror(allocation(), idempotency_key="bind-1")
    assert result.changed is True
    assert dict(result.annotations) == SINGLE
    assert len(store.patches) == 1
    assert store.annotations(NS, POD) == {"gpu-fraction": "0.5", **SINGLE,
                                          MIRRORED_ANNOTATION: store.patches[0][2][
                                              MIRRORED_ANNOTATION]}
    assert record_of(store) == {
        "v": 1, "uid": UID, "container": "trainer", "keys": sorted(SINGLE),
        "digest": allocation_digest(SINGLE), "idempotencyKey": "bind-1"}
    assert [p.container for p in result.plans] == ["trainer"]


async def test_the_patched_dialect_also_writes_the_compute_portion(store, patched):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    result = await patched.mirror(allocation(), idempotency_key="bind-1")
    assert dict(result.annotations) == SINGLE_PATCHED
    assert record_of(store)["keys"] == sorted(SINGLE_PATCHED)
    assert [p.container for p in result.plans] == ["trainer"]


async def test_identical_repeat_and_same_key_write_nothing(store, service):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    first = await service.mirror(allocation(), idempotency_key="bind-1")
    again = await service.mirror(allocation(), idempotency_key="bind-1")
    no_key = await service.mirror(allocation())
    assert (again.changed, no_key.changed) == (False, False)
    assert again.annotations == first.annotations == no_key.annotations
    assert len(store.patches) == 1
    # A new key for the same decision writes the record alone (changed: false), once.
    other_key = await service.mirror(allocation(), idempotency_key="bind-2")
    assert other_key.changed is False and other_key.annotations == first.annotations
    assert len(store.patches) == 2 and list(store.patches[1][2]) == [MIRRORED_ANNOTATION]
    assert (await service.mirror(allocation(), idempotency_key="bind-2")).changed is False
    assert len(store.patches) == 2
    assert record_of(store)["idempotencyKey"] == "bind-1"  # the first caller's key stays
    assert record_of(store)["aliasKeys"] == ["bind-2"]


async def test_a_different_decision_is_refused_without_replace(store, service):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    await service.mirror(allocation(), idempotency_key="bind-1")
    with pytest.raises(AllocationConflict) as e:
        await service.mirror(allocation(portion="0.25", gpu_ids=(GPU_B,)), idempotency_key="bind-2")
    assert e.value.kind == "ALLOCATION_CONFLICT"
    assert str(e.value).startswith("pod team-a/train-0 already carries a different mirrored "
                                   "allocation (container trainer, sha256:")
    assert str(e.value).endswith("set replace to rebind it, or release it first")
    assert len(store.patches) == 1


async def test_a_pod_being_deleted_or_bound_elsewhere_gets_no_allocation(store, service):
    """From the gRPC review: both were written (OK, changed), the node's agent then refusing
    the devices of another node, or a dying pod carrying a fresh allocation."""
    deleting = pod({"gpu-fraction": "0.5"})
    deleting["metadata"]["deletionTimestamp"] = "2026-12-06T12:00:00Z"
    store.add_pod(deleting)
    with pytest.raises(AllocationConflict) as e:
        await service.mirror(allocation())
    assert (e.value.kind, str(e.value)) == (
        "POD_DELETING", "pod team-a/train-0 is being deleted: no allocation is written onto it")
    elsewhere = pod({"gpu-fraction": "0.5"}, name="train-1")
    elsewhere["spec"]["nodeName"] = "node-2"
    store.add_pod(elsewhere)
    with pytest.raises(AllocationConflict) as e:
        await service.mirror(allocation(pod_name="train-1"))
    assert (e.value.kind, str(e.value)) == ("POD_ON_ANOTHER_NODE", (
        "pod team-a/train-1 is bound to node node-2, not to node-1, the allocation's: its GPUs "
        "are not there"))
    assert store.patches == []
    here = pod({"gpu-fraction": "0.5"}, name="train-2")
    here["spec"]["nodeName"] = "node-1"  # bound to the allocation's node: fine
    store.add_pod(here)
    assert (await service.mirror(allocation(pod_name="train-2"))).changed


async def test_reusing_an_idempotency_key_for_another_decision_is_refused_even_with_replace(
        store, service):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    await service.mirror(allocation(), idempotency_key="bind-1")
    with pytest.raises(AllocationConflict) as e:
        await service.mirror(allocation(portion="0.25"), idempotency_key="bind-1", replace=True)
    assert e.value.kind == "IDEMPOTENCY_KEY_REUSED"
    assert len(store.patches) == 1


async def test_a_late_retry_of_a_replaced_decision_is_refused(store, service):
    """bind-1 timed out at its caller, who decided again (bind-2, a replace); bind-1's retry
    arriving after that must not put the superseded decision back on the pod, where the
    scheduler no longer accounts it."""
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    await service.mirror(allocation(), idempotency_key="bind-1")
    second = allocation(gpu_ids=(GPU_B,))
    await service.mirror(second, idempotency_key="bind-2", replace=True)
    with pytest.raises(AllocationConflict) as e:
        await service.mirror(allocation(), idempotency_key="bind-1", replace=True)
    assert e.value.kind == "IDEMPOTENCY_KEY_SUPERSEDED"
    assert "(key bind-2)" in str(e.value)
    assert store.annotations(NS, POD)["nvidia.com/container.trainer.gpus.devices"] == GPU_B
    assert len(store.patches) == 2
    # bind-2's own retry still writes nothing and answers OK; a new decision still replaces
    assert not (await service.mirror(second, idempotency_key="bind-2", replace=True)).changed
    assert (await service.mirror(allocation(), idempotency_key="bind-3", replace=True)).changed
    assert record_of(store)["spentKeys"] == ["bind-1", "bind-2"]


async def test_a_late_retry_of_a_second_key_for_a_replaced_decision_is_refused(
        store, service):
    """From review: bind-2 repeated bind-1's decision under a new key and was answered OK;
    after a rebind (bind-3), bind-2's late retry wrote the superseded GPU back, as only
    bind-1 had become spent. Every key answered OK for an allocation is spent with it."""
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    await service.mirror(allocation(), idempotency_key="bind-1")
    assert not (await service.mirror(allocation(), idempotency_key="bind-2",
                                     replace=True)).changed
    with pytest.raises(AllocationConflict) as e:  # bind-2 is this allocation's key now
        await service.mirror(allocation(portion="0.25"), idempotency_key="bind-2", replace=True)
    assert e.value.kind == "IDEMPOTENCY_KEY_REUSED"
    await service.mirror(allocation(gpu_ids=(GPU_B,)), idempotency_key="bind-3", replace=True)
    assert record_of(store)["spentKeys"] == ["bind-1", "bind-2"]
    assert "aliasKeys" not in record_of(store)
    written = len(store.patches)
    with pytest.raises(AllocationConflict) as e:
        await service.mirror(allocation(), idempotency_key="bind-2", replace=True)
    assert e.value.kind == "IDEMPOTENCY_KEY_SUPERSEDED"
    assert "(key bind-3)" in str(e.value)
    assert store.annotations(NS, POD)[DEVICES] == GPU_B
    assert len(store.patches) == written


async def test_a_late_retry_of_a_second_key_for_a_released_decision_is_refused(
        store, service):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    await service.mirror(allocation(), idempotency_key="bind-1")
    await service.mirror(allocation(), idempotency_key="bind-2")
    await service.release(NS, POD, idempotency_key="rollback-1")
    assert record_of(store)["spentKeys"] == ["bind-1", "bind-2"]
    with pytest.raises(AllocationConflict) as e:
        await service.mirror(allocation(), idempotency_key="bind-2", replace=True)
    assert e.value.kind == "IDEMPOTENCY_KEY_SUPERSEDED"
    assert set(store.annotations(NS, POD)) == {"gpu-fraction", MIRRORED_ANNOTATION}


SIGNATURE = "kai-fractions.io/container.trainer.signature"


def signing(store: FakePodStore, clock: FakeClock) -> MirrorService:
    """The mirror restarted with --signing-key-file: its hook adds a signature per plan."""
    keyring = KeyringSource.fixed(Keyring.of(bytes(range(32))))
    return MirrorService(store, clock=clock, extra_annotations=signing_annotations(keyring))


async def test_turning_signing_on_keeps_the_records_keys_and_a_late_retry_is_refused(
        store, service, clock):
    """From review: after a restart with signing on, a repeat of the same decision (same
    digest: signatures are not the allocation) wrote a fresh record holding only its own key,
    so bind-2, answered OK for that allocation, put it back after the rebind."""
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    await service.mirror(allocation(), idempotency_key="bind-1")
    await service.mirror(allocation(), idempotency_key="bind-2")
    signed = signing(store, clock)
    repeat = await signed.mirror(allocation(), idempotency_key="bind-3")
    assert repeat.changed is True  # the signature is written
    record = record_of(store)
    assert (record["idempotencyKey"], record["aliasKeys"]) == ("bind-1", ["bind-2", "bind-3"])
    assert record["keys"] == sorted([*SINGLE, SIGNATURE])
    assert record["digest"] == allocation_digest(SINGLE)
    await signed.mirror(allocation(gpu_ids=(GPU_B,)), idempotency_key="bind-4", replace=True)
    assert record_of(store)["spentKeys"] == ["bind-1", "bind-2", "bind-3"]
    written = len(store.patches)
    with pytest.raises(AllocationConflict) as e:
        await signed.mirror(allocation(), idempotency_key="bind-2", replace=True)
    assert e.value.kind == "IDEMPOTENCY_KEY_SUPERSEDED"
    assert store.annotations(NS, POD)[DEVICES] == GPU_B
    assert len(store.patches) == written


async def test_turning_signing_off_keeps_the_records_keys(store, service, clock):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    signed = signing(store, clock)
    await signed.mirror(allocation(), idempotency_key="bind-1")
    await signed.mirror(allocation(), idempotency_key="bind-2")
    assert SIGNATURE in store.annotations(NS, POD)
    repeat = await service.mirror(allocation(), idempotency_key="bind-1")  # signing off
    assert repeat.changed is True  # the signature the mirror wrote is removed
    assert SIGNATURE not in store.annotations(NS, POD)
    record = record_of(store)
    assert (record["idempotencyKey"], record["aliasKeys"]) == ("bind-1", ["bind-2"])
    assert record["keys"] == sorted(SINGLE)
    written = len(store.patches)
    assert not (await service.mirror(allocation(), idempotency_key="bind-2")).changed
    assert len(store.patches) == written  # nothing left to write
    await service.release(NS, POD, idempotency_key="rollback-1")
    assert record_of(store)["spentKeys"] == ["bind-1", "bind-2"]


async def test_a_record_keeps_the_latest_repeating_keys_only(store, service):
    """The keys of repeats are bounded as spent keys are: the record stays small."""
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    for i in range(12):
        await service.mirror(allocation(), idempotency_key=f"bind-{i}")
    assert record_of(store)["idempotencyKey"] == "bind-0"
    assert record_of(store)["aliasKeys"] == [f"bind-{i}" for i in range(4, 12)]
    await service.mirror(allocation(gpu_ids=(GPU_B,)), idempotency_key="bind-12", replace=True)
    assert record_of(store)["spentKeys"] == [f"bind-{i}" for i in range(4, 12)]


async def test_a_record_keeps_the_latest_spent_keys_only(store, service):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    gpus = (GPU_A, GPU_B)
    for i in range(12):
        await service.mirror(allocation(gpu_ids=(gpus[i % 2],)), idempotency_key=f"bind-{i}",
                             replace=True)
    assert record_of(store)["spentKeys"] == [f"bind-{i}" for i in range(3, 11)]
    assert record_of(store)["idempotencyKey"] == "bind-11"


async def test_replace_recomputes_the_request_the_mirror_wrote(store, service):
    """The subtle case: after the first mirror the pod carries a request the MIRROR wrote. A
    rebind to another portion must recompute it, not keep it as if the user had set it."""
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    await service.mirror(allocation())
    result = await service.mirror(allocation(portion="0.25", gpu_ids=(GPU_B,)), replace=True)
    assert result.changed
    now = store.annotations(NS, POD)
    assert now["nvidia.com/container.trainer.gpu-memory.request"] == "10Gi"
    assert "nvidia.com/container.trainer.gpu-compute.portion" not in now
    assert now["nvidia.com/container.trainer.gpus.devices"] == GPU_B
    assert now["kai-fractions.io/container.trainer.memory-limit-mib"] == "10240"
    assert len(store.patches) == 2


async def test_replace_recomputes_the_compute_portion_of_the_patched_dialect(store, patched):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    await patched.mirror(allocation())
    assert store.annotations(NS, POD)["nvidia.com/container.trainer.gpu-compute.portion"] == \
        "0.5"
    result = await patched.mirror(allocation(portion="0.25", gpu_ids=(GPU_B,)), replace=True)
    assert result.changed
    now = store.annotations(NS, POD)
    assert now["nvidia.com/container.trainer.gpu-memory.request"] == "10Gi"
    assert now["nvidia.com/container.trainer.gpu-compute.portion"] == "0.25"
    assert now["nvidia.com/container.trainer.gpus.devices"] == GPU_B
    assert len(store.patches) == 2


async def test_replace_to_time_slicing_removes_the_sm_sharing_keys(store, service):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    # The pod's mode is the user's; here the user switches it between two binds.
    store.pods[(NS, POD)]["metadata"]["annotations"][
        "nvidia.com/container.trainer.gpu-compute.mode"] = "sm-sharing"
    await service.mirror(allocation(group_modes=("sm-sharing",)))
    assert "kai-fractions.io/container.trainer.mps-active-thread-percentage" in \
        store.annotations(NS, POD)
    del store.pods[(NS, POD)]["metadata"]["annotations"][
        "nvidia.com/container.trainer.gpu-compute.mode"]
    await service.mirror(allocation(), replace=True)
    last = store.patches[-1][2]
    assert last["kai-fractions.io/container.trainer.mps-active-thread-percentage"] is None
    assert last["kai-fractions.io/container.trainer.mps-pipe-directory"] is None
    assert {k: v for k, v in store.annotations(NS, POD).items()
            if k != MIRRORED_ANNOTATION} == {"gpu-fraction": "0.5", **SINGLE}


async def test_user_request_and_limit_are_never_overwritten(store, service):
    user = {"nvidia.com/container.trainer.gpu-memory.request": "8Gi",
            "nvidia.com/container.trainer.gpu-memory.limit": "12Gi"}
    store.add_pod(pod(user))
    result = await service.mirror(allocation(portion="0.25"))
    assert "nvidia.com/container.trainer.gpu-memory.request" not in result.annotations
    assert "nvidia.com/container.trainer.gpu-memory.limit" not in result.annotations
    now = store.annotations(NS, POD)
    assert {k: now[k] for k in user} == user
    assert now["kai-fractions.io/container.trainer.memory-request-mib"] == "8192"
    assert now["kai-fractions.io/container.trainer.memory-limit-mib"] == "12288"
    # ...and a release leaves them too
    await service.release(NS, POD)
    assert store.annotations(NS, POD) == user


@pytest.mark.parametrize(("dialect", "written"), [(Dialect.UPSTREAM, SINGLE),
                                                   (Dialect.PATCHED, SINGLE_PATCHED)])
async def test_binder_owned_keys_are_always_rewritten(store, clock, dialect, written):
    # A stale compute portion is binder-owned too: the upstream dialect removes it.
    service = MirrorService(store, clock=clock, dialect=dialect)
    store.add_pod(pod({"gpu-fraction": "0.5",
                       "nvidia.com/container.trainer.gpus.devices": "GPU-9999ffff",
                       "nvidia.com/container.trainer.gpu-compute.portion": "1",
                       "kai-fractions.io/container.trainer.memory-limit-mib": "999999"}))
    await service.mirror(allocation())
    now = store.annotations(NS, POD)
    assert {k: v for k, v in now.items() if k != MIRRORED_ANNOTATION} == {
        "gpu-fraction": "0.5", **written}


async def test_release_removes_what_the_mirror_wrote_and_is_idempotent(store, service):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    await service.mirror(allocation())
    first = await service.release(NS, POD)
    assert first.changed
    assert first.removed_keys == tuple(sorted([*SINGLE, MIRRORED_ANNOTATION]))
    assert store.annotations(NS, POD) == {"gpu-fraction": "0.5"}
    second = await service.release(NS, POD)
    assert (second.changed, second.removed_keys) == (False, ())
    assert len(store.patches) == 2


async def test_a_late_retry_of_a_release_does_not_strip_a_newer_allocation(store, service):
    """rollback-1 timed out at the binder, which decided again (bind-2); rollback-1's retry
    arriving after that must not strip bind-2, which the scheduler accounts. Its retry before
    any newer call is a no-op."""
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    await service.mirror(allocation(), idempotency_key="bind-1")
    first = await service.release(NS, POD, idempotency_key="rollback-1")
    assert first.changed and first.removed_keys == tuple(sorted(SINGLE))
    assert record_of(store) == {"v": 1, "released": True, "uid": UID,
                                "idempotencyKey": "rollback-1", "spentKeys": ["bind-1"]}
    assert decode_record(store.annotations(NS, POD)[MIRRORED_ANNOTATION]) is None  # no keys
    again = await service.release(NS, POD, idempotency_key="rollback-1")
    assert (again.changed, again.removed_keys) == (False, ())
    assert len(store.patches) == 2
    # A new decision needs no `replace`: the pod carries no allocation.
    second = allocation(gpu_ids=(GPU_B,))
    assert (await service.mirror(second, idempotency_key="bind-2")).changed
    assert record_of(store)["spentKeys"] == ["bind-1", "rollback-1"]
    with pytest.raises(AllocationConflict) as e:
        await service.release(NS, POD, idempotency_key="rollback-1")
    assert e.value.kind == "IDEMPOTENCY_KEY_SUPERSEDED"
    assert "'rollback-1'" in str(e.value) and "(key bind-2)" in str(e.value)
    assert store.annotations(NS, POD)[DEVICES] == GPU_B
    assert len(store.patches) == 3
    # bind-2's own rollback still releases it
    assert (await service.release(NS, POD, idempotency_key="rollback-2")).changed
    assert record_of(store)["spentKeys"] == ["bind-1", "rollback-1", "bind-2"]


SIGNATURE = "kai-fractions.io/container.trainer.signature"


async def test_a_retry_of_a_release_leaves_what_the_binder_wrote_since(store, service):
    """rollback-1 landed but its answer was lost; meanwhile an unmodified KAI binder bound the
    pod again on its own (its keys written by itself, signed by the follower) under the record
    rollback-1 left. rollback-1's retry stripped that allocation, which the scheduler
    accounts; it is a no-op, as promised: changed false, nothing removed, nothing written."""
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    await service.mirror(allocation(), idempotency_key="bind-1")
    assert (await service.release(NS, POD, UID, idempotency_key="rollback-1")).changed
    left = store.annotations(NS, POD)[MIRRORED_ANNOTATION]
    rebound = {"nvidia.com/container.trainer.gpu-memory.request": "20Gi", DEVICES: GPU_B,
               "received-resource-type": "Fraction", SIGNATURE: "v1.sig"}
    await store.patch_annotations(NS, POD, rebound, uid=UID, resource_version="")
    writes = len(store.patches)
    again = await service.release(NS, POD, UID, idempotency_key="rollback-1")
    assert (again.changed, again.removed_keys) == (False, ())
    assert len(store.patches) == writes
    assert store.annotations(NS, POD) == {"gpu-fraction": "0.5", MIRRORED_ANNOTATION: left,
                                          **rebound}
    # A release of its own (a new key) removes the binder's keys (the memory request, which
    # a user may write too, stays as any release of a binder's own bind leaves it).
    rollback = await service.release(NS, POD, UID, idempotency_key="rollback-2")
    assert rollback.removed_keys == (SIGNATURE, DEVICES, "received-resource-type")
    assert record_of(store)["spentKeys"] == ["bind-1", "rollback-1"]


async def _bound_then_a_webhook_keeps_the_devices(clock) -> tuple[MutatingStore, MirrorService]:
    """A pod the mirror bound (key bind-1), then a mutating webhook that puts its devices
    back into every write that removes them."""
    store = MutatingStore(nodes={"node-1": {}})
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    service = MirrorService(store, clock=clock)
    await service.mirror(allocation(), idempotency_key="bind-1")
    store.webhook = lambda changes: {DEVICES: GPU_A} if DEVICES in changes else {}
    return store, service


async def test_a_keyed_release_a_webhook_undid_is_reported_once_and_not_redone(clock):
    """The release's own write came back with a key a webhook put back: that call fails
    INTERNAL naming it. Its retry cannot tell that key from one written since (a rebind), so
    it is a no-op; a release with a new key, once the webhook is fixed, removes it."""
    store, service = await _bound_then_a_webhook_keeps_the_devices(clock)
    with pytest.raises(ApiRejected, match=f"{DEVICES} is '{GPU_A}', not absent"):
        await service.release(NS, POD, UID, idempotency_key="rollback-1")
    writes = len(store.patches)
    again = await service.release(NS, POD, UID, idempotency_key="rollback-1")
    assert (again.changed, again.removed_keys, len(store.patches)) == (False, (), writes)
    assert store.annotations(NS, POD)[DEVICES] == GPU_A
    store.webhook = MutatingStore.webhook
    assert (await service.release(NS, POD, UID, idempotency_key="rollback-2")
            ).removed_keys == (DEVICES,)


async def test_a_late_retry_of_a_released_decision_is_refused(store, service):
    """bind-1's retry after its rollback would put back a decision the scheduler dropped."""
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    await service.mirror(allocation(), idempotency_key="bind-1")
    await service.release(NS, POD, idempotency_key="rollback-1")
    for key, kind in (("bind-1", "IDEMPOTENCY_KEY_SUPERSEDED"),
                      ("rollback-1", "IDEMPOTENCY_KEY_REUSED")):
        with pytest.raises(AllocationConflict) as e:
            await service.mirror(allocation(), idempotency_key=key, replace=True)
        assert e.value.kind == kind
    assert set(store.annotations(NS, POD)) == {"gpu-fraction", MIRRORED_ANNOTATION}
    assert len(store.patches) == 2


async def test_a_release_that_finds_nothing_still_remembers_its_key(store, service):
    """The binder rolls back a bind whose mirror call never wrote: nothing to remove, but the
    release's late retry must still not strip the allocation of the binder's next try."""
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    nothing = await service.release(NS, POD, idempotency_key="rollback-0")
    assert (nothing.changed, nothing.removed_keys) == (False, ())
    assert record_of(store)["idempotencyKey"] == "rollback-0"
    assert (await service.release(NS, POD, idempotency_key="rollback-0")).changed is False
    assert (await service.release(NS, POD)).changed is False  # without a key: nothing new
    assert len(store.patches) == 1
    await service.mirror(allocation(), idempotency_key="bind-1")
    with pytest.raises(AllocationConflict, match="later call came after"):
        await service.release(NS, POD, idempotency_key="rollback-0")
    assert DEVICES in store.annotations(NS, POD)


async def test_what_a_release_left_on_a_recreated_pod_is_ignored(store, service):
    left = ReleasedRecord("00000000-0000-4000-8000-000000000000", "rollback-1", ("bind-1",))
    store.add_pod(pod({"gpu-fraction": "0.5", MIRRORED_ANNOTATION: left.encode()}))
    assert (await service.mirror(allocation(), idempotency_key="bind-1")).changed
    assert "spentKeys" not in record_of(store)
    assert (await service.release(NS, POD, idempotency_key="rollback-1")).changed


DEVICES = "nvidia.com/container.trainer.gpus.devices"


class MutatingStore(FakePodStore):
    """An API server with a mutating admission webhook on pod UPDATE (as a Kyverno or
    Gatekeeper mutation policy can be): `webhook(changes)` says what it changes in a write."""

    webhook = staticmethod(lambda changes: {})

    async def patch_annotations(self, namespace, name, changes, **kwargs):
        written = await super().patch_annotations(namespace, name, changes, **kwargs)
        mutated = self.webhook(changes)
        if not mutated:
            return written
        return await super().patch_annotations(namespace, name, mutated, uid="",
                                               resource_version="")


@pytest.mark.parametrize("dropped", [DEVICES, MIRRORED_ANNOTATION])
async def test_a_write_the_api_server_stored_otherwise_is_not_a_success(clock, dropped):
    """The answer to the PATCH is what etcd holds: a pod without its devices (or without the
    record) would wait in its gate while the scheduler was told the allocation is there."""
    store = MutatingStore(nodes={"node-1": {}})
    store.webhook = lambda changes: {dropped: None} if dropped in changes else {}
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    with pytest.raises(ApiRejected) as info:
        await MirrorService(store, clock=clock).mirror(allocation(), idempotency_key="bind-1")
    assert f"{dropped} is absent, not " in str(info.value)
    assert "mutating admission webhook" in str(info.value)
    assert dropped not in store.annotations(NS, POD)


async def test_a_release_the_api_server_stored_otherwise_is_not_a_success(clock):
    store, service = await _bound_then_a_webhook_keeps_the_devices(clock)
    with pytest.raises(ApiRejected, match=f"{DEVICES} is '{GPU_A}', not absent"):
        await service.release(NS, POD, UID)
    # The record went with that patch (what the release leaves took its place); a retry
    # still finds the key, and still says so.
    assert json.loads(store.annotations(NS, POD)[MIRRORED_ANNOTATION])["released"] is True
    with pytest.raises(ApiRejected, match=f"{DEVICES} is '{GPU_A}', not absent"):
        await service.release(NS, POD, UID)
    store.webhook = MutatingStore.webhook  # the webhook fixed: the retry removes it
    assert (await service.release(NS, POD, UID)).removed_keys == (DEVICES,)
    assert set(store.annotations(NS, POD)) == {"gpu-fraction", MIRRORED_ANNOTATION}


async def test_a_rewrite_is_said_with_its_values_cut(clock):
    """The message goes into a gRPC status (16 KiB of metadata at most): a webhook rewriting
    64 long device ids must not turn INTERNAL into RESOURCE_EXHAUSTED."""
    store = MutatingStore(nodes={"node-1": {}})
    store.webhook = lambda changes: {DEVICES: "X" * 9000, MIRRORED_ANNOTATION: None} \
        if DEVICES in changes else {}
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    with pytest.raises(ApiRejected) as info:
        await MirrorService(store, clock=clock).mirror(allocation())
    assert len(str(info.value)) < 1000
    assert "(9000 characters)" in str(info.value)


async def test_preview_writes_nothing(store, service):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    result = await service.preview(allocation())
    assert dict(result.annotations) == SINGLE
    assert store.patches == []


async def test_preview_checks_a_conflict_when_asked(store, service):
    """A preview of another decision for a pod that carries one answers what a rebind would
    write; asked to check the conflict, it answers the refusal MirrorAllocation would give."""
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    await service.mirror(allocation(), idempotency_key="bind-1")
    other = allocation(gpu_ids=(GPU_B,))
    rebind = await service.preview(other)
    assert rebind.annotations["nvidia.com/container.trainer.gpus.devices"] == GPU_B
    with pytest.raises(AllocationConflict) as preview:
        await service.preview(other, check_conflict=True)
    with pytest.raises(AllocationConflict) as mirror:
        await service.mirror(other, idempotency_key="bind-2")
    assert (preview.value.kind, str(preview.value)) == (mirror.value.kind, str(mirror.value))
    same = await service.preview(allocation(), check_conflict=True)
    assert same.annotations == (await service.mirror(allocation())).annotations
    assert len(store.patches) == 1


async def test_a_recreated_pod_is_refused(store, service):
    store.add_pod(pod({"gpu-fraction": "0.5"}, uid="99999999-0000-0000-0000-000000000000"))
    with pytest.raises(PodReplaced) as e:
        await service.mirror(allocation())
    assert str(e.value) == (
        f"pod team-a/train-0 has uid 99999999-0000-0000-0000-000000000000, not {UID}: the pod "
        "the decision was made for was deleted and recreated; nothing was written")
    assert store.patches == []


def recreate_on_patch(store: FakePodStore) -> None:
    def recreate(operation, namespace, name):
        if operation == "patch":
            store.faults.clear()
            store.delete_pod(namespace, name)
            store.add_pod(pod({"gpu-fraction": "0.5"}, uid="other-uid"))

    store.faults.append(recreate)


async def test_a_pod_recreated_between_read_and_write_is_refused_to_its_uids_caller(
        store, service):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    recreate_on_patch(store)
    with pytest.raises(PodReplaced):
        await service.mirror(allocation())
    assert MIRRORED_ANNOTATION not in store.annotations(NS, POD)


async def test_a_pod_recreated_between_read_and_write_is_written_for_a_caller_naming_none(
        store, service):
    """A caller that names no uid (KAI's BindRequest) means the pod of that name, as the
    first read does: the recreated pod is read and written, not refused as replaced."""
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    recreate_on_patch(store)
    result = await service.mirror(allocation(pod_uid=""))
    assert result.changed and MIRRORED_ANNOTATION in store.annotations(NS, POD)
    assert store.pods[(NS, POD)]["metadata"]["uid"] == "other-uid"


async def test_a_write_conflict_rereads_and_retries(store, service, clock):
    store.add_pod(pod({"gpu-fraction": "0.5"}))

    def conflict_once(operation, namespace, name):
        if operation == "patch":
            store.faults.clear()
            raise WriteConflict("the object has been modified")

    store.faults.append(conflict_once)
    result = await service.mirror(allocation())
    assert result.changed
    assert len(clock.sleeps) == 1
    assert MIRRORED_ANNOTATION in store.annotations(NS, POD)


async def test_the_result_is_what_the_write_that_succeeded_put_on_the_pod(store, service):
    store.add_pod(pod({"gpu-fraction": "0.5"}))

    def conflict_once(operation, namespace, name):
        if operation == "patch":
            store.faults.clear()
            raise WriteConflict("the object has been modified")

    store.faults.append(conflict_once)
    result = await service.mirror(allocation())
    written = await service.store.get_pod(NS, POD)
    assert (result.changed, result.resource_version) == (True, written.resource_version)
    assert dict(result.annotations) == SINGLE
    assert [p.container for p in result.plans] == ["trainer"]
    again = await service.mirror(allocation())
    assert (again.changed, again.resource_version) == (False, written.resource_version)
    assert (again.annotations, again.plans) == (result.annotations, result.plans)


async def test_a_write_is_logged_once_the_caller_has_its_answer(store, service, caplog):
    caplog.set_level(logging.INFO, logger="kai_fractions.mirror.service")
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    await service.mirror(allocation())
    assert "wrote" not in caplog.text  # queued behind the answer
    await asyncio.sleep(0)
    assert "pod team-a/train-0: wrote 8 annotation change(s) for container trainer" \
        in caplog.text


async def test_endless_conflicts_end_as_unavailable(store, clock):
    service = MirrorService(store, clock=clock,
                            conflict_backoff=Backoff(attempts=3))
    store.add_pod(pod({"gpu-fraction": "0.5"}))

    def always(operation, namespace, name):
        if operation == "patch":
            raise WriteConflict("the object has been modified")

    store.faults.append(always)
    with pytest.raises(ApiUnavailable, match=r"kept changing under the write \(3 conflicts\)"):
        await service.mirror(allocation())
    assert len(clock.sleeps) == 2


async def test_missing_pod_is_not_found(store, service):
    with pytest.raises(PodNotFound, match=r"^pod team-a/train-0 not found$"):
        await service.mirror(allocation())
    with pytest.raises(PodNotFound):
        await service.release(NS, POD)


async def test_unknown_container_is_a_request_error(store, service):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    with pytest.raises(InvalidAllocation) as e:
        await service.mirror(allocation(container="worker"))
    assert [(x.key, x.rule) for x in e.value.errors] == [(
        "container_name", "names container 'worker', which is not in pod team-a/train-0 "
        "(containers: trainer)")]
    assert store.patches == []


async def test_container_other_than_the_fractional_one_is_refused(store, service):
    store.add_pod(pod({"gpu-fraction": "0.5", "gpu-fraction-container-name": "trainer"},
                      containers=("sidecar", "trainer")))
    with pytest.raises(InvalidAllocation) as e:
        await service.mirror(allocation(container="sidecar"))
    assert [x.key for x in e.value.errors] == ["container_name"]


async def test_broken_pod_annotations_are_reported_by_key(store, service):
    store.add_pod(pod({"nvidia.com/container.trainer.gpu-memory.request": "-1"}))
    with pytest.raises(InvalidAllocation) as e:
        await service.mirror(allocation())
    assert [x.key for x in e.value.errors] == [
        "nvidia.com/container.trainer.gpu-memory.request"]


@pytest.mark.parametrize(("label", "written"), [("16384", "8Gi"), ("16384.0", "8Gi"),
                                               ("16000", "8000Mi"), ("16001.9", "8000Mi")])
async def test_node_memory_comes_from_the_node_label_when_zero(store, service, label, written):
    # The label is read as a number, as KAI reads it; float64 product, truncated.
    store.nodes["node-1"] = {"nvidia.com/gpu.memory": label}
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    result = await service.mirror(allocation(node_gpu_memory_mib=0))
    assert result.annotations["nvidia.com/container.trainer.gpu-memory.request"] == written


async def test_a_nodes_labels_are_read_once_per_ttl_and_a_missing_node_every_time(
        store, service, clock):
    reads = []
    store.faults.append(lambda op, ns, name: reads.append(name) if op == "node" else None)
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    await service.preview(allocation())
    await service.preview(allocation())
    assert reads == ["node-1"]  # reused: a node's GPU memory label does not change
    clock.now += 31
    await service.preview(allocation())
    assert reads == ["node-1", "node-1"]
    for _ in range(2):
        with pytest.raises(InvalidAllocation, match="names a node that does not exist"):
            await service.preview(allocation(selected_node="node-2"))
    assert reads == ["node-1", "node-1", "node-2", "node-2"]  # a missing node is not cached
    store.nodes["node-2"] = {}
    await service.preview(allocation(selected_node="node-2"))


async def test_a_node_without_its_gpu_memory_label_is_read_again_by_a_call_that_needs_it(
        store, service, clock):
    """GPU feature discovery labels a node a while after it joins: a node read before that
    must not be refused (INVALID_ARGUMENT, final to a scheduler) for a TTL once labelled."""
    reads = []
    store.faults.append(lambda op, ns, name: reads.append(name) if op == "node" else None)
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    with pytest.raises(InvalidAllocation, match=r"no nvidia\.com/gpu\.memory label"):
        await service.preview(allocation(node_gpu_memory_mib=0))
    await service.preview(allocation())  # gives its memory: the node need only exist
    assert reads == ["node-1"]
    with pytest.raises(InvalidAllocation):  # at once again: not a read per call
        await service.preview(allocation(node_gpu_memory_mib=0))
    assert reads == ["node-1"]
    store.nodes["node-1"] = {"nvidia.com/gpu.memory": "40960"}
    clock.now += NODE_LABELS_RETRY
    result = await service.mirror(allocation(node_gpu_memory_mib=0))
    assert result.annotations["nvidia.com/container.trainer.gpu-memory.request"] == "20Gi"
    await service.preview(allocation(node_gpu_memory_mib=0))  # usable now: reused
    assert reads == ["node-1", "node-1"]


async def test_a_node_recreated_under_its_name_replaces_its_entry(store, service, clock,
                                                                   caplog):
    nodes = {"node-1": NodeLabels({"nvidia.com/gpu.memory": "81920"}, uid="node-uid-1")}

    async def node_labels(node, deadline=None):
        return nodes[node]

    store.node_labels = node_labels
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    await service.preview(allocation(node_gpu_memory_mib=0))
    nodes["node-1"] = NodeLabels({"nvidia.com/gpu.memory": "40960"}, uid="node-uid-2")
    clock.now += NODE_LABELS_TTL  # what the TTL means: a recreation is seen this much later
    with caplog.at_level(logging.INFO, logger="kai_fractions.mirror.node_labels"):
        result = await service.mirror(allocation(node_gpu_memory_mib=0))
    assert result.annotations["nvidia.com/container.trainer.gpu-memory.request"] == "20Gi"
    assert "node node-1 was recreated (uid node-uid-2, was node-uid-1)" in caplog.text
    assert service._nodes.entries["node-1"].uid == "node-uid-2"


async def test_regular_bind_writes_only_the_resource_type(store, service):
    store.add_pod(pod({}))
    result = await service.mirror(allocation(resource_type="Regular", portion="", group_modes=(),
                                       gpu_ids=(), gpu_count=0))
    assert dict(result.annotations) == {"received-resource-type": "Regular"}
    assert result.plans == ()


async def test_concurrent_duplicates_cost_one_write(store, service):
    store.add_pod(pod({"gpu-fraction": "0.5"}))
    results = await asyncio.gather(*(service.mirror(allocation()) for _ in range(8)))
    assert sorted(r.changed for r in results) == [False] * 7 + [True]
    assert len(store.patches) == 1
