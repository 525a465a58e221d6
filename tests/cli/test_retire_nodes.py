"""`kai-fractions retire-nodes` (the chart's pre-delete hook) against kmock.

Before it, `helm uninstall` deleted the node agent DaemonSet and its RBAC in one pass: an agent
stopping could no longer publish its condition False, the mirror (the only other writer) was
gone first, and every GPU node kept `gpu-fractioning.nvidia.com/Ready=True` with nothing behind
it, so KAI went on placing fractional pods there, which ran with no limit. Now the command
deletes the DaemonSet first and waits for its pods (each agent publishes False as it stops, its
RBAC still there), then sets every condition of ours still True Unknown (reason
KaiFractionsUninstalled) in a patch guarded by the node's resourceVersion, and exits non-zero
naming what it could not do."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s

from kai_fractions.cli import main
from kai_fractions.contract import keys as k
from tests.support.kube import KubeServer

NS = "kai-fractions"
DS = "kai-fractions-node-agent"
DS_PATH = f"/apis/apps/v1/namespaces/{NS}/daemonsets/{DS}"
LABELS = {"app.kubernetes.io/name": "kai-fractions", "app.kubernetes.io/component": "node-agent"}
REASON = "KaiFractionsUninstalled"
NODE_STATUS = re.compile(r"/api/v1/nodes/[^/]+/status")
BINDING = "kai-fractions-node-agent"  # the node agent's ClusterRoleBinding (the chart's name)
BINDING_PATH = f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{BINDING}"


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    from kai_fractions.cli import retire_nodes

    monkeypatch.setattr(retire_nodes, "POLL_SECONDS", 0.05)
    monkeypatch.setattr(retire_nodes, "REVOKE_SECONDS", 0.05)


def condition(kind: str, status: str, reason: str = "AgentReady") -> dict:
    return {"type": kind, "status": status, "reason": reason, "message": "m",
            "lastHeartbeatTime": "2026-12-02T11:59:00Z",
            "lastTransitionTime": "2026-12-02T11:00:00Z"}


def node(name: str, *conditions: dict) -> dict:
    return {"metadata": {"name": name}, "status": {"conditions": [
        {"type": "Ready", "status": "True", "reason": "KubeletReady"}, *conditions]}}


def agent_pod(name: str, node_name: str) -> dict:
    return {"metadata": {"name": name, "namespace": NS, "labels": LABELS},
            "spec": {"nodeName": node_name,
                     "containers": [{"name": "agent", "image": "registry.invalid/kf:1"}]}}


@pytest.fixture
def cluster(kube: KubeServer, tmp_path: Path) -> Path:
    k8s.AppsV1Api(kube.api_client).create_namespaced_daemon_set(NS, {
        "metadata": {"name": DS, "namespace": NS},
        "spec": {"selector": {"matchLabels": LABELS}, "template": {
            "metadata": {"labels": LABELS},
            "spec": {"containers": [{"name": "agent", "image": "registry.invalid/kf:1"}]}}}})
    for name, on in (("agent-a", "gpu-1"), ("agent-b", "gpu-2")):
        kube.core.create_namespaced_pod(NS, agent_pod(name, on))
    # gpu-1: its agent was killed before it published False; gpu-2: its agent said False;
    # gpu-3: the mirror found its agent silent; cpu-1: no condition of ours.
    kube.core.create_node(node("gpu-1", condition(k.NODE_CONDITION, "True"),
                               condition(k.LEGACY_NODE_CONDITION, "True")))
    kube.core.create_node(node("gpu-2", condition(k.NODE_CONDITION, "False", "NotReconciling"),
                               condition(k.LEGACY_NODE_CONDITION, "False", "NotReconciling")))
    kube.core.create_node(node("gpu-3", condition(k.NODE_CONDITION, "Unknown",
                                                  "NodeAgentSilent")))
    kube.core.create_node(node("cpu-1"))
    return kube.write_kubeconfig(tmp_path / "kubeconfig")


def retire(cluster: Path, capsys, *flags: str) -> tuple[int, str, str]:
    code = main(["retire-nodes", "--kubeconfig", str(cluster), *flags])
    out, err = capsys.readouterr()
    return code, out, err


def delete_pods_later(kube: KubeServer, seconds: float = 0.4) -> threading.Timer:
    """The agents stop (the kubelet removes their pods) a little after the DaemonSet goes."""
    def delete():
        for name in ("agent-a", "agent-b"):
            kube.core.delete_namespaced_pod(name, NS)
    timer = threading.Timer(seconds, delete)
    timer.start()
    return timer


def ours(kube: KubeServer, name: str) -> dict[str, str]:
    conditions = kube.core.read_node(name).to_dict()["status"]["conditions"] or []
    return {c["type"]: c["status"] for c in conditions if c["type"] != "Ready"}


def test_the_agents_stop_first_then_true_conditions_are_set_unknown(kube, cluster, capsys):
    """Before: nothing stopped the agents while their RBAC stood, and nothing set a condition
    left True otherwise. Now: the DaemonSet is deleted (foreground), its pods are waited for,
    and only then are the conditions still True set Unknown, only those, in a guarded
    strategic merge patch naming why."""
    timer = delete_pods_later(kube)
    code, out, err = retire(cluster, capsys, "--wait-seconds", "10")
    timer.join()
    assert (code, err) == (0, "")
    [delete] = kube.requests("DELETE", DS_PATH)
    assert delete.url.query.get("propagationPolicy") == "Foreground"
    assert kube.count("GET", f"/api/v1/namespaces/{NS}/pods") >= 1
    [patch] = kube.requests("PATCH", NODE_STATUS)
    assert patch.url.path == "/api/v1/nodes/gpu-1/status"
    assert patch.headers["Content-Type"] == "application/strategic-merge-patch+json"
    assert patch.data["metadata"]["resourceVersion"]  # guarded
    sent = patch.data["status"]["conditions"]
    assert [(c["type"], c["status"], c["reason"]) for c in sent] == [
        (k.NODE_CONDITION, "Unknown", REASON), (k.LEGACY_NODE_CONDITION, "Unknown", REASON)]
    assert "uninstalled" in sent[0]["message"] and "no fractional pod" in sent[0]["message"]
    assert sent[0]["lastHeartbeatTime"].startswith("2026-12-02T11:59:00")  # the agent's
    assert ours(kube, "gpu-1") == {k.NODE_CONDITION: "Unknown",
                                   k.LEGACY_NODE_CONDITION: "Unknown"}
    assert ours(kube, "gpu-2") == {k.NODE_CONDITION: "False", k.LEGACY_NODE_CONDITION: "False"}
    assert ours(kube, "gpu-3") == {k.NODE_CONDITION: "Unknown"}
    assert "gpu-1" in out


def test_it_waits_for_the_agent_pods_before_touching_a_node(kube, cluster, capsys):
    """An agent still stopping may yet publish False itself: no node is written until every
    pod of the DaemonSet is gone."""
    timer = delete_pods_later(kube, 0.5)
    code, _, err = retire(cluster, capsys, "--wait-seconds", "10")
    timer.join()
    assert (code, err) == (0, "")
    order = [(r.method.value, r.url.path) for r in kube.requests()]
    lists = [i for i, r in enumerate(order) if r == ("GET", f"/api/v1/namespaces/{NS}/pods")]
    patches = [i for i, r in enumerate(order) if r[0] == "PATCH"]
    assert len(lists) >= 2  # polled while the pods were there
    assert patches and min(patches) > max(lists)
    assert order.index(("DELETE", DS_PATH)) < min(lists)


def test_a_conflict_is_read_again_and_retried(kube, cluster, capsys):
    """The node changed between the list and the patch (409): read again, decided again."""
    kube.core.delete_namespaced_pod("agent-a", NS)
    kube.core.delete_namespaced_pod("agent-b", NS)
    kube.fail("PATCH", "/api/v1/nodes/gpu-1/status", 409, times=1)
    code, _, err = retire(cluster, capsys)
    assert (code, err) == (0, "")
    assert kube.count("PATCH", "/api/v1/nodes/gpu-1/status") == 2
    assert kube.count("GET", "/api/v1/nodes/gpu-1") == 1  # the read again
    assert ours(kube, "gpu-1")[k.NODE_CONDITION] == "Unknown"


def test_pods_left_at_the_deadline_are_named_and_the_nodes_still_set_unknown(
        kube, cluster, capsys):
    """An agent pod that does not go (its node unreachable) fails the command, naming it; its
    node's condition is set Unknown all the same: that is what must not stay True."""
    code, _, err = retire(cluster, capsys, "--wait-seconds", "0.2")
    assert code == 1
    assert "2 node agent pod(s) still there after 0.2 s" in err
    assert f"{NS}/agent-a (node gpu-1)" in err and f"{NS}/agent-b (node gpu-2)" in err
    assert ours(kube, "gpu-1")[k.NODE_CONDITION] == "Unknown"


