"""A fractional container that mounts CUDA's default MPS pipe directory: a warning, not a refusal.

Manifests written for an MPS daemon run on the host (upstream KAI's MPS example mounts the
hostPath `/tmp/nvidia-mps` at `/tmp/nvidia-mps`) ask for a daemon kai_fractions does not manage:
CUDA looks for one there when CUDA_MPS_PIPE_DIRECTORY is unset, and the mutating webhook removes
a user's own. A time-slicing container then runs time-sliced where no such daemon runs, and
where one does it joins it, with none of the settings kai_fractions gives its own daemon; an
sm-sharing container reaches kai_fractions' daemon through its injected
CUDA_MPS_PIPE_DIRECTORY, so the mount is unused. The pod keeps working either way, so both
webhooks admit it with a warning (the same text from each: the API server passes a repeated
warning on once) that names the key asking kai_fractions for sm-sharing; the workloads webhook
says it of a template, where the user applying it sees it (a pod's warnings go to whoever
creates the pod, a controller for a Deployment's), when the template brings it.

The host directory a hostPath mount brings is its path joined with its subPath, as the node
resolves it; a subPathExpr's is known only on the node, so such a mount warns only at the
default directory itself. A parent of the host's directory mounted where it is (the host's
/tmp at /tmp, mostly scratch space) warns only a time-slicing container: an sm-sharing one's
CUDA never looks there.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator, Mapping
from typing import Any

from ..contract import ComputeMode, PodRequest
from ..contract import keys as k
from ..contract.errors import shown
from . import hostpaths

DEFAULT_MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"
"""Where CUDA and nvidia-cuda-mps-control look for the daemon's pipes without
CUDA_MPS_PIPE_DIRECTORY."""


def _list(value: Any) -> list[Any]:
    """`value` if a list: a workload's template reaches here with its shape unchecked."""
    return value if isinstance(value, list) else []


def _named(spec: Mapping[str, Any], name: str) -> Iterator[Mapping[str, Any]]:
    for field in ("initContainers", "containers"):
        for c in _list(spec.get(field)):
            if isinstance(c, Mapping) and c.get("name") == name:
                yield c


def _host_paths(spec: Mapping[str, Any]) -> dict[str, str]:
    """Each hostPath volume's name and path."""
    return {str(v.get("name")): str(v["hostPath"].get("path") or "")
            for v in _list(spec.get("volumes"))
            if isinstance(v, Mapping) and isinstance(v.get("hostPath"), Mapping)}


def _cleaned(path: str) -> str:
    return posixpath.normpath("/" + path.lstrip("/"))


def default_mps_warnings(spec: Any, request: PodRequest, keys: k.Keys) -> tuple[str, ...]:
    """One warning for each fractional container that mounts CUDA's default MPS pipe directory,
    or a hostPath volume of that host directory (as the node resolves it), naming its first
    such mount."""
    if not isinstance(spec, Mapping):
        return ()
    host = _host_paths(spec)
    out: list[str] = []
    for share in request.shares:
        for c in _named(spec, share.container):
            mounts = [m for m in _list(c.get("volumeMounts")) if isinstance(m, Mapping)]
            found = next((what for m in mounts
                          if (what := _what(m, host, share.compute_mode)) is not None), None)
            if found is not None:
                out.append(_warning(share.container, found, share.compute_mode, keys))
    return tuple(out)


def _host_source(mount: Mapping[str, Any], host: Mapping[str, str]) -> str | None:
    """The host directory the mount brings, as the node resolves it (its volume's path joined
    with its subPath); None for a volume that is no hostPath, or a subPathExpr, whose value
    only the node knows."""
    path = host.get(str(mount.get("name")))
    if path is None or mount.get("subPathExpr"):
        return None
    return hostpaths.canonical(posixpath.join(path, str(mount.get("subPath") or "")))


def _what(mount: Mapping[str, Any], host: Mapping[str, str], mode: ComputeMode) -> str | None:
    """What the mount brings to CUDA's default directory, in the warning's words; None when
    nothing worth a warning. Any volume at the default directory: CUDA finds whatever it holds.
    The host's default directory mounted anywhere. One of its parents mounted where that parent
    is (the host's /tmp at /tmp shows the host's /tmp/nvidia-mps at /tmp/nvidia-mps), but only
    for a time-slicing container: an sm-sharing one's CUDA uses its injected
    CUDA_MPS_PIPE_DIRECTORY, and such a mount is mostly scratch space, not unused."""
    at = str(mount.get("mountPath") or "")
    source = _host_source(mount, host)
    if _cleaned(at) == DEFAULT_MPS_PIPE_DIRECTORY:
        return (f"the host's {shown(source)}" if source == DEFAULT_MPS_PIPE_DIRECTORY
                else shown(at))
    if source is None:
        return None
    if source == DEFAULT_MPS_PIPE_DIRECTORY:
        return f"the host's {shown(source)} at {shown(at)}"
    below = posixpath.relpath(DEFAULT_MPS_PIPE_DIRECTORY, _cleaned(at))
    if (mode is ComputeMode.SM_SHARING or below.startswith("..")
            or hostpaths.canonical(posixpath.join(source, below)) != DEFAULT_MPS_PIPE_DIRECTORY):
        return None
    return (f"the host's {shown(source)} at {shown(at)} and with it the host's "
            f"{shown(DEFAULT_MPS_PIPE_DIRECTORY)}")


def _warning(container: str, what: str, mode: ComputeMode, keys: k.Keys) -> str:
    key = f"{keys.container(container, k.COMPUTE_MODE)}: {ComputeMode.SM_SHARING}"
    then = (f"it is unused: its CUDA_MPS_PIPE_DIRECTORY points at kai_fractions' daemon ({key}); "
            "remove the mount" if mode is ComputeMode.SM_SHARING else
            "the container runs time-sliced, or joins a daemon someone runs on the host, "
            f"which kai_fractions does not configure; for kai_fractions' MPS set {key}")
    return (f"container {container!r} mounts {what}, CUDA's default MPS pipe directory: it asks "
            f"for an MPS daemon kai_fractions does not manage; {then}")
