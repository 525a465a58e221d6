"""A kubeconfig user's exec plugin as `Kube` runs it (kube.credentials.ExecCredential): again after
a 401 (once for all the requests refused), off the event loop, under a timeout, and at most
once every PLUGIN_RUNS_SECONDS however short-lived its tokens. The plugin is a real process (a
script of the test's), steered through files; the clock the runs are spaced by is moved by
hand, never waited out."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import sys
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from kai_fractions.kube import Forbidden, Kube, Transient, credentials, load_api_client
from tests.kube.standin import Answer, StandIn, status
from tests.support.aio import until
from tests.support.clock import FakeClock

PATH = "/api/v1/namespaces/ns/pods/p"
POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns"}}
UNAUTHORIZED = Answer(401, status(401, "Unauthorized", "Unauthorized"))
PAST_ANY_SPACING = 60.0
"""Seconds the clock moves for the plugin's next run to be due (past PLUGIN_RUNS_SECONDS)."""

PLUGIN = """
import json, pathlib, sys, time
here = pathlib.Path(sys.argv[1])
with open(here / "runs", "a") as runs:
    runs.write("run\\n")
if (here / "hold").exists():  # the test says go once it has seen this run start
    (here / "started").touch()
    for _ in range(300):
        if (here / "go").exists():
            break
        time.sleep(0.01)
    else:
        sys.exit("nobody said go")
if (here / "sleep").exists():
    time.sleep(float((here / "sleep").read_text()))
if (here / "fail").exists():
    sys.exit((here / "fail").read_text())
status = {"token": "tok-" + (here / "gen").read_text()}
if (here / "expiry").exists():
    status["expirationTimestamp"] = (here / "expiry").read_text()
print(json.dumps({"apiVersion": "client.authentication.k8s.io/v1beta1",
                  "kind": "ExecCredential", "status": status}))
"""


class Plugin(SimpleNamespace):
    """The plugin's directory: `gen` is the number of the token it gives (tok-N), `runs` one
    line per run; `hold`, `sleep`, `fail`, `expiry` steer it as PLUGIN reads them."""

    def set(self, **files: str) -> None:
        for name, content in files.items():
            (self.dir / name).write_text(content)

    def runs(self) -> int:
        return len((self.dir / "runs").read_text().splitlines())

    @contextlib.asynccontextmanager
    async def session(self, api: StandIn) -> AsyncIterator[Kube]:
        """A `Kube` of this plugin's kubeconfig for `api`, closed after."""
        kube = self.kube(api.url)
        try:
            yield kube
        finally:
            await kube.close()

    def kube(self, url: str, **options) -> Kube:
        path = self.dir / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "x",
            "clusters": [{"name": "c", "cluster": {"server": url}}],
            "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
            "users": [{"name": "u", "user": {"exec": {
                "apiVersion": "client.authentication.k8s.io/v1beta1",
                "command": sys.executable, "args": [str(self.dir / "plugin.py"), str(self.dir)],
                "interactiveMode": "Never"}}}]}))
        return Kube(load_api_client(str(path)), **options)


@pytest.fixture
def plugin(tmp_path) -> Plugin:
    (tmp_path / "plugin.py").write_text(PLUGIN)
    made = Plugin(dir=tmp_path)
    made.set(gen="1")
    return made


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    """The monotonic clock kube.credentials spaces the plugin's runs by, moved by hand."""
    now = FakeClock(now=1000.0)
    monkeypatch.setattr(credentials, "time", now)
    return now


def expiring_in(minutes: float) -> str:
    return (datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=minutes)
            ).strftime("%Y-%m-%dT%H:%M:%SZ")


def tokens(api: StandIn, last: int) -> list[str]:
    return [seen.headers["authorization"] for seen in api.seen[-last:]]


async def test_a_401_runs_the_plugin_again_once_for_all_the_requests_refused(plugin):
    # The official loader ran it again only once an expirationTimestamp had passed: a token
    # without one (kept "until the server responds with a 401"), revoked, was sent for ever.
    async with (StandIn(Answer(200, POD), *[UNAUTHORIZED] * 5, Answer(200, POD)) as api,
                plugin.session(api) as kube):
        await kube.request("GET", PATH, what="read pod")
        plugin.set(gen="2")  # tok-1 is revoked; the plugin would give tok-2
        refused = await asyncio.gather(
            *[kube.request("GET", PATH, what="read pod") for _ in range(5)],
            return_exceptions=True)
        assert [type(e) for e in refused] == [Forbidden] * 5
        await asyncio.gather(*[kube.request("GET", PATH, what="read pod") for _ in range(5)])
    assert tokens(api, 11) == ["Bearer tok-1"] * 6 + ["Bearer tok-2"] * 5
    assert plugin.runs() == 2  # the loader's, and one for the five 401s


async def test_a_plugin_that_gives_the_refused_token_again_runs_once_every_ten_seconds(
        plugin, clock):
    async with StandIn(UNAUTHORIZED) as api, plugin.session(api) as kube:
        for _ in range(4):  # the first 401 to a new token runs it at once; then, not
            with pytest.raises(Forbidden):
                await kube.request("GET", PATH, what="read pod")
        assert plugin.runs() == 2
        clock.now += credentials.PLUGIN_RUNS_SECONDS
        for _ in range(2):
            with pytest.raises(Forbidden):
                await kube.request("GET", PATH, what="read pod")
    assert plugin.runs() == 3