def agent_binding(kube: KubeServer) -> None:
    k8s.RbacAuthorizationV1Api(kube.api_client).create_cluster_role_binding({
        "metadata": {"name": BINDING},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": BINDING},
        "subjects": [{"kind": "ServiceAccount", "name": BINDING, "namespace": NS}]})


def test_agents_left_at_the_deadline_lose_their_rbac_before_the_nodes_are_set_unknown(
        kube, cluster, capsys):
    """Before: an agent that outlived the wait (its kubelet down, its container running, its
    pod never gone) wrote True again at its next heartbeat over the hook's Unknown, and `helm
    uninstall --no-hooks` then left that True with no agent. Now, with agent pods left, the
    node agent's ClusterRoleBinding (its only grant of nodes/status) is deleted BEFORE any node
    is written, so no survivor can write its condition again; the command still exits 1, saying
    so. A binding already gone is fine; one that may not be deleted is named, and the nodes are
    set Unknown all the same."""
    agent_binding(kube)
    code, _, err = retire(cluster, capsys, "--wait-seconds", "0.2",
                          f"--node-agent-binding={BINDING}")
    assert code == 1
    assert "2 node agent pod(s) still there after 0.2 s" in err
    assert "can no longer write their condition" in err
    assert f"clusterrolebinding {BINDING} deleted" in err
    order = [(r.method.value, r.url.path) for r in kube.requests()]
    deletes = [i for i, r in enumerate(order) if r == ("DELETE", BINDING_PATH)]
    patches = [i for i, r in enumerate(order) if r[0] == "PATCH"]
    lists = [i for i, r in enumerate(order) if r == ("GET", f"/api/v1/namespaces/{NS}/pods")]
    assert len(deletes) == 1 and patches
    assert max(lists) < deletes[0] < min(patches)  # after the wait, before any node
    assert ours(kube, "gpu-1")[k.NODE_CONDITION] == "Unknown"
    assert not any(b.metadata.name == BINDING for b in k8s.RbacAuthorizationV1Api(
        kube.api_client).list_cluster_role_binding().items)

    # a second run (a retry of the Job): the binding is gone already, which is fine
    code, _, err = retire(cluster, capsys, "--wait-seconds", "0",
                          "--node-agent-selector=app.kubernetes.io/component=node-agent",
                          f"--node-agent-binding={BINDING}")
    assert code == 1
    assert "can no longer write their condition" in err and "not deleted" not in err

    # a binding that may not be deleted: named, and the nodes are still written
    kube.fail("DELETE", BINDING_PATH, 403)
    kube.core.patch_node_status("gpu-1", {"status": {"conditions": [
        condition(k.NODE_CONDITION, "True")]}})
    code, _, err = retire(cluster, capsys, "--wait-seconds", "0",
                          "--node-agent-selector=app.kubernetes.io/component=node-agent",
                          f"--node-agent-binding={BINDING}")
    assert code == 1
    assert f"clusterrolebinding {BINDING} not deleted" in err
    assert "may write their condition True again" in err
    assert ours(kube, "gpu-1")[k.NODE_CONDITION] == "Unknown"


