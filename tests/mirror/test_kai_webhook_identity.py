"""The gRPC path through KAI's own NvFractions admission webhook.

KAI (KAI-Scheduler pkg/admission/.../nvfractions, `validateDeviceAnnotation`) refuses any pod
write that adds, changes or removes a binder-owned key (`.gpus.devices`) unless the admission
request's username is exactly the binder's service account, `system:serviceaccount:kai-scheduler:
binder`, with the message `<suffix> annotations may only be modified by <binder>`. The rule is
replayed here (not KAI's code: the same decision, written for the test) against every PATCH a
real `kai-fractions mirror` process sends, with the identity the API server would see: the
Impersonate-User header when there is one, else the mirror's own account.
"""

from __future__ import annotations

import json

import pytest

from tests.support.mirror_kube import run_mirror_process

pytestmark = pytest.mark.integration

BINDER = "system:serviceaccount:kai-scheduler:binder"
MIRROR_SA = "system:serviceaccount:kai-fractions:kai-fractions-mirror"
BINDER_OWNED_SUFFIX = ".gpus.devices"  # upstream main's only binder-owned NvFractions key
PREFIX = "nvidia.com/container."


def kai_refusal(username: str, changed_keys: set[str]) -> str | None:
    """KAI's rule: None when admitted, else its refusal message."""
    for key in sorted(changed_keys):
        if key.startswith(PREFIX) and key.endswith(BINDER_OWNED_SUFFIX) and username != BINDER:
            return f"{BINDER_OWNED_SUFFIX} annotations may only be modified by {BINDER}"
    return None


def pod_writes(kube) -> list[tuple[str, set[str]]]:
    """(identity the API server sees, annotation keys written) of each pod PATCH."""
    out = []
    for request in kube.requests("PATCH", r"/api/v1/namespaces/team-a/pods/train-0"):
        identity = request.headers.get("Impersonate-User") or MIRROR_SA
        body = json.loads(request.body)
        out.append((identity, set((body.get("metadata") or {}).get("annotations") or {})))
    return out


def test_writes_as_the_binder_pass_kais_identity_rule(kube, tmp_path):
    run = run_mirror_process(kube, tmp_path, "--write-as", BINDER)
    assert run.returncode == 0, run.err
    assert f"pod writes impersonate {BINDER}" in run.err
    writes = pod_writes(kube)
    assert writes and any(f"{PREFIX}trainer{BINDER_OWNED_SUFFIX}" in keys for _, keys in writes)
    assert [kai_refusal(identity, keys) for identity, keys in writes] == [None] * len(writes)


def test_writes_under_the_mirrors_own_account_are_what_kai_refuses(kube, tmp_path):
    run = run_mirror_process(kube, tmp_path)
    assert run.returncode == 0, run.err
    refusals = {kai_refusal(identity, keys) for identity, keys in pod_writes(kube)}
    assert refusals == {f".gpus.devices annotations may only be modified by {BINDER}"}


def test_only_pod_writes_are_impersonated(kube, tmp_path):
    run_mirror_process(kube, tmp_path, "--write-as", BINDER)
    impersonated = {(r.method.value, r.url.path) for r in kube.requests()
                    if r.headers.get("Impersonate-User")}
    assert impersonated == {("PATCH", "/api/v1/namespaces/team-a/pods/train-0")}
