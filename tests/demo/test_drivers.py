"""`kai-fractions demo --config` with an old (550) and a new (615) driver, every
`memory_enforcement` the config accepts and both watchdog policies: the node condition, each
row's state and tier, and what stops a container that asks for more than its cap are what a
real node of that driver and those flags shows.

Written down by hand from what the driver has and what each tier does: r615 has NVML cgroup
memory limits, 550 has not (the simulated NVML raises FunctionNotFound); mps-pinned applies to
sm-sharing containers only, and caps them only where the MPS daemon has namespaces (615: on 550
every sm-sharing tenant reaches the daemon's control pipe and can change the pinned limit, which
the agent still sets but counts as no tier); the watchdog works everywhere but only after the
fact, and caps a
container on its own only with `watchdog_policy: kill`. A `report` watchdog stops nothing: it is
a second line beside cgroup or mps-pinned, never a row's TIER, and a container only it would
watch is refused (MemoryLimitsUnsupported). The node condition is False when no fractional
container can be capped: DriverTooOld on 550, NoMemoryEnforcement on 615 (cgroup left out).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kai_fractions.cli import main

from .expected import parse_tables

OLD, NEW = "550.54.15", "615.00.00"
REPORT, KILL = "report", "kill"
REFUSED = "refused (MemoryLimitsUnsupported)"
READY = ("True", None)
TOO_OLD = ("False", "DriverTooOld")
NO_ENFORCEMENT = ("False", "NoMemoryEnforcement")
HELD, CAUGHT, NOTHING = "Cap held", "Violation caught", "Over the cap"
NONE = (REFUSED, "none")
TS_WATCHDOG = ("enforced", "watchdog")

# (driver, memory_enforcement, watchdog_policy) ->
#     (node condition (status, reason), time-slicing rows (state, tier),
#      the sm-sharing row (state, tier), the over-the-cap section)
CASES = {
    # report: the watchdog caps nothing, and on 550 neither does mps-pinned (no namespaces)
    (OLD, "cgroup", REPORT): (TOO_OLD, NONE, NONE, NOTHING),
    (OLD, "mps-pinned", REPORT): (TOO_OLD, NONE, NONE, NOTHING),
    (OLD, "watchdog", REPORT): (TOO_OLD, NONE, NONE, NOTHING),
    (OLD, "cgroup,mps-pinned", REPORT): (TOO_OLD, NONE, NONE, NOTHING),
    (OLD, "cgroup,watchdog", REPORT): (TOO_OLD, NONE, NONE, NOTHING),
    (OLD, "mps-pinned,watchdog", REPORT): (TOO_OLD, NONE, NONE, NOTHING),
    (OLD, "cgroup,mps-pinned,watchdog", REPORT): (TOO_OLD, NONE, NONE, NOTHING),
    (NEW, "cgroup", REPORT): (READY, ("enforced", "cgroup"), ("enforced", "cgroup"), HELD),
    (NEW, "mps-pinned", REPORT): (READY, NONE, ("enforced", "mps-pinned"), HELD),
    (NEW, "watchdog", REPORT): (NO_ENFORCEMENT, NONE, NONE, NOTHING),
    (NEW, "cgroup,mps-pinned", REPORT): (READY, ("enforced", "cgroup"), ("enforced", "cgroup"),
                                         HELD),
    (NEW, "cgroup,watchdog", REPORT): (READY, ("enforced", "cgroup"), ("enforced", "cgroup"),
                                       HELD),
    (NEW, "mps-pinned,watchdog", REPORT): (READY, NONE, ("enforced", "mps-pinned"), HELD),
    (NEW, "cgroup,mps-pinned,watchdog", REPORT): (READY, ("enforced", "cgroup"),
                                                  ("enforced", "cgroup"), HELD),
    # kill: the watchdog caps where nothing stronger does; the first row it alone holds (GPU 0's
    # first time-slicing row) goes over and is stopped. Where cgroup holds, it is a second line.
    (OLD, "watchdog", KILL): (READY, TS_WATCHDOG, ("enforced", "watchdog"), CAUGHT),
    (OLD, "cgroup,watchdog", KILL): (READY, TS_WATCHDOG, ("enforced", "watchdog"), CAUGHT),
    (OLD, "mps-pinned,watchdog", KILL): (READY, TS_WATCHDOG, ("enforced", "watchdog"), CAUGHT),
    (OLD, "cgroup,mps-pinned,watchdog", KILL): (READY, TS_WATCHDOG, ("enforced", "watchdog"),
                                                CAUGHT),
    (NEW, "watchdog", KILL): (READY, TS_WATCHDOG, ("enforced", "watchdog"), CAUGHT),
    (NEW, "cgroup,watchdog", KILL): (READY, ("enforced", "cgroup"), ("enforced", "cgroup"),
                                     HELD),
    (NEW, "mps-pinned,watchdog", KILL): (READY, TS_WATCHDOG, ("enforced", "mps-pinned"),
                                         CAUGHT),
    (NEW, "cgroup,mps-pinned,watchdog", KILL): (READY, ("enforced", "cgroup"),
                                                ("enforced", "cgroup"), HELD),
}


@pytest.mark.parametrize(("driver", "enforcement", "policy"), list(CASES))
def test_the_demo_shows_what_a_node_of_that_driver_does(driver, enforcement, policy,
                                                        tmp_path: Path, capsys):
    (status, reason), ts, sm, section = CASES[(driver, enforcement, policy)]
    config = tmp_path / "node.yaml"
    config.write_text(f"driver_version: {driver}\nmemory_enforcement: {enforcement}\n"
                      f"watchdog_policy: {policy}\n")
    code = main(["demo", "--config", str(config)])
    out, err = capsys.readouterr()
    assert code == 0, err

    assert ("\nnode demo-node  nvidia.com/gpu.memory=81559  "
            f"gpu-fractioning.nvidia.com/Ready={status}\n") in out
    assert f"(driver {driver})" in out
    if reason == "DriverTooOld":
        assert ("note: gpu-fractioning.nvidia.com/Ready is False: DriverTooOld: NVIDIA driver "
                f"{driver} has no cgroup GPU memory limits") in out
    elif reason == "NoMemoryEnforcement":
        assert ("note: gpu-fractioning.nvidia.com/Ready is False: NoMemoryEnforcement: the "
                "cgroup tier is not enabled") in out
    else:
        assert "note: gpu-fractioning.nvidia.com/Ready is False" not in out
    # Before, a False node got its pods bound with no word that KAI would place none there.
    not_ready = ("\nnote: KAI places no fractional pod on a node whose "
                 "gpu-fractioning.nvidia.com/Ready is not True; the demo's scheduler binds "
                 "them anyway, to show the node agent refusing them\n")
    assert (not_ready in out) == (status == "False")
    gpus, unplaced, reasons = parse_tables(out)
    states = {row[0]: (row[6], row[7]) for _, _, rows in gpus.values() for row in rows}
    assert states.pop("default/sm-sharing/server") == sm
    assert len(states) == 5 and set(states.values()) == {ts}
    assert [(row[6], row[7]) for row in unplaced] == [("unscheduled (Unschedulable)", "-")]
    refusals = [line for line in reasons if ": MemoryLimitsUnsupported: " in line]
    assert len(refusals) == (5 if ts == NONE else 0) + (sm == NONE)
    if "watchdog" in enforcement:  # refused with a report watchdog: the message names kill
        assert all("--watchdog-policy=kill" in line for line in refusals)

    titles = re.findall(r"^(Cap held|Violation caught|Over the cap):$", out, re.MULTILINE)
    assert titles == [section]
    body = out.split(f"\n{section}:\n", 1)[1].split("\n\n", 1)[0]
    assert "LimitViolation" not in out  # a report watchdog never is the tier that acts
    if section == HELD:
        tier = ts[1] if ts[0] == "enforced" else sm[1]
        [line] = [line for line in body.splitlines() if line.startswith(f"  {tier} -> ")]
        assert line.startswith(f"  {tier} -> the allocation fails (out of memory): ")
        # Before, nothing said that the refusal is the demo's simulation.
        assert line.endswith({
            "cgroup": " holds it (simulated NVML, as an r615 driver refuses it)",
            "mps-pinned": " holds it (simulated, as the MPS client refuses it)"}[tier])
        assert "LimitEnforced" not in out
    elif section == CAUGHT:
        assert body.startswith("  default/embeddings-batch-0/embed on GPU 0 (tier watchdog): ")
        assert "the allocation succeeds, no hard limit stops it" in body
        pid = re.search(r"its process \(pid (\d+)\)", body)[1]
        assert (f"\n  watchdog (policy kill) -> Event Warning LimitEnforced on pod "
                f"default/embeddings-batch-0: container embed: process {pid} terminated for "
                "using more GPU memory on ") in body
        assert (f"\n  simulated: the demo's process killer recorded the stop of pid {pid} and "
                "sent no signal") in body
    else:
        assert body == ("  (no running container to push over its cap: the node agent refused "
                        "the fractional containers it could not cap, see the reasons above)")