def test_with_every_agent_gone_their_binding_is_left_to_helm(kube, cluster, capsys):
    """No agent pod left: nothing can write True again, and the binding is Helm's to delete
    with the release (an uninstall that stops later keeps its agents' rights)."""
    agent_binding(kube)
    timer = delete_pods_later(kube, 0.2)
    code, _, err = retire(cluster, capsys, "--wait-seconds", "10",
                          f"--node-agent-binding={BINDING}")
    timer.join()
    assert (code, err) == (0, "")
    assert kube.count(None, BINDING_PATH) == 0
    assert kube.count("PATCH", NODE_STATUS) == 1


def test_what_cannot_be_done_is_named(kube, cluster, capsys):
    """A DaemonSet that cannot be deleted leaves the agents running (they would write True
    again): nothing else is done, and the command fails saying so. A node that may not be
    written is named."""
    kube.fail("DELETE", DS_PATH, 403)
    code, _, err = retire(cluster, capsys)
    assert code == 1
    assert f"daemonset {NS}/{DS} not deleted" in err and "the node agents still run" in err
    assert kube.count("PATCH", NODE_STATUS) == 0

    kube.core.delete_namespaced_pod("agent-a", NS)
    kube.core.delete_namespaced_pod("agent-b", NS)
    kube.fail("PATCH", "/api/v1/nodes/gpu-1/status", 403)
    code, _, err = retire(cluster, capsys)
    assert code == 1
    assert "node gpu-1: its condition still says True" in err


