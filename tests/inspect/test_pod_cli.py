"""`kai-fractions inspect pod` (and node) against kmock: the pod's namespace as kubectl's -n,
the release's as --release-namespace; the agent's events on the pod off the node; a node, or
events, the user may not read; what a 401 says; an --agent-metrics that is not this node's
agent."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
from kubernetes import client as k8s

from kai_fractions.kube.objects import pod_event
from kai_fractions.node.agent import events as ev
from kai_fractions.node.agent.options import COMPONENT
from tests.support.kube import KubeServer

from .pods import NODE
from .test_cli import (  # noqa: F401  (agent_socket, cluster: fixtures)
    METRICS,
    _inspect,
    agent_socket,
    cluster,
    serving,
)

EVENTS = "/api/v1/namespaces/team-a/events"
SET_ASIDE = ("container main: an MPS cap it relies on is not in force, so its readiness marker "
             "is set aside (a gate of the pod waits; Applied follows once the cap is back): "
             "MpsPinnedLimitLost: the MPS daemon restarted")


def _agent_event(kube: KubeServer, reason: str, message: str) -> None:
    notebook = kube.core.read_namespaced_pod("notebook", "team-a").metadata
    kube.core.create_namespaced_event("team-a", pod_event(
        "team-a", "notebook", notebook.uid, event_type=ev.WARNING, reason=reason,
        message=message, component=COMPONENT, host=NODE,
        now=datetime.datetime.now(datetime.UTC)))


def _row(out: str) -> dict:
    return json.loads(out)["gpus"][0]["allocations"][0]


# -- the pod's namespace, the release's -------------------------------------------------------

def test_dash_n_is_the_pods_namespace(cluster: Path, capsys) -> None:  # noqa: F811
    code, out, _ = _inspect(capsys, "pod", "notebook", "-n", "team-a", "--kubeconfig",
                            str(cluster), "-o", "json")
    assert (code, json.loads(out)["title"]) == (0, "pod team-a/notebook")
    code, out, _ = _inspect(capsys, "pod", "team-a/notebook", "--namespace", "team-a",
                            "--kubeconfig", str(cluster), "-o", "json")
    assert (code, json.loads(out)["title"]) == (0, "pod team-a/notebook")
    # NAME alone is in default, as kubectl's: not silently another namespace's pod
    assert _inspect(capsys, "pod", "notebook", "--kubeconfig", str(cluster)) == (
        1, "", "kai-fractions inspect: pod default/notebook: not found\n")


def test_a_namespace_given_twice_and_different_is_a_usage_error(cluster: Path,  # noqa: F811
                                                                capsys) -> None:
    assert _inspect(capsys, "pod", "team-a/notebook", "-n", "team-b", "--kubeconfig",
                    str(cluster)) == (
        2, "", "kai-fractions inspect: pod team-a/notebook: its namespace team-a is not "
        "-n/--namespace team-b: give the namespace once. -n is now the pod's namespace, as "
        "kubectl's; the release's namespace (where the node agents' heartbeat Leases are) is "
        "--release-namespace: inspect pod team-a/notebook --release-namespace team-b\n")
    code, _, err = _inspect(capsys, "pod", "notebook", "-n", "Team_A", "--kubeconfig",
                            str(cluster))
    assert (code, err) == (2, "kai-fractions inspect: -n/--namespace 'Team_A': not a namespace "
                           "name (lower-case letters, digits and '-', at most 63)\n")


def test_the_command_older_notes_printed_says_where_the_release_namespace_went(
        cluster: Path, capsys) -> None:  # noqa: F811
    """NOTES.txt of the releases before printed `inspect pod default/memory-request -n
    kai-fractions`, -n then the release's namespace: the refusal says what -n is now and
    which flag took its old meaning, not only that the namespaces differ."""
    code, out, err = _inspect(capsys, "pod", "default/memory-request", "-n", "kai-fractions",
                              "--kubeconfig", str(cluster))
    assert (code, out) == (2, "")
    assert "-n is now the pod's namespace" in err
    assert ("the release's namespace (where the node agents' heartbeat Leases are) is "
            "--release-namespace: inspect pod default/memory-request --release-namespace "
            "kai-fractions\n") in err


def _kubeconfig_in(kube: KubeServer, path: Path, namespace: str | None) -> Path:
    """kmock's kubeconfig with its context's namespace `namespace` (None: the context names
    none)."""
    import yaml

    kube.write_kubeconfig(path)
    doc = yaml.safe_load(path.read_text())
    [context] = doc["contexts"]
    if namespace is None:
        del context["context"]["namespace"]
    else:
        context["context"]["namespace"] = namespace
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_name_alone_is_in_the_kubeconfig_contexts_namespace(
        kube: KubeServer, cluster: Path, tmp_path: Path, capsys) -> None:  # noqa: F811
    """As kubectl's -n: without NS/ and -n, the current context's namespace, not `default`."""
    config = _kubeconfig_in(kube, tmp_path / "team-a.kubeconfig", "team-a")
    code, out, err = _inspect(capsys, "pod", "notebook", "--kubeconfig", str(config), "-o",
                              "json")
    assert (code, err, json.loads(out)["title"]) == (0, "", "pod team-a/notebook")
    # -n and NS/ still win over the context's
    assert _inspect(capsys, "pod", "notebook", "-n", "team-b", "--kubeconfig", str(config)) == (
        1, "", "kai-fractions inspect: pod team-b/notebook: not found\n")
    assert _inspect(capsys, "pod", "team-b/notebook", "--kubeconfig", str(config)) == (
        1, "", "kai-fractions inspect: pod team-b/notebook: not found\n")
    # a context that names no namespace: default, as kubectl's
    bare = _kubeconfig_in(kube, tmp_path / "bare.kubeconfig", None)
    assert _inspect(capsys, "pod", "notebook", "--kubeconfig", str(bare)) == (
        1, "", "kai-fractions inspect: pod default/notebook: not found\n")


def test_a_context_namespace_that_is_no_namespace_name_is_a_usage_error(
        kube: KubeServer, cluster: Path, tmp_path: Path, capsys) -> None:  # noqa: F811
    config = _kubeconfig_in(kube, tmp_path / "bad.kubeconfig", "Team_A")
    code, out, err = _inspect(capsys, "pod", "notebook", "--kubeconfig", str(config))
    assert (code, out) == (2, "")
    assert err == ("kai-fractions inspect: the default namespace (the kubeconfig's current "
                   "context's, or in a pod its own) 'Team_A': not a namespace name (lower-case "
                   "letters, digits and '-', at most 63)\n")


@pytest.fixture
def in_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """inspect runs in a pod: the service account's token and CA (files of the test's), an API
    server address where nothing listens (no request gets an answer: its error names the pod
    it read). Returns the service account directory."""
    import socket

    from kubernetes.config import incluster_config

    from tests.mirror.certs import CertificateAuthority

    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("t")
    (account / "ca.crt").write_bytes(CertificateAuthority().pem)
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(account / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(account / "ca.crt"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(port))
    return account


def test_in_a_pod_a_name_alone_is_in_the_pods_own_namespace(in_cluster: Path,
                                                            capsys) -> None:
    """In-cluster, kubectl's default is the pod's own namespace (the service account's
    `namespace` file, beside its token); without that file, default."""
    (in_cluster / "namespace").write_text("team-a\n")
    code, out, err = _inspect(capsys, "pod", "notebook")
    assert (code, out) == (2, "")
    assert err.startswith("kai-fractions inspect: pod team-a/notebook: the Kubernetes API is "
                          "not reachable"), err
    (in_cluster / "namespace").unlink()
    code, _, err = _inspect(capsys, "pod", "notebook")
    assert err.startswith("kai-fractions inspect: pod default/notebook: the Kubernetes API is "
                          "not reachable"), err


def test_the_release_namespace_names_where_the_heartbeat_lease_is(
        kube: KubeServer, cluster: Path, capsys) -> None:  # noqa: F811
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": f"kai-fractions-agent.{NODE}", "namespace": "gpu-system"},
             "spec": {"holderIdentity": NODE, "renewTime": datetime.datetime.now(
                 datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}}
    k8s.CoordinationV1Api(kube.api_client).create_namespaced_lease("gpu-system", lease)
    for args in (("pod", "team-a/notebook", "--release-namespace", "gpu-system"),
                 ("node", NODE, "--release-namespace", "gpu-system"),
                 ("node", NODE, "-n", "gpu-system")):  # a node has no namespace: -n as before
        code, out, _ = _inspect(capsys, *args, "--kubeconfig", str(cluster), "-o", "json")
        assert (code, json.loads(out)["heartbeat"]["from"]) == (
            0, f"lease gpu-system/kai-fractions-agent.{NODE}"), args


def test_an_empty_node_name_is_a_usage_error(cluster: Path, capsys) -> None:  # noqa: F811
    assert _inspect(capsys, "node", "", "--kubeconfig", str(cluster)) == (
        2, "", "kai-fractions inspect: node: NODE must not be empty\n")


# -- the agent's events off the node ----------------------------------------------------------

def test_off_the_node_the_agents_events_say_a_marker_was_set_aside(
        kube: KubeServer, cluster: Path, capsys) -> None:  # noqa: F811
    """The gate exited 0 long ago; the agent has since set the marker aside: pending with the
    event's reason and message, not enforced."""
    _agent_event(kube, ev.MPS_CAP_NOT_IN_FORCE, SET_ASIDE)
    code, out, _ = _inspect(capsys, "pod", "team-a/notebook", "--kubeconfig", str(cluster),
                            "-o", "json")
    row = _row(out)
    assert (code, row["state"], row["reason"], row["state_source"]) == (
        0, "pending", "MpsCapNotInForce", "events")
    assert row["message"] == SET_ASIDE.removeprefix("container main: ")
    code, out, _ = _inspect(capsys, "pod", "team-a/notebook", "--kubeconfig", str(cluster))
    assert "pending (MpsCapNotInForce)" in out and "enforced" not in out


