"""API faults under the node agent's list/watch and writes: HTTP 429/500/503/410 answers, a
watch cut mid-stream, connections reset on connect, connections that never answer, a 409 on
its annotation patch. After each, the agent converges on what the cluster says (pods created
during the outage applied, pods deleted during it released, nothing else), and at no moment
is a pod marked ready without its limit on the GPU."""

from __future__ import annotations

import time

import pytest

from tests.agent.builders import wait_for

from .agent_rig import GIB, AgentRig, agent_over_proxy, slice_of

pytestmark = [pytest.mark.faults, pytest.mark.integration]

PODS = "/api/v1/pods"


def applied(rig: AgentRig, uid: str) -> bool:
    body = rig.markers().get(uid)
    return bool(body) and body["containers"]["main"]["state"] == "applied"


def watch_until(rig: AgentRig, predicate, what: str, timeout: float = 20.0) -> None:
    """Wait, checking the invariant at every look."""
    def check():
        assert rig.ready_without_limits() == []
        return predicate()
    wait_for(check, timeout=timeout, interval=0.05, what=what)


def converged(rig: AgentRig, live: set[str]) -> None:
    watch_until(rig, lambda: set(rig.markers()) == live
                and all(applied(rig, u) for u in live)
                and set(rig.limits()) == {slice_of(u) for u in live}
                and rig.marker_dirs() == live, what=f"convergence on {sorted(live)}")
    assert rig.limits() == {slice_of(u): (10 * GIB, 20 * GIB) for u in live}


@pytest.mark.parametrize("status", [429, 500, 503, 410])
def test_failing_lists_at_start_then_convergence(kube, tmp_path, status):
    fault = kube.fail("GET", PODS, status, times=2)
    with agent_over_proxy(kube, tmp_path) as rig:
        uid = rig.create_pod("a")
        converged(rig, {uid})
        assert fault.hits == 2


def test_a_watch_cut_mid_stream_misses_nothing(kube, tmp_path):
    with agent_over_proxy(kube, tmp_path) as rig:
        first = rig.create_pod("a")
        converged(rig, {first})
        # the API goes away: open streams reset, the next 3 connections reset on connect
        rig.proxy.reset_next = 3
        assert rig.proxy.reset_all() >= 1
        second = rig.create_pod("b")  # while the agent cannot see
        rig.delete_pod("a")
        converged(rig, {second})
        assert rig.proxy.resets >= 4


def test_connections_that_never_answer_time_out_and_the_agent_recovers(kube, tmp_path):
    with agent_over_proxy(kube, tmp_path) as rig:
        first = rig.create_pod("a")
        converged(rig, {first})
        rig.proxy.stall = True
        rig.proxy.reset_all()  # the watch has to reconnect, into the stall
        second = rig.create_pod("b")
        time.sleep(2.5)  # longer than the list timeout: at least one request timed out
        assert not applied(rig, second)  # not seen yet, so not applied, and not marked
        assert rig.agent.cache.last_error  # the agent knows the API is failing
        rig.proxy.stall = False
        rig.proxy.reset_all()
        converged(rig, {first, second})


def test_a_conflict_on_the_annotation_patch_is_retried_before_the_marker(kube, tmp_path):
    """Following an unmodified KAI the agent writes the derived annotations itself, and the
    marker only after them; a 409 (the pod changed under it) just delays both."""
    with agent_over_proxy(kube, tmp_path) as rig:
        path = "/api/v1/namespaces/default/pods/a"
        fault = kube.fail("PATCH", path, 409, times=1)
        uid = rig.create_pod("a")
        converged(rig, {uid})
        assert fault.hits == 1
        assert kube.count("PATCH", path) == 2
        notes = kube.get_object("v1/pods", "default", "a")["metadata"]["annotations"]
        assert notes["kai-fractions.io/container.main.memory-limit-mib"] == "20480"


def test_api_errors_on_writes_do_not_stop_enforcement(kube, tmp_path):
    """Events and the node condition failing (500) change nothing on the GPU."""
    kube.fail("POST", "/api/v1/namespaces/default/events", 500, times=3)
    kube.fail("PATCH", "/api/v1/nodes/gpu-node-1/status", 503, times=2)
    with agent_over_proxy(kube, tmp_path) as rig:
        uid = rig.create_pod("a")
        converged(rig, {uid})
        wait_for(lambda: [e for e in kube.core.list_namespaced_event("default").items
                          if e.reason == "Applied"], timeout=20, what="the Applied event")
