"""`--allowed-identity` names who may write protected keys. A blank one would replace the
defaults (denying KAI's binder) and match the user "" that a review without `userInfo` has, so
that any such review could write the binder's keys: it is refused at start, naming the flag."""

from __future__ import annotations

import pytest

from kai_fractions.admission.config import AdmissionConfig
from kai_fractions.admission.validate import validate
from kai_fractions.cli import main

from .reviews import BINDER, CONFIG, GPU, pod, request

OLD = {"nvidia.com/container.main.gpu-memory.request": "8Gi"}
NEW = {**OLD, "nvidia.com/container.main.gpus.devices": GPU}


@pytest.mark.parametrize("identity", ["", " ", "\t", f" {BINDER}", f"{BINDER}\n"])
def test_the_cli_refuses_a_blank_or_padded_identity(capsys, identity: str):
    argv = ["admission", "--tls-cert", "/nonexistent/c", "--tls-key", "/nonexistent/k",
            "--gate-image", "img", "--allowed-identity", BINDER, "--allowed-identity", identity]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"kai-fractions admission: --allowed-identity: must be a username, got {identity!r}\n")


def test_the_config_refuses_it_too():
    with pytest.raises(ValueError, match=r"^allowed_identities: must be a username, got ''$"):
        AdmissionConfig(gate_image="img", allowed_identities=("",))


def test_a_review_without_a_user_never_passes_as_an_allowed_identity():
    """No `userInfo` (or no username in it) is the user "", which no allowed identity can be."""
    for strip in ("userInfo", "username"):
        review = request(pod(NEW), old=pod(OLD), user=BINDER)
        if strip == "userInfo":
            review.pop("userInfo")
        else:
            review["userInfo"].pop("username")
        decision = validate(review, CONFIG)
        assert not decision.allowed, strip
        assert "is a protected key" in decision.message
    assert validate(request(pod(NEW), old=pod(OLD), user=BINDER), CONFIG).allowed