def test_bad_flags_are_usage_errors(cluster, capsys):
    code, _, err = retire(cluster, capsys, "--node-agent-daemonset", "no-slash")
    assert code == 2 and "--node-agent-daemonset must be NAMESPACE/NAME" in err
    code, _, err = retire(cluster, capsys, "--wait-seconds", "-1")
    assert code == 2 and "--wait-seconds" in err
    code, _, err = retire(cluster, capsys, "--node-agent-binding", f"{NS}/{BINDING}")
    assert code == 2 and "--node-agent-binding must be a ClusterRoleBinding's name" in err


def test_a_deadline_shorter_than_the_wait_is_a_usage_error(cluster, capsys):
    """A deadline that the wait for the agents would use up leaves no time for the nodes."""
    for flags in (("--deadline-seconds", "0"), ("--deadline-seconds", "60"),
                  ("--wait-seconds", "10", "--deadline-seconds", "10")):
        code, _, err = retire(cluster, capsys, *flags)
        assert code == 2 and "--deadline-seconds must be more than --wait-seconds" in err, flags


# -- a large cluster, a deadline: against a scripted API (kmock neither pages nor hangs) -------


class ScriptedApi:
    """Nodes (all True) served in pages of `page` whatever the `limit` asked (as an API server
    that pages); the first `hung_lists` node lists and every PATCH when `hang_patches` get no
    answer; each PATCH otherwise takes `patch_seconds`. No DaemonSet: no agent to wait for."""

    def __init__(self, count: int, *, page: int = 3, hung_lists: int = 0,
                 hang_patches: bool = False, patch_seconds: float = 0.0,
                 not_a_node: frozenset[str] = frozenset()) -> None:
        self.nodes = {f"gpu-{i:02d}": node(f"gpu-{i:02d}", condition(k.NODE_CONDITION, "True"))
                      for i in range(count)}
        for i, n in enumerate(self.nodes.values()):
            n["metadata"]["resourceVersion"] = str(i + 1)
        self.page, self.hung_lists, self.hang_patches = page, hung_lists, hang_patches
        self.patch_seconds = patch_seconds
        self.not_a_node = not_a_node
        """Nodes whose PATCH is a conflict (409), and whose read then answers 200 with what is
        no node (a proxy's `{"ok": true}`)."""
        self.lists: list[dict[str, str]] = []
        self.patches: list[str] = []
        self.in_flight = self.most_in_flight = 0

    async def _serve(self, request):
        from aiohttp import web

        path = request.path
        if path == "/api/v1/nodes":
            self.lists.append(dict(request.query))
            if len(self.lists) <= self.hung_lists:
                await self._released.wait()
            start = int(request.query.get("continue") or 0)
            names = sorted(self.nodes)[start:start + self.page]
            more = start + self.page < len(self.nodes)
            return web.json_response({"kind": "NodeList", "metadata": {
                "resourceVersion": "100", **({"continue": str(start + self.page)} if more
                                            else {})},
                "items": [self.nodes[name] for name in names]})
        if request.method == "PATCH" and path.endswith("/status"):
            name, body = path.split("/")[4], await request.json()
            self.patches.append(name)
            if name in self.not_a_node:
                return web.json_response({"kind": "Status", "code": 409, "reason": "Conflict",
                                          "message": "changed"}, status=409)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                if self.hang_patches:
                    await self._released.wait()
                    return web.Response(status=503)
                await asyncio.sleep(self.patch_seconds)
            finally:
                self.in_flight -= 1
            for sent in body["status"]["conditions"]:
                for old in self.nodes[name]["status"]["conditions"]:
                    if old["type"] == sent["type"]:
                        old.update(sent)
            return web.json_response(self.nodes[name])
        if path.startswith("/api/v1/nodes/"):
            name = path.split("/")[4]
            return web.json_response({"ok": True} if name in self.not_a_node
                                     else self.nodes[name])
        return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound",
                                  "message": "not found"}, status=404)

    def still_true(self) -> list[str]:
        return [name for name, n in self.nodes.items()
                if any(c["status"] == "True" for c in n["status"]["conditions"]
                       if c["type"] == k.NODE_CONDITION)]

    def __enter__(self) -> ScriptedApi:
        from aiohttp import web

        ready = threading.Event()

        async def serve() -> None:
            self._released = asyncio.Event()
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._serve)
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = runner.addresses[0][1]
            self._stop = asyncio.Event()
            ready.set()
            await self._stop.wait()
            self._released.set()
            await runner.cleanup()

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(serve(),),
                                        daemon=True)
        self._thread.start()
        assert ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "x",
            "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}]}))
        return path


