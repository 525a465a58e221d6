"""The mirror signs each container's allocation in the same patch, records the signature as its
own key, keeps a still-valid signature across key rotations, and the node-side check accepts
exactly what it wrote."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kai_fractions.contract import keys as k
from kai_fractions.mirror.decision import AllocationInput
from kai_fractions.mirror.errors import AllocationConflict
from kai_fractions.mirror.record import MIRRORED_ANNOTATION, allocation_digest
from kai_fractions.mirror.service import MirrorService
from kai_fractions.mirror.signing import signing_annotations
from kai_fractions.signing import Keyring, KeyringSource, Reason
from tests.support.clock import FakeClock
from tests.support.fake_store import FakePodStore

from .allocations import GPU_A, GPU_B, KEY_A, KEY_B, UID, plans_of

NS, POD = "team-a", "train-0"
SIG = "kai-fractions.io/container.trainer.signature"


class Keys:
    """A keyring the test can rotate (what a re-read Secret volume does)."""

    def __init__(self, *secrets: bytes) -> None:
        self.keyring = Keyring.of(*secrets)

    def current(self) -> Keyring:
        return self.keyring


def allocation(**changes) -> AllocationInput:
    base = AllocationInput(
        namespace=NS, pod_name=POD, pod_uid=UID, selected_node="node-1",
        resource_type="Fraction", gpu_count=1, portion="0.5", group_ids=("g-1",),
        group_modes=("time-slicing",), gpu_ids=(GPU_A,), node_gpu_memory_mib=40960)
    return replace(base, **changes)


def new_pod(store: FakePodStore, annotations: dict[str, str] | None = None) -> None:
    store.add_pod({"metadata": {"name": POD, "namespace": NS, "uid": UID,
                                "annotations": {"gpu-fraction": "0.5"} if annotations is None
                                else dict(annotations)},
                   "spec": {"containers": [{"name": "trainer"}]}})


@pytest.fixture
def store() -> FakePodStore:
    return FakePodStore(nodes={"node-1": {}})  # the node every allocation here names


@pytest.fixture
def keys() -> Keys:
    return Keys(KEY_A)


@pytest.fixture
def service(store, keys) -> MirrorService:
    return MirrorService(store, clock=FakeClock(),
                         extra_annotations=signing_annotations(keys))


def pod_object(store: FakePodStore) -> dict:
    return store.pods[(NS, POD)]


def verify(keyring: Keyring, store: FakePodStore):
    """What the node agent does: plan from the pod's annotations, check the signature."""
    obj = pod_object(store)
    (plan,) = plans_of(obj)
    return keyring.verify(plan, obj["metadata"]["annotations"].get(SIG))


async def test_the_signature_is_written_in_the_same_patch_and_recorded(store, service):
    new_pod(store)
    result = await service.mirror(allocation(), idempotency_key="bind-1")
    assert len(store.patches) == 1
    patch = store.patches[0][2]
    (plan,) = result.plans
    assert patch[SIG] == Keyring.of(KEY_A).sign(plan) == result.annotations[SIG]
    record = json.loads(store.annotations(NS, POD)[MIRRORED_ANNOTATION])
    assert SIG in record["keys"]
    unsigned = {key: value for key, value in result.annotations.items() if key != SIG}
    assert record["digest"] == allocation_digest(unsigned)  # the decision, not its signature
    assert verify(Keyring.of(KEY_A), store).ok


async def test_sm_sharing_on_two_gpus_is_signed_too(store, service):
    new_pod(store, {"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2",
                    "nvidia.com/container.trainer.gpu-compute.mode": "sm-sharing"})
    await service.mirror(allocation(gpu_count=2, gpu_ids=(GPU_A, GPU_B), group_ids=("g-1", "g-2"),
                              group_modes=("sm-sharing", "sm-sharing")))
    assert verify(Keyring.of(KEY_A), store).ok


async def test_a_repeat_writes_nothing(store, service):
    new_pod(store)
    await service.mirror(allocation(), idempotency_key="bind-1")
    again = await service.mirror(allocation(), idempotency_key="bind-1")
    assert again.changed is False and len(store.patches) == 1


async def test_a_repeat_after_rotation_keeps_the_still_valid_signature(store, service, keys):
    new_pod(store)
    first = await service.mirror(allocation(), idempotency_key="bind-1")
    keys.keyring = Keyring.of(KEY_B, KEY_A)
    again = await service.mirror(allocation(), idempotency_key="bind-1")
    assert again.changed is False and len(store.patches) == 1
    assert again.annotations[SIG] == first.annotations[SIG]
    assert verify(keys.keyring, store).ok


async def test_a_repeat_after_the_old_key_is_retired_re_signs_without_a_conflict(store, service,
                                                                           keys):
    new_pod(store)
    await service.mirror(allocation(), idempotency_key="bind-1")
    keys.keyring = Keyring.of(KEY_B)
    assert verify(keys.keyring, store).reason == Reason.KEY_UNKNOWN
    again = await service.mirror(allocation(), idempotency_key="bind-1")
    assert again.changed is True and len(store.patches) == 2
    assert set(store.patches[1][2]) == {SIG}  # only the signature moves; the record stays
    assert verify(keys.keyring, store).ok


async def test_a_different_decision_still_conflicts(store, service):
    new_pod(store)
    await service.mirror(allocation(), idempotency_key="bind-1")
    with pytest.raises(AllocationConflict):
        await service.mirror(allocation(portion="0.25"), idempotency_key="bind-2")
    rebound = await service.mirror(allocation(portion="0.25", gpu_ids=(GPU_B,)), replace=True)
    assert rebound.changed and verify(Keyring.of(KEY_A), store).ok


async def test_a_forged_signature_on_the_pod_is_replaced(store, service):
    new_pod(store, {"gpu-fraction": "0.5", SIG: "v1;kid=00000000;sig=" + "A" * 43})
    await service.mirror(allocation())
    assert verify(Keyring.of(KEY_A), store).ok


async def test_release_removes_the_signature(store, service):
    new_pod(store)
    await service.mirror(allocation())
    released = await service.release(NS, POD)
    assert SIG in released.removed_keys
    assert store.annotations(NS, POD) == {"gpu-fraction": "0.5"}


async def test_preview_shows_the_signature_and_writes_nothing(store, service):
    new_pod(store)
    preview = await service.preview(allocation())
    assert SIG in preview.annotations and store.patches == []


async def test_a_whole_gpu_bind_has_nothing_to_sign(store, service):
    new_pod(store, {})
    result = await service.mirror(allocation(resource_type="Regular", portion="", gpu_count=0,
                                       group_modes=(), gpu_ids=()))
    assert dict(result.annotations) == {"received-resource-type": "Regular"}
    assert not any(key.endswith(k.DERIVED_SIGNATURE) for key in store.annotations(NS, POD))


async def test_a_user_edit_after_the_mirror_is_caught(store, service):
    """The attack the signature exists for: the user raises their own limit after the bind
    (a user key, so admission lets it through on UPDATE)."""
    new_pod(store)
    await service.mirror(allocation())
    pod_object(store)["metadata"]["annotations"][
        "nvidia.com/container.trainer.gpu-memory.limit"] = "40Gi"
    verdict = verify(Keyring.of(KEY_A), store)
    assert (verdict.ok, verdict.reason) == (False, Reason.INVALID)


def test_keyring_source_fixed():
    source = KeyringSource.fixed(Keyring.of(KEY_A))
    assert source.current().kids == Keyring.of(KEY_A).kids
