"""The mirror's write to a silent node (mirror.markSilentNodesAfterSeconds): its flags, its RBAC
(`patch nodes/status`, test_rbac.py) and the node-status ValidatingAdmissionPolicy, evaluated
with a CEL interpreter on real updates: the mirror may set our readiness conditions Unknown, and
nothing else of a Node."""

from __future__ import annotations

import pytest

from kai_fractions.contract import keys as k
from kai_fractions.mirror.node_liveness import SILENT_REASON

from .node_metadata_edits import METADATA_EDIT_IDS, METADATA_EDITS
from .render import NAMESPACE, container, find, one, render, template_error
from .test_node_agent_policy import AGENT_USER, changed, condition, node, review

MIRROR = "kai-fractions-mirror"
MIRROR_USER = f"system:serviceaccount:{NAMESPACE}:{MIRROR}"


def policy(*sets: str) -> dict:
    return one(render(None, sets), "ValidatingAdmissionPolicy", f"{MIRROR}-node-status")


@pytest.fixture(scope="module")
def pol() -> dict:
    return policy()


def ready_node() -> dict:
    def ready(n):
        for kind in (k.NODE_CONDITION, k.LEGACY_NODE_CONDITION):
            condition(n, kind).update(status="True", reason="AgentReady",
                                      lastHeartbeatTime="2026-12-02T11:00:00Z")
    return changed(node(), ready)


def silent(n: dict, *kinds: str) -> None:
    for kind in kinds:
        condition(n, kind).update(status="Unknown", reason=SILENT_REASON,
                                  message="the kai-fractions node agent has not reported")


def test_the_mirror_is_told_what_to_watch_and_may_do_it():
    docs = render()
    args = container(one(docs, "Deployment", MIRROR), "mirror")["args"]
    assert "--mark-silent-nodes-after=180" in args
    assert [a for a in args if a.startswith("--node-condition=")] == [
        f"--node-condition={k.NODE_CONDITION}", f"--node-condition={k.LEGACY_NODE_CONDITION}"]
    binding = one(docs, "ValidatingAdmissionPolicyBinding", f"{MIRROR}-node-status")
    assert binding["spec"] == {"policyName": f"{MIRROR}-node-status",
                               "validationActions": ["Deny"]}


def test_off_means_no_flag_no_policy():
    docs = render(None, ("mirror.markSilentNodesAfterSeconds=0",))
    args = container(one(docs, "Deployment", MIRROR), "mirror")["args"]
    assert not [a for a in args if "silent" in a or "node-condition" in a]
    assert not find(docs, "ValidatingAdmissionPolicy", f"{MIRROR}-node-status")
    err = template_error("mirror.markSilentNodesAfterSeconds=60")
    assert "/mirror/markSilentNodesAfterSeconds" in err


def test_the_mirror_may_set_our_conditions_unknown(pol):
    old = ready_node()
    assert review(pol, old, changed(old, lambda n: silent(n, k.NODE_CONDITION)),
                  "nodes/status", user=MIRROR_USER) == []
    assert review(pol, old, changed(old, lambda n: silent(
        n, k.NODE_CONDITION, k.LEGACY_NODE_CONDITION)), "nodes/status", user=MIRROR_USER) == []


@pytest.mark.parametrize(("edit", "resource", "message"), [
    (lambda n: condition(n, k.NODE_CONDITION).update(status="False"), "nodes/status",
     "only to Unknown"),
    (lambda n: condition(n, k.NODE_CONDITION).update(reason="Elsewhere"), "nodes/status",
     "only to Unknown"),
    (lambda n: n["status"]["conditions"].pop(1), "nodes/status", "never remove them"),
    (lambda n: condition(n, "Ready").update(status="False"), "nodes/status",
     "may change only the conditions"),
    (lambda n: n["status"]["capacity"].update({"nvidia.com/gpu": "8"}), "nodes/status",
     "may change only the conditions"),
    (lambda n: n["metadata"]["labels"].update(x="y"), "nodes",
     "may update only a Node's status"),
])
def test_nothing_else_of_a_node(pol, edit, resource, message):
    old = ready_node()
    found = review(pol, old, changed(old, edit), resource, user=MIRROR_USER)
    assert any(message in m for m in found), found


@pytest.mark.parametrize(("edit", "message"), METADATA_EDITS, ids=METADATA_EDIT_IDS)
def test_no_metadata_through_the_status(pol, edit, message):
    """Before, a nodes/status write (the API server resets only the spec there) that relabelled
    the Node, annotated it, or gave it a finalizer or an owner that does not exist (the garbage
    collector then deletes the Node) passed: the policy read only status.*. Now each is refused,
    naming the field, alone or beside the Unknown the mirror may write, which still passes."""
    old = ready_node()
    unknown = changed(old, lambda n: silent(n, k.NODE_CONDITION))
    assert review(pol, old, unknown, "nodes/status", user=MIRROR_USER) == []
    for new in (changed(old, edit), changed(unknown, edit)):
        found = review(pol, old, new, "nodes/status", user=MIRROR_USER)
        assert any(message in m and "the mirror" in m for m in found), found


def test_the_policy_is_the_mirrors_alone(pol):
    old = ready_node()
    back = changed(old, lambda n: silent(n, k.NODE_CONDITION))
    # the agent sets its condition True again: not the mirror's policy to judge
    assert review(pol, back, old, "nodes/status", user=AGENT_USER) == []
