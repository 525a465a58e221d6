"""A node agent's `--signing-key-file` holds PUBLIC keys only (the ConfigMap
kai-fractions-signing-public): text found there never becomes a verification key. Anything but a
PEM key in it used to be read as an HMAC key, so whoever could write that ConfigMap (readable,
and not a Secret) chose a shared secret the agent then verified with, and could sign allocations
the agent applied. The legacy HMAC key (the Secret of the releases that signed with HMAC) has a
flag of its own, `--signing-hmac-key-file`, which the chart passes with that Secret's mount."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kai_fractions.cli import main
from kai_fractions.signing import (
    CURRENT,
    V1,
    V2,
    Ed25519Key,
    Keyring,
    KeyringSource,
    SigningConfigError,
    load_keyring,
)

from .allocations import KEY_A, plan_of, time_slicing
from .test_chart_signing import KEY_DIR, LEGACY_DIR, agent_pod, lookup_values

TEXT = b"not-a-key-just-some-text-here"  # 29 bytes: long enough for an HMAC key
NODE = "gpu-node-1"


def agent(*args: str) -> int:
    return main(["node-agent", "--node-name", "n1", "--kubeconfig", "/nonexistent", *args])


def test_text_in_the_public_key_directory_does_not_replace_the_public_key(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: the ConfigMap's `current` turned from a PEM public key into 29 bytes of text was
    re-read as an HMAC key (logged INFO "signing keys reloaded"), and a v1 signature made with
    that text verified. Now the reload is refused with a WARNING naming the file and the rule,
    the Ed25519 key stays, and the forged signature does not verify."""
    public = Ed25519Key.generate()
    (tmp_path / CURRENT).write_bytes(public.public_pem())
    source = KeyringSource([str(tmp_path)], verify_only=True)
    plan = plan_of(time_slicing())
    forged = Keyring.of(TEXT).sign(plan)
    assert forged.startswith(f"{V1};")
    (tmp_path / CURRENT).write_bytes(TEXT)  # another size: re-read
    with caplog.at_level(logging.INFO):
        keyring = source.current()
    assert keyring.kids == (public.kid,) and [key.version for key in keyring.keys] == [V2]
    assert not keyring.verify(plan, forged, node=NODE).ok
    assert "signing keys reloaded" not in caplog.text
    warning = next(r for r in caplog.records if "keeping the previous signing keys" in r.message)
    assert warning.levelno == logging.WARNING
    assert f"--signing-key-file {tmp_path / CURRENT}: not a PEM public key" in warning.message
    assert "--signing-hmac-key-file" in warning.message
    assert TEXT.decode() not in caplog.text  # it may be a secret someone put in the wrong place


@pytest.mark.parametrize("material", [TEXT, KEY_A, b"x" * 16 + b"\n"],
                         ids=["text", "random bytes", "text and a newline"])
def test_a_public_key_file_that_is_not_pem_is_refused(tmp_path: Path, material: bytes) -> None:
    """Any non-PEM value of an HMAC key's size was taken as one by a verify-only keyring."""
    (tmp_path / "key").write_bytes(material)
    with pytest.raises(SigningConfigError) as e:
        load_keyring([str(tmp_path / "key")], verify_only=True)
    message = str(e.value)
    assert message.startswith(f"--signing-key-file {tmp_path / 'key'}: not a PEM public key"), \
        message
    assert "--signing-hmac-key-file" in message and "kai-fractions-signing-public" in message


def test_a_key_file_with_two_pem_blocks_is_refused(tmp_path: Path) -> None:
    """Before: the PEM reader took the first of two keys in one file and dropped the second
    unseen, so pods signed with a key appended by hand (a "rotation" by concatenation) were
    refused as signed with an unknown key, with no word of why. Now the file is refused, naming
    the rule (one key per file; the old one goes in `previous`)."""
    first, second = Ed25519Key.generate(), Ed25519Key.generate()
    (tmp_path / "current").write_bytes(first.public_pem() + second.public_pem())
    with pytest.raises(SigningConfigError) as e:
        load_keyring([str(tmp_path)], verify_only=True)
    assert str(e.value) == (f"--signing-key-file {tmp_path / 'current'}: holds 2 PEM blocks; "
                            "one key per file (in a rotation the old key goes in `previous`)")


