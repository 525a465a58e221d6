"""The schema holds the node agent's DaemonSet update strategy and its capabilities to what the
API server takes and what `privileged: false` means: a bad value fails the render naming the
field, not the install at the API server (or, for `ALL`, not at all)."""

from __future__ import annotations

import pytest

from .render import container, one, render, template_error

AGENT = "kai-fractions-node-agent"


def _strategy(*sets: str) -> dict:
    return one(render(sets=sets), "DaemonSet", AGENT)["spec"]["updateStrategy"]


@pytest.mark.parametrize(("sets", "expected"), [
    (("nodeAgent.updateStrategy.type=Recreate",),
     ["/nodeAgent/updateStrategy/type", "'RollingUpdate', 'OnDelete'"]),
    (("nodeAgent.updateStrategy.rollingUpdate.maxUnavaliable=2",),
     ["/nodeAgent/updateStrategy/rollingUpdate", "'maxUnavaliable' not allowed"]),
    (("nodeAgent.updateStrategy.partition=1",),
     ["/nodeAgent/updateStrategy", "'partition' not allowed"]),
    (("nodeAgent.updateStrategy.rollingUpdate.maxUnavailable=150%",),
     ["/nodeAgent/updateStrategy/rollingUpdate/maxUnavailable"]),
    (("nodeAgent.updateStrategy.rollingUpdate.maxUnavailable=-1",),
     ["/nodeAgent/updateStrategy/rollingUpdate/maxUnavailable"]),
    (("nodeAgent.updateStrategy.rollingUpdate.maxUnavailable=0",),
     ["/nodeAgent/updateStrategy/rollingUpdate/maxUnavailable"]),
    (("nodeAgent.updateStrategy.rollingUpdate.maxUnavailable=0%",),
     ["/nodeAgent/updateStrategy/rollingUpdate/maxUnavailable"]),
    (("nodeAgent.updateStrategy.rollingUpdate.maxUnavailable=00%",),
     ["/nodeAgent/updateStrategy/rollingUpdate/maxUnavailable"]),
    (("nodeAgent.updateStrategy.rollingUpdate.maxSurge=half",),
     ["/nodeAgent/updateStrategy/rollingUpdate/maxSurge"]),
    (("nodeAgent.updateStrategy.rollingUpdate.maxUnavailable=0",
      "nodeAgent.updateStrategy.rollingUpdate.maxSurge=10%"),
     ["/nodeAgent/updateStrategy/rollingUpdate/maxSurge", "0, '0%'"]),
], ids=["Recreate", "misspelt key", "a StatefulSet's key", "over 100%", "negative", "0",
        "0%", "00%", "not a number", "a surge"])
def test_the_node_agents_update_strategy_is_held_to_a_daemonsets(sets, expected):
    """Before, `nodeAgent.updateStrategy` was any object: `type: Recreate` (a Deployment's,
    refused for a DaemonSet), a misspelt key or a maxUnavailable over 100% rendered, and the
    install then failed at the API server (or a misspelt key was dropped unseen). Now the schema
    refuses them, naming the field."""
    error = template_error(*sets)
    assert "values don't meet the specifications of the schema" in error
    for part in expected:
        assert part in error, (part, error)


def test_every_daemonset_update_strategy_still_renders():
    """OnDelete (node by node: docs/chart.md), an int or a percentage, a large maxUnavailable
    (allowed: it rolls that many nodes' agents at once). Not a surge: a node's new agent
    would run beside its old one, and nothing keeps two agents of one node apart (two writers
    of its GPU limits, its markers and its MPS control daemon)."""
    assert _strategy() == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    assert _strategy("nodeAgent.updateStrategy.type=OnDelete",
                     "nodeAgent.updateStrategy.rollingUpdate=null") == {"type": "OnDelete"}
    assert _strategy("nodeAgent.updateStrategy.rollingUpdate.maxUnavailable=100%")[
        "rollingUpdate"] == {"maxUnavailable": "100%"}
    assert _strategy("nodeAgent.updateStrategy.rollingUpdate.maxUnavailable=50")[
        "rollingUpdate"] == {"maxUnavailable": 50}
    assert _strategy("nodeAgent.updateStrategy.rollingUpdate.maxSurge=0")[
        "rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}


@pytest.mark.parametrize("value", ["05%", "007%", "0100%"])
def test_a_percentage_with_leading_zeros_is_taken_as_kubernetes_takes_it(value):
    """Before, the schema refused maxUnavailable "05%", which Kubernetes takes (the digits
    before the % are read as a number: 5%). Now it takes it too, and still refuses 0% however
    it is written (the table above)."""
    assert _strategy(f"nodeAgent.updateStrategy.rollingUpdate.maxUnavailable={value}")[
        "rollingUpdate"] == {"maxUnavailable": value}


@pytest.mark.parametrize("privileged", ["false", "true"])
def test_the_node_agent_may_not_be_given_every_capability(privileged):
    """Before, `nodeAgent.capabilities` took `ALL` (it matched ^[A-Z_]+$): with privileged=false,
    which is meant to give the agent only the capabilities it needs, the container runtime then
    adds every capability. Now the schema refuses it, whatever privileged says, with a message
    that names the field and the rule (not "'not' failed")."""
    error = template_error(f"nodeAgent.privileged={privileged}",
                           "nodeAgent.capabilities={KILL,ALL}")
    assert "/nodeAgent/capabilities/1" in error
    assert "a capability other than ALL" in error
    assert "grants every capability" in error
    assert "'not' failed" not in error
    # the default list, and any other capability name, still render
    docs = render(sets=("nodeAgent.privileged=false",
                        "nodeAgent.capabilities={SYS_ADMIN,KILL,SYS_RESOURCE}"))
    added = container(one(docs, "DaemonSet", AGENT), "node-agent")["securityContext"][
        "capabilities"]["add"]
    assert added == ["SYS_ADMIN", "KILL", "SYS_RESOURCE"]
