"""Least privilege, read from the rendered RBAC: each component's service account gets exactly its
rule set, nothing is a wildcard, and Secrets are reachable only by name (the signing key, by the
mirror). The one impersonation right (the mirror writing as KAI's binder) names its single
ServiceAccount. The admission server has no API access at all."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from .render import CHART, CI_VALUES, NAMESPACE, find, one, render, values_id

VALUES = (None, *CI_VALUES)
MIRROR, AGENT, ADMISSION = ("kai-fractions-mirror", "kai-fractions-node-agent",
                            "kai-fractions-admission")
RETIRE_NODES = "kai-fractions-retire-nodes"

# The mirror only POSTs core events (kai_fractions/mirror/kube_store.py): no patch, and nothing
# in events.k8s.io.
EVENTS = ((frozenset({""}), frozenset({"events"}), frozenset()), frozenset({"create"}))


def rule(groups, resources, verbs, names=()):
    return ((frozenset(groups), frozenset(resources), frozenset(names)), frozenset(verbs))


IMPERSONATE_BINDER = rule([""], ["serviceaccounts"], ["impersonate"], ["binder"])
REPORTER_RULES = {
    rule(["gpu-fractioning.kai.scheduler"], ["gpufractioningconfigs"], ["get"], ["default"]),
    rule(["gpu-fractioning.kai.scheduler"], ["gpufractioningconfigs/status"], ["patch"],
         ["default"]),
    rule(["apps"], ["daemonsets"], ["get"], ["kai-fractions-node-agent"]),
}

PUBLIC_KEY_RULES = {
    rule([""], ["configmaps"], ["get", "patch"], ["kai-fractions-signing-public"]),
    rule([""], ["configmaps"], ["create"]),
}

LEASE_RULES = {
    rule(["coordination.k8s.io"], ["leases"], ["get", "patch"], ["kai-fractions-mirror-follower"]),
    rule(["coordination.k8s.io"], ["leases"], ["create"]),
}


SILENT_NODES = rule([""], ["nodes/status"], ["patch"])
HEARTBEATS = rule(["coordination.k8s.io"], ["leases"], ["get"])
MIRROR_RULES = {
    rule([""], ["pods"], ["get", "list", "watch", "patch"]),
    rule([""], ["nodes"], ["get"]),
    rule(["scheduling.run.ai"], ["bindrequests"], ["get", "list", "watch"]),
    # a silent node's readiness condition set Unknown, and nothing else (the mirror's
    # node-status ValidatingAdmissionPolicy: test_mirror_node_status.py)
    SILENT_NODES,
    EVENTS,
    # publishes the signing public key for the node agents (--publish-public-key)
    *PUBLIC_KEY_RULES,
    # the GpuFractioningConfig reporter: the one object KAI's operator reads, its status only
    # written, and the one DaemonSet whose readiness it reports
    rule(["gpu-fractioning.kai.scheduler"], ["gpufractioningconfigs"], ["get"], ["default"]),
    rule(["gpu-fractioning.kai.scheduler"], ["gpufractioningconfigs/status"], ["patch"],
         ["default"]),
    rule(["apps"], ["daemonsets"], ["get"], ["kai-fractions-node-agent"]),
    # writes as KAI's binder (its NvFractions webhook lets only that account write .gpus.devices),
    # with mirror.writeAsBinder (off by default)
    IMPERSONATE_BINDER,
    # one BindRequest follower among the replicas: its Lease (test_mirror_lease.py)
    *LEASE_RULES,
    # the silent-node check reads the node agents' heartbeat Leases
    HEARTBEATS,
}
# Exactly what kai_fractions/node/agent/kube.py calls (test_node_agent_policy.py); `patch nodes`
# only with nodeAgent.publishGpuMemoryLabel.
AGENT_RULES = {
    rule([""], ["pods"], ["list", "watch", "patch"]),
    rule([""], ["events"], ["create"]),
    rule([""], ["nodes"], ["get"]),
    rule([""], ["nodes/status"], ["patch"]),
    # its heartbeat Lease, in the release namespace; which one: the own-node policy
    rule(["coordination.k8s.io"], ["leases"], ["create", "patch"]),
}


def granted(docs: list[dict]) -> dict[str, set]:
    """service account -> its rules (normalised), following every (Cluster)RoleBinding."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    rules: dict[str, set] = defaultdict(set)
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        ref = binding["roleRef"]
        ns = binding["metadata"].get("namespace") if ref["kind"] == "Role" else None
        role = roles.get((ref["kind"], ns, ref["name"]))
        assert role is not None, f"{binding['metadata']['name']} binds a role the chart lacks"
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount"
            assert subject["namespace"] == NAMESPACE
            for r in role["rules"]:
                rules[subject["name"]].add(rule(r.get("apiGroups", []), r.get("resources", []),
                                                r["verbs"], r.get("resourceNames", [])))
    return dict(rules)


