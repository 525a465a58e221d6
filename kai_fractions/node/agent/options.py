"""The agent's own settings (beyond the engine's `NodeConfig`).

The command line fixes the flag names; the timings that have no flag keep defaults that suit
production and are only changed by tests that build an `AgentOptions` themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...contract import keys as k
from ...marker import BOOT_ID_PATH

DEFAULT_SOCKET = "/run/kai-fractions/agent.sock"
DEFAULT_MARKER_DIR = "/var/lib/kai-fractions/markers"
DEFAULT_METRICS_LISTEN = "0.0.0.0:9400"
DEFAULT_RESYNC_SECONDS = 300.0
COMPONENT = "kai-fractions-node-agent"


@dataclass(frozen=True, slots=True)
class AgentOptions:
    marker_dir: str = DEFAULT_MARKER_DIR
    boot_id_file: str = BOOT_ID_PATH
    """Where the kernel tells this boot's ID, which every marker carries (a reboot clears the
    limits, not the markers); tests point it at a file of their own to play a reboot."""
    socket: str | None = DEFAULT_SOCKET
    """The NodeEnforcer unix socket; None serves no gRPC (in-process tests)."""
    metrics_listen: str | None = DEFAULT_METRICS_LISTEN
    """HOST:PORT of the Prometheus endpoint; None serves none (the registry still fills)."""
    condition_name: str = k.NODE_CONDITION
    legacy_condition: bool = False
    publish_gpu_memory_label: bool = False
    resync_seconds: float = DEFAULT_RESYNC_SECONDS
    first_list_jitter_seconds: float = 0.0
    """The first list waits a random 0..this: agents restarted together list apart."""
    list_from_watch_cache: bool = False
    """Lists with resourceVersion "0": the API server answers from its watch cache."""
    retry_seconds: float = 1.0
    """First delay before a pass that did not converge (something pending) is tried again."""
    retry_max_seconds: float = 2.0
    """Cap of that delay; also how often a broken NVML is re-initialised."""
    mps_check_seconds: float = 5.0
    """How often the MPS control daemon is health-checked between passes."""
    mps_drain_before_kill_seconds: float = 3.0
    """`--mps-drain-before-kill`: a deleted sm-sharing pod's MPS clients are drained this long
    before its grace period ends (`drain_before_kill`); 0 turns it off."""
    heartbeat_seconds: float = 60.0
    """How often the agent says it is alive: it renews its heartbeat Lease, or without one
    re-patches its unchanged node condition (lastHeartbeatTime)."""
    heartbeat_lease_namespace: str | None = None
    """`--heartbeat-lease-namespace`: where the agent's heartbeat Lease lives (`heartbeat.py`);
    None beats on the node condition."""
    status_report_seconds: float = 300.0
    """With the heartbeat Lease renewed: an unchanged node condition is re-patched this often
    (the kubelet's nodeStatusReportFrequency)."""
    status_tick_seconds: float = 1.0
    """How often the status publisher looks at the agent's health."""
    stale_after_seconds: float = 60.0
    """A pass running this long, the API unreachable this long, or passes failing with an
    internal error this long, is `NotReconciling`."""
    failed_passes_not_ready: int = 3
    """This many passes in a row failing with an internal error are `NotReconciling` too (the
    retries come 1 s, then 2 s apart: sooner than `stale_after_seconds`)."""
    rpc_timeout_seconds: float = 30.0
    """How long a gRPC call waits for its turn on the worker."""
    marker_grace_seconds: float = 600.0
    """An empty marker directory of no known pod (the kubelet creates it for subPathExpr before
    the agent may have seen the pod) is removed only once it is this old."""
    api_timeout_seconds: float = 10.0
    """Per Kubernetes request (watches excepted)."""
    watch_seconds: int = 300
    """Server-side timeout of one watch request (then it is renewed)."""
    signing_key_files: tuple[str, ...] = ()
    """`--signing-key-file` values (the mirror's Ed25519 PUBLIC keys, PEM only): apply only
    allocations the mirror signed (see `signatures.py`); empty, with no
    `signing_hmac_key_files` either = signatures are not checked."""
    signing_hmac_key_files: tuple[str, ...] = ()
    """`--signing-hmac-key-file` values: the legacy HMAC key(s) (the Secret of the releases
    that signed with HMAC), so that pods signed before the upgrade to Ed25519 verify. Only
    these files are read as HMAC keys: never a public-key file, whatever it holds."""

    @property
    def signing(self) -> bool:
        """Whether allocations are applied only when signed (any key file given)."""
        return bool(self.signing_key_files or self.signing_hmac_key_files)
    signature_key_wait_seconds: float = 300.0
    """How long a signature under a key this node does not hold waits for it (a rotation on
    its way) before it is refused."""

    @property
    def condition_types(self) -> tuple[str, ...]:
        names = [self.condition_name]
        if self.legacy_condition and k.LEGACY_NODE_CONDITION not in names:
            names.append(k.LEGACY_NODE_CONDITION)
        return tuple(names)
