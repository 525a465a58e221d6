"""Fixtures shared by the agent's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .builders import Rig


@pytest.fixture
def running(short_tmp: Path) -> Iterator[Rig]:
    """An agent started on its NodeEnforcer socket and metrics port, fast ticks, stopped after."""
    rig = Rig(short_tmp, options={"socket": str(short_tmp / "agent.sock"),
                                  "metrics_listen": "127.0.0.1:0", "status_tick_seconds": 0.05,
                                  "retry_seconds": 0.05})
    rig.agent.start()
    try:
        yield rig
    finally:
        rig.agent.stop(timeout=5)
