"""Kubernetes object names (RFC 1123), as the API server allows them: what a caller may name a
namespace, a pod, a node or a container by. Names are logged and echoed back in errors, so a
name checked here carries nothing past its bound or across a line."""

from __future__ import annotations

import re

from .errors import ContractError

MAX_NAME = 253
"""A DNS subdomain's length: pods, nodes, RuntimeClasses."""

_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?"
                        r"(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
"""Kubernetes' IsDNS1123Subdomain: dot-separated RFC 1123 labels (no empty label, none starting
or ending with '-')."""


def is_dns_label(name: str) -> bool:
    """How a namespace or a container is named (at most 63, no dots)."""
    return _LABEL.fullmatch(name) is not None


def is_dns_subdomain(name: str) -> bool:
    """How a pod, a node, a RuntimeClass, a DaemonSet, a ConfigMap or a Lease is named, and
    the part of an annotation key before its '/'."""
    return _SUBDOMAIN.fullmatch(name) is not None


def pod_ref_problems(namespace: str, name: str, uid: str) -> list[ContractError]:
    """What is wrong with a pod reference a caller sent (empty values are not checked here:
    whether they may be is the caller's rule)."""
    out = []
    for field, value in (("pod.namespace", namespace), ("pod.name", name), ("pod.uid", uid)):
        if len(value) > MAX_NAME:
            out.append(ContractError(field, f"must be at most {MAX_NAME} characters (got "
                                     f"{len(value)})"))
        elif field == "pod.namespace" and value and not is_dns_label(value):
            out.append(ContractError(field, "must be a Kubernetes namespace (lowercase letters, "
                                     "digits and '-', at most 63)", value))
        elif field == "pod.name" and value and not is_dns_subdomain(value):
            out.append(ContractError(field, "must be a Kubernetes name (lowercase letters, "
                                     "digits, '-' and '.')", value))
        elif field == "pod.uid" and not value.isprintable():
            out.append(ContractError(field, "must be printable", value))
    return out
