"""kai_fractions.signing: what is signed, the annotation's format, verification verdicts,
rotation with two keys, and key files (a Secret volume) re-read when they change."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os

import pytest

from kai_fractions.contract import DEFAULT_KEYS, Keys
from kai_fractions.contract import keys as k
from kai_fractions.signing import (
    Ed25519Key,
    Keyring,
    KeyringSource,
    Reason,
    SignatureFormatError,
    SigningConfigError,
    SigningKey,
    allocation_claims,
    load_keyring,
    parse_signature,
    signature_key,
)

from .allocations import GPU_A, GPU_B, KEY_A, KEY_B, UID, plan_of, sm_sharing, time_slicing

KID_A = hashlib.sha256(KEY_A).hexdigest()[:8]
KID_B = hashlib.sha256(KEY_B).hexdigest()[:8]
TS_CLAIMS = (f'["kai-fractions.io/allocation",1,"{UID}","main","{GPU_A}","time-slicing",'
             '20480,30720,null]')
SM_CLAIMS = (f'["kai-fractions.io/allocation",1,"{UID}","main","{GPU_A},{GPU_B}",'
             '"sm-sharing",10240,10240,25]')


def expected_signature(key: bytes, claims: str) -> str:
    mac = hmac.new(key, claims.encode(), hashlib.sha256).digest()
    return (f"v1;kid={hashlib.sha256(key).hexdigest()[:8]};"
            f"sig={base64.urlsafe_b64encode(mac).decode().rstrip('=')}")


def edited(annotations: dict[str, str], **changes: str | None) -> dict[str, str]:
    out = dict(annotations)
    for suffix, value in changes.items():
        key = f"nvidia.com/container.main.{suffix.replace('_', '-').replace('--', '.')}"
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


# -- what is signed ----------------------------------------------------------------------------

def test_the_annotation_key_is_a_protected_derived_key():
    assert k.DERIVED_SIGNATURE == ".signature"
    assert signature_key(plan_of(time_slicing())) == "kai-fractions.io/container.main.signature"
    assert DEFAULT_KEYS.is_protected("kai-fractions.io/container.main.signature")
    keys = Keys(project_prefix="example.com/c.")
    assert signature_key(plan_of(time_slicing()), keys) == "example.com/c.main.signature"
    assert keys.is_protected("example.com/c.main.signature")


def test_claims_are_the_enforced_values_as_a_compact_json_array():
    assert allocation_claims(plan_of(time_slicing())) == TS_CLAIMS.encode()
    assert allocation_claims(plan_of(sm_sharing())) == SM_CLAIMS.encode()


def test_signature_is_hmac_sha256_with_the_key_id():
    keyring = Keyring.of(KEY_A)
    assert keyring.sign(plan_of(time_slicing())) == expected_signature(KEY_A, TS_CLAIMS)
    assert keyring.sign(plan_of(sm_sharing())) == expected_signature(KEY_A, SM_CLAIMS)
    assert keyring.current.kid == KID_A
    value = keyring.sign(plan_of(time_slicing()))
    assert value.startswith(f"v1;kid={KID_A};sig=") and len(value) == len("v1;kid=;sig=") + 8 + 43


def test_a_valid_signature_verifies():
    keyring = Keyring.of(KEY_A)
    for wanted in (time_slicing(), sm_sharing()):
        plan = plan_of(wanted)
        verdict = keyring.verify(plan, keyring.sign(plan))
        assert (verdict.ok, verdict.reason, verdict.message, verdict.kid) == (True, "", "", KID_A)


EDITS = {
    "request raised": edited(time_slicing(), gpu_memory__request="25Gi"),
    "limit raised": edited(time_slicing(), gpu_memory__limit="80Gi"),
    "limit removed": edited(time_slicing(), gpu_memory__limit=None),
    "devices changed": edited(time_slicing(), gpus__devices=GPU_B),
    "device added": edited(time_slicing(), gpus__devices=f"{GPU_A},{GPU_B}"),
    "devices as CDI names": edited(time_slicing(),
                                   gpus__devices=f"k8s.device-plugin.nvidia.com/gpu={GPU_A}"),
    "mode switched": edited(time_slicing(), gpu_compute__mode="sm-sharing",
                            gpu_compute__portion="0.5"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_an_edited_allocation_is_invalid(name):
    keyring = Keyring.of(KEY_A)
    signature = keyring.sign(plan_of(time_slicing()))
    verdict = keyring.verify(plan_of(EDITS[name]), signature)
    assert (verdict.ok, verdict.reason, verdict.kid) == (False, Reason.INVALID, KID_A)
    assert verdict.message == (
        "annotation kai-fractions.io/container.main.signature does not match the allocation: "
        "the pod's GPU annotations (devices, memory request or limit, compute mode or portion) "
        "were changed after the kai-fractions mirror signed them, or were written by someone "
        "else; nothing is applied: delete the pod so the scheduler binds it again")


@pytest.mark.parametrize(("portion", "ok"), [("0.5", False), ("0.1", False), ("0.252", True)])
def test_the_portion_counts_as_the_active_thread_percentage_the_node_enforces(portion, ok):
    keyring = Keyring.of(KEY_A)
    signature = keyring.sign(plan_of(sm_sharing()))
    changed = edited(sm_sharing(), gpu_compute__portion=portion)
    assert keyring.verify(plan_of(changed), signature).ok is ok


def test_another_pod_uid_or_container_is_invalid():
    keyring = Keyring.of(KEY_A)
    signature = keyring.sign(plan_of(time_slicing()))
    other_uid = plan_of(time_slicing(), uid="99999999-0000-4000-8000-000000000000")
    assert keyring.verify(other_uid, signature).reason == Reason.INVALID
    other_container = plan_of(time_slicing("side"), containers=("side",))
    assert keyring.verify(other_container, signature).reason == Reason.INVALID


def test_a_spelling_that_enforces_the_same_signs_the_same():
    keyring = Keyring.of(KEY_A)
    signature = keyring.sign(plan_of(time_slicing()))
    same = edited(time_slicing(), gpu_memory__request="20480Mi")
    assert keyring.verify(plan_of(same), signature).ok


@pytest.mark.parametrize("value", [None, ""])
def test_a_missing_signature(value):
    verdict = Keyring.of(KEY_A).verify(plan_of(time_slicing()), value)
    assert (verdict.ok, verdict.reason) == (False, Reason.MISSING)
    assert verdict.message == (
        "annotation kai-fractions.io/container.main.signature is missing: this node applies "
        "only allocations signed by the kai-fractions mirror, and waits for it (with an "
        "unmodified KAI the mirror's BindRequest follower signs once it has checked the "
        "binder's annotations); if it never comes, look for NvFractionsMismatch events on "
        "the pod and check that the mirror runs with --signing-key-file (and "
        "--follow-bindrequests for an unmodified KAI)")
    assert Reason.MISSING == "SignatureMissing" and Reason.INVALID == "SignatureInvalid"


GOOD_SIG = expected_signature(KEY_A, TS_CLAIMS).split("sig=")[1]
MALFORMED = [
    ("v3;kid=00000000;sig=" + GOOD_SIG, "version 'v3' is not 'v2' (or 'v1')"),
    ("v2;kid=00000000;sig=" + GOOD_SIG,
     "the third field must be sig=<86 base64url characters (Ed25519, no padding)>"),
    ("v1;kid=0000000;sig=" + GOOD_SIG, "the second field must be kid=<8 lowercase hex digits>"),
    ("v1;kid=ABCDEF01;sig=" + GOOD_SIG, "the second field must be kid=<8 lowercase hex digits>"),
    ("v1;key=00000000;sig=" + GOOD_SIG, "the second field must be kid=<8 lowercase hex digits>"),
    ("v1;kid=00000000;sig=" + GOOD_SIG + "=",
     "the third field must be sig=<43 base64url characters (HMAC-SHA256, no padding)>"),
    ("v1;kid=00000000;sig=" + GOOD_SIG[:-1],
     "the third field must be sig=<43 base64url characters (HMAC-SHA256, no padding)>"),
    ("v1;kid=00000000;sig=" + GOOD_SIG[:-1] + "+",
     "the third field must be sig=<43 base64url characters (HMAC-SHA256, no padding)>"),
    ("v1;kid=00000000;sig=" + "A" * 42 + "B", "sig is not the canonical base64url of 32 bytes"),
    ("v1;kid=00000000", "expected v2;kid=<key id>;sig=<signature> (3 fields separated by ';'), "
     "got 2 field(s)"),
    ("v1;kid=00000000;sig=" + GOOD_SIG + ";x=1", "expected v2;kid=<key id>;sig=<signature> "
     "(3 fields separated by ';'), got 4 field(s)"),
    ("x" * 129, "is 129 characters long; a signature has at most 128"),
]


@pytest.mark.parametrize(("value", "why"), MALFORMED)
def test_malformed_signatures_are_invalid_and_say_why(value, why):
    with pytest.raises(SignatureFormatError) as e:
        parse_signature(value)
    assert str(e.value) == why
    verdict = Keyring.of(KEY_A).verify(plan_of(time_slicing()), value)
    assert (verdict.ok, verdict.reason) == (False, Reason.INVALID)
    assert verdict.message.startswith(
        f"annotation kai-fractions.io/container.main.signature is malformed ({why}); the pod's "
        "GPU annotations")


def test_parse_roundtrip():
    value = expected_signature(KEY_A, TS_CLAIMS)
    signature = parse_signature(value)
    assert signature.kid == KID_A and len(signature.mac) == 32
    assert signature.encode() == value
    assert repr(signature.mac) not in repr(signature)


# -- rotation ----------------------------------------------------------------------------------

def test_rotation_signs_with_current_and_accepts_previous():
    plan = plan_of(time_slicing())
    old = Keyring.of(KEY_A).sign(plan)
    rotated = Keyring.of(KEY_B, KEY_A)
    assert rotated.current.kid == KID_B and rotated.kids == (KID_B, KID_A)
    assert rotated.sign(plan) == expected_signature(KEY_B, TS_CLAIMS)
    assert rotated.verify(plan, old).ok and rotated.verify(plan, old).kid == KID_A
    retired = Keyring.of(KEY_B)
    verdict = retired.verify(plan, old)
    assert (verdict.ok, verdict.reason, verdict.kid) == (False, Reason.KEY_UNKNOWN, KID_A)
    assert verdict.message == (
        f"annotation kai-fractions.io/container.main.signature was signed with v1 key {KID_A}, "
        f"which this node does not hold (it holds {KID_B}): after a key rotation the mirror's "
        "new public key reaches the nodes within minutes (ConfigMap "
        "kai-fractions-signing-public, as the kubelet syncs it); if it never does, the key was "
        "rotated without keeping the old one as `previous`, or the mirror and the node agent "
        "use different keys")


def test_a_signature_from_an_unknown_key_with_a_known_kid_is_still_checked():
    """The kid only picks the key: a forger who copies a valid kid still needs the key."""
    plan = plan_of(time_slicing())
    forged = parse_signature(Keyring.of(KEY_B).sign(plan))
    value = f"v1;kid={KID_A};sig=" + forged.encode().split("sig=")[1]
    verdict = Keyring.of(KEY_A).verify(plan, value)
    assert (verdict.ok, verdict.reason) == (False, Reason.INVALID)
    assert "does not match the allocation" in verdict.message


def test_short_keys_are_refused_and_keys_never_show_in_repr():
    with pytest.raises(SigningConfigError) as e:
        SigningKey(b"x" * 15, "/keys/current")
    assert str(e.value) == ("signing key /keys/current: 15 byte(s); an HMAC-SHA256 key needs at "
                            "least 16 (better: an Ed25519 key pair from `kai-fractions "
                            "signing-keys`)")
    assert KEY_A.hex() not in repr(Keyring.of(KEY_A)) and str(KEY_A) not in repr(
        Keyring.of(KEY_A))
    with pytest.raises(SigningConfigError):
        Keyring(())


def test_duplicate_keys_count_once():
    assert Keyring.of(KEY_A, KEY_B, KEY_A).kids == (KID_A, KID_B)


def test_two_keys_whose_kids_collide_are_both_kept_and_both_verify():
    """A kid is 8 hex digits of a SHA-256: two keys in 2^32 share one. The keyring kept only the
    first, so after a rotation onto such a key every signature of the other was refused."""
    first, second = b"collide-kid-0000009613", b"collide-kid-0000134479"
    assert hashlib.sha256(first).hexdigest()[:8] == hashlib.sha256(second).hexdigest()[:8]
    plan = plan_of(time_slicing())
    signed_by_second = Keyring.of(second).sign(plan)
    both = Keyring.of(first, second)
    assert len(both.keys) == 2
    assert both.verify(plan, signed_by_second).ok
    assert both.verify(plan, Keyring.of(first).sign(plan)).ok
    assert not Keyring.of(first).verify(plan, signed_by_second).ok


# -- key files ---------------------------------------------------------------------------------

def write_secret_volume(root, data: dict[str, bytes], generation: int) -> None:
    """What the kubelet does for a Secret volume: files in a timestamped directory, `..data`
    swapped atomically, and each key a symlink through `..data`."""
    stamp = root / f"..2025_01_01_00_00_{generation:02d}"
    stamp.mkdir()
    for name, value in data.items():
        (stamp / name).write_bytes(value)
    tmp = root / "..data_tmp"
    tmp.symlink_to(stamp.name)
    os.replace(tmp, root / "..data")
    for name in data:
        link = root / name
        if not link.is_symlink():
            link.symlink_to(f"..data/{name}")
    for name in ("current", "previous"):
        if name not in data and (root / name).is_symlink():
            (root / name).unlink()


def test_a_directory_holds_current_and_previous(tmp_path):
    (tmp_path / "current").write_bytes(KEY_B)
    assert load_keyring([str(tmp_path)]).kids == (KID_B,)
    (tmp_path / "previous").write_bytes(KEY_A)
    assert load_keyring([str(tmp_path)]).kids == (KID_B, KID_A)


def test_repeated_files_first_signs(tmp_path):
    (tmp_path / "new").write_bytes(KEY_B)
    (tmp_path / "old").write_bytes(KEY_A)
    keyring = load_keyring([str(tmp_path / "new"), str(tmp_path / "old")])
    assert keyring.current.kid == KID_B and keyring.kids == (KID_B, KID_A)


def test_key_bytes_are_used_verbatim(tmp_path):
    (tmp_path / "key").write_bytes(KEY_A + b"\n")
    assert load_keyring([str(tmp_path / "key")]).current.kid == \
        hashlib.sha256(KEY_A + b"\n").hexdigest()[:8]


def test_unusable_key_files(tmp_path):
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    (tmp_path / "short").write_bytes(b"abc")
    cases = [
        ([str(tmp_path / "nope")], f"--signing-key-file {tmp_path}/nope: no such file or "
         "directory"),
        ([str(empty_dir)], f"--signing-key-file {empty_dir}: a key directory needs a file "
         "named 'current' (and may have 'previous')"),
        ([str(tmp_path / "short")], f"signing key {tmp_path}/short: 3 byte(s); an HMAC-SHA256 "
         "key needs at least 16 (better: an Ed25519 key pair from `kai-fractions signing-keys`)"),
        ([], "--signing-key-file: no key file given"),
    ]
    for paths, message in cases:
        with pytest.raises(SigningConfigError) as e:
            load_keyring(paths)
        assert str(e.value) == message


def test_a_rotated_secret_volume_takes_effect_without_restart(tmp_path):
    write_secret_volume(tmp_path, {"current": KEY_A}, 1)
    source = KeyringSource([str(tmp_path)])
    assert source.current().kids == (KID_A,)
    write_secret_volume(tmp_path, {"current": KEY_B, "previous": KEY_A}, 2)
    assert source.current().kids == (KID_B, KID_A)
    write_secret_volume(tmp_path, {"current": KEY_B}, 3)
    assert source.current().kids == (KID_B,)


def test_a_broken_update_keeps_the_last_good_keys_and_recovers(tmp_path, caplog):
    (tmp_path / "current").write_bytes(KEY_A)
    source = KeyringSource([str(tmp_path)])
    (tmp_path / "current").write_bytes(b"short")
    assert source.current().kids == (KID_A,)
    assert "keeping the previous signing keys" in caplog.text
    (tmp_path / "current").write_bytes(KEY_B)
    assert source.current().kids == (KID_B,)
    (tmp_path / "current").unlink()
    assert source.current().kids == (KID_B,)


def test_a_source_that_cannot_load_at_start_fails_at_start(tmp_path):
    with pytest.raises(SigningConfigError):
        KeyringSource([str(tmp_path / "missing")])


def test_a_pem_key_after_a_byte_order_mark_is_the_pem_key(tmp_path):
    """An editor's UTF-8 BOM before the PEM made it an HMAC key of the PEM text: the mirror
    then signed v1 with it and its public key went unpublished. Now the BOM is skipped, for
    the mirror's private key and for a public key (the mirror and the node agent)."""
    key = Ed25519Key.generate()
    (tmp_path / "private.pem").write_bytes(b"\xef\xbb\xbf" + key.private_pem())
    (tmp_path / "public.pem").write_bytes(b"\xef\xbb\xbf" + key.public_pem())
    mirror = load_keyring([str(tmp_path / "private.pem")]).current
    assert isinstance(mirror, Ed25519Key) and mirror.can_sign and mirror.kid == key.kid
    for verify_only in (False, True):
        public = load_keyring([str(tmp_path / "public.pem")], verify_only=verify_only).current
        assert isinstance(public, Ed25519Key) and not public.can_sign
        assert public.kid == key.kid


