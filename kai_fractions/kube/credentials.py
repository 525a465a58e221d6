"""Where a request's credentials come from when the official client's own hooks fall short:
a kubeconfig user's `tokenFile` read again every minute (`TokenFile`), an exec plugin run off
the event loop, under a timeout and again after a 401 (`ExecCredential`), an in-cluster token
without the whitespace around it (`_InClusterLoader`), and the name of each source for errors
(`NamedRefresh`).

Apart from `config` (where the API server is, and the session it needs): how a token is had and
renewed is a concern of its own, and the longest part of the client's configuration.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import math
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.config import incluster_config, kube_config
from kubernetes.config.dateutil import parse_rfc3339
from kubernetes.config.exec_provider import ExecProvider

log = logging.getLogger(__name__)

TOKEN_FILE_SECONDS = 60.0
"""How often a kubeconfig user's tokenFile is read again (client-go's cached file token
source; the official client's in-cluster token is read again as often)."""

PLUGIN_SECONDS = 30.0
"""How long an exec plugin may take to give credentials before it is killed (the official
client waits for it for ever, and with it every request)."""

PLUGIN_RUNS_SECONDS = 10.0
"""An exec plugin runs at most once in this many seconds while it gives the same token again,
fails, or gives tokens that expire within the official client's 5-minute margin (which it
would run again for every request)."""


class CredentialError(Exception):
    """The official client could not give a request its credentials (a token file that cannot
    be read, a token refresh that failed); the message names where they come from."""


def _name_refresh(configuration: k8s.Configuration, source: str) -> None:
    if configuration.refresh_api_key_hook is not None:
        configuration.refresh_api_key_hook = NamedRefresh(configuration.refresh_api_key_hook,
                                                          source)


@dataclass(slots=True)
class NamedRefresh:
    """The official loader's refresh_api_key_hook, with where its token comes from (for the
    errors of `auth_headers`)."""

    refresh: Callable[[k8s.Configuration], Any]
    source: str

    def __call__(self, configuration: k8s.Configuration) -> None:
        try:
            self.refresh(configuration)
        finally:
            # The official loaders set their hook again at each refresh: keep theirs, under
            # this name.
            if configuration.refresh_api_key_hook is not self:
                self.refresh = configuration.refresh_api_key_hook
                configuration.refresh_api_key_hook = self