ADVICE = 'docs/chart.md, "Uninstalling"'


def test_nodes_are_listed_in_pages_and_every_page_is_retired(tmp_path, capsys):
    """Before: one unpaged GET of every node (at 5,000 nodes of ~12 KB the Job's 256Mi limit
    killed it, exit 137, saying nothing). Now the nodes are listed in pages (`limit`, then
    `continue`), each page cut down as it arrives, and the nodes of every page are set
    Unknown."""
    with ScriptedApi(7, page=3) as api:
        code, out, err = retire(api.kubeconfig(tmp_path / "kc"), capsys, "--wait-seconds", "0")
    assert (code, err) == (0, "")
    assert len(api.lists) == 3 and all(q.get("limit") == "500" for q in api.lists)
    assert [q.get("continue") for q in api.lists] == [None, "3", "6"]
    assert api.still_true() == [] and sorted(api.patches) == sorted(api.nodes)
    assert f"set Unknown ({REASON}) on 7 node(s)" in out


def test_a_node_list_that_times_out_is_listed_again(monkeypatch, tmp_path, capsys):
    """Before: a node list slower than the client's timeout ended the run, nothing changed and
    nothing retried. Now a list that fails transiently (no answer in time) is listed again, a
    few times, and the nodes are set Unknown."""
    from kai_fractions.cli import retire_nodes

    monkeypatch.setattr(retire_nodes, "REQUEST_SECONDS", 0.5, raising=False)
    with ScriptedApi(4, hung_lists=1) as api:
        code, _, err = retire(api.kubeconfig(tmp_path / "kc"), capsys, "--wait-seconds", "0")
    assert (code, err) == (0, "")
    assert len(api.lists) >= 2 and api.still_true() == []