@pytest.mark.parametrize("values_file", VALUES, ids=values_id)
def test_no_wildcards_and_secrets_only_by_name(values_file: Path | None):
    docs = render(values_file)
    for role in (d for d in docs if d["kind"] in ("Role", "ClusterRole")):
        assert "aggregationRule" not in role
        for r in role["rules"]:
            where = f"{role['kind']}/{role['metadata']['name']}: {r}"
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert not any("*" in item for item in r.get(field, [])), where
            assert "nonResourceURLs" not in r, where
            # no escalation paths: nothing that grants; events are the only thing created,
            # and the mirror's election Lease and signing public key ConfigMap in its own
            # namespace (test_mirror_lease.py, tests/security/test_chart_signing.py);
            # the only impersonation is of KAI's binder ServiceAccount, by name, in KAI's
            # namespace (the mirror writes as it: test_kai_identity.py)
            assert not {"escalate", "bind", "create"} & set(r["verbs"]) or (
                set(r["resources"]) == {"events"}) or (
                set(r["resources"]) in ({"leases"}, {"configmaps"}) and role["kind"] == "Role"
                and role["metadata"]["namespace"] == NAMESPACE), where
            if "impersonate" in r["verbs"]:
                assert role["kind"] == "Role", where
                assert role["metadata"]["name"] == "kai-fractions-mirror-write-as-binder", where
                assert r == {"apiGroups": [""], "resources": ["serviceaccounts"],
                             "resourceNames": ["binder"], "verbs": ["impersonate"]}, where
            # the signing key is mounted: no component reads a Secret through the API
            assert "secrets" not in r["resources"], where


def test_each_component_gets_exactly_its_rules():
    rules = granted(render())
    assert set(rules) == {MIRROR, AGENT, RETIRE_NODES}  # and nothing for the admission server
    # the uninstall hook (kai-fractions retire-nodes): its rights exist only while it runs
    assert rules[RETIRE_NODES] == {
        rule([""], ["nodes"], ["get", "list"]), rule([""], ["nodes/status"], ["patch"]),
        rule(["apps"], ["daemonsets"], ["get", "delete"], [AGENT]), rule([""], ["pods"], ["list"]),
        # agents left running at its deadline may no longer write their condition
        rule(["rbac.authorization.k8s.io"], ["clusterrolebindings"], ["delete"], [AGENT])}
    # by default nothing to impersonate: the follower of an unmodified KAI writes as the mirror
    assert rules[MIRROR] == MIRROR_RULES - {IMPERSONATE_BINDER}
    assert rules[AGENT] == AGENT_RULES
    # the gRPC path's writes of .gpus.devices pass KAI's webhook only as its binder
    assert granted(render(sets=("mirror.writeAsBinder=true",)))[MIRROR] == MIRROR_RULES


def test_mirror_rules_shrink_with_its_options():
    docs = render(CHART / "ci" / "watchdog-kill-values.yaml",
                  ("mirror.followBindRequests=false", "signing.enabled=false",
                   "gpuFractioningConfig.enabled=false", "mirror.writeAsBinder=false"))
    rules = granted(docs)
    assert rules[MIRROR] == MIRROR_RULES - REPORTER_RULES - LEASE_RULES - {
        IMPERSONATE_BINDER, SILENT_NODES, HEARTBEATS,
        rule(["scheduling.run.ai"], ["bindrequests"], ["get", "list", "watch"])} - PUBLIC_KEY_RULES
    assert not find(docs, "Secret", "kai-fractions-signing-key")


def test_signing_key_rules_follow_the_names_and_never_read_the_key():
    """The private key is mounted (the kubelet reads its Secret): a leaked token of the mirror
    must not fetch it through the API. The public key's ConfigMap is read and written by name."""
    docs = render(CHART / "ci" / "time-slicing-only-values.yaml",
                  ("signing.secretName=allocation-hmac", "signing.create=false"))
    assert not any("secrets" in key[1] for key, _verbs in granted(docs)[MIRROR])
    assert not find(docs, "Secret", "allocation-hmac")
    docs = render(CHART / "ci" / "time-slicing-only-values.yaml",
                  ("signing.publicKeyConfigMap=allocation-public",))
    assert rule([""], ["configmaps"], ["get", "patch"], ["allocation-public"]) in \
        granted(docs)[MIRROR]


@pytest.mark.parametrize("values_file", VALUES, ids=values_id)
def test_admission_has_no_api_access(values_file: Path | None):
    docs = render(values_file)
    assert ADMISSION not in granted(docs)
    if docs:
        sa = one(docs, "ServiceAccount", ADMISSION)
        assert sa["automountServiceAccountToken"] is False
        pod = one(docs, "Deployment", ADMISSION)["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False


def test_workloads_run_as_their_own_service_accounts():
    docs = render()
    assert one(docs, "Deployment", MIRROR)["spec"]["template"]["spec"]["serviceAccountName"] \
        == MIRROR
    assert one(docs, "DaemonSet", AGENT)["spec"]["template"]["spec"]["serviceAccountName"] \
        == AGENT
    assert one(docs, "Deployment", ADMISSION)["spec"]["template"]["spec"][
        "serviceAccountName"] == ADMISSION