def test_events_that_cannot_be_read_are_a_note(kube: KubeServer, cluster: Path,  # noqa: F811
                                               capsys) -> None:
    kube.fail("GET", EVENTS, 403, times=None, message="events is forbidden")
    code, out, _ = _inspect(capsys, "pod", "team-a/notebook", "--kubeconfig", str(cluster),
                            "-o", "json")
    data = json.loads(out)
    assert (code, data["gpus"][0]["allocations"][0]["state"]) == (0, "enforced")
    [note] = [n for n in data["notes"] if n.startswith("the pod's events not read (")]
    assert "events is forbidden" in note and "RBAC does not allow it" in note


# -- what the user may not read ---------------------------------------------------------------

def test_a_node_the_user_may_not_get_is_a_note_and_the_rows_are_printed(
        kube: KubeServer, cluster: Path, capsys) -> None:  # noqa: F811
    said = f'nodes "{NODE}" is forbidden: User "bob" cannot get resource "nodes"'
    kube.fail("GET", f"/api/v1/nodes/{NODE}", 403, times=None, message=said)
    code, out, err = _inspect(capsys, "pod", "team-a/notebook", "--kubeconfig", str(cluster),
                              "-o", "json")
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert _row(out)["pod"] == "notebook"
    assert f"node {NODE} not readable: the API server refused this identity (403 Forbidden: " \
           f"{said}): RBAC does not allow it" in data["notes"]
    assert not any("was not found" in n for n in data["notes"])


