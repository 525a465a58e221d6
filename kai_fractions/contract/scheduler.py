"""Which scheduler binds a GPU fraction: KAI's alone. Its admission skips the pods of other
schedulers and no BindRequest is ever made for them (upstream KAI-Scheduler
pkg/admission/webhook/v1alpha2/podhooks/pod_validator.go), so a fractional pod placed by
another scheduler waits in its gate for ever. `validate` and the mutating webhook both warn."""

from __future__ import annotations

DEFAULT_SCHEDULER_NAME = "kai-scheduler"
"""KAI's scheduler, as the chart's `mirror.schedulerName` names it."""


def scheduler_problem(found: object, scheduler: str, key: str) -> str | None:
    """What is wrong with a fractional pod's `spec.schedulerName` (`found`; None: absent) where
    KAI's scheduler is `scheduler`, at field `key`; None when it is KAI's."""
    if found == scheduler:
        return None
    said = ("absent, so the default scheduler places the pod" if found is None
            else "names another scheduler")
    return (f"{said}, and only {scheduler} binds a GPU fraction (KAI skips the pods of other "
            f"schedulers): the pod would never be released from its gate; set {key}: "
            f"{scheduler}")
