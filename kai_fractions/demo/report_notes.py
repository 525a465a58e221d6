"""What the demo adds to the node's report (the `inspect` table), which `inspect` cannot know:
each pod's admission warnings (what `kubectl apply` would have shown its user), and where the
demo's scheduler did what KAI would not: bind a pod upstream KAI main may never bind, or bind
to a node whose condition is not True. Said in the table's own style: a `!` line under the
pod's GPU, a `note:` line under the node's heading."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace

from ..contract.before_bind import FRACTION_LIMIT_NOT_BOUND
from ..inspect.model import Report, Row

PATCHED_BIND = "the demo binds it as a patched KAI would"
"""Said of a pod upstream KAI main may never bind, when the demo bound it."""
NOT_READY = ("KAI places no fractional pod on a node whose {condition} is not True; the demo's "
             "scheduler binds them anyway, to show the node agent refusing them")


def warning_lines(warnings: tuple[str, ...], bound: bool) -> tuple[str, ...]:
    """`admission warning: <warning>` each; one saying upstream KAI main may never bind the
    pod says too, of a pod the demo bound, that the demo played a patched KAI for it."""
    return tuple(f"admission warning: {w}" + (f"; {PATCHED_BIND}" if bound and
                                               FRACTION_LIMIT_NOT_BOUND in w else "")
                 for w in warnings)


def annotated(report: Report, warned: Mapping[str, tuple[str, ...]],
              bound: Collection[str]) -> Report:
    """The report with the admission warnings of each pod (`warned`, by `namespace/name`) among
    the warnings of its first row, and a note when the demo bound pods (`bound`) to a node whose
    condition is not True."""
    said: set[str] = set()

    def row(r: Row) -> Row:
        """A pod's warnings under its first row only (a pod of several containers or GPUs has
        several rows, and its warnings are the pod's)."""
        pod = f"{r.namespace}/{r.pod}"
        if pod in said:
            return r
        said.add(pod)
        extra = warning_lines(warned.get(pod, ()), pod in bound)
        return replace(r, warnings=(*r.warnings, *extra)) if extra else r

    notes = report.notes
    condition = report.condition
    if bound and condition is not None and condition[1] != "True":
        notes = (*notes, NOT_READY.format(condition=condition[0]))
    return replace(report, notes=notes,
                   gpus=tuple(replace(g, rows=tuple(row(r) for r in g.rows))
                              for g in report.gpus),
                   unplaced=tuple(row(r) for r in report.unplaced))


def rowless(report: Report, warned: Mapping[str, tuple[str, ...]],
            sources: Mapping[str, str]) -> list[str]:
    """`pod <ref> (<source>): <warning>` for each warning of a pod with no row in the report
    (not fractional), which no `!` line can carry."""
    with_rows = {f"{r.namespace}/{r.pod}" for r in report.rows}
    return [f"pod {pod} ({sources.get(pod, '?')}): {w}"
            for pod, warnings in warned.items() if pod not in with_rows for w in warnings]
