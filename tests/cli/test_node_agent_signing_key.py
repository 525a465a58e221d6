"""`kai-fractions node-agent --signing-key-file`: the node takes the mirror's PUBLIC key (the
chart's ConfigMap kai-fractions-signing-public). A private key is refused at start, with the
flag, the file and the rule: a node that holds it could sign allocations."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kai_fractions.cli import main
from kai_fractions.signing import CURRENT, Ed25519Key, KeyringSource

OPENSSH = (b"-----BEGIN OPENSSH PRIVATE KEY-----\n"
           b"b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
           b"-----END OPENSSH PRIVATE KEY-----\n")


def agent(*args: str) -> int:
    return main(["node-agent", "--node-name", "n1", "--kubeconfig", "/nonexistent", *args])


@pytest.mark.parametrize("layout", ["file", "directory"])
def test_the_mirrors_private_key_is_refused_and_nothing_derived_from_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
        layout: str) -> None:
    key = Ed25519Key.generate()
    if layout == "file":
        given = path = tmp_path / "private.pem"
    else:
        given = tmp_path / "signing"
        given.mkdir()
        path = given / CURRENT
    path.write_bytes(key.private_pem())
    with caplog.at_level(logging.INFO):
        assert agent("--signing-key-file", str(given)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kai-fractions node-agent: --signing-key-file {path}: a private "
                          "key; "), err
    assert "PUBLIC key" in err and "kai-fractions-signing-public" in err
    assert "only the mirror may hold one" in err
    # the key is not reduced to its public half: no key id, no "applying only signed"
    assert key.kid not in err and key.kid not in caplog.text
    assert "applying only signed allocations" not in caplog.text


def test_a_private_key_of_another_kind_is_not_taken_for_an_hmac_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "id_ed25519").write_bytes(OPENSSH)
    assert agent("--signing-key-file", str(tmp_path / "id_ed25519")) == 2
    assert "a private key; " in capsys.readouterr().err


def test_the_public_key_and_a_legacy_hmac_key_are_taken(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    key = Ed25519Key.generate()
    (tmp_path / "public.pem").write_bytes(key.public_pem())
    (tmp_path / "hmac").write_bytes(b"k" * 32)
    with caplog.at_level(logging.INFO):
        # it gets past the keys and stops at the (missing) kubeconfig
        assert agent("--signing-key-file", str(tmp_path / "public.pem"),
                     "--signing-key-file", str(tmp_path / "hmac")) == 2
    assert "private key" not in capsys.readouterr().err
    assert f"applying only signed allocations (keys: {key.kid}, " in caplog.text


def test_the_help_names_the_public_key_and_the_configmap(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "10000")  # no wrapping, which breaks words at hyphens
    with pytest.raises(SystemExit):
        main(["node-agent", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    text = out[out.index("--signing-key-file FILE apply"):]
    text = text[:text.index("--signature-key-wait SECONDS")]
    assert "Ed25519 public key (PEM)" in text and "kai-fractions-signing-public" in text
    assert "A private key is refused" in text
    assert "raw key" not in text and "Secret" not in text


def test_a_private_key_swapped_in_while_the_agent_runs_is_not_taken(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The agent re-reads its key files when they change (a rotated ConfigMap): a private key
    found there then is refused as at start, and the public keys it had stay in use."""
    public, private = Ed25519Key.generate(), Ed25519Key.generate()
    (tmp_path / CURRENT).write_bytes(public.public_pem())
    source = KeyringSource([str(tmp_path)], verify_only=True)
    assert source.current().kids == (public.kid,)
    (tmp_path / CURRENT).write_bytes(private.private_pem() + b"\n")  # size changes: re-read
    with caplog.at_level(logging.WARNING):
        assert source.current().kids == (public.kid,)
    assert "keeping the previous signing keys" in caplog.text
    assert "a private key" in caplog.text and private.kid not in caplog.text


def test_the_agent_rereads_its_key_files_verify_only(tmp_path: Path) -> None:
    """NodeAgent's own key source, the one that follows a rotated ConfigMap."""
    from kai_fractions.node.agent.agent import NodeAgent
    from kai_fractions.node.agent.options import AgentOptions
    from kai_fractions.node.config import NodeConfig
    from kai_fractions.sim.cgroups import FakeCgroupFs
    from kai_fractions.sim.nvml import FakeNvml

    (tmp_path / CURRENT).write_bytes(Ed25519Key.generate().public_pem())
    node_agent = NodeAgent(
        config=NodeConfig(node_name="n1", sm_sharing=False),
        options=AgentOptions(marker_dir=str(tmp_path / "markers"), socket=None,
                             metrics_listen=None, signing_key_files=(str(tmp_path),)),
        nvml=FakeNvml.simulated(1), cgroup_fs=FakeCgroupFs(), source=None, cluster=None)
    signatures = node_agent.reconciler.pods.signatures
    assert signatures is not None and signatures.source.verify_only is True
