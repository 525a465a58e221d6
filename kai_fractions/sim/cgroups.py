"""A simulated cgroup filesystem, for the demo's simulated node (and tests).

The demo runs the node agent without a kubelet, so no pod has a cgroup on disk; the engine still
checks that a container's cgroup exists before it sets a limit on it, and lists the pod cgroups
to sweep stale limits. `FakeCgroupFs` answers both from memory, and tells whoever asked
(`on_remove`: the simulated NVML, whose limits go with a removed cgroup) of each removal.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable


class FakeCgroupFs:
    """An in-memory cgroup tree with `CgroupFs`'s methods.

    `assume_present=True` answers every `exists` with yes, as if a kubelet had created each
    pod's cgroups: a simulated node (the demo) has no kubelet. Listing still shows only the
    paths added, so the stale-limit sweep finds only those."""

    def __init__(self, paths: Iterable[str] = (), *, assume_present: bool = False):
        self._dirs: set[str] = set()
        self.assume_present = assume_present
        self._removal_hooks: list[Callable[[str], None]] = []
        for p in paths:
            self.add(p)

    def add(self, path: str) -> None:
        path = path.rstrip("/") or "/"
        while path not in ("/", ""):
            self._dirs.add(path)
            path = os.path.dirname(path)

    def on_remove(self, hook: Callable[[str], None]) -> None:
        """`hook(path)` after each `remove(path)`."""
        self._removal_hooks.append(hook)

    def remove(self, path: str) -> None:
        """The cgroup `path` and everything below it are gone (also with `assume_present`:
        `exists` still says yes then, but what went with the cgroup is gone)."""
        path = path.rstrip("/")
        self._dirs = {d for d in self._dirs if d != path and not d.startswith(path + "/")}
        for hook in self._removal_hooks:
            hook(path or "/")

    def exists(self, path: str) -> bool:
        return self.assume_present or path.rstrip("/") in self._dirs

    def list_dirs(self, path: str) -> tuple[str, ...]:
        base = path.rstrip("/") + "/"
        return tuple(sorted(d[len(base):] for d in self._dirs
                            if d.startswith(base) and "/" not in d[len(base):]))
