"""The gRPC path through KAI's own NvFractions webhook, read from the rendered chart.

KAI's admission plugin (upstream KAI-Scheduler `pkg/admission/webhook/v1alpha2/nvfractions`,
failurePolicy Fail) lets a pod's `.gpus.devices` be created or changed only when the admission
request's `UserInfo.Username` equals the binder's service-account username, compared as a string;
its tests use `system:serviceaccount:kai-scheduler:binder` (KAI's default namespace and binder
ServiceAccount). The mirror therefore writes as that user (`--write-as`, impersonation), and the
chart grants it `impersonate` on exactly that ServiceAccount, with mirror.writeAsBinder (off by
default: only a caller of MirrorAllocation needs it, not the follower of an unmodified KAI). Both
halves are replayed here: KAI's rule against the identity the mirror's writes carry, and the API
server's impersonation check against the rendered RBAC, for that identity and for every other
one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .render import CHART, NAMESPACE, container, one, render

MIRROR = "kai-fractions-mirror"
KAI_BINDER = "system:serviceaccount:kai-scheduler:binder"
PATCHED = CHART / "ci" / "patched-kai-values.yaml"  # KAI in kai-system, the gRPC path
WRITE_AS = ("mirror.writeAsBinder=true",)


def kai_admits_device_write(username: str, binder_username: str) -> bool:
    """KAI's rule for a changed `.gpus.devices` (or `.gpu-compute.portion`) key: exactly the
    configured binder username, nothing else (no groups, no prefixes)."""
    return bool(binder_username) and username == binder_username


def _impersonation_attributes(user: str) -> tuple[str, str, str]:
    """(resource, namespace, name) the API server authorizes `impersonate` on for a username:
    a service-account username is impersonation of that ServiceAccount in its namespace,
    anything else of a cluster-scoped `users` entry."""
    parts = user.split(":")
    if len(parts) == 4 and parts[:2] == ["system", "serviceaccount"]:
        return "serviceaccounts", parts[2], parts[3]
    return "users", "", user


def may_impersonate(docs: list[dict], sa_namespace: str, sa_name: str, user: str,
                    resource_override: str | None = None) -> bool:
    """RBAC as the API server evaluates it, over the rendered Roles and bindings: does the
    ServiceAccount sa_namespace/sa_name hold `impersonate` on `user` (or on a group, with
    resource_override="groups")?"""
    resource, namespace, name = _impersonation_attributes(user)
    if resource_override is not None:
        resource, namespace, name = resource_override, "", user
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        binding_ns = binding["metadata"].get("namespace")
        if binding["kind"] == "RoleBinding" and binding_ns != namespace:
            continue  # a RoleBinding grants only inside its own namespace
        if not any(s["kind"] == "ServiceAccount" and s["name"] == sa_name
                   and s.get("namespace") == sa_namespace for s in binding["subjects"]):
            continue
        ref = binding["roleRef"]
        role = roles.get((ref["kind"], binding_ns if ref["kind"] == "Role" else None,
                          ref["name"]))
        for r in (role or {}).get("rules", []):
            if ("" in r.get("apiGroups", []) and resource in r.get("resources", [])
                    and "impersonate" in r["verbs"]
                    and (not r.get("resourceNames") or name in r["resourceNames"])):
                return True
    return False


def _write_as(docs: list[dict]) -> str:
    args = container(one(docs, "Deployment", MIRROR), "mirror")["args"]
    values = [a.split("=", 1)[1] for a in args if a.startswith("--write-as=")]
    assert len(values) == 1, args
    return values[0]


@pytest.mark.parametrize(("values_file", "sets", "binder"), [
    (None, WRITE_AS, KAI_BINDER),
    (PATCHED, (), "system:serviceaccount:kai-system:binder"),
], ids=["write-as-binder", "kai-in-kai-system"])
def test_the_mirrors_writes_pass_kais_identity_rule(values_file: Path | None,
                                                     sets: tuple[str, ...], binder: str):
    docs = render(values_file, sets)
    write_as = _write_as(docs)
    assert write_as == binder
    assert kai_admits_device_write(write_as, binder)
    # ...which the mirror's own identity would not: hence the impersonation
    assert not kai_admits_device_write(f"system:serviceaccount:{NAMESPACE}:{MIRROR}", binder)
    # the chart lets the mirror impersonate exactly that account
    assert may_impersonate(docs, NAMESPACE, MIRROR, write_as)
    # and our own webhook lets the same identity write binder-owned keys
    admission = container(one(docs, "Deployment", "kai-fractions-admission"), "admission")
    assert f"--allowed-identity={write_as}" in admission["args"]


@pytest.mark.parametrize("other", [
    "system:serviceaccount:kai-scheduler:scheduler",
    "system:serviceaccount:kai-scheduler:kai-operator",
    "system:serviceaccount:kai-scheduler:default",
    "system:serviceaccount:default:binder",  # the same name in another namespace
    "system:serviceaccount:kube-system:default",
    f"system:serviceaccount:{NAMESPACE}:kai-fractions-node-agent",
    f"system:serviceaccount:{NAMESPACE}:kai-fractions-admission",
    "admin",
    "system:admin",
])
def test_no_other_identity_can_be_impersonated(other: str):
    assert not may_impersonate(render(sets=WRITE_AS), NAMESPACE, MIRROR, other)


@pytest.mark.parametrize("group", ["system:masters", "system:serviceaccounts",
                                   "system:serviceaccounts:kai-scheduler"])
def test_no_group_can_be_impersonated(group: str):
    assert not may_impersonate(render(sets=WRITE_AS), NAMESPACE, MIRROR, group,
                               resource_override="groups")


@pytest.mark.parametrize("sa", ["kai-fractions-node-agent", "kai-fractions-admission"])
def test_only_the_mirror_may_write_as_the_binder(sa: str):
    assert not may_impersonate(render(sets=WRITE_AS), NAMESPACE, sa, KAI_BINDER)


@pytest.mark.parametrize("sets", [(), ("mirror.writeAsBinder=false",)],
                         ids=["default", "false"])
def test_without_write_as_binder_nothing_is_impersonated(sets: tuple[str, ...]):
    """The default (an unmodified KAI, the follower only): the mirror's writes carry its own
    identity, which our webhook allows for the signature it adds, and it may impersonate
    nobody."""
    docs = render(sets=sets)
    args = container(one(docs, "Deployment", MIRROR), "mirror")["args"]
    assert not any(a.startswith("--write-as") for a in args)
    assert not may_impersonate(docs, NAMESPACE, MIRROR, KAI_BINDER)
    admission = container(one(docs, "Deployment", "kai-fractions-admission"), "admission")
    assert (f"--allowed-identity=system:serviceaccount:{NAMESPACE}:{MIRROR}"
            in admission["args"])