def test_the_agent_refuses_to_start_with_text_as_its_public_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """Before: it started, verifying with the text as an HMAC key. Now it stops (exit 2) with
    the file and the rule, before it reads its kubeconfig; NodeAgent itself refuses it too."""
    keys = tmp_path / "signing"
    keys.mkdir()
    (keys / CURRENT).write_bytes(TEXT)
    with caplog.at_level(logging.INFO):
        assert agent("--signing-key-file", str(keys)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kai-fractions node-agent: --signing-key-file {keys / CURRENT}: not "
                          "a PEM public key"), err
    assert "--signing-hmac-key-file" in err
    assert "applying only signed allocations" not in caplog.text

    from kai_fractions.node.agent.agent import NodeAgent
    from kai_fractions.node.agent.options import AgentOptions
    from kai_fractions.node.config import NodeConfig
    from kai_fractions.sim.cgroups import FakeCgroupFs
    from kai_fractions.sim.nvml import FakeNvml

    with pytest.raises(SigningConfigError, match="not a PEM public key"):
        NodeAgent(config=NodeConfig(node_name="n1", sm_sharing=False),
                  options=AgentOptions(marker_dir=str(tmp_path / "markers"), socket=None,
                                       metrics_listen=None, signing_key_files=(str(keys),)),
                  nvml=FakeNvml.simulated(1), cgroup_fs=FakeCgroupFs(), source=None,
                  cluster=None)


def test_the_legacy_hmac_key_given_by_its_flag_still_verifies_v1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """The upgrade release's agent: the published public key with --signing-key-file, the old
    HMAC Secret with --signing-hmac-key-file. A pod signed (v1) before the upgrade verifies,
    a new (v2) signature too; a PEM key in the HMAC file is refused (it is no HMAC key)."""
    public = Ed25519Key.generate()
    (tmp_path / "public").mkdir()
    (tmp_path / "public" / CURRENT).write_bytes(public.public_pem())
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / CURRENT).write_bytes(KEY_A)
    source = KeyringSource([str(tmp_path / "public")], verify_only=True,
                           hmac_paths=[str(tmp_path / "legacy")])
    plan = plan_of(time_slicing())
    keyring = source.current()
    assert [key.version for key in keyring.keys] == [V2, V1]
    assert keyring.verify(plan, Keyring.of(KEY_A).sign(plan), node=NODE).ok
    assert keyring.verify(plan, Keyring.of(public).sign(plan, NODE), node=NODE).ok
    with caplog.at_level(logging.INFO):
        # it gets past the keys and stops at the (missing) kubeconfig
        assert agent("--signing-key-file", str(tmp_path / "public"),
                     "--signing-hmac-key-file", str(tmp_path / "legacy")) == 2
    assert "--signing" not in capsys.readouterr().err
    assert f"applying only signed allocations (keys: {public.kid}, " in caplog.text
    (tmp_path / "pem").write_bytes(public.public_pem())
    with pytest.raises(SigningConfigError, match=r"^--signing-hmac-key-file .*: a PEM file"):
        load_keyring([], verify_only=True, hmac_paths=[str(tmp_path / "pem")])


def test_the_chart_passes_the_legacy_secret_with_its_own_flag(tmp_path: Path) -> None:
    """Before: the legacy HMAC Secret's mount was a second --signing-key-file."""
    values = lookup_values(tmp_path, legacy={"current": KEY_A}, legacyHmac={"enabled": True})
    _, c = agent_pod(values_file=values)
    assert [a for a in c["args"] if a.startswith("--signing-")] == [
        f"--signing-key-file={KEY_DIR}", f"--signing-hmac-key-file={LEGACY_DIR}"]
    # and the agent's own parser takes it
    from kai_fractions.cli import build_parser

    parsed = build_parser().parse_args(["node-agent", "--node-name", "n1", *(
        a for a in c["args"] if a.startswith("--signing-"))])
    assert parsed.signing_key_file == [KEY_DIR] and parsed.signing_hmac_key_file == [LEGACY_DIR]
