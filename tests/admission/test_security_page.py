"""SECURITY.md's row on the admission server's bounds says the numbers the server runs with:
each phrase is built from the constant it names, so a changed bound fails here until the page
that platform engineers size and firewall the webhook by says it too."""

from __future__ import annotations

from pathlib import Path

from kai_fractions.admission.body_budget import BODY_BUDGET, MAX_BODY
from kai_fractions.admission.connections import PENDING_GRACE
from kai_fractions.admission.errors import MAX_LISTED, MAX_LOGGED
from kai_fractions.admission.handler import BODY_GRACE, BODY_RATE, QUEUE_WAIT
from kai_fractions.admission.review import MAX_OPENINGS
from kai_fractions.admission.server import (
    HANDSHAKE_TIMEOUT,
    HEAD_TIMEOUT,
    MAX_CONNECTIONS,
    MAX_REVIEWS,
)

SECURITY = Path(__file__).resolve().parents[2] / "SECURITY.md"
MIB = 1024 * 1024


def row() -> str:
    [line] = [x for x in SECURITY.read_text().splitlines()
              if x.startswith("| **Admission server: bounded cost per caller** |")]
    return line


def test_the_admission_bounds_row_says_the_server_s_numbers() -> None:
    assert MAX_REVIEWS == 1 and HANDSHAKE_TIMEOUT == HEAD_TIMEOUT
    text = row()
    for phrase in (
        f"a body over {MAX_BODY // MIB} MiB",
        f"at most {BODY_BUDGET // MIB} MiB",
        "one review is parsed and judged at a time",
        f"after {QUEUE_WAIT:g} s in all without room",
        f"within {BODY_GRACE:g} s plus 1 s per MiB",
        f"more than {MAX_OPENINGS:,} arrays and objects",
        f"at most {MAX_LISTED} problems",
        f"keeps {MAX_LOGGED} characters",
        f"At most {MAX_CONNECTIONS:,} connections",
        f"{PENDING_GRACE:g} s behind on its peer",
        f"within {HEAD_TIMEOUT:g} s",
        "waits in the listen backlog",
        "`webhook.networkPolicy.metricsFrom`",
    ):
        assert phrase in text, phrase
    assert BODY_RATE == MIB  # "a second per MiB"