def test_a_401_says_the_credentials_were_not_accepted(kube: KubeServer, cluster: Path,  # noqa: F811
                                                      capsys) -> None:
    kube.fail("GET", "/api/v1/namespaces/team-a/pods/notebook", 401, times=None,
              reason="Unauthorized", message="Unauthorized")
    code, out, err = _inspect(capsys, "pod", "team-a/notebook", "--kubeconfig", str(cluster))
    assert (code, out) == (2, "")
    assert err == ("kai-fractions inspect: pod team-a/notebook: the API server did not accept "
                   "the credentials (401 Unauthorized: Unauthorized): authentication failed; "
                   "check the kubeconfig's user (its token, client certificate or exec "
                   "plugin)\n")
    assert "RBAC" not in err and "component" not in err


# -- an --agent-metrics that is not this node's agent -----------------------------------------

MIRROR_METRICS = """\
# HELP kai_fractions_mirror_calls_total Calls.
# TYPE kai_fractions_mirror_calls_total counter
kai_fractions_mirror_calls_total{code="OK",method="MirrorAllocation"} 3.0
"""


@pytest.mark.parametrize(("text", "why"), [
    (MIRROR_METRICS, "not a node agent's metrics: no kai_fractions_node_ready series"),
    (METRICS.replace(f'node="{NODE}"', 'node="other-node"'),
     f"these are the metrics of node other-node's agent, not {NODE}'s"),
])
def test_metrics_that_are_not_this_nodes_agent_are_noted_and_not_used(
        cluster: Path, capsys, text: str, why: str) -> None:  # noqa: F811
    with serving(text) as url:
        code, out, _ = _inspect(capsys, "node", NODE, "--kubeconfig", str(cluster),
                                "--agent-metrics", url, "-o", "json")
    data = json.loads(out)
    assert (code, data["agent"]["reachable"]) == (0, False)
    assert data["agent"]["error"].startswith(why), data["agent"]["error"]
    assert any(n.startswith(f"used: n/a (agent not reachable: {why}") for n in data["notes"])
    assert _row(out)["used_bytes"] is None


