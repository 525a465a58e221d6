"""The readiness marker: format, atomic write, permissions, and a reader that trusts nothing."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from kai_fractions import marker as m
from kai_fractions.marker import (
    BOOT_ID_PATH,
    GONE_PREFIX,
    ContainerMarker,
    Marker,
    MarkerError,
    MarkerState,
    parse_marker,
    read_boot_id,
    read_marker,
    remove_leftovers,
    remove_marker,
    write_marker,
)

UID = "5f0c6c1e-2b2b-4c4c-8d8d-000000000001"
DIGEST = "sha256:" + "ab" * 32
OTHER_DIGEST = "sha256:" + "cd" * 32
BOOT = "0b0a1c2d-3e4f-4a5b-8c6d-7e8f9a0b1c2d"


def sample(digest: str = DIGEST) -> Marker:
    return Marker.build(UID, {"main": ContainerMarker.applied(digest)}, boot_id=BOOT,
                        clock=lambda: 1.7e9)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_file_format_is_exactly_the_agreed_json(tmp_path: Path) -> None:
    path = write_marker(tmp_path / "markers", Marker.build(UID, {
        "main": ContainerMarker.applied(DIGEST),
        "side": ContainerMarker.refused("MixedComputeModes", "GPU-1 already runs time-slicing"),
    }, boot_id=BOOT, clock=lambda: 1_700_000_000.9))
    assert path == tmp_path / "markers" / UID / "marker.json"
    assert json.loads(path.read_text()) == {
        "version": 1,
        "pod_uid": UID,
        "written_at": "2023-11-14T22:13:20Z",
        "boot_id": BOOT,
        "containers": {
            "main": {"state": "applied", "plan_digest": DIGEST, "reason": "Applied",
                     "message": ""},
            "side": {"state": "refused", "plan_digest": "", "reason": "MixedComputeModes",
                     "message": "GPU-1 already runs time-slicing"},
        },
    }


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    written = sample()
    write_marker(tmp_path, written)
    assert read_marker(tmp_path / UID, expected_pod_uid=UID) == written
    assert read_marker(tmp_path / "no-such-pod") is None


def test_the_boot_id_is_this_hosts_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    real = read_boot_id()  # the kernel's, as the agent and the gate read it
    assert real == Path(BOOT_ID_PATH).read_text().strip() and len(real) == 36
    (tmp_path / "boot_id").write_text(BOOT + "\n")
    assert read_boot_id(tmp_path / "boot_id") == BOOT
    (tmp_path / "boot_id").write_text("../../etc\n")
    with pytest.raises(MarkerError, match=r"boot_id: not a boot ID: '\.\./\.\./etc'"):
        read_boot_id(tmp_path / "boot_id")
    with pytest.raises(MarkerError, match="cannot read the host's boot ID: No such file"):
        read_boot_id(tmp_path / "none")
    with pytest.raises(MarkerError, match="boot_id: must be a boot ID, got 'a b'"):
        Marker.build(UID, {}, boot_id="a b")
    with pytest.raises(MarkerError, match="boot_id: must be a string, got 7"):
        parse_marker(json.dumps({"version": 1, "pod_uid": UID, "boot_id": 7, "containers": {},
                                 "written_at": "2023-11-14T22:13:20Z"}))


def test_permissions_let_an_unprivileged_gate_read_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        write_marker(tmp_path / "markers", sample())
    finally:
        os.umask(old)
    assert mode(tmp_path / "markers") == 0o700
    assert mode(tmp_path / "markers" / UID) == 0o755
    assert mode(tmp_path / "markers" / UID / "marker.json") == 0o644


def test_a_pod_directory_the_kubelet_made_first_gets_the_readable_mode(tmp_path: Path) -> None:
    (tmp_path / UID).mkdir(mode=0o750)  # subPathExpr creates it when missing
    os.chmod(tmp_path / UID, 0o750)
    write_marker(tmp_path, sample())
    assert mode(tmp_path / UID) == 0o755


def test_a_failed_write_leaves_the_previous_marker_whole_and_no_temp_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_marker(tmp_path, sample(DIGEST))

    def crash(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(m.os, "fsync", crash)
    with pytest.raises(OSError, match="No space left"):
        write_marker(tmp_path, sample(OTHER_DIGEST))
    monkeypatch.undo()
    assert read_marker(tmp_path / UID) == sample(DIGEST)
    assert sorted(p.name for p in (tmp_path / UID).iterdir()) == ["marker.json"]


def test_the_new_marker_appears_by_rename_in_the_same_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[Path, Path, str]] = []
    real_replace = os.replace

    def spy(src: str, dst: str) -> None:
        # At the moment of the rename the complete new content is already in the temp file.
        seen.append((Path(src).parent, Path(dst), Path(src).read_text()))
        real_replace(src, dst)

    monkeypatch.setattr(m.os, "replace", spy)
    write_marker(tmp_path, sample())
    [(src_dir, dst, content)] = seen
    assert src_dir == tmp_path / UID and dst == tmp_path / UID / "marker.json"
    assert parse_marker(content) == sample()


def test_readers_never_see_a_partial_marker(tmp_path: Path) -> None:
    write_marker(tmp_path, sample(DIGEST))
    stop = threading.Event()
    errors: list[Exception] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                assert read_marker(tmp_path / UID) in (sample(DIGEST), sample(OTHER_DIGEST))
            except Exception as e:  # collected and asserted below
                errors.append(e)
                return

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(100):
        write_marker(tmp_path, sample(OTHER_DIGEST if i % 2 else DIGEST))
    stop.set()
    thread.join()
    assert errors == []


def test_remove_marker_deletes_the_pod_directory(tmp_path: Path) -> None:
    write_marker(tmp_path, sample())
    assert remove_marker(tmp_path, UID) is True
    assert not (tmp_path / UID).exists()
    assert remove_marker(tmp_path, UID) is False


class Killed(BaseException):
    """The remover's process dies here (nothing after it runs)."""