async def test_a_token_expiring_within_five_minutes_runs_the_plugin_once_every_ten_seconds(
        plugin, clock):
    # The official loader renews a token 5 minutes before its expiry: one valid for less
    # (always "expired") ran the plugin at every request.
    plugin.set(expiry=expiring_in(2))
    async with StandIn(Answer(200, POD)) as api, plugin.session(api) as kube:
        plugin.set(gen="2")
        for _ in range(3):
            await kube.request("GET", PATH, what="read pod")
        assert plugin.runs() == 1
        clock.now += credentials.PLUGIN_RUNS_SECONDS
        for _ in range(3):
            await kube.request("GET", PATH, what="read pod")
    assert tokens(api, 6) == ["Bearer tok-1"] * 3 + ["Bearer tok-2"] * 3
    assert plugin.runs() == 2


async def test_the_plugin_runs_off_the_event_loop_once_for_the_requests_waiting(plugin, clock):
    # It ran on the loop (the mirror's gRPC calls and leader lease stalled with it): here the
    # plugin waits for the test, on the same loop, to say go; run on the loop it would wait
    # in vain, give up, and the old token would be sent.
    plugin.set(expiry=expiring_in(2))
    async with StandIn(Answer(200, POD)) as api, plugin.session(api) as kube:
        clock.now += PAST_ANY_SPACING
        plugin.set(gen="2", hold="")
        waiting = asyncio.gather(
            *[kube.request("GET", PATH, what="read pod") for _ in range(3)])
        await until((plugin.dir / "started").exists, "the plugin's run")
        plugin.set(go="")
        await waiting
    assert tokens(api, 3) == ["Bearer tok-2"] * 3
    assert plugin.runs() == 2


async def test_a_plugin_that_does_not_answer_in_time_is_transient_and_killed(
        plugin, clock, monkeypatch):
    # A hung plugin held the loop, and every request, for good.
    monkeypatch.setattr(credentials, "PLUGIN_SECONDS", 1.0, raising=False)
    plugin.set(expiry=expiring_in(2))
    async with StandIn(Answer(200, POD)) as api, plugin.session(api) as kube:
        clock.now += PAST_ANY_SPACING
        plugin.set(gen="2", sleep="3")
        source = f"the exec plugin {sys.executable} of the kubeconfig's user 'u'"
        with pytest.raises(Transient) as raised:
            await kube.request("GET", PATH, what="read pod", timeout=0.1)
        assert str(raised.value) == (
            f"read pod: cannot get credentials from {source}: no answer within 0.1 s (it "
            "goes on running for the next request)")
        with pytest.raises(Transient) as raised:  # waits for the same run, which is killed
            await kube.request("GET", PATH, what="read pod")
        assert str(raised.value).startswith(
            f"read pod: cannot get credentials from {source}: no credentials within 1 s; "
            "it was killed; check the plugin")
        await kube.request("GET", PATH, what="read pod")  # the token held, meanwhile
    assert tokens(api, 1) == ["Bearer tok-1"]


async def test_a_plugin_that_fails_is_transient_naming_it_and_the_token_held_is_kept(
        plugin, clock):
    plugin.set(expiry=expiring_in(2))
    async with StandIn(Answer(200, POD)) as api, plugin.session(api) as kube:
        clock.now += PAST_ANY_SPACING
        plugin.set(fail="the token service is unreachable\n")
        with pytest.raises(Transient) as raised:
            await kube.request("GET", PATH, what="read pod")
        assert str(raised.value) == (
            f"read pod: cannot get credentials from the exec plugin {sys.executable} of the "
            "kubeconfig's user 'u': it exited with 1: the token service is unreachable; "
            "check the plugin and what it needs (its identity provider, its environment)")
        await kube.request("GET", PATH, what="read pod")  # tried again in ten seconds
    assert tokens(api, 1) == ["Bearer tok-1"]
    assert plugin.runs() == 2


def test_a_plugin_that_gives_a_client_certificate_keeps_the_official_loaders_way(tmp_path):
    # Nothing to refresh here (the certificate is read once, at the start): no ExecCredential.
    (tmp_path / "plugin.py").write_text(
        "import json; print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1beta1',"
        " 'kind': 'ExecCredential', 'status': {'clientCertificateData': 'c', "
        "'clientKeyData': 'k'}}))")
    made = Plugin(dir=tmp_path)
    kube = made.kube("http://127.0.0.1:1")
    assert not isinstance(kube.api_client.configuration.refresh_api_key_hook,
                          credentials.ExecCredential)


async def test_the_loaders_first_token_is_sent_without_a_newline_the_plugin_wrote(plugin):
    # The official loader sends the token of its own run (at start) as the plugin wrote it; a
    # newline in it made every request fail, for good (no expiry, so no run again).
    plugin.set(gen="1\n")
    async with StandIn(Answer(200, POD), Answer(200, POD)) as api, plugin.session(api) as kube:
        for _ in range(2):
            await kube.request("GET", PATH, what="read pod")
    assert tokens(api, 2) == ["Bearer tok-1"] * 2
    assert plugin.runs() == 1


async def test_a_plugin_that_failed_at_the_start_runs_before_the_first_request(plugin):
    # The loader's own run failed (its identity provider away for a moment): no hook was set,
    # and every request went without credentials for good.
    plugin.set(fail="the token service is unreachable\n")
    async with StandIn(Answer(200, POD), Answer(200, POD)) as api, plugin.session(api) as kube:
        (plugin.dir / "fail").unlink()  # the provider is back
        for _ in range(2):
            await kube.request("GET", PATH, what="read pod")
    assert tokens(api, 2) == ["Bearer tok-1"] * 2
    assert plugin.runs() == 2  # the loader's, failed, and the one before the first request