class TokenFile:
    """The refresh_api_key_hook of a kubeconfig user's tokenFile: the token read again every
    TOKEN_FILE_SECONDS (the official client reads it once), so one rotated in the file is sent
    within a minute. A read that fails keeps the last token, as client-go does, and is tried
    again at the next request. The first read raises OSError or ValueError."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.source = f"the kubeconfig's tokenFile {path}"
        self.token = self._read()
        self._read_at = time.monotonic()
        self._failing = False

    def __call__(self, configuration: k8s.Configuration) -> None:
        if time.monotonic() - self._read_at >= TOKEN_FILE_SECONDS:
            try:
                self.token = self._read()
            except (OSError, ValueError) as e:
                if not self._failing:
                    log.warning("cannot read %s again (%s); the last token read is sent",
                                self.source, e)
                self._failing = True
            else:
                self._read_at, self._failing = time.monotonic(), False
        configuration.api_key["BearerToken"] = self.token

    def _read(self) -> str:
        token = Path(self.path).read_text().strip()  # as client-go: no surrounding space
        if not token:
            raise ValueError(f"{self.source} is empty")
        return f"Bearer {token}"


class _InClusterLoader(incluster_config.InClusterConfigLoader):
    """The official in-cluster loader, its token without the whitespace around it: it sends the
    file's content as it is, and one ending in a newline (a Secret written with `echo`) made
    every request fail (aiohttp refuses a newline in a header)."""

    def _read_token_file(self) -> None:
        before = self.__dict__.get("token"), self.__dict__.get("token_expires_at")
        super()._read_token_file()  # its errors for a file missing or empty
        token = self.token.removeprefix("bearer ").strip()
        if not token:
            # As for an empty file: the last token kept, the file read again next time.
            self.token, self.token_expires_at = before
            raise k8s_config.ConfigException("Token file exists but empty.")
        self.token = f"bearer {token}"


class ExecCredential:
    """The refresh_api_key_hook of a kubeconfig user's exec plugin, in place of the official
    loader's: that one ran the plugin on the calling thread (the event loop that serves the
    mirror's calls and renews its lease) with no timeout, and again only once the token's
    expirationTimestamp was near, so a token revoked (or one without an expiry: kept "until the
    server responds with a 401", the Kubernetes docs say) was sent for ever.

    The hook itself only sets the token held. `Kube` awaits `refresh` before a request when the
    token is `due`: 5 minutes before it expires (the official loader's margin), or at once
    after a 401 to it (client-go's rule). The plugin then runs in a thread, killed after
    PLUGIN_SECONDS, one run shared by every request that waits; and at most once every
    PLUGIN_RUNS_SECONDS, except for the first 401 to a token a run has just given."""

    def __init__(self, plugin: ExecProvider, token: str, expiry: datetime.datetime | None,
                 source: str) -> None:
        """`token`: "Bearer <token>" as the loader's run of the plugin gave it, "" when that
        run failed."""
        self.plugin = plugin
        self.token = token
        self.source = source
        self._ran_at = time.monotonic()  # the loader has just run it
        self._new = True
        """The token held came new from the last run (a 401 to it runs the plugin at once)."""
        # No token: the loader's own run failed (an identity provider away at the start): the
        # plugin runs before the first request, as after a failed run.
        self._due_at = self._due(expiry) if token else self._ran_at
        self._running: asyncio.Task[None] | None = None

    def __call__(self, configuration: k8s.Configuration) -> None:
        configuration.api_key["BearerToken"] = self.token

    def due(self) -> bool:
        """Whether the plugin should run before the next request (cheap: asked for every
        request)."""
        return time.monotonic() >= self._due_at

    def refused(self, sent: str | None) -> None:
        """A 401 answered a request that sent `sent` (its authorization header): when that is
        the token held, the plugin runs again before the next request. The other requests
        refused the same token, at the same time, wait for that one run."""
        if sent == self.token:
            soonest = time.monotonic() if self._new else self._ran_at + PLUGIN_RUNS_SECONDS
            self._due_at = min(self._due_at, soonest)

    async def refresh(self, timeout: float) -> None:
        """The plugin run (or the one running) awaited, for `timeout` seconds at most (it goes
        on running for the next request). CredentialError, naming the plugin, when it fails or
        does not answer in time; the token held is kept."""
        run = self._running
        if run is None or run.done() or run.get_loop() is not asyncio.get_running_loop():
            run = self._running = asyncio.create_task(self._run())
            # Its error is the waiters'; one that no request waited for is no "never retrieved".
            run.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            async with asyncio.timeout(timeout if timeout < PLUGIN_SECONDS else None):
                await asyncio.shield(run)
        except TimeoutError:
            raise CredentialError(f"cannot get credentials from {self.source}: no answer "
                                  f"within {timeout:g} s (it goes on running for the next "
                                  "request)") from None

    async def _run(self) -> None:
        try:
            token, expiry = await asyncio.to_thread(self._credential)
        except CredentialError:
            self._ran_at, self._new = time.monotonic(), False
            self._due_at = self._ran_at + PLUGIN_RUNS_SECONDS
            raise
        self._ran_at, self._new, self.token = time.monotonic(), token != self.token, token
        self._due_at = self._due(expiry)

    def _due(self, expiry: datetime.datetime | None) -> float:
        """When the plugin runs again, without a 401, for a token that expires at `expiry`."""
        if expiry is None:
            return math.inf
        left = (expiry - kube_config.EXPIRY_SKEW_PREVENTION_DELAY
                - datetime.datetime.now(datetime.UTC)).total_seconds()
        return max(time.monotonic() + left, self._ran_at + PLUGIN_RUNS_SECONDS)

    def _credential(self) -> tuple[str, datetime.datetime | None]:
        """The plugin's token and its expiry, as the official ExecProvider.run asks for them,
        but not interactive (nobody is at the terminal of a component) and under
        PLUGIN_SECONDS."""
        plugin = self.plugin
        spec: dict[str, Any] = {"interactive": False}
        if plugin.cluster:
            cluster = spec["cluster"] = dict(plugin.cluster.value)
            for extension in cluster.get("extensions") or ():
                if extension.get("name") == "client.authentication.k8s.io/exec":
                    cluster["config"] = extension.get("extension")
                    break
        info = {"apiVersion": plugin.api_version, "kind": "ExecCredential", "spec": spec}
        try:
            done = subprocess.run(plugin.args, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, cwd=plugin.cwd, timeout=PLUGIN_SECONDS,
                                  env={**plugin.env, "KUBERNETES_EXEC_INFO": json.dumps(info)})
        except subprocess.TimeoutExpired:
            raise self._error(f"no credentials within {PLUGIN_SECONDS:g} s; it was "
                              "killed") from None
        except (OSError, ValueError) as e:
            raise self._error(f"it cannot be run: {e}") from None
        if done.returncode != 0:
            raise self._error(f"it exited with {done.returncode}: "
                              f"{' '.join(done.stderr.split())[-300:] or 'no message'}")
        try:
            answer = json.loads(done.stdout)
            if answer.get("apiVersion") != plugin.api_version:
                raise ValueError(f"apiVersion {answer.get('apiVersion')!r}, not "
                                 f"{plugin.api_version!r}")
            status = answer["status"]
            token = status.get("token")
            if not isinstance(token, str) or not token.strip():
                raise ValueError("no status.token (a client certificate from a plugin is "
                                 "read only at the start)")
            expiry = status.get("expirationTimestamp")
            return f"Bearer {token.strip()}", parse_rfc3339(expiry) if expiry else None
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise self._error(f"its output is not an ExecCredential with a token: "
                              f"{type(e).__name__}: {e}") from None

    def _error(self, problem: str) -> CredentialError:
        return CredentialError(f"cannot get credentials from {self.source}: {problem}; check "
                               "the plugin and what it needs (its identity provider, its "
                               "environment)")