def test_a_removal_cut_short_leaves_no_directory_that_looks_like_a_new_pods(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent SIGKILLed between emptying a gone pod's directory and removing it left an empty
    `<uid>` directory: the agent keeps such a one for its grace period (the kubelet makes it for
    a new pod), so the node stayed untidy for ten minutes (CI caught it in the agent-process
    fault test). The directory leaves the pod's name first."""
    write_marker(tmp_path, sample())

    def killed(path: object) -> None:
        raise Killed

    monkeypatch.setattr(os, "rmdir", killed)
    with pytest.raises(Killed):
        remove_marker(tmp_path, UID)
    monkeypatch.undo()
    assert not (tmp_path / UID).exists()
    assert read_marker(tmp_path / UID) is None
    (grave,) = os.listdir(tmp_path)
    assert grave.startswith(GONE_PREFIX + UID)
    assert remove_leftovers(tmp_path) == {grave: None}
    assert os.listdir(tmp_path) == []
    assert remove_leftovers(tmp_path) == {}


def test_leftovers_are_removed_one_by_one_and_symlinks_are_never_followed(
        tmp_path: Path) -> None:
    """Whatever sits under a leftover's name goes (a file, a symlink, a directory holding
    more), a symlink's target stays untouched, and one that cannot be removed holds up no
    other."""
    root, outside = tmp_path / "markers", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    write_marker(root, sample())
    (root / f"{GONE_PREFIX}link").symlink_to(outside)
    (root / f"{GONE_PREFIX}file").write_text("x")
    (root / f"{GONE_PREFIX}deep" / "sub").mkdir(parents=True)
    (root / f"{GONE_PREFIX}deep" / "sub" / "f").write_text("x")
    assert remove_marker(root, UID) is True
    assert not (root / UID).exists()
    (pod_link := root / UID).symlink_to(outside)  # a pod's name that is a symlink
    assert remove_marker(root, UID) is True
    assert not pod_link.is_symlink()
    assert (outside / "precious").read_text() == "keep"
    left = remove_leftovers(root)
    assert sorted(left) == [f"{GONE_PREFIX}deep", f"{GONE_PREFIX}file", f"{GONE_PREFIX}link"]
    assert set(left.values()) == {None}
    assert sorted(os.listdir(root)) == [] and os.listdir(outside) == ["precious"]


def test_a_leftover_that_cannot_go_holds_up_no_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("a", "b", "c"):
        (tmp_path / f"{GONE_PREFIX}{name}").mkdir()
    real_rmdir = os.rmdir

    def rmdir(path: object) -> None:
        if str(path).endswith(f"{GONE_PREFIX}b"):
            raise PermissionError(1, "Operation not permitted")
        real_rmdir(path)

    monkeypatch.setattr(os, "rmdir", rmdir)
    left = remove_leftovers(tmp_path)
    assert {n: type(e) for n, e in left.items()} == {
        f"{GONE_PREFIX}a": type(None), f"{GONE_PREFIX}b": PermissionError,
        f"{GONE_PREFIX}c": type(None)}
    assert os.listdir(tmp_path) == [f"{GONE_PREFIX}b"]


@pytest.mark.parametrize("uid", ["", "../etc", "a/b", ".hidden"])
def test_a_pod_uid_cannot_escape_the_marker_root(tmp_path: Path, uid: str) -> None:
    with pytest.raises(MarkerError, match="pod_uid: must be a pod UID"):
        m.pod_marker_dir(tmp_path, uid)


GOOD = {"version": 1, "pod_uid": UID, "written_at": "2025-01-31T12:00:00Z",
        "containers": {"main": {"state": "applied", "plan_digest": DIGEST}}}


def bad(**changes: object) -> str:
    data = json.loads(json.dumps(GOOD))
    for key, value in changes.items():
        if key.startswith("main_"):
            data["containers"]["main"][key[5:]] = value
        else:
            data[key] = value
    return json.dumps(data)


def test_a_minimal_marker_is_accepted() -> None:
    parsed = parse_marker(json.dumps(GOOD))
    assert parsed.containers["main"] == ContainerMarker(MarkerState.APPLIED, DIGEST)


@pytest.mark.parametrize(("text", "message"), [
    ("{", "not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 "
          "(char 1)"),
    ("[]", "must be a JSON object"),
    (bad(version=2), "version: must be 1, got 2"),
    (bad(pod_uid=7), "pod_uid: is missing or not a string"),
    (bad(written_at="yesterday"), "written_at: must be an RFC 3339 time, got 'yesterday'"),
    (bad(written_at="2025-01-31T12:00:00"), "written_at: must carry a time zone (Z), got "
                                            "'2025-01-31T12:00:00'"),
    (bad(containers=[]), "containers: must be an object keyed by container name"),
    (bad(main_state="done"), "containers.main.state: must be applied or refused, got 'done'"),
    (bad(main_plan_digest="md5:00"), "containers.main.plan_digest: must be sha256:<64 hex "
                                     "digits>, got 'md5:00'"),
    (bad(main_plan_digest=""), "containers.main.plan_digest: is required when the state is "
                               "applied"),
    (bad(main_reason="not camel"), "containers.main.reason: must be CamelCase, got 'not camel'"),
    (bad(main_message=3), "containers.main.message: must be a string, got 3"),
    (bad(main_state="refused", main_reason="NoGpu"), "containers.main: a refusal needs a "
                                                    "reason and a message"),
])
def test_the_reader_rejects_a_malformed_marker_with_a_clear_error(text: str,
                                                                  message: str) -> None:
    with pytest.raises(MarkerError) as info:
        parse_marker(text)
    assert str(info.value) == message


def test_what_is_not_a_marker_file_is_refused_without_blocking(tmp_path: Path) -> None:
    """Under the marker's name: a FIFO (a read would block past the gate's deadline), a file
    larger than any marker (read whole, in the gate's small memory), JSON nested deeper than
    the parser recurses. Each is an unreadable marker, named, never a hang or a traceback."""
    pod_dir = tmp_path / UID
    pod_dir.mkdir()
    path = pod_dir / "marker.json"
    os.mkfifo(path)
    with pytest.raises(MarkerError, match=r"marker\.json: cannot read: not a regular file"):
        read_marker(pod_dir)
    path.unlink()
    path.write_bytes(b" " * (m.MAX_MARKER_BYTES + 1))
    with pytest.raises(MarkerError, match=f"larger than {m.MAX_MARKER_BYTES} bytes"):
        read_marker(pod_dir)
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(MarkerError, match=r"marker\.json: not a marker: nested too deeply"):
        read_marker(pod_dir)
    path.write_text(json.dumps(GOOD))
    assert read_marker(pod_dir) is not None


def test_the_reader_names_the_file_and_checks_the_pod(tmp_path: Path) -> None:
    (tmp_path / UID).mkdir()
    (tmp_path / UID / "marker.json").write_text(json.dumps(GOOD))
    with pytest.raises(MarkerError) as info:
        read_marker(tmp_path / UID, expected_pod_uid="another-uid")
    assert str(info.value) == (f"{tmp_path / UID / 'marker.json'}: pod_uid: is {UID!r}, "
                               "expected this pod's 'another-uid'")
    (tmp_path / UID / "marker.json").write_text('{"version": 1, "pod_uid": "x"')
    with pytest.raises(MarkerError, match=r"marker\.json: not valid JSON"):
        read_marker(tmp_path / UID)
