"""The node agent takes the hard limit of open files at start: its watchdog holds a pidfd per
GPU process, and container runtimes start processes at a soft limit of 1,024."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap

from kai_fractions.cli.node_agent import NOFILE_CEILING

HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
WANT = NOFILE_CEILING if HARD == resource.RLIM_INFINITY else min(HARD, NOFILE_CEILING)


def started_with_soft_limit(soft: int) -> dict:
    """`raise_open_file_limit` in a process of its own, started at `soft` open files."""
    script = textwrap.dedent(f"""
        import json, resource
        from kai_fractions.cli.node_agent import raise_open_file_limit
        resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {HARD}))
        said = raise_open_file_limit()
        print(json.dumps({{"said": said, "now": resource.getrlimit(resource.RLIMIT_NOFILE)}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    assert started_with_soft_limit(64) == {"said": [64, WANT], "now": [WANT, HARD]}


def test_a_soft_limit_already_there_is_left_alone() -> None:
    assert started_with_soft_limit(WANT) == {"said": [WANT, WANT], "now": [WANT, HARD]}
