"""FakeMpsControl behaves like MpsControl: same validation, reasons and readback formats."""

from __future__ import annotations

import pytest

from kai_fractions.node.mps import errors as e
from kai_fractions.node.mps.control import MpsClient, MpsControl
from kai_fractions.node.mps.errors import MpsError
from kai_fractions.sim.mps import FakeMpsControl

PUBLIC = [name for name in dir(MpsControl)
          if not name.startswith("_") and callable(getattr(MpsControl, name))]


def test_fake_has_every_public_method_of_the_real_control():
    missing = [name for name in PUBLIC if not callable(getattr(FakeMpsControl, name, None))]
    assert missing == []


def test_legacy_defaults_read_back_like_the_daemon():
    mps = FakeMpsControl()
    assert mps.get_default_pinned_mem_limit(0) == ""
    assert mps.get_default_pinned_mem_limit_mib(0) is None
    assert mps.set_default_pinned_mem_limit(0, 4096) == "4G"
    assert mps.set_default_pinned_mem_limit(1, 1536) == "1G"
    assert mps.get_default_pinned_mem_limit(0) == "4G"
    assert mps.get_default_pinned_mem_limit_mib(1) == 1024
    assert mps.get_default_active_thread_percentage() == "100.0"
    assert mps.set_default_active_thread_percentage(25) == "25.0"
    assert mps.get_default_active_thread_percentage_value() == 25.0
    assert mps.calls[:3] == [("get_default_pinned_mem_limit", (0,)),
                             ("get_default_pinned_mem_limit", (0,)),
                             ("set_default_pinned_mem_limit", (0, 4096))]


def test_missing_device_is_not_applied_and_bad_input_is_invalid():
    mps = FakeMpsControl(devices=2)
    with pytest.raises(MpsError) as exc:
        mps.set_default_pinned_mem_limit(2, 100)
    assert exc.value.reason == "NotApplied"
    for call in (lambda: mps.set_default_pinned_mem_limit(0, 0),
                 lambda: mps.set_default_active_thread_percentage(0),
                 lambda: mps.namespace_create("Bad"),
                 lambda: mps.namespace_set_active_thread_percentage("kf_a", 101)):
        with pytest.raises(MpsError) as exc:
            call()
        assert exc.value.reason == "InvalidArgument"


def test_namespaces_lifecycle_with_busy_delete():
    mps = FakeMpsControl(pipe_dir="/run/kf/mps")
    mps.namespace_create("kf_a")
    mps.namespace_set_active_thread_percentage("kf_a", 50)
    assert mps.namespace_get_pipe_directory("kf_a") == "/run/kf/mps/shared/kf_a"
    assert mps.namespace_list() == ["kf_a"]
    with pytest.raises(MpsError) as exc:
        mps.namespace_create("kf_a")
    assert exc.value.reason == "NamespaceExists"
    mps.namespace_create("kf_a", exist_ok=True)
    mps.attach_client(4321, "kf_a")
    assert mps.client_list() == [MpsClient(4321, "kf_a")]
    with pytest.raises(MpsError) as exc:
        mps.namespace_delete("kf_a")
    assert exc.value.reason == e.NAMESPACE_BUSY
    with pytest.raises(MpsError) as exc:
        mps.namespace_set_active_thread_percentage("kf_a", 30)  # fixed at first attach
    assert exc.value.reason == e.NAMESPACE_BUSY
    mps.client_terminate(4321)
    assert mps.terminated == [4321]
    # its clients gone, the cap stays the one the first attach fixed (enforcement-primitives:
    # it "can be set only before its first client attaches"); a namespace made again takes one
    with pytest.raises(MpsError) as exc:
        mps.namespace_set_active_thread_percentage("kf_a", 30)
    assert exc.value.reason == e.NAMESPACE_BUSY
    assert "the cap was fixed when its first client attached" in exc.value.message
    mps.namespace_delete("kf_a")
    mps.namespace_create("kf_a")
    mps.namespace_set_active_thread_percentage("kf_a", 30)
    assert mps.namespace_get_active_thread_percentage("kf_a") == 30.0
    mps.namespace_delete("kf_a")
    assert mps.namespace_list() == []
    with pytest.raises(MpsError) as exc:
        mps.namespace_delete("kf_a")
    assert exc.value.reason == "NamespaceNotFound"
    mps.namespace_delete("kf_a", missing_ok=True)
    with pytest.raises(MpsError) as exc:
        mps.client_terminate(4321)
    assert exc.value.reason == "ClientNotFound"


def test_legacy_servers_and_clients():
    mps = FakeMpsControl(protocol_v3=False)
    mps.attach_client(77, server_pid=900)
    assert mps.get_server_list() == [900]
    assert mps.get_client_list(900) == [77]
    mps.terminate_client(900, 77)
    assert mps.terminated == [77]
    with pytest.raises(MpsError) as exc:
        mps.get_client_list(5)
    assert exc.value.reason == "ServerNotFound"
    mps.set_active_thread_percentage(900, 40)
    assert mps.servers[900].active_thread_percentage == 40


def test_old_driver_fake_refuses_v3():
    mps = FakeMpsControl(protocol_v3=False)
    assert mps.supports_protocol_v3() is False
    for call in (lambda: mps.namespace_create("kf_a"), mps.namespace_list, mps.client_list,
                 lambda: mps.client_terminate(1)):
        with pytest.raises(MpsError) as exc:
            call()
        assert exc.value.reason == "ProtocolUnsupported"


def test_kill_loses_state_and_injected_errors():
    mps = FakeMpsControl()
    mps.set_default_active_thread_percentage(30)
    mps.namespace_create("kf_a")
    mps.kill()
    with pytest.raises(MpsError) as exc:
        mps.namespace_list()
    assert exc.value.reason == "MpsDaemonUnreachable"
    mps.start()
    assert mps.namespace_list() == []
    assert mps.get_default_active_thread_percentage() == "100.0"
    mps.inject("namespace_create", MpsError("MpsDaemonUnreachable", "down"), times=2)
    for _ in range(2):
        with pytest.raises(MpsError, match="down"):
            mps.namespace_create("kf_b")
    mps.namespace_create("kf_b")
    assert mps.methods_called()[-3:] == ["namespace_create"] * 3


def test_unknown_command_and_quit():
    mps = FakeMpsControl()
    with pytest.raises(MpsError) as exc:
        mps.command("foo")
    assert exc.value.reason == "UnknownCommand"
    mps.quit()
    assert mps.running is False


def test_shared_call_journal():
    journal: list = []
    mps = FakeMpsControl(calls=journal)
    mps.namespace_list()
    assert journal == [("namespace_list", ())]
    assert mps.env == {"CUDA_MPS_PIPE_DIRECTORY": "/run/kai-fractions/mps",
                       "CUDA_MPS_LOG_DIRECTORY": "/var/log/kai-fractions/mps",
                       "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
