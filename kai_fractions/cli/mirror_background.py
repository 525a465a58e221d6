"""What `kai-fractions mirror` runs on its event loop besides serving: the public key's
publisher, the GpuFractioningConfig reporter and the BindRequest follower (under leader
election when asked)."""

from __future__ import annotations

import argparse

from ..contract import Dialect, Keys


def background(args: argparse.Namespace, kube, *, keys: Keys, dialect: Dialect, keyring,
               election, publish_to: list[str], daemonset: list[str], metrics=None
               ) -> tuple[list, object]:
    """The mirror's work besides serving, as tasks of its event loop (callables that return
    coroutines, run until cancelled), and the public key's publisher when there is one."""
    from ..mirror.kube_store import KubePodStore

    tasks: list = []
    publisher = None
    if publish_to and keyring is not None:
        from ..mirror.public_key import Publisher

        publisher = Publisher(kube, *publish_to, keyring)
        tasks.append(publisher.run)
    if args.report_gpu_fractioning_config:
        from ..mirror.kai_dependency import Reporter

        tasks.append(Reporter(kube, *daemonset, interval=args.report_interval).run)
    if args.follow_bindrequests:
        from ..mirror.bindrequests import bindrequest_source, follow
        from ..mirror.follower import BindRequestView, Follower

        follower = Follower(KubePodStore(kube), keys=keys, default_reserve_mib=args.reserve_mib,
                            dialect=dialect, signer=keyring,
                            reservation_namespace=args.reservation_namespace)

        async def handle(obj) -> None:
            br = BindRequestView.from_object(obj)
            if metrics is None:
                await follower.follow_one(br)
            else:
                await metrics.check(follower.follow_one, br)

        async def follow_bindrequests() -> None:
            await follow(bindrequest_source(kube), handle, forget=follower.forget,
                         concurrency=args.follow_concurrency)

        if election is None:
            tasks.append(follow_bindrequests)
            if metrics is not None:
                metrics.watch_leading(lambda: True)
        else:  # the same loop, while holding the Lease
            from ..mirror.leader import KubeLease, LeaderElector

            elector = LeaderElector(KubeLease(kube, election.namespace, election.name),
                                    election)

            async def follow_while_leading() -> None:
                await elector.run(follow_bindrequests)

            tasks.append(follow_while_leading)
            if metrics is not None:
                metrics.watch_leading(lambda: elector.leading)
    return tasks, publisher


async def first_publish(publisher, kube) -> None:
    try:
        await publisher.try_publish()
    finally:
        await kube.close()