@pytest.mark.parametrize("header", [
    b"-----begin private key-----",  # lower case: not PEM to OpenSSL
    b"-----BEGIN EC PRIVATE KEY-----",
    b"-----BEGIN RSA PUBLIC KEY-----",
    b"-----BEGIN CERTIFICATE-----",
])
def test_a_pem_file_that_is_not_an_ed25519_key_is_refused_not_taken_as_hmac(tmp_path, header):
    """Any PEM but an Ed25519 PRIVATE KEY or PUBLIC KEY was read as the raw bytes of an HMAC
    key: the mirror signed v1 with the PEM's text, which no node holding the public key could
    verify. It is refused at start, naming the file and what a key file may hold."""
    path = tmp_path / "key.pem"
    path.write_bytes(b"\xef\xbb\xbf\n" + header + b"\nMC4CAQAwBQYDK2VwBCIEIA==\n"
                     + header.replace(b"BEGIN", b"END").replace(b"begin", b"end") + b"\n")
    with pytest.raises(SigningConfigError) as e:
        load_keyring([str(path)])
    assert str(e.value) == (
        f"--signing-key-file {path}: a PEM file that starts {header.decode()!r}; a signing key "
        "is an Ed25519 key in PEM (-----BEGIN PRIVATE KEY----- on the mirror, -----BEGIN "
        "PUBLIC KEY----- on nodes: `kai-fractions signing-keys`) or the raw bytes of an HMAC "
        "key")
