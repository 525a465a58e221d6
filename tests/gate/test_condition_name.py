"""The gate names the node condition the node agent publishes, as it was configured.

The chart lets an operator rename the condition (`nodeCondition.name`, the agent's
`--condition-name`); the gate's wait and timeout lines point there for the agent's reason, so
they must name the renamed one, not the default that is missing on every node of that cluster
(and whose absence the line reads as "no node agent runs").
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kai_fractions.marker import ContainerMarker

from .pods import UID, bound_annotations, plan_of
from .test_cli import gate, pod_files
from .test_gate import STALE, FakeClock, marker_for, run, setup_pod

RENAMED = "example.com/Ready"
DEFAULT = "gpu-fractioning.nvidia.com/Ready"
WHERE = ("the node agent's reason: `kai-fractions inspect pod NS/NAME`, and the condition "
         f"{RENAMED} of the pod's node (`kubectl describe node`), which is missing or Unknown "
         "where no node agent runs")
NOT_WRITTEN = (
    "the node agent has not written this pod's readiness marker yet; it writes none while it "
    "holds the pod pending (the pod's node not ready for it, its limits not in force yet) or "
    f"does not run ({WHERE})")


def test_the_gate_process_names_the_condition_it_is_given(tmp_path: Path) -> None:
    """Before, the gate had no `--condition-name` (a usage error) and always named
    gpu-fractioning.nvidia.com/Ready; now its wait and its timeout line name the given one."""
    args = [*pod_files(tmp_path, with_marker=False), "--condition-name", RENAMED,
            "--timeout", "0.05", "--poll-interval", "0.01"]
    result = gate(args)
    line = ("timed out after 0.05s waiting for the node agent to apply this pod's GPU limits: "
            f"{NOT_WRITTEN} (marker: {tmp_path}/markers/{UID}/marker.json)\n")
    assert result.returncode == 1, result.stderr
    assert result.stderr == f"waiting: {NOT_WRITTEN}\n{line}"
    assert (tmp_path / "termination-log").read_text() == line
    assert DEFAULT not in result.stderr


def test_the_timeout_of_another_wait_names_the_given_condition(tmp_path: Path) -> None:
    """A wait that does not name the agent's reason itself (here a plan that does not match)
    gets the pointer at the timeout: before, to the default condition whatever the gate was
    told; now to the configured one."""
    stale = marker_for({"main": ContainerMarker.applied(STALE)})
    opts = dataclasses.replace(setup_pod(tmp_path, bound_annotations(), stale),
                               condition_name=RENAMED)
    code, log, _, err = run(opts, FakeClock())
    reason = (f"container 'main': the node agent applied plan {STALE} but the pod's "
              f"annotations give {plan_of(bound_annotations()).digest}")
    line = ("timed out after 2s waiting for the node agent to apply this pod's GPU limits: "
            f"{reason} (marker: {tmp_path}/markers/{UID}/marker.json; {WHERE})\n")
    assert (code, log, err) == (1, line, f"waiting: {reason}\n{line}")

