"""KubePodStore over a scripted Kube: what a request's answer means to the mirror."""

from __future__ import annotations

import random

from kai_fractions.kube import errors as kerr
from kai_fractions.kube.retry import Backoff
from kai_fractions.mirror.kube_store import KubePodStore
from kai_fractions.mirror.store import PodSnapshot
from tests.support.clock import FakeClock


class EventsKube:
    """Stores POSTed events by name as an API server does (409 AlreadyExists for a name it
    has); the answer to the first POST is lost after it landed."""

    def __init__(self) -> None:
        self.events: dict[str, dict] = {}
        self.posts = 0

    async def request(self, method, path, *, what, body=None, timeout=None, **_):
        self.posts += 1
        name = body["metadata"]["name"]
        if name in self.events:
            raise kerr.refused(what, 409, "Conflict", b'{"reason":"AlreadyExists"}')
        self.events[name] = body
        if self.posts == 1:
            raise kerr.unreachable(what, TimeoutError())
        return body

    async def close(self) -> None:
        pass


def store_over(kube) -> KubePodStore:
    return KubePodStore(kube, backoff=Backoff(attempts=3, base=0.001), clock=FakeClock(),
                        rng=random.Random(0))


POD = PodSnapshot.from_object({"metadata": {"name": "p", "namespace": "ns", "uid": "u",
                                            "resourceVersion": "3"}})


async def test_an_event_whose_answer_was_lost_is_recorded_once_and_not_an_error():
    kube = EventsKube()
    await store_over(kube).emit_event(POD, "Warning", "Unsigned", "not signed")
    assert (len(kube.events), kube.posts) == (1, 2)  # the retry met it: 409, success


class NodeKube:
    async def request(self, method, path, *, what, timeout=None, **_):
        assert (method, path) == ("GET", "/api/v1/nodes/node-1")
        return {"metadata": {"name": "node-1", "uid": "node-uid-1",
                             "labels": {"nvidia.com/gpu.memory": 40960}}}

    async def close(self) -> None:
        pass


async def test_a_nodes_labels_come_with_its_uid():
    labels = await store_over(NodeKube()).node_labels("node-1")
    assert labels == {"nvidia.com/gpu.memory": "40960"} and labels.uid == "node-uid-1"
