"""`--list-from-watch-cache`: a list from the API server's watch cache may lag behind etcd and
lack a pod started meanwhile. The pods such a list lacks that the agent knew, or holds a marker
for, keep their limits and markers until a consistent list confirms them gone; while none
answers, nothing is applied or cleared."""

from __future__ import annotations

from pathlib import Path

from kai_fractions.kube.errors import KubeError
from kai_fractions.node.agent.reconciler import UNCONFIRMED

from .builders import NODE, Rig
from .test_reconcile import add_pod, slice_of

CACHED = {"list_from_watch_cache": True}


def lagging_list(rig: Rig, *missing: str) -> None:
    """What a watch cache behind etcd answers: the node's pods without `missing`."""
    rig.agent.cache.replace([p for p in rig.cluster.pods_on(NODE)
                             if p["metadata"]["uid"] not in missing], consistent=False)


def applied(short_tmp: Path) -> tuple[Rig, str, dict, str]:
    rig = Rig(short_tmp, sm_sharing=False, options=CACHED)
    uid = add_pod(rig)
    assert rig.step().converged
    return rig, uid, dict(rig.nvml.limits), rig.marker_path(uid).read_text()


def restarted(rig: Rig, short_tmp: Path) -> Rig:
    """A new agent process over the same GPU, cgroups, markers and cluster: it knew no pod."""
    new = Rig(short_tmp, sm_sharing=False, nvml=rig.nvml, options=CACHED)
    new.cluster, new.cgroups = rig.cluster, rig.cgroups
    new.agent = type(rig.agent)(config=new.config, options=new.options, nvml=rig.nvml,
                                cgroup_fs=rig.cgroups, source=rig.cluster, cluster=rig.cluster)
    new.reconciler = new.agent.reconciler
    return new


def test_a_running_pod_a_lagging_list_lacks_keeps_its_limits_and_marker(short_tmp: Path):
    rig, uid, limits, written = applied(short_tmp)
    for agent in (rig, restarted(rig, short_tmp)):  # it knew the pod; it holds only a marker
        lagging_list(agent, uid)
        asked = len(rig.cluster.list_versions)
        assert agent.reconciler.reconcile().converged
        assert rig.cluster.list_versions[asked:] == [""]  # one consistent list confirmed it
        assert rig.nvml.limits == limits and rig.marker_path(uid).read_text() == written
        assert uid in agent.agent.cache.snapshot() and agent.agent.cache.consistent


def test_a_lagging_list_that_lacks_nothing_known_costs_no_consistent_list(short_tmp: Path):
    rig, _, limits, _ = applied(short_tmp)
    lagging_list(rig)
    asked = len(rig.cluster.list_versions)
    assert rig.reconciler.reconcile().converged
    assert rig.cluster.list_versions[asked:] == [] and rig.nvml.limits == limits


def test_while_no_consistent_list_answers_nothing_is_applied_or_cleared(short_tmp: Path):
    rig, uid, limits, written = applied(short_tmp)
    new = add_pod(rig, "q")
    lagging_list(rig, uid)
    rig.cluster.fail("list_pods", KubeError("etcd: request timed out"))
    report = rig.reconciler.reconcile()
    assert not report.converged and UNCONFIRMED in report.errors
    assert rig.nvml.limits == limits and rig.marker_path(uid).read_text() == written
    assert not rig.marker_path(new).exists()  # the new pod waits for the confirmation too
    assert rig.reconciler.reconcile().converged  # the API answers again
    assert rig.marker_path(new).exists() and rig.marker_path(uid).read_text() == written


def test_a_pod_the_consistent_list_lacks_too_is_gone_and_released(short_tmp: Path):
    rig, uid, _, _ = applied(short_tmp)
    rig.cluster.delete_pod(uid)
    lagging_list(rig)
    asked = len(rig.cluster.list_versions)
    assert rig.reconciler.reconcile().converged
    assert rig.cluster.list_versions[asked:] == [""]
    assert not any(key[1].startswith(slice_of(uid)) for key in rig.nvml.limits)
    assert not rig.marker_path(uid).parent.exists()


def test_once_a_pass_found_nothing_missing_a_deletion_the_watch_brings_costs_no_list(
        short_tmp: Path):
    # A watch event is newer than any list: only what a cached list lacks needs a confirmation.
    rig, uid, _, _ = applied(short_tmp)
    lagging_list(rig)
    assert rig.reconciler.reconcile().converged
    asked = len(rig.cluster.list_versions)
    rig.cluster.delete_pod(uid)
    rig.agent.cache.remove(uid)  # the watch's DELETED event
    assert rig.reconciler.reconcile().converged
    assert rig.cluster.list_versions[asked:] == []
    assert not rig.marker_path(uid).parent.exists()


def test_a_list_that_replaces_the_confirmed_one_meanwhile_clears_nothing(short_tmp: Path):
    # While the consistent list that confirms what list N lacks is on its way, the loop lists
    # again from a watch cache that lags differently (list N+1 lacks a running pod of its
    # own). The confirmation vouches for list N only: nothing N+1 lacks may be cleared.
    rig = Rig(short_tmp, sm_sharing=False, options=CACHED)
    first, second = add_pod(rig, "p1"), add_pod(rig, "p2")
    assert rig.step().converged
    limits, written = dict(rig.nvml.limits), rig.marker_path(second).read_text()
    lagging_list(rig, first)
    confirm = rig.agent.cache.confirm

    def relisted_meanwhile(generation, found):
        lagging_list(rig, second)
        confirm(generation, found)

    rig.agent.cache.confirm = relisted_meanwhile
    report = rig.reconciler.reconcile()
    rig.agent.cache.confirm = confirm
    assert not report.converged and UNCONFIRMED in report.errors
    assert rig.nvml.limits == limits and rig.marker_path(second).read_text() == written
    assert not rig.agent.cache.consistent
    # The next pass confirms what the newer list lacks: both pods run on, as they were.
    assert rig.reconciler.reconcile().converged
    assert rig.nvml.limits == limits and rig.marker_path(second).read_text() == written
    assert rig.agent.cache.consistent and {first, second} <= set(rig.agent.cache.snapshot())
