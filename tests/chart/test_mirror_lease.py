"""The mirror's leader election in the chart: with followBindRequests, every replica runs
`--leader-elect` on one Lease, and the mirror's service account may touch exactly that Lease
(get and patch by name, in the release namespace) plus create one there; nothing without it."""

from __future__ import annotations

from .render import NAMESPACE, find, one, render

MIRROR = "kai-fractions-mirror"
LEASE = f"{MIRROR}-follower"


def mirror_args(docs: list[dict]) -> list[str]:
    deployment = one(docs, "Deployment", MIRROR)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container["args"]


def test_the_follower_elects_on_the_one_lease_its_role_names():
    docs = render(sets=("mirror.followBindRequests=true",))
    args = mirror_args(docs)
    assert "--leader-elect" in args and f"--leader-elect-lease-name={LEASE}" in args
    role = one(docs, "Role", f"{MIRROR}-leader-election")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": [LEASE], "verbs": ["get", "patch"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        # the silent-node check (markSilentNodesAfterSeconds) reads the agents' heartbeats
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get"]}]
    quiet = one(render(sets=("mirror.followBindRequests=true",
                             "mirror.markSilentNodesAfterSeconds=0")),
                "Role", f"{MIRROR}-leader-election")
    assert quiet["rules"] == role["rules"][:2]
    binding = one(docs, "RoleBinding", f"{MIRROR}-leader-election")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": f"{MIRROR}-leader-election"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": MIRROR,
                                    "namespace": NAMESPACE}]
    # No cluster-wide right on leases anywhere.
    for cluster_role in find(docs, "ClusterRole"):
        assert all("leases" not in r.get("resources", []) for r in cluster_role["rules"])


def test_without_the_follower_there_is_no_election_and_no_lease_right():
    docs = render(sets=("mirror.followBindRequests=false",))
    assert not any(a.startswith("--leader-elect") for a in mirror_args(docs))
    assert not find(docs, "Role", f"{MIRROR}-leader-election")
    assert not find(docs, "RoleBinding", f"{MIRROR}-leader-election")
