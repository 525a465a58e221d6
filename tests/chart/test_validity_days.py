"""`mirror.tls.validityDays` and `webhook.tls.validityDays` are bounded: Helm's `genCA` and
`genSignedCert` count the days in a Go duration of nanoseconds, which overflows past 106751 days
into a certificate whose notAfter lies before its notBefore (the webhook would then refuse every
review). The schema caps them at 36500 (100 years), naming the value."""

from __future__ import annotations

import base64

import pytest
from cryptography import x509

from .render import find, render, template_error

MAX_DAYS = 36500
SECRETS = {"mirror": ("kai-fractions-mirror-tls", "kai-fractions-mirror-client-tls"),
           "webhook": ("kai-fractions-admission-tls",)}


@pytest.mark.parametrize("component", sorted(SECRETS))
@pytest.mark.parametrize("days", [MAX_DAYS + 1, 106752, 200000])
def test_more_days_than_the_bound_are_refused_naming_the_value(component: str, days: int):
    err = template_error(f"{component}.tls.validityDays={days}")
    assert f"/{component}/tls/validityDays" in err, err
    assert "maximum" in err and ("36,500" in err or "36500" in err), err


@pytest.mark.parametrize("component", sorted(SECRETS))
def test_the_bound_itself_makes_certificates_valid_for_it(component: str):
    """At the bound the generated CA and certificates end after they start, and cover the days
    asked for (a day count past Helm's overflow made them end centuries before)."""
    docs = render(sets=(f"{component}.tls.validityDays={MAX_DAYS}",))
    for name in SECRETS[component]:
        [secret] = find(docs, "Secret", name)
        for field in ("tls.crt", "ca.crt"):
            if field not in secret["data"]:
                continue
            cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"][field]))
            span = cert.not_valid_after_utc - cert.not_valid_before_utc
            assert MAX_DAYS - 1 <= span.days <= MAX_DAYS, (name, field, span)
