"""`kai-fractions demo --config` with an old (550) and a new (615) driver and every
`memory_enforcement` the config accepts: the node condition, each row's state and tier, and what
stops a container that asks for more than its cap are what a real node of that driver shows.

Written down by hand from what the driver has: r615 has NVML cgroup memory limits, 550 has not
(the simulated NVML raises FunctionNotFound); mps-pinned applies to sm-sharing containers only;
the watchdog works everywhere but only after the fact.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kai_fractions.cli import main

from .expected import parse_tables

OLD, NEW = "550.54.15", "615.00.00"
REFUSED = "refused (MemoryLimitsUnsupported)"
READY = "gpu-fractioning.nvidia.com/Ready=True"
TOO_OLD = "gpu-fractioning.nvidia.com/Ready=False"
HELD, CAUGHT, NOTHING = "Cap held", "Violation caught", "Over the cap"

# (driver, memory_enforcement) -> (node condition, time-slicing rows (state, tier),
#                                  the sm-sharing row (state, tier), the over-the-cap section)
CASES = {
    (OLD, "cgroup"): (TOO_OLD, (REFUSED, "none"), (REFUSED, "none"), NOTHING),
    (OLD, "mps-pinned"): (READY, (REFUSED, "none"), ("enforced", "mps-pinned"), HELD),
    (OLD, "watchdog"): (READY, ("enforced", "watchdog"), ("enforced", "watchdog"), CAUGHT),
    (OLD, "cgroup,mps-pinned"): (READY, (REFUSED, "none"), ("enforced", "mps-pinned"), HELD),
    (OLD, "cgroup,watchdog"): (READY, ("enforced", "watchdog"), ("enforced", "watchdog"),
                               CAUGHT),
    (OLD, "mps-pinned,watchdog"): (READY, ("enforced", "watchdog"),
                                   ("enforced", "mps-pinned"), CAUGHT),
    (OLD, "cgroup,mps-pinned,watchdog"): (READY, ("enforced", "watchdog"),
                                          ("enforced", "mps-pinned"), CAUGHT),
    (NEW, "cgroup"): (READY, ("enforced", "cgroup"), ("enforced", "cgroup"), HELD),
    (NEW, "mps-pinned"): (READY, (REFUSED, "none"), ("enforced", "mps-pinned"), HELD),
    (NEW, "watchdog"): (READY, ("enforced", "watchdog"), ("enforced", "watchdog"), CAUGHT),
    (NEW, "cgroup,mps-pinned"): (READY, ("enforced", "cgroup"), ("enforced", "cgroup"), HELD),
    (NEW, "cgroup,watchdog"): (READY, ("enforced", "cgroup"), ("enforced", "cgroup"), HELD),
    (NEW, "mps-pinned,watchdog"): (READY, ("enforced", "watchdog"),
                                   ("enforced", "mps-pinned"), CAUGHT),
    (NEW, "cgroup,mps-pinned,watchdog"): (READY, ("enforced", "cgroup"),
                                          ("enforced", "cgroup"), HELD),
}


@pytest.mark.parametrize(("driver", "enforcement"), list(CASES))
def test_the_demo_shows_what_a_node_of_that_driver_does(driver, enforcement, tmp_path: Path,
                                                        capsys):
    condition, ts, sm, section = CASES[(driver, enforcement)]
    config = tmp_path / "node.yaml"
    config.write_text(f"driver_version: {driver}\nmemory_enforcement: {enforcement}\n")
    code = main(["demo", "--config", str(config)])
    out, err = capsys.readouterr()
    assert code == 0, err

    assert f"\nnode demo-node  nvidia.com/gpu.memory=81559  {condition}\n" in out
    assert f"(driver {driver})" in out
    if condition == TOO_OLD:
        assert ("note: gpu-fractioning.nvidia.com/Ready is False: DriverTooOld: NVIDIA driver "
                f"{driver} has no cgroup GPU memory limits") in out
    gpus, unplaced, _ = parse_tables(out)
    states = {row[0]: (row[6], row[7]) for _, _, rows in gpus.values() for row in rows}
    assert states.pop("default/sm-sharing/server") == sm
    assert len(states) == 5 and set(states.values()) == {ts}
    assert [(row[6], row[7]) for row in unplaced] == [("unscheduled (Unschedulable)", "-")]

    titles = re.findall(r"^(Cap held|Violation caught|Over the cap):$", out, re.MULTILINE)
    assert titles == [section]
    body = out.split(f"\n{section}:\n", 1)[1].split("\n\n", 1)[0]
    if section == HELD:
        tier = ts[1] if ts[0] == "enforced" else sm[1]
        assert f"\n  {tier} -> the allocation fails (out of memory): " in body
        assert "LimitViolation" not in out
    elif section == CAUGHT:
        assert "the allocation succeeds, no hard limit stops it" in body
        assert "-> Event Warning LimitViolation on pod default/embeddings-batch-0" in body
    else:
        assert body == "  (no running container to push over its cap)"
