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
creates the pod, a controller for a Deployment's).
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
            found = next((m for m in mounts if _reaches(m, host)), None)
            if found is not None:
                out.append(_warning(share.container, found, host, share.compute_mode, keys))
    return tuple(out)


def _reaches(mount: Mapping[str, Any], host: Mapping[str, str]) -> bool:
    """Whether CUDA in the container finds something at the default directory through this
    mount (any volume there), or the mount brings the host's default directory: a hostPath of
    it (with its subPath) mounted anywhere, or one of its parents mounted where that parent is
    (the host's /tmp at /tmp shows the host's /tmp/nvidia-mps at /tmp/nvidia-mps)."""
    at = _cleaned(str(mount.get("mountPath") or ""))
    if at == DEFAULT_MPS_PIPE_DIRECTORY:
        return True
    path = host.get(str(mount.get("name")))
    if path is None:
        return False
    source = posixpath.join(path, str(mount.get("subPath") or ""))
    if hostpaths.canonical(source) == DEFAULT_MPS_PIPE_DIRECTORY:
        return True
    below = posixpath.relpath(DEFAULT_MPS_PIPE_DIRECTORY, at)
    return not below.startswith("..") and hostpaths.canonical(
        posixpath.join(source, below)) == DEFAULT_MPS_PIPE_DIRECTORY


def _warning(container: str, mount: Mapping[str, Any], host: Mapping[str, str],
             mode: ComputeMode, keys: k.Keys) -> str:
    at = str(mount.get("mountPath") or "")
    path = host.get(str(mount.get("name")))
    if path is not None and _cleaned(at) != DEFAULT_MPS_PIPE_DIRECTORY and hostpaths.canonical(
            posixpath.join(path, str(mount.get("subPath") or ""))) != DEFAULT_MPS_PIPE_DIRECTORY:
        # a parent of it, where that parent is
        what = (f"the host's {shown(path)} at {shown(at)} and with it the host's "
                f"{shown(DEFAULT_MPS_PIPE_DIRECTORY)}")
    elif path is None or hostpaths.canonical(path) != DEFAULT_MPS_PIPE_DIRECTORY:
        what = shown(at)  # another volume there: what CUDA finds is whatever it holds
    elif _cleaned(at) == DEFAULT_MPS_PIPE_DIRECTORY:
        what = f"the host's {shown(path)}"
    else:
        what = f"the host's {shown(path)} at {shown(at)}"
    key = f"{keys.container(container, k.COMPUTE_MODE)}: {ComputeMode.SM_SHARING}"
    then = (f"it is unused: its CUDA_MPS_PIPE_DIRECTORY points at kai_fractions' daemon ({key}); "
            "remove the mount" if mode is ComputeMode.SM_SHARING else
            "the container runs time-sliced, or joins a daemon someone runs on the host, "
            f"which kai_fractions does not configure; for kai_fractions' MPS set {key}")
    return (f"container {container!r} mounts {what}, CUDA's default MPS pipe directory: it asks "
            f"for an MPS daemon kai_fractions does not manage; {then}")
