"""The demo's session and story in this process: other node settings (from --config), and
nothing left running afterwards."""

from __future__ import annotations

import io
import re
import threading
import time
from pathlib import Path

import pytest

from kai_fractions.demo.config import config_from_dict
from kai_fractions.demo.scenario import Scenario
from kai_fractions.demo.session import DemoSession

from .expected import PLACEMENT, expected_rows, parse_tables, row_cells


def run(config_data: dict) -> tuple[str, list[str], DemoSession]:
    session = DemoSession(config_from_dict(config_data))
    out = io.StringIO()
    progress: list[str] = []
    try:
        session.start()
        Scenario(session, out, progress.append).run()
    finally:
        session.stop()
    return out.getvalue(), progress, session


@pytest.fixture(scope="module")
def default_run():
    before = set(threading.enumerate())
    out, progress, session = run({})
    return out, progress, session, before


def test_nothing_keeps_running_after_stop(default_run):
    _, _, session, before = default_run
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not any(not t.daemon for t in left):
            break
        time.sleep(0.05)
    assert [t.name for t in left if not t.daemon] == []
    assert not session.workdir.exists()


def _normalized(text: str) -> str:
    """Without what changes from run to run: temp paths, ports, pod UIDs (in cgroup paths too),
    pids."""
    text = re.sub(r"/tmp/kf-demo-\w+", "/tmp/kf-demo-X", text)
    text = re.sub(r"-pod[0-9a-f_]{36}\.slice", "-podUID.slice", text)
    text = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", text)
    text = re.sub(r"of pod [0-9a-f-]{36}", "of pod UID", text)
    return re.sub(r"pids? \d+(, \d+)*", "pid N", text)


def test_the_readme_shows_a_real_run(default_run):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("A real run:\n\n```\n", 1)[1].split("```", 1)[0]
    assert _normalized(block) == _normalized(default_run[0])


def test_four_gpus_place_every_example():
    placement = {**PLACEMENT, "multi-device-fraction": (1, 2), "sm-sharing": (3,)}
    out, _, _ = run({"gpus": [{"model": "H100-80GB", "count": 4}]})
    gpus, unplaced, reasons = parse_tables(out)
    expected = expected_rows(placement=placement)
    assert (unplaced, reasons) == ([], [])
    for index, (_uuid, _mode, rows) in gpus.items():
        want = sorted(row_cells(e) for e in expected if e.gpus and index in e.gpus)
        if index in (1, 2):  # the two-GPU container: 3/4 of its request on each GPU
            want = [[*cells[:2], f"{cells[2]} x2", *cells[3:]] for cells in want]
        assert rows == want, f"GPU {index}"


def test_a_node_without_sm_sharing_refuses_the_sm_sharing_pod():
    out, progress, _ = run({"sm_sharing": False})
    gpus, _, reasons = parse_tables(out)
    [row] = gpus[1][2]
    assert row[0] == "default/sm-sharing/server"
    assert (row[5], row[6]) == ("n/a", "refused (SmSharingDisabled)")
    message = ("the container asks for compute mode sm-sharing but this node runs without MPS "
               "(--no-sm-sharing): use time-slicing, or schedule it to a node with sm-sharing "
               "enabled")
    assert f"default/sm-sharing/server: SmSharingDisabled: {message}" in reasons
    assert any(line == ("gate default/sm-sharing: FAILED (exit 1): container 'server' refused "
                        f"by the node agent: SmSharingDisabled: {message}")
               for line in progress), progress


@pytest.mark.parametrize("data, error", [
    ({"gpus": []}, "gpus: must be a non-empty list of mappings such as "
                   "{model: H100-80GB, count: 2}"),
    ({"colour": "red"}, "unknown key(s) colour; known: node, gpus, driver_version, sm_sharing, "
                        "memory_enforcement, reserve_mib, namespace, examples"),
])
def test_bad_configs(data, error):
    from kai_fractions.demo.config import DemoConfigError

    with pytest.raises(DemoConfigError) as e:
        config_from_dict(data)
    assert str(e.value) == error
