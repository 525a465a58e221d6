"""A live admission server's /metrics with its labelled series populated: the REAL
`kai-fractions admission --metrics-listen` process on 127.0.0.1, after a review of each
outcome (an allowed /mutate, a denied /validate, a /validate that failed with an internal
error) and two refusals (`malformed`, `not_found`), and a scrape of it after SIGTERM, while it
drains. For the test that the CLI serves its metrics (tests/admission/test_server_metrics.py)
and the chart's dashboard and alerting-rule tests (tests/chart/test_dashboard.py,
tests/chart/test_alerts.py), which check their expressions against it.

No review the API server sends should make the server fail, so the `error` review is a fault
injected into the process: it runs the CLI's own `main` (as the mirror's test process does),
its /validate wrapped to raise for one review uid (FAULT_UID) and to review every other as
before. The rest is the real server: its HTTPS, its counting, its metrics endpoint."""

from __future__ import annotations

import http.client
import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.admission.reviews import CONFIG
from tests.support.promql import sample_value

DATA = Path(__file__).resolve().parents[1] / "admission" / "data"
FAULT_UID = "kai-fractions-test-internal-error"
FAULT = "a fault the test injected"
REVIEWS = "kai_fractions_admission_reviews_total"
REFUSED = "kai_fractions_admission_requests_refused_total"
FAMILIES = (  # the samples a scrape holds of every family: the server's, and its process's
    REVIEWS, "kai_fractions_admission_review_seconds_bucket", REFUSED,
    "kai_fractions_admission_connections_open", "kai_fractions_admission_connections_limit",
    "kai_fractions_admission_connections_evicted_total",
    "kai_fractions_admission_connections_backlogged_total",
    "kai_fractions_admission_body_bytes_held", "kai_fractions_admission_body_bytes_budget",
    "kai_fractions_admission_draining",
    "process_resident_memory_bytes", "process_cpu_seconds_total")
SERVING_LINE = re.compile(r"serving /validate, /mutate and /healthz on https://127\.0\.0\.1:"
                          r"(\d+)$")
METRICS_LINE = re.compile(r"metrics at (http://127\.0\.0\.1:\d+/metrics)$")
LAUNCH = f"""\
import sys
from kai_fractions.admission import server
from kai_fractions.cli import main

validate = server.ROUTES["/validate"]

def failing(request, config):
    if request.get("uid") == {FAULT_UID!r}:
        raise RuntimeError({FAULT!r})
    return validate(request, config)

server.ROUTES["/validate"] = failing
sys.exit(main())
"""

SENT = {  # what the server counts for the requests sent
    (REVIEWS, (("webhook", "mutate"), ("outcome", "allowed"))): 1.0,
    (REVIEWS, (("webhook", "validate"), ("outcome", "denied"))): 1.0,
    (REVIEWS, (("webhook", "validate"), ("outcome", "error"))): 1.0,
    (REFUSED, (("reason", "malformed"),)): 1.0,
    (REFUSED, (("reason", "not_found"),)): 1.0,
}


def _review(name: str, uid: str = "") -> bytes:
    review = json.loads((DATA / name).read_text())
    if uid:
        review["request"]["uid"] = uid
    return json.dumps(review).encode()


def _post(port: int, ca_file: Path, path: str, body: bytes) -> tuple[int, Any]:
    context = ssl.create_default_context(cafile=str(ca_file))
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        answer = conn.getresponse()
        raw = answer.read()
    finally:
        conn.close()
    is_json = answer.getheader("Content-Type", "").startswith("application/json")
    return answer.status, json.loads(raw) if is_json else raw.decode()


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read().decode()


def _line(proc: subprocess.Popen[str], pattern: re.Pattern[str]) -> re.Match[str]:
    assert proc.stderr is not None
    line = proc.stderr.readline().rstrip("\n")
    found = pattern.search(line)
    assert found, f"{line!r}, not {pattern.pattern!r}"
    return found


def populated_admission_scrape(tls_dir: Path) -> tuple[str, str]:
    """The /metrics text of a real `kai-fractions admission --metrics-listen` process once it
    counted a review of each outcome and a refusal of two reasons (SENT), and a scrape of it
    after SIGTERM, while it drains; `tls_dir` holds its tls.crt (for 127.0.0.1) and tls.key.
    The process has exited 0 when this returns."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, "admission", "--listen", "127.0.0.1:0", "--tls-cert",
         str(tls_dir / "tls.crt"), "--tls-key", str(tls_dir / "tls.key"), "--gate-image",
         CONFIG.gate_image, "--shutdown-delay", "2", "--metrics-listen", "127.0.0.1:0"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        port = int(_line(proc, SERVING_LINE).group(1))
        url = _line(proc, METRICS_LINE).group(1)
        ca_file = tls_dir / "tls.crt"
        status, answer = _post(port, ca_file, "/mutate", _review("pod-time-slicing.review.json"))
        assert status == 200 and answer["response"]["allowed"] is True, answer
        status, answer = _post(port, ca_file, "/validate", _review("pod-invalid.review.json"))
        assert status == 200 and answer["response"]["allowed"] is False, answer
        status, answer = _post(port, ca_file, "/validate",
                               _review("pod-plain.review.json", FAULT_UID))
        assert status == 200 and answer["response"]["status"]["reason"] == "InternalError", \
            answer
        assert _post(port, ca_file, "/validate", b"{not json")[0] == 400
        assert _post(port, ca_file, "/nope", _review("pod-plain.review.json"))[0] == 404
        text = _scrape(url)
        for (name, labels), value in SENT.items():
            assert sample_value(text, name, **dict(labels)) == value, (name, labels, text)
        proc.terminate()
        deadline = time.monotonic() + 5
        while sample_value(draining := _scrape(url), "kai_fractions_admission_draining") != 1:
            assert time.monotonic() < deadline, f"never drained:\n{draining}"
            time.sleep(0.01)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        # the one stack trace is the injected fault's
        assert err.count("Traceback") == 1 and f"RuntimeError: {FAULT}" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return text, draining