def test_metrics_of_no_agent_beside_the_socket_are_noted(
        cluster: Path, agent_socket: Path, capsys) -> None:  # noqa: F811
    """The socket is read; the metrics given with it are not this node's agent's: not merged,
    and said (they were dropped silently when they could not be read)."""
    with serving(MIRROR_METRICS) as url:
        code, out, _ = _inspect(capsys, "node", NODE, "--kubeconfig", str(cluster),
                                "--agent-socket", str(agent_socket), "--agent-metrics", url,
                                "-o", "json")
    data = json.loads(out)
    assert (code, data["agent"]["source"]) == (0, f"socket unix://{agent_socket}")
    assert data["notes"] == [f"--agent-metrics not used (metrics http://{url}/metrics: not a "
                             "node agent's metrics: no kai_fractions_node_ready series (the "
                             "agent serves it on port 9400 of its pod, from its first pass "
                             "on))"]


REFUSED = """\
# TYPE kai_fractions_container_refused gauge
kai_fractions_container_refused{{container="main",namespace="team-a",node="{node}",pod="notebook",pod_uuid="{uid}",reason="SmSharingDisabled"}} 1.0
"""  # noqa: E501


def test_metrics_give_a_refusals_own_reason(cluster: Path, kube: KubeServer,  # noqa: F811
                                            capsys) -> None:
    uid = kube.core.read_namespaced_pod("notebook", "team-a").metadata.uid
    with serving(METRICS + REFUSED.format(node=NODE, uid=uid)) as url:
        code, out, _ = _inspect(capsys, "pod", "team-a/notebook", "--kubeconfig", str(cluster),
                                "--agent-metrics", url, "-o", "json")
    row = _row(out)
    assert (code, row["state"], row["reason"], row["state_source"], row["accounted"]) == (
        0, "refused", "SmSharingDisabled", "metrics", False)
    assert row["message"].startswith("the node agent's metrics say it refuses this container")
