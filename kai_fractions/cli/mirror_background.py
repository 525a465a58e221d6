"""What `kai-fractions mirror` runs on its event loop besides serving: the public key's
publisher, the GpuFractioningConfig reporter and the BindRequest follower (under leader
election when asked)."""

from __future__ import annotations

import argparse
import os

from ..contract import Dialect, Keys


def background(args: argparse.Namespace, kube, *, keys: Keys, dialect: Dialect, keyring,
               election, publish_to: list[str], daemonset: list[str], metrics=None
               ) -> tuple[list, object]:
    """The mirror's work besides serving, as tasks of its event loop (callables that return
    coroutines, run until cancelled), and the public key's publisher when there is one."""
    from ..mirror.kube_store import KubePodStore

    tasks: list = []
    in_term = None  # with leader election: whether this replica holds the Lease now
    if args.report_gpu_fractioning_config:
        from ..mirror.kai_dependency import Reporter

        tasks.append(Reporter(kube, *daemonset, interval=args.report_interval).run)
    if args.follow_bindrequests:
        from ..mirror.bindrequest_view import BindRequestView
        from ..mirror.bindrequests import bindrequest_source, follow
        from ..mirror.follower import Follower

        elector = lease_kube = None
        if election is not None:
            from ..kube.client import Kube
            from ..mirror.leader import LEASE_CONNECTIONS, KubeLease, LeaderElector

            # A client of its own, from the same configuration: the Lease's requests never
            # wait for a connection behind the calls' pod requests (a burst of them against an
            # API server slow for pods would cost the Lease), nor count against their pool.
            lease_kube = Kube(kube.api_client, connections=LEASE_CONNECTIONS,
                              request_timeout=kube.request_timeout, observe=kube.observe)
            elector = LeaderElector(KubeLease(lease_kube, election.namespace, election.name),
                                    election)
        in_term = elector.in_term if elector is not None else None

        follower = Follower(KubePodStore(kube), keys=keys, default_reserve_mib=args.reserve_mib,
                            dialect=dialect, signer=keyring,
                            reservation_namespace=args.reservation_namespace, in_term=in_term)

        liveness = None
        if args.mark_silent_nodes_after:
            from ..contract.keys import LEGACY_NODE_CONDITION, NODE_CONDITION
            from ..mirror.leader import own_namespace
            from ..mirror.node_liveness import NodeLiveness

            liveness = NodeLiveness(
                kube, args.node_condition or (NODE_CONDITION, LEGACY_NODE_CONDITION),
                stale_after_seconds=args.mark_silent_nodes_after,
                lease_namespace=args.heartbeat_lease_namespace or own_namespace(os.environ),
                on_marked=metrics.node_marked_silent if metrics is not None else None,
                on_failed=metrics.node_check_failed if metrics is not None else None,
                on_cleared=metrics.node_no_longer_silent if metrics is not None else None,
                in_term=in_term)

        async def handle(br: BindRequestView) -> object:
            if liveness is not None and _placing_now(br, args.mark_silent_nodes_after):
                liveness.saw(br.selected_node)
            # The result goes back to the loop: it checks again what may pass by itself.
            if metrics is None:
                return await follower.follow_one(br)
            return await metrics.check(follower.follow_one, br)

        async def follow_bindrequests() -> None:
            try:
                await follow(bindrequest_source(kube), handle, forget=follower.forget,
                             concurrency=args.follow_concurrency)
            finally:
                if liveness is not None:
                    await liveness.close()

        if elector is None:
            tasks.append(follow_bindrequests)
            if metrics is not None:
                metrics.watch_leading(lambda: True)
        else:  # the same loop, while holding the Lease
            async def follow_while_leading() -> None:
                try:
                    await elector.run(follow_bindrequests)
                finally:  # cancelled at shutdown, after the Lease's release
                    await lease_kube.close()

            tasks.append(follow_while_leading)
            if metrics is not None:
                metrics.watch_leading(lambda: elector.leading)
    publisher = None
    if publish_to and keyring is not None:
        from ..mirror.public_key import Publisher

        # Under election only the Lease's holder overwrites the ConfigMap: replicas that see
        # different key sets mid-rotation would otherwise take turns rewriting it.
        publisher = Publisher(kube, *publish_to, keyring, in_term=in_term)
        tasks.insert(0, publisher.run)
    return tasks, publisher


def _placing_now(br, stale_after: float) -> bool:
    """Whether KAI made this bind lately: a resync replays every BindRequest, and only the
    nodes KAI is placing pods on now are worth a read (BindRequestView.created)."""
    from ..kube.objects import seconds_since

    age = seconds_since(br.created) if br.created else None
    return age is None or age <= stale_after


async def first_publish(publisher, kube) -> None:
    try:
        await publisher.try_publish()
    finally:
        await kube.close()
