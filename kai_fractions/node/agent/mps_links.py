"""sm-sharing on MPS daemons without v3 namespaces (drivers before r615).

The contract gives every sm-sharing container `CUDA_MPS_PIPE_DIRECTORY=<root>/shared/<namespace>`
(the mirror and the gate compute the same value, whatever the node's driver), and the container
mounts that directory (a subPath the kubelet resolves; pods wired before mount `<root>/shared`).
A legacy daemon has one pipe directory, which the supervisor puts in `<root>/shared/legacy`
(`mps.daemon.legacy_pipe_dir`). So the agent makes `<root>/shared/<namespace>` a RELATIVE
symlink to `legacy` (its sibling): it resolves to the daemon's directory on the host, for the
kubelet's subPath, and equally inside a whole-directory mount (an absolute target would
name a host path the container does not have). Released with the pod.

What this does NOT give: a per-container compute cap the daemon enforces. The active-thread
percentage then reaches MPS only through the client's own CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (the
webhook sets it from the pod's annotations), which a process can change for itself: weaker than a
namespace, and reported as such (node condition message, GetNodeState, marker message). Nor a
memory cap by the daemon's default pinned limit: the directory every container reaches is the
daemon's own, control pipe included, so any tenant's process (root or not) can change that
limit, a server's, or end another tenant's clients. The agent still sets the limit, and counts
it as no tier (`plan_refusals.hard_tiers_of`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

from ...contract.plan import MPS_SERVER
from ..desired import ComputeEnforcement, ContainerKey, DesiredState
from ..engine import ContainerResult, ContainerState, is_our_namespace
from ..errors import NodeError
from ..mps.daemon import LEGACY_DIR

log = logging.getLogger(__name__)

LINK_TARGET = LEGACY_DIR
"""Relative: the legacy daemon's directory beside the link (an older agent's `..` is replaced)."""
LEGACY_MPS_LINK = "MPSPipeLinkFailed"
LEGACY_MPS_NOTE = ("compute cap through the client's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE only: this "
                   "MPS daemon has no namespaces (driver before r615), so it is not enforced by "
                   "the daemon; nor is a GPU memory cap by the daemon's default pinned limit, "
                   "which the agent sets but every sm-sharing tenant of the node can change (its "
                   "pipe directory, which each one mounts, holds the daemon's control pipe)")
"""What GetNodeState says of such a container."""


class LegacyPipeLinks:
    def __init__(self, pipe_dir: str, server: str = MPS_SERVER):
        self.server_dir = os.path.join(pipe_dir, server)

    def path(self, namespace: str) -> str:
        return os.path.join(self.server_dir, namespace)

    def ensure(self, namespace: str) -> bool:
        """Creates the link (True when it had to); raises NodeError when the path is taken by
        something that is not our link."""
        if not is_our_namespace(namespace):
            raise NodeError(f"MPS namespace name {namespace!r} is not one the agent makes",
                            reason=LEGACY_MPS_LINK)
        path = self.path(namespace)
        try:
            if os.readlink(path) == LINK_TARGET:
                return False
            os.unlink(path)  # our name, wrong target: put it right
        except FileNotFoundError:
            pass
        except OSError as e:  # EINVAL: not a symlink (a v3 daemon's directory, say)
            raise NodeError(
                f"{path} exists and is not the agent's link to the MPS pipe directory "
                f"({e.strerror}); remove it, or run an MPS daemon with namespaces",
                reason=LEGACY_MPS_LINK) from None
        try:
            os.makedirs(self.server_dir, mode=0o755, exist_ok=True)
            os.symlink(LINK_TARGET, path)
        except FileExistsError:
            pass  # made between our check and now: checked again on the next pass
        except OSError as e:
            raise NodeError(f"cannot create the MPS pipe link {path}: {e.strerror or e}",
                            reason=LEGACY_MPS_LINK) from None
        return True

    def remove(self, namespace: str) -> bool:
        path = self.path(namespace)
        if os.path.islink(path) and is_our_namespace(namespace):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                return True
        return False

    def existing(self) -> set[str]:
        """Names of the agent's links present now."""
        try:
            entries = list(os.scandir(self.server_dir))
        except (FileNotFoundError, NotADirectoryError):
            return set()
        return {e.name for e in entries if e.is_symlink() and is_our_namespace(e.name)}

    def sweep(self, keep: set[str]) -> list[str]:
        removed = []
        for name in sorted(self.existing() - keep):
            if self.remove(name):
                removed.append(name)
        return removed

    def link_applied(self, desired: DesiredState, results: dict[ContainerKey, ContainerResult],
                     errors: set[str]) -> dict[ContainerKey, ContainerResult]:
        """Links each applied container that reaches the daemon through its client env; one
        whose link cannot be made turns pending (with the reason) in the returned results."""
        for c in desired.containers:
            if c.compute is not ComputeEnforcement.MPS_CLIENT_ENV or not c.plan.mps_namespace:
                continue
            result = results.get(c.key)
            if result is None or result.state is not ContainerState.APPLIED:
                continue
            try:
                if self.ensure(c.plan.mps_namespace):
                    log.info("linked %s to the legacy MPS pipe directory for %s",
                             self.path(c.plan.mps_namespace), c.ref)
            except NodeError as e:
                errors.add(e.reason)
                results[c.key] = dataclasses.replace(result, state=ContainerState.PENDING,
                                                     reason=e.reason, message=e.message)
        return results

    def tidy(self, desired: DesiredState) -> None:
        """Removes the links no container of `desired` uses."""
        keep = {c.plan.mps_namespace for c in desired.containers
                if c.compute is ComputeEnforcement.MPS_CLIENT_ENV and c.plan.mps_namespace}
        for name in self.sweep(keep):
            log.info("removed the MPS pipe link %s (no container uses it)", name)
