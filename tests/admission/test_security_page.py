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


ADMISSION = SECURITY.parent / "docs" / "admission.md"
HOST_PATHS_ITEM = "Fractional pods' own `hostPath` volumes"


def listed_after(text: str, lead_in: str) -> list[str]:
    """The items of the bullet list that follows the line containing `lead_in` (up to the
    first blank line after it starts), each with its continuation lines joined."""
    lines = text.splitlines()
    [start] = [i for i, x in enumerate(lines) if lead_in in x]
    items: list[str] = []
    for x in lines[start + 1:]:
        if not x.strip():
            if items:
                break
            continue
        if x.lstrip().startswith("- "):
            items.append(x.strip()[2:])
        elif items:
            items[-1] += " " + x.strip()
    return items


def test_both_policy_engine_lists_name_fractional_pods_own_host_paths() -> None:
    """Before, SECURITY.md's and docs/admission.md's lists of what is left to Pod Security or a
    policy engine named only plain pods, other namespaces and the runtime, and SECURITY.md said
    the webhook kept tenants' fractional pods from the node-root cases. But the webhook refuses
    in a fractional pod only host paths reaching kai_fractions' and the kubelet's directories: a
    writable `/etc` or `/var/lib/containerd` is admitted (KAI manifests mount host paths), in a
    namespace that must be Pod Security `privileged`. Now both lists name those volumes, with a
    policy-engine rule, and the node-root sentence no longer credits the webhook with them."""
    security = SECURITY.read_text()
    lists = {
        "SECURITY.md": listed_after(security, "What remains for Pod Security or a policy engine:"),
        "docs/admission.md": listed_after(
            ADMISSION.read_text(), "What it does not cover is left to Pod Security or a policy "
            "engine:"),
    }
    for page, items in lists.items():
        assert len(items) >= 3, (page, items)
        [item] = [x for x in items if HOST_PATHS_ITEM in x] or [None]
        assert item is not None, f"{page}: no item on fractional pods' own host paths"
        assert "policy engine" in item or "ValidatingAdmissionPolicy" in item, (page, item)
        assert "root" in item, (page, item)  # why: a writable host path is root on the node
    node_root = " ".join(security.split("These are the node-root cases", 1)[1]
                         .split("\n- ", 1)[0].split())
    assert "the webhook (in fractional pods)" not in node_root, node_root
    assert "fractional pods' own" in node_root, node_root
