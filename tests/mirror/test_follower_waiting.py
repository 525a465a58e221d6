"""A BindRequest not Succeeded yet and within its grace is "waiting", not incomplete: every bind
is so for a moment, so it is counted as `waiting` and its rechecks log nothing at INFO.

Before, each normal bind logged "not complete; checked again in N s" at INFO for every recheck
of its fresh Pending version and counted as `skipped` (the reviewer's probe
p2_pending_log_noise.py: 200 normal binds, 600 INFO lines).
"""

from __future__ import annotations

import logging

from prometheus_client import generate_latest

from kai_fractions.kube.retry import Backoff
from kai_fractions.mirror.bindrequest_view import BindRequestView
from kai_fractions.mirror.follower import PENDING_GRACE, Follower
from kai_fractions.mirror.metrics import MirrorMetrics, check_result
from tests.support.fake_store import FakePodStore

from .test_follower import NS, SIGNATURE, one_group_store
from .test_follower_pending import Clock, Following, bound_pod, signer, still_pending
from .test_follower_rechecks import QueueSource

FAST = Backoff(attempts=1_000_000, base=0.005, cap=0.02)
BINDS = 5


def store() -> FakePodStore:
    return one_group_store()


async def test_normal_binds_log_nothing_at_info_while_they_wait(caplog):
    pods = store()
    source = QueueSource()
    following = Following(source, Follower(pods, signer=signer(), now=Clock(1)),
                          recheck_backoff=FAST)
    uids = [pods.add_pod(bound_pod(f"train-{i}")).uid for i in range(BINDS)]
    with caplog.at_level(logging.DEBUG, logger="kai_fractions.mirror"):
        for i, uid in enumerate(uids):
            source.events.put_nowait(("ADDED", uid_of(still_pending(
                uid, name=f"br-{i}", pod_name=f"train-{i}", rv="2"), i)))
        # Rechecked while they wait (the binder works through its queue)...
        await following.until(lambda: all(following.count(f"br-{i}") >= 3
                                          for i in range(BINDS)))
        for i, uid in enumerate(uids):  # ...then KAI's binder reports them Succeeded
            source.events.put_nowait(("MODIFIED", uid_of(still_pending(
                uid, name=f"br-{i}", pod_name=f"train-{i}", phase="Succeeded", rv="3"), i)))
        await following.until(lambda: all(SIGNATURE in pods.annotations(NS, f"train-{i}")
                                          for i in range(BINDS)))
        await following.stop()
    follow_log = [r for r in caplog.records if r.name == "kai_fractions.mirror.bindrequests"]
    assert [r.getMessage() for r in follow_log if r.levelno >= logging.INFO] == []
    assert any("waiting for KAI's binder; checked again in" in r.getMessage()
               for r in follow_log if r.levelno == logging.DEBUG)


def uid_of(br: dict, i: int) -> dict:
    return {**br, "metadata": {**br["metadata"], "uid": f"br-uid-{i}"}}


async def test_a_waiting_check_is_counted_as_waiting_not_skipped():
    pods = store()
    created = pods.add_pod(bound_pod("train-0", node=None))
    metrics = MirrorMetrics()
    follower = Follower(pods, signer=signer(), now=Clock(PENDING_GRACE - 1))
    view = BindRequestView.from_object(still_pending(created.uid))
    waiting = await metrics.check(follower.follow_one, view)
    assert waiting is not None and waiting.waiting and check_result(waiting) == "waiting"
    follower.now = Clock(PENDING_GRACE)  # past the grace, the pod not bound yet: skipped
    assert check_result(await metrics.check(follower.follow_one, view)) == "skipped"
    text = generate_latest(metrics.registry).decode()
    assert 'kai_fractions_follower_checks_total{result="waiting"} 1.0' in text
    assert 'kai_fractions_follower_checks_total{result="skipped"} 1.0' in text


def test_the_help_text_names_waiting_and_no_longer_not_fractional():
    """Non-fractional BindRequests never reach a check (`fractional_view`)."""
    text = generate_latest(MirrorMetrics().registry).decode()
    (help_line,) = [line for line in text.splitlines()
                    if line.startswith("# HELP kai_fractions_follower_checks_total ")]
    assert "waiting (" in help_line and "not fractional" not in help_line
