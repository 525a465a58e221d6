"""The node agent with a signing key (here the legacy HMAC keys, `--signing-hmac-key-file`: the
same checks hold for the Ed25519 public keys of `--signing-key-file`, see
test_ed25519_signing): it applies what the mirror signed; a missing
signature is pending (no marker, one `SignatureMissing` event, nothing applied) until it lands;
one under a key the node does not hold waits for it (a rotation on its way) and is refused
once `--signature-key-wait` is over; a malformed or edited one is refused with a refused
marker, a `Refused` event and nothing applied; a running pod edited after it was applied keeps
the plan it had (never loosened: its marker stays, a `PlanChangeRefused` event names the
signature failure); a refused pod takes nothing from any GPU; provisioned pods are not
checked."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from kai_fractions.cli import main
from kai_fractions.contract import DEFAULT_KEYS
from kai_fractions.gate.check import Outcome, judge
from kai_fractions.marker import read_marker
from kai_fractions.node.agent.signatures import kept_limits
from kai_fractions.signing import Keyring, SigningConfigError
from tests.agent.builders import GIB, LEAF, Rig, binder_annotations, pod, slice_of
from tests.agent.builders import limits_of as limits
from tests.agent.builders import marker_of as marker

from .allocations import KEY_A, KEY_B, plans_of

UID = "0b7e1c9a-3d2f-4a5b-8c6d-7e8f9a0b1c2d"
UID2 = "1c8f2dab-4e30-4b6c-9d7e-8f9a0b1c2d3e"
SIG = "kai-fractions.io/container.main.signature"


def signed(manifest: dict, key: bytes = KEY_A) -> dict:
    (plan,) = plans_of(manifest)
    manifest["metadata"]["annotations"][SIG] = Keyring.of(key).sign(plan)
    return manifest


def rig_with_keys(tmp: Path, *secrets: bytes, key_wait: float = 300.0, **kw) -> Rig:
    keys = tmp / "signing"
    keys.mkdir(exist_ok=True)
    for name, secret in zip(("current", "previous"), secrets, strict=False):
        (keys / name).write_bytes(secret)
    rig = Rig(tmp, sm_sharing=False, options={"signing_hmac_key_files": (str(keys),),
                                              "signature_key_wait_seconds": key_wait}, **kw)
    return rig


def add(rig: Rig, manifest: dict) -> str:
    uid = rig.add(manifest)["metadata"]["uid"]
    rig.cgroups.add(f"{slice_of(uid)}/{LEAF}")
    return uid


def gate(rig: Rig, uid: str):
    notes = rig.cluster.pods[uid]["metadata"]["annotations"]
    return judge(notes, read_marker(rig.marker_path(uid).parent), pod_uid=uid,
                 keys=DEFAULT_KEYS, boot_id=rig.reconciler.markers.boot_id,
                 containers=["main"])


def test_a_signed_allocation_is_applied(short_tmp):
    rig = rig_with_keys(short_tmp, KEY_A)
    uid = add(rig, signed(pod(uid=UID, notes=binder_annotations(devices=rig.gpu0))))
    assert rig.step().converged
    assert marker(rig, uid)["containers"]["main"]["state"] == "applied"
    assert limits(rig, uid) == {slice_of(uid): (10 * GIB, 20 * GIB),
                                f"{slice_of(uid)}/{LEAF}": (10 * GIB, 20 * GIB)}
    assert rig.cluster.event_reasons(uid) == ["Applied"]
    assert gate(rig, uid).outcome is Outcome.RELEASE


MISSING = ("annotation kai-fractions.io/container.main.signature is missing: this node applies "
           "only allocations signed by the kai-fractions mirror, and waits for it (with an "
           "unmodified KAI the mirror's BindRequest follower signs once it has checked the "
           "binder's annotations); if it never comes, look for NvFractionsMismatch events on "
           "the pod and check that the mirror runs with --signing-key-file (and "
           "--follow-bindrequests for an unmodified KAI)")
EDITED = ("annotation kai-fractions.io/container.main.signature does not match the allocation: "
          "the pod's GPU annotations (devices, memory request or limit, compute mode or portion) "
          "were changed after the kai-fractions mirror signed them, or were written by someone "
          "else; nothing is applied: delete the pod so the scheduler binds it again")


def unsigned(rig):
    return pod(uid=UID, notes=binder_annotations(devices=rig.gpu0))


def forged(rig):
    return signed(pod(uid=UID, notes=binder_annotations(devices=rig.gpu0)), KEY_B)


def edited(rig):
    manifest = signed(pod(uid=UID, notes=binder_annotations(devices=rig.gpu0)))
    manifest["metadata"]["annotations"]["nvidia.com/container.main.gpu-memory.limit"] = "80Gi"
    return manifest


def malformed(rig):
    manifest = pod(uid=UID, notes=binder_annotations(devices=rig.gpu0))
    manifest["metadata"]["annotations"][SIG] = "v1;kid=zz;sig=nope"
    return manifest


@pytest.mark.parametrize(("build", "reason", "message"), [
    (forged, "SignatureKeyUnknown", None),
    (edited, "SignatureInvalid", EDITED),
    (malformed, "SignatureInvalid", None),
])
def test_a_bad_allocation_is_refused_with_nothing_applied(short_tmp, build, reason,
                                                                      message):
    rig = rig_with_keys(short_tmp, KEY_A, key_wait=0)  # a forger's own key: no wait
    uid = add(rig, build(rig))
    report = rig.step()
    entry = marker(rig, uid)["containers"]["main"]
    assert (entry["state"], entry["reason"]) == ("refused", reason)
    if message is not None:
        assert entry["message"] == message
    elif build is forged:
        kid_b = Keyring.of(KEY_B).current.kid
        assert entry["message"].startswith(
            f"annotation {SIG} was signed with v1 key {kid_b}, which this node does not hold")
        assert entry["message"].endswith(" (refused after 0 s)")
    else:
        assert entry["message"].startswith(f"annotation {SIG} is malformed (the second field "
                                           "must be kid=<8 lowercase hex digits>)")
    assert limits(rig, uid) == {}  # nothing applied, on any cgroup of the pod
    assert rig.nvml.set_limit_calls == []
    assert rig.cluster.annotation_patches == []  # no derived annotations written for it
    assert rig.cluster.event_reasons(uid) == ["Refused"]
    event = rig.cluster.events[0]
    assert event["reason"] == "Refused" and event["type"] == "Warning"
    assert event["message"].startswith(f"container main: {reason}: ")
    verdict = gate(rig, uid)
    assert verdict.outcome is Outcome.FAIL
    assert verdict.message.startswith(f"container 'main' refused by the node agent: {reason}: ")
    assert report.converged  # a refusal is final: nothing left to retry
    result = rig.reconciler.view.results[(uid, "main")]
    assert (result.state.value, result.reason) == ("refused", reason)


def test_an_unsigned_allocation_waits_for_its_signature_then_is_applied(short_tmp):
    """With an unmodified KAI the binder's keys land first and the mirror's follower signs them
    after it checked them: until then the pod is pending, not refused."""
    rig = rig_with_keys(short_tmp, KEY_A)
    uid = add(rig, unsigned(rig))
    for _ in range(2):  # the retries of a pending pod: still one event, still no marker
        report = rig.step()
        assert not report.converged  # pending: retried until the signature lands
        assert marker(rig, uid) is None
        assert limits(rig, uid) == {} and rig.nvml.set_limit_calls == []
        assert rig.cluster.annotation_patches == []
    result = rig.reconciler.view.results[(uid, "main")]
    assert (result.state.value, result.reason, result.message) == (
        "pending", "SignatureMissing", MISSING)
    assert rig.cluster.event_reasons(uid) == ["SignatureMissing"]
    event = rig.cluster.events[0]
    assert (event["type"], event["message"]) == (
        "Warning", f"container main: waiting for its signature: {MISSING}")
    assert gate(rig, uid).outcome is Outcome.WAIT  # the gate keeps waiting (its own timeout)
    # The follower's signature lands: applied.
    manifest = rig.cluster.pods[uid]
    rig.cluster.update_pod(uid, metadata=signed(copy.deepcopy(manifest))["metadata"])
    assert rig.step().converged
    assert marker(rig, uid)["containers"]["main"]["state"] == "applied"
    assert limits(rig, uid) == {slice_of(uid): (10 * GIB, 20 * GIB),
                                f"{slice_of(uid)}/{LEAF}": (10 * GIB, 20 * GIB)}
    assert rig.cluster.event_reasons(uid) == ["SignatureMissing", "Applied"]
    assert gate(rig, uid).outcome is Outcome.RELEASE


def test_a_running_pod_edited_after_it_was_applied_keeps_its_limits(short_tmp):
    """The attack the signature closes: a user raises their own limit on a running pod."""
    rig = rig_with_keys(short_tmp, KEY_A)
    uid = add(rig, signed(pod(uid=UID, notes=binder_annotations(devices=rig.gpu0))))
    rig.step()
    before = limits(rig, uid)
    assert before == {slice_of(uid): (10 * GIB, 20 * GIB),
                      f"{slice_of(uid)}/{LEAF}": (10 * GIB, 20 * GIB)}
    applied = marker(rig, uid)["containers"]["main"]
    original = copy.deepcopy(rig.cluster.pods[uid]["metadata"])
    notes = {**original["annotations"], "nvidia.com/container.main.gpu-memory.limit": "80Gi"}
    rig.cluster.update_pod(uid, metadata={**original, "annotations": notes})
    writes = len(rig.nvml.set_limit_calls)
    for _ in range(2):
        rig.step(full=True)  # a full resync re-reads everything: still kept
        assert limits(rig, uid) == before  # neither raised to 80Gi nor cleared
    assert len(rig.nvml.set_limit_calls) == writes
    assert marker(rig, uid)["containers"]["main"] == applied  # the applied plan stays
    assert rig.reconciler.view.results[(uid, "main")].state.value == "applied"
    assert rig.cluster.event_reasons(uid) == ["Applied", "PlanChangeRefused"]
    message = rig.cluster.events[-1]["message"]
    assert message.startswith("container main: its plan is refused now (SignatureInvalid: "
                              "annotation kai-fractions.io/container.main.signature does not "
                              "match the allocation")
    assert message.endswith("the change is refused and the applied plan (memory request 10240 "
                            f"MiB, limit 20480 MiB, time-slicing on {rig.gpu0}) stays in force "
                            "until the pod is recreated (delete it to have it planned again)")
    # the edit undone: the signature holds again and the pod is applied again
    rig.cluster.update_pod(uid, metadata=original)
    assert rig.step().converged
    assert marker(rig, uid)["containers"]["main"]["state"] == "applied"
    assert limits(rig, uid) == before


def edited_then_restarted(short_tmp, before_first_pass=lambda rig: None):
    """A signed pod applied, its binder-owned devices edited, then a restarted agent (the same
    cluster, GPUs and cgroup tree, nothing remembered) after its first pass: (the old rig, the
    new one, the pod's uid, the limits in force before)."""
    rig = rig_with_keys(short_tmp, KEY_A)
    uid = add(rig, signed(pod(uid=UID, notes=binder_annotations(devices=rig.gpu0))))
    rig.step()
    before = limits(rig, uid)
    manifest = rig.cluster.pods[uid]
    notes = {**manifest["metadata"]["annotations"],
             "nvidia.com/container.main.gpus.devices": rig.gpu1}
    rig.cluster.update_pod(uid, metadata={**manifest["metadata"], "annotations": notes})
    fresh = Rig(short_tmp, sm_sharing=False, nvml=rig.nvml,
                options={"signing_hmac_key_files": (str(short_tmp / "signing"),)})
    fresh.cluster = fresh.agent.watcher.source = rig.cluster
    fresh.agent.reconciler.cgroup_fs = fresh.agent.reconciler.engine.cgroup_fs = rig.cgroups
    before_first_pass(rig)
    fresh.step()
    return rig, fresh, uid, before


def test_a_new_agent_keeps_the_limits_of_an_edited_running_pod(short_tmp):
    rig, fresh, uid, before = edited_then_restarted(short_tmp)
    # The binder-owned devices changed: the applied plan cannot be read back from the pod
    # (its digest names the old devices), so the pod is refused, but the limits the kernel
    # holds stay (`kept_limits`).
    assert fresh.reconciler.view.results[(uid, "main")].reason == "SignatureInvalid"
    assert limits(rig, uid) == before
    assert marker(rig, uid)["containers"]["main"]["reason"] == "SignatureInvalid"


def test_a_limit_that_cannot_be_read_back_is_not_swept(short_tmp):
    """As above, with NVML failing to read the limits back in the new agent's pass: what it
    cannot read it leaves alone, it does not clear (found by the fail-closed audit)."""
    rig, fresh, uid, before = edited_then_restarted(
        short_tmp, lambda rig: rig.nvml.fail("get_memory_limits", "Unknown", times=1))
    assert fresh.reconciler.view.results[(uid, "main")].reason == "SignatureInvalid"
    assert limits(rig, uid) == before
    # NVML unable to say whether limits are supported at all: every cgroup of the pod is left
    engine, inventory = fresh.reconciler.engine, fresh.reconciler.view.inventory
    assert inventory is not None
    rig.nvml.fail("memory_limits_supported", "Unknown", times=1)
    kept, unread = kept_limits(engine, inventory, {uid})
    assert kept == () and unread >= {(gpu, path) for gpu in (rig.gpu0, rig.gpu1)
                                     for path in before}


def test_a_refused_pod_takes_nothing_from_the_gpu(short_tmp):
    """A forged 80 GiB sm-sharing allocation neither counts against the GPU's memory nor sets
    its compute mode: the signed pod after it gets the GPU as if it were not there."""
    keys = short_tmp / "k"
    keys.write_bytes(KEY_A)
    rig = Rig(short_tmp, sm_sharing=True, options={"signing_hmac_key_files": (str(keys),)})
    big = pod("forged", uid=UID, notes=binder_annotations(
        devices=rig.gpu0, request="80Gi", limit="80Gi", mode="sm-sharing"))
    forged_uid = add(rig, big)
    small = signed(pod("honest", uid=UID2, notes=binder_annotations(
        devices=rig.gpu0, request="10Gi", limit="20Gi")))
    honest = add(rig, small)
    rig.step()
    assert marker(rig, forged_uid) is None  # unsigned: pending, waiting for its signature
    assert rig.reconciler.view.results[(forged_uid, "main")].reason == "SignatureMissing"
    assert marker(rig, honest)["containers"]["main"]["state"] == "applied"
    gpu = rig.reconciler.view.desired.gpu(rig.gpu0)
    assert gpu.requested_bytes == 10 * GIB and gpu.mps_pinned_mib is None
    assert gpu.compute_mode.name == "DEFAULT"  # time-slicing, not the forged sm-sharing
    assert limits(rig, forged_uid) == {}


def test_provisioned_pods_are_not_checked(short_tmp):
    rig = rig_with_keys(short_tmp, KEY_A)
    rig.sync()
    keys = rig.reconciler.provision("default", "direct", UID, binder_annotations(
        devices=rig.gpu0), ["main"])
    assert [(k.pod_uid, k.container) for k in keys] == [(UID, "main")]
    assert rig.reconciler.view.results[(UID, "main")].state.value == "applied"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_signature_under_a_key_not_here_yet_waits_for_it(short_tmp):
    """A rotation: the mirror signs with its new key (B) a minute or two before the node's
    mounted ConfigMap has its public half. The pod waits for it (pending, one event, no
    marker, nothing applied) and is applied once the keys are re-read; a key that never comes
    is refused when the wait is over."""
    rig = rig_with_keys(short_tmp, KEY_A)
    clock = Clock()
    rig.reconciler.pods.signatures.monotonic = clock
    rotated = add(rig, signed(pod(uid=UID, notes=binder_annotations(devices=rig.gpu0)), KEY_B))
    assert not rig.step().converged
    assert marker(rig, rotated) is None and limits(rig, rotated) == {}
    result = rig.reconciler.view.results[(rotated, "main")]
    assert (result.state.value, result.reason) == ("pending", "SignatureKeyUnknown")
    (event,) = rig.cluster.events
    assert (event["reason"], event["type"]) == ("SignatureKeyUnknown", "Warning")
    assert event["message"].startswith("container main: waiting for its signature's key: ")
    clock.now += 299
    rig.step()
    assert marker(rig, rotated) is None and len(rig.cluster.events) == 1
    (short_tmp / "signing" / "current").write_bytes(KEY_B)  # the kubelet's sync lands
    (short_tmp / "signing" / "previous").write_bytes(KEY_A)
    assert rig.step().converged
    assert marker(rig, rotated)["containers"]["main"]["state"] == "applied"
    assert limits(rig, rotated)

    never = add(rig, signed(pod(name="p2", uid=UID2,
                                notes=binder_annotations(devices=rig.gpu1)), b"c" * 32))
    rig.step()
    assert marker(rig, never) is None
    clock.now += 300
    rig.step()
    entry = marker(rig, never)["containers"]["main"]
    assert (entry["state"], entry["reason"]) == ("refused", "SignatureKeyUnknown")
    assert entry["message"].endswith("(refused after 300 s)")
    assert gate(rig, never).outcome is Outcome.FAIL and limits(rig, never) == {}


def test_rotation_accepts_previous_until_it_is_removed(short_tmp):
    rig = rig_with_keys(short_tmp, KEY_B, KEY_A)  # current B, previous A
    uid = add(rig, signed(pod(uid=UID, notes=binder_annotations(devices=rig.gpu0)), KEY_A))
    rig.step()
    assert marker(rig, uid)["containers"]["main"]["state"] == "applied"
    (short_tmp / "signing" / "previous").unlink()  # A retired: the running pod keeps its limits
    before = limits(rig, uid)
    rig.step()
    assert marker(rig, uid)["containers"]["main"]["state"] == "applied"
    refusal = rig.reconciler.view.desired.refusal((uid, "main"))
    assert refusal.reason == "PlanChangeRefused" and "SignatureKeyUnknown" in refusal.message
    assert limits(rig, uid) == before


def test_without_keys_unsigned_allocations_are_applied(short_tmp):
    rig = Rig(short_tmp, sm_sharing=False)
    uid = add(rig, pod(uid=UID, notes=binder_annotations(devices=rig.gpu0)))
    assert rig.step().converged
    assert marker(rig, uid)["containers"]["main"]["state"] == "applied"


def test_unusable_keys_stop_the_agent_at_start(short_tmp, capsys):
    with pytest.raises(SigningConfigError):
        Rig(short_tmp, sm_sharing=False,
            options={"signing_key_files": (str(short_tmp / "missing"),)})
    (short_tmp / "short").write_bytes(b"abc")
    code = main(["node-agent", "--node-name", "n1", "--signing-hmac-key-file",
                 str(short_tmp / "short"), "--kubeconfig", "/nonexistent"])
    assert code == 2
    assert capsys.readouterr().err == (
        f"kai-fractions node-agent: signing key {short_tmp}/short: 3 byte(s); an HMAC-SHA256 "
        "key needs at least 16 (better: an Ed25519 key pair from `kai-fractions signing-keys`)\n")
