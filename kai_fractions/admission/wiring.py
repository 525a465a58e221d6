"""What the mutating webhook wired into a fractional pod must stay exactly so.

- The gate: the first init container, with exactly the image, command, env, mounts and security
  context the webhook injects. Another image or command releases the workload without waiting
  for the node agent; `restartPolicy: Always` makes it a sidecar that blocks nothing; an extra
  mount or env could feed it a forged marker or code. A few fields that change nothing the gate
  does (`LENIENT`) may differ, so the API server's defaults never get a pod refused; so may the
  node condition the command's `--condition-name` names, or its absence (`_same_but_condition`).
- Every other container (sidecars, other init containers, ephemeral containers): exactly
  `NVIDIA_VISIBLE_DEVICES=void` among the enforced variables. Removing the variable is not
  enough: an image's own `ENV NVIDIA_VISIBLE_DEVICES=all` would then apply.

The fractional container's env and MPS mount and the reserved volumes are held to what the
mutating webhook injects by the validating webhook (`wired_spec`), with the mutating webhook's
own tests.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..contract import ContainerShare
from ..contract import keys as k
from ..contract.errors import shown
from . import podspec
from .config import CONDITION_NAME, GATE_CONTAINER, AdmissionConfig
from .errors import Problem, clip, exact

VOID_ENV = {"name": k.ENV_VISIBLE_DEVICES, "value": "void"}

Json = dict[str, Any]


def matches(actual: Any, desired: Any) -> bool:
    """`desired` is contained in `actual`: every field we set is there with our value; fields
    the API server added (defaults) do not count."""
    if isinstance(desired, Mapping):
        return isinstance(actual, Mapping) and all(
            key in actual and matches(actual[key], value) for key, value in desired.items())
    if isinstance(desired, list):
        return (isinstance(actual, list) and len(actual) == len(desired)
                and all(matches(a, d) for a, d in zip(actual, desired, strict=True)))
    return actual == desired


def strip_enforced(env: list[Json]) -> list[Json]:
    """`env` without the enforced variables (the pod's own values for them)."""
    return [e for e in env if not (isinstance(e, Mapping) and e.get("name") in k.ENFORCED_ENV)]


def fractional_env(env: list[Json], wanted: list[Json]) -> list[Json]:
    """The fractional container's env as the mutating webhook wires it: `wanted` (the enforced
    variables) first, so the pod's own variables can refer to them as `$(NAME)`, the pod's own
    values for the enforced names dropped; `env` itself when already so (the validating
    webhook's test of that container too)."""
    enforced = [e for e in env if isinstance(e, Mapping) and e.get("name") in k.ENFORCED_ENV]
    if len(enforced) == len(wanted) and all(
            any(matches(e, w) for e in enforced) for w in wanted):
        return env
    return wanted + strip_enforced(env)


LENIENT = frozenset({"resources", "imagePullPolicy", "terminationMessagePolicy",
                     "resizePolicy", "stdin", "stdinOnce", "tty"})
"""Fields of the gate that do not change what it checks or when the workload may start. Not
`terminationMessagePath`: the kubelet mounts a writable host file there (mode 0666), which at
the marker's path would hide the node agent's marker under one the pod can write."""
_SHOWN = 120
"""Characters of a value a message shows; the problem keeps the value in full (`Problem`)."""


def show_value(value: Any) -> str:
    """`value` as compact JSON, cut to a length a message can show."""
    return clip(json.dumps(value, sort_keys=True, separators=(",", ":")), _SHOWN)


def _names(items: Any) -> list[str]:
    return [str(c.get("name", "")) for c in items or [] if isinstance(c, Mapping)]


def gate_name_problem(share: ContainerShare) -> Problem | None:
    """The fractional container may not have the gate's name: the mutating webhook replaces
    every init container of that name with its gate, so the workload would be dropped."""
    if share.container != GATE_CONTAINER:
        return None
    return Problem(f"{share.source_key or 'the pod'}: names container {GATE_CONTAINER!r}, the "
                   "name of the init container the admission webhook injects (its gate); give "
                   "the container another name", exact(share.container))


def gate_differences(gate: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[Problem]:
    """How `gate` differs from the injected `wanted`, outside the fields of `LENIENT`."""
    out = []
    for field in sorted(set(gate) | set(wanted)):
        if field in LENIENT:
            continue
        have = gate.get(field)
        if field not in wanted:
            if have not in (None, "", [], {}, False):
                out.append(Problem(f"spec.initContainers[0].{field}: the {GATE_CONTAINER} init "
                                   f"container may not set it (got {show_value(have)})",
                                   exact(have)))
        elif have != wanted[field]:
            out.append(Problem(f"spec.initContainers[0].{field}: must be exactly what the "
                               f"admission webhook injects into {GATE_CONTAINER}, "
                               f"{show_value(wanted[field])} (got {show_value(have)})",
                               exact(have)))
    return out


def gate_problems(spec: Mapping[str, Any], config: AdmissionConfig) -> list[Problem]:
    """Why the pod's gate is not the one the mutating webhook injects (empty: it is)."""
    init = [c for c in spec.get("initContainers") or [] if isinstance(c, Mapping)]
    if not init or init[0].get("name") != GATE_CONTAINER:
        name = init[0].get("name") if init else "none"
        return [Problem(f"spec.initContainers[0]: the first init container of a fractional pod "
                        f"must be {GATE_CONTAINER} (the admission webhook injects it), not "
                        f"{shown(str(name))}", exact(name))]
    containers, others = _names(spec.get("containers")), _names(init[1:])
    wanted = podspec.gate_container(config, containers, others)
    command = init[0].get("command")
    if _same_but_condition(command, wanted["command"]):
        wanted["command"] = command
    return gate_differences(init[0], wanted)


_CONDITION_FLAG = "--condition-name"


def _same_but_condition(have: Any, wanted: list[str]) -> bool:
    """Whether the gate's command `have` is the one wanted but for the node condition its
    messages name: another valid `--condition-name`, or none (the default). Webhooks of one
    release or of two, mid-way through a rollout or a rollback, may be told different names,
    and `/mutate` and `/validate` may reach different replicas; the gate waits and judges the
    same whichever it names (only its wait's words change), so no pod is refused for it."""
    if not isinstance(have, list):
        return False
    base = _without_condition(wanted)
    if have == base:
        return True
    return (have[:len(base)] == base and len(have) == len(base) + 2
            and have[len(base)] == _CONDITION_FLAG and isinstance(have[-1], str)
            and CONDITION_NAME.fullmatch(have[-1]) is not None)


def _without_condition(command: list[str]) -> list[str]:
    """`command` without its trailing `--condition-name NAME` (podspec.gate_command puts it
    last, where it puts it)."""
    if len(command) >= 2 and command[-2] == _CONDITION_FLAG:
        return command[:-2]
    return command


def _is_void(env: Any) -> bool:
    enforced = [e for e in env or [] if isinstance(e, Mapping) and e.get("name") in k.ENFORCED_ENV]
    return len(enforced) == 1 and dict(enforced[0]) == VOID_ENV


def env_problems(spec: Mapping[str, Any], share: ContainerShare) -> list[Problem]:
    """The containers without the GPU fraction that do not say `NVIDIA_VISIBLE_DEVICES=void`
    (the gate's env is checked with the rest of the gate)."""
    others = ", ".join(n for n in k.ENFORCED_ENV if n != k.ENV_VISIBLE_DEVICES)
    out = []
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(spec.get(field) or []):
            if not isinstance(c, Mapping):
                continue
            name = c.get("name")
            if (field != "ephemeralContainers" and name == share.container) or (
                    field == "initContainers" and name == GATE_CONTAINER):
                continue
            if not _is_void(c.get("env")):
                out.append(Problem(f"spec.{field}[{i}].env: container {name!r} has no GPU "
                                   f"fraction: it must set {k.ENV_VISIBLE_DEVICES}=void and none "
                                   f"of {others}"))
    return out