def test_a_deadline_stops_the_run_saying_what_is_left_and_what_to_do(tmp_path, capsys):
    """Before: with PATCHes that hang, 5 tries of 10 s per node, one node after another, ran
    far past the Job's activeDeadlineSeconds, which killed it with nothing said (what was left
    was printed only at the very end). Now `--deadline-seconds` bounds the whole run: at the
    deadline it stops, names the nodes still True, exits 1, and ends with what to do."""
    with ScriptedApi(12, hang_patches=True) as api:
        started = time.monotonic()
        code, _, err = retire(api.kubeconfig(tmp_path / "kc"), capsys, "--wait-seconds", "0",
                              "--deadline-seconds", "3")
        took = time.monotonic() - started
    assert code == 1 and took < 4.5, (code, took)
    assert "--deadline-seconds" in err and "12 node(s)" in err
    assert all(name in err for name in api.nodes)
    lines = err.strip().splitlines()
    assert ADVICE in lines[-1] and "helm uninstall" in lines[-1], lines[-1]


def test_nodes_are_written_a_few_at_a_time(monkeypatch, tmp_path, capsys):
    """Before: one node after another (2,000 nodes took over a minute). Now several at once,
    and never more than CONCURRENCY PATCHes in flight."""
    from kai_fractions.cli import retire_nodes

    monkeypatch.setattr(retire_nodes, "CONCURRENCY", 4, raising=False)
    with ScriptedApi(13, page=5, patch_seconds=0.1) as api:
        code, _, err = retire(api.kubeconfig(tmp_path / "kc"), capsys, "--wait-seconds", "0")
    assert (code, err) == (0, "")
    assert api.most_in_flight == 4 and api.still_true() == []


def test_a_run_that_leaves_something_ends_saying_what_to_do(kube, cluster, capsys):
    """Before: exit 1 named what was left but not what to do about it. Now its last line points
    to the uninstall steps (fix what is named and run helm uninstall again; agent pods on
    unreachable nodes: those nodes first, then --no-hooks and the hook's objects)."""
    code, _, err = retire(cluster, capsys, "--wait-seconds", "0.2")
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert ADVICE in last and "helm uninstall" in last and "--no-hooks" in last, last


def test_a_read_that_is_no_node_is_never_taken_for_a_retired_one(tmp_path, capsys):
    """Before: after a conflict the node was read again, and a 200 answer that is no node (a
    proxy's `{"ok": true}`) held no True condition, so the node counted as retired: exit 0,
    "done", while it still said True (second look S4). Now such an answer is named as what it
    is, the node as maybe still True, and the run exits 1 saying what to do."""
    with ScriptedApi(4, not_a_node=frozenset({"gpu-02"})) as api:
        code, _, err = retire(api.kubeconfig(tmp_path / "kc"), capsys, "--wait-seconds", "0")
    assert code == 1 and api.still_true() == ["gpu-02"]
    assert "node gpu-02: its condition may still say True (the answer to read node gpu-02 is " \
        "not that node)" in err
    assert ADVICE in err.strip().splitlines()[-1]


def test_one_nodes_surprise_does_not_cancel_the_others(monkeypatch, tmp_path, capsys):
    """Before: an exception other than the API client's in one node's writer made the task
    group cancel the writers in flight, and the run ended in a traceback naming none of the
    nodes still True (second look S4). Now that node is named as maybe still True and every
    other node is set Unknown."""
    from kai_fractions.cli import retire_node_conditions

    real = retire_node_conditions._retire_node

    async def surprising(kube, name, *args):
        if name == "gpu-01":
            raise AttributeError("'NoneType' object has no attribute 'get'")
        return await real(kube, name, *args)

    monkeypatch.setattr(retire_node_conditions, "_retire_node", surprising)
    with ScriptedApi(6, patch_seconds=0.05) as api:
        code, _, err = retire(api.kubeconfig(tmp_path / "kc"), capsys, "--wait-seconds", "0")
    assert code == 1 and api.still_true() == ["gpu-01"]
    assert "node gpu-01: its condition may still say True (AttributeError: " in err
    assert ADVICE in err.strip().splitlines()[-1]
