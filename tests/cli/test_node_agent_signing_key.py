"""`kai-fractions node-agent --signing-key-file`: the node takes the mirror's PUBLIC key (the
chart's ConfigMap kai-fractions-signing-public). A private key is refused at start, with the
flag, the file and the rule: a node that holds it could sign allocations."""

from __future__ import annotations

import base64
import json
import logging
import random
from pathlib import Path

import pytest

from kai_fractions.cli import main
from kai_fractions.signing import (
    CURRENT,
    Ed25519Key,
    KeyringSource,
    SigningConfigError,
    SigningKey,
    _private_key_form,
    load_keyring,
)

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
                     "--signing-hmac-key-file", str(tmp_path / "hmac")) == 2
    assert "private key" not in capsys.readouterr().err
    assert f"applying only signed allocations (keys: {key.kid}, " in caplog.text


def test_the_help_names_the_public_key_and_the_configmap(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "10000")  # no wrapping, which breaks words at hyphens
    with pytest.raises(SystemExit):
        main(["node-agent", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    text = out[out.index("--signing-key-file FILE apply"):]
    text = text[:text.index("--signing-hmac-key-file FILE also")]
    assert "Ed25519 public key (PEM)" in text and "kai-fractions-signing-public" in text
    assert "A private key is refused" in text
    assert "never read as an HMAC key" in text and "--signing-hmac-key-file" in text
    assert "raw key" not in text and "Secret" not in text
    legacy = out[out.index("--signing-hmac-key-file FILE also"):]
    legacy = legacy[:legacy.index("--signature-key-wait SECONDS")]
    assert "legacy HMAC key" in legacy and "seed cannot be told from an HMAC key" in legacy


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


# -- private keys in other forms than a PEM header -----------------------------------------------


def _private_forms() -> dict[str, tuple[Ed25519Key | None, bytes]]:
    """A private key as a node could be handed one by mistake: each must be refused, not read as
    an HMAC key (which is what anything but a PEM key used to become)."""
    from cryptography.hazmat.primitives import serialization as s
    from cryptography.hazmat.primitives.asymmetric import ec

    key = Ed25519Key.generate()
    assert key.private is not None
    der = key.private.private_bytes(s.Encoding.DER, s.PrivateFormat.PKCS8, s.NoEncryption())
    b64 = base64.b64encode(der)
    pem = key.private_pem()
    seed = key.private.private_bytes(s.Encoding.Raw, s.PrivateFormat.Raw, s.NoEncryption())
    x = key.public.public_bytes(s.Encoding.Raw, s.PublicFormat.Raw)
    jwk = {"kty": "OKP", "crv": "Ed25519", "d": base64.urlsafe_b64encode(seed).decode(),
           "x": base64.urlsafe_b64encode(x).decode()}
    return {
        "PKCS8 DER": (key, der),
        "encrypted PKCS8 DER": (key, key.private.private_bytes(
            s.Encoding.DER, s.PrivateFormat.PKCS8, s.BestAvailableEncryption(b"secret"))),
        "EC DER (traditional)": (None, ec.generate_private_key(ec.SECP256R1()).private_bytes(
            s.Encoding.DER, s.PrivateFormat.TraditionalOpenSSL, s.NoEncryption())),
        "base64 of the DER": (key, b64),
        "base64 of the DER, with a newline": (key, b64 + b"\n"),
        "a PEM body without its lines": (key, b"".join(pem.splitlines(keepends=True)[1:-1])),
        "base64url of the DER, no padding": (key, base64.urlsafe_b64encode(der).rstrip(b"=")),
        "base64 of the PEM (a Secret's data value)": (key, base64.b64encode(pem)),
        "JWK": (key, json.dumps(jwk).encode()),
        "JWK set": (key, json.dumps({"keys": [jwk]}).encode()),
        "JWK with a BOM": (key, b"\xef\xbb\xbf" + json.dumps(jwk).encode()),
        "PEM, lowercase header": (key, pem.replace(b"-----BEGIN PRIVATE KEY-----",
                                                   b"-----begin private key-----")),
        "PEM after a BOM": (key, b"\xef\xbb\xbf" + pem),
        "PEM after blank lines": (key, b"\n\n  " + pem),
    }


@pytest.mark.parametrize("form", list(_private_forms()))
def test_a_private_key_in_any_form_is_refused(tmp_path: Path, form: str) -> None:
    key, material = _private_forms()[form]
    (tmp_path / "key").write_bytes(material)
    with pytest.raises(SigningConfigError) as e:
        load_keyring([str(tmp_path / "key")], verify_only=True)
    message = str(e.value)
    assert message.startswith(f"--signing-key-file {tmp_path / 'key'}: a private key"), message
    assert "only the mirror may hold one" in message
    assert key is None or key.kid not in message


def test_a_der_private_key_is_refused_at_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    key, der = _private_forms()["PKCS8 DER"]
    (tmp_path / "key.der").write_bytes(der)
    with caplog.at_level(logging.INFO):
        assert agent("--signing-key-file", str(tmp_path / "key.der")) == 2
    err = capsys.readouterr().err
    assert f"--signing-key-file {tmp_path / 'key.der'}: a private key (DER); " in err
    assert key is not None and key.kid not in err and key.kid not in caplog.text
    assert "applying only signed allocations" not in caplog.text


def test_a_der_private_key_swapped_in_while_the_agent_runs_is_not_taken(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """It used to be read as an HMAC key: "signing keys reloaded: <kid>", and the public key
    it replaced was gone, so every pod then waited with SignatureKeyUnknown."""
    public = Ed25519Key.generate()
    (tmp_path / CURRENT).write_bytes(public.public_pem())
    source = KeyringSource([str(tmp_path)], verify_only=True)
    _, der = _private_forms()["PKCS8 DER"]
    (tmp_path / CURRENT).write_bytes(der)
    with caplog.at_level(logging.INFO):
        assert source.current().kids == (public.kid,)
    assert "signing keys reloaded" not in caplog.text
    assert "a private key (DER)" in caplog.text


def test_a_public_key_after_a_bom_is_the_public_key(tmp_path: Path) -> None:
    key = Ed25519Key.generate()
    (tmp_path / "public.pem").write_bytes(b"\xef\xbb\xbf" + key.public_pem())
    taken = load_keyring([str(tmp_path / "public.pem")], verify_only=True).current
    assert isinstance(taken, Ed25519Key) and taken.kid == key.kid and not taken.can_sign


def test_random_hmac_keys_are_never_taken_for_private_keys(tmp_path: Path) -> None:
    """An HMAC key is random bytes (the chart's legacy Secret: `randBytes 32`), or printable
    random text. None of 10,000 of each is refused. A DER private key is a SEQUENCE (first byte
    0x30), so about 1 in 256 random keys reaches the DER parser, which then needs a complete
    key structure (a PKCS8 Ed25519 key: 16 fixed bytes of 48); printable keys decode, as
    base64, to random bytes too."""
    rng = random.Random(20261207)
    raw = [rng.randbytes(32) for _ in range(10_000)]
    assert sum(key.startswith(b"\x30") for key in raw) > 10  # the parser is exercised
    printable = [base64.b64encode(rng.randbytes(32)) + b"\n" for _ in range(10_000)]
    printable += [rng.randbytes(32).hex().encode() for _ in range(1_000)]
    assert [m for m in raw + printable if _private_key_form(m) is not None] == []
    path = tmp_path / "hmac"
    for material in raw[:100] + printable[:100]:  # the same check, as the agent reads a file
        path.write_bytes(material)
        assert isinstance(load_keyring([], verify_only=True, hmac_paths=[str(path)]).current,
                          SigningKey)


def test_a_refused_reload_is_logged_once_and_still_retried(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """current() runs on every plan pass: while the files stay refused the warning is not
    repeated, but each call still re-reads them (a read that raced the kubelet's update must
    succeed later), and another refused state is logged again."""
    import kai_fractions.signing as signing

    public, private = Ed25519Key.generate(), Ed25519Key.generate()
    (tmp_path / CURRENT).write_bytes(public.public_pem())
    source = KeyringSource([str(tmp_path)], verify_only=True)
    (tmp_path / CURRENT).write_bytes(private.private_pem())
    loads = []
    real = signing.load_keyring
    monkeypatch.setattr(signing, "load_keyring",
                        lambda *a, **kw: loads.append(1) or real(*a, **kw))
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            assert source.current().kids == (public.kid,)
        assert len(loads) == 5
        assert caplog.text.count("keeping the previous signing keys") == 1
        (tmp_path / CURRENT).write_bytes(b"short")  # another state, another reason
        assert source.current().kids == (public.kid,)
        assert source.current().kids == (public.kid,)
        assert caplog.text.count("keeping the previous signing keys") == 2
        assert "not a PEM public key (5 byte(s), not shown)" in caplog.text
        (tmp_path / CURRENT).write_bytes(private.private_pem())  # back to the first: again
        assert source.current().kids == (public.kid,)
        assert caplog.text.count("keeping the previous signing keys") == 3
    newer = Ed25519Key.generate()
    (tmp_path / CURRENT).write_bytes(newer.public_pem() + b"\n")  # a size of its own
    assert source.current().kids == (newer.kid,)
