"""The watch composed from settings, with a real ledger (temp SQLite), real locked releases
with their bench.json, a deploy state file, and B's fault-injecting metrics server behind
two loopback ports (one for vLLM, one for the gateway). The rollback path is the real
adapter over a stand-in for `releasekit.promote.rollback.rollback` (same signature) that
records like it does: a live `rollback` event and a `mark_bad` event."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import webclient
import yaml
from sqlalchemy import create_engine
from watchkit import AppServer, FakeClock, FaultyMetrics, Sim

from releasekit.config import Settings, load_settings
from releasekit.deploy.gateway import Route
from releasekit.deploy.state import DeployStateError, EnvState, GatewayRecord, write_state
from releasekit.promote.rollback import RollbackError, RollbackResult
from releasekit.stores.evidence import read_evidence
from releasekit.stores.ledger import DecisionRecordsError, Event, EventType, Ledger, events_table
from releasekit.watch.receiver import ReceiverAuth
from releasekit.watch.rules import Rule
from releasekit.watch.service import (
    WatchService,
    WatchSetupError,
    build_alert_rules,
    last_promotion_time,
    last_rollback_time,
    metrics_urls,
    plan_watch,
    receiver_auth,
    rollback_adapter,
    write_alert_rules,
)
from releasekit.watch.watcher import RollbackRequest, RollbackTransientError

ENV = "prod"
ACTOR = "Wanda Watcher <wanda@example.com>"
WATCH_RULES = """watch:
  - {metric: ttft_p95_s, max: 1.0, window_s: 1, sustain: 3}
  - {metric: error_rate, max: 0.05, window_s: 1, sustain: 2}
"""


# --------------------------------------------------------------------------- the kit


class _Prefix:
    """ASGI: serve FaultyMetrics' /<which>/metrics as plain /metrics (a server of its own)."""

    def __init__(self, app: Any, which: str) -> None:
        self.app, self.which = app, which

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics":
            scope = {**scope, "path": f"/{self.which}/metrics", "raw_path": None}
        await self.app(scope, receive, send)


def bench_json(release_id: str, *, e2e_p95: float = 0.5) -> dict[str, Any]:
    """A bench.json with three load points (1, 4, 16 concurrent; 2, 8, 30 req/s)."""

    def pct(base: float) -> dict[str, float]:
        return {"p50": base * 0.6, "p90": base * 0.9, "p95": base, "p99": base * 1.2}

    points = [
        {
            "load": c,
            "mode": "concurrency",
            "n": 100,
            "ok": 99,
            "errors": 1,
            "timeouts": 0,
            "request_throughput": rate,
            "ttft": pct(0.05 * c),
            "itl": pct(0.02),
            "e2e": pct(e2e_p95 * c / 4),
        }
        for c, rate in ((1, 2.0), (4, 8.0), (16, 30.0))
    ]
    return {"release_id": release_id, "points": points, "knee": points[1]}


@dataclass
class StandInRollback:
    """`releasekit.promote.rollback.rollback`'s signature and ledger effects, without a
    deploy: a live rollback event to the previous release, a mark_bad event, the deploy
    state's route moved, the sim's live release moved. `fail` raises that error instead."""

    env: WatchEnv
    calls: list[dict[str, Any]] = field(default_factory=list)
    fail: Exception | None = None

    def __call__(
        self,
        settings: Settings,
        env: str,
        *,
        reason: str,
        actor: str | None = None,
        evidence: dict[str, Any] | None = None,
        from_release: str | None = None,
        ledger: Ledger | None = None,
        break_glass: bool = False,
    ) -> RollbackResult:
        self.calls.append(
            {
                "env": env,
                "reason": reason,
                "actor": actor,
                "evidence": evidence,
                "break_glass": break_glass,
            }
        )
        if self.fail is not None:
            raise self.fail
        assert ledger is not None
        cur = ledger.live_at(env)
        current = cur.to_release if cur else None
        if from_release is not None and from_release != current:
            return RollbackResult(
                status="not_live", environment=env, from_release=from_release, reason=reason
            )
        target = self.env.r0 if current == self.env.r1 else self.env.r1
        rec = ledger.append(
            Event(
                type=EventType.ROLLBACK,
                environment=env,
                from_release=current,
                to_release=target,
                reason=reason,
                evidence=evidence or {},
                live=True,
                actor=actor,
            )
        )
        bad = ledger.append(
            Event(
                type=EventType.MARK_BAD,
                environment=env,
                from_release=target,
                to_release=current,
                reason=reason,
                live=False,
                actor=actor,
            )
        )
        self.env.route_to(target)
        return RollbackResult(
            status="rolled_back",
            environment=env,
            from_release=current,
            to_release=target,
            reason=reason,
            record=rec,
            marked_bad=bad,
        )


@dataclass
class WatchEnv:
    """A project with two locked releases (r0 then r1 live in prod), a ledger, a deploy
    state pointing at the sim's two metrics servers."""

    root: Path
    settings: Settings
    ledger: Ledger
    r0: str
    r1: str
    sim: Sim
    faults: FaultyMetrics
    vllm_url: str
    gateway_url: str

    def route_to(self, release_id: str) -> None:
        """The deploy state's gateway sends `release_id` to the (one) sim server."""
        write_state(
            self.settings.state_dir,
            EnvState(
                env=ENV,
                gateway=GatewayRecord(
                    url=self.gateway_url,
                    host="127.0.0.1",
                    port=int(self.gateway_url.rsplit(":", 1)[1]),
                    pid=os.getpid(),
                    admin_token="t",
                    config_path="-",
                    log_path="-",
                    started_at=0.0,
                ),
                routes=[Route(release_id=release_id, base_url=self.vllm_url, model="demo")],
            ),
        )
        self.sim.release = release_id

    def service(self, clock: FakeClock | None = None, **kw: Any) -> WatchService:
        if clock is not None:
            kw["clock"] = clock
        return WatchService(self.settings, ENV, ledger=self.ledger, **kw)

    def rollback_by_hand(self) -> Any:
        """A manual rollback from r1 to r0, as `releasekit rollback` records it."""
        return self.ledger.append(
            Event(
                type=EventType.ROLLBACK,
                environment=ENV,
                from_release=self.r1,
                to_release=self.r0,
                live=True,
                reason="by hand",
            )
        )

    def rollback_events(self) -> list[Any]:
        return self.ledger.records(environment=ENV, types=[EventType.ROLLBACK.value])


def _locked_release(root: Path, name: str, *, max_num_seqs: int) -> str:
    from releasekit.spec.lock import lock

    base = (root / "manifests" / "demo-bf16.yaml").read_text()
    text = base.replace("name: demo-bf16", f"name: {name}").replace(
        "max-num-seqs: 32", f"max-num-seqs: {max_num_seqs}"
    )
    text = text[: text.index("watch:")] + WATCH_RULES  # watch: is the manifest's last block
    path = root / "manifests" / f"{name}.yaml"
    path.write_text(text)
    lk = lock(path, root=root)
    d = root / "results" / lk.release_id
    (d / "bench").mkdir(parents=True)
    (d / "lock.json").write_text(lk.model_dump_json(indent=2))
    shutil.copy(path, d / "manifest.yaml")
    (d / "bench" / "bench.json").write_text(json.dumps(bench_json(lk.release_id)))
    return lk.release_id


@pytest.fixture
def wenv(
    project: Path,
    stand_in_model: Any,
    monkeypatch: pytest.MonkeyPatch,
    sim: Sim,
) -> Iterator[WatchEnv]:
    """The project, settings from its releasekit.toml (environment prod), r0 then r1 live."""
    stand_in_model(project)
    (project / "releasekit.toml").write_text(
        f'[environments.{ENV}]\ntarget = "local"\nhost = "127.0.0.1"\nport = 27080\n'
    )
    monkeypatch.chdir(project)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for key in list(os.environ):
        if key.startswith("RELEASEKIT_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("RELEASEKIT_CONFIG", str(project / "releasekit.toml"))
    monkeypatch.setenv("RELEASEKIT_ACTOR", ACTOR)
    settings = load_settings(root=project)
    r0 = _locked_release(project, "demo-r0", max_num_seqs=32)
    r1 = _locked_release(project, "demo-r1", max_num_seqs=1)
    led = Ledger(settings.ledger_url or "", actor=ACTOR)
    for rid in (r0, r1):
        # The register event signs the release's files, as `register` records them.
        digests = read_evidence(settings, rid).digests
        led.append(
            Event(
                type=EventType.REGISTER,
                to_release=rid,
                evidence={"reports": digests, "manifest_digest": digests["manifest.yaml"]},
            )
        )
    for rid in (r0, r1):
        led.append(
            Event(type=EventType.PROMOTE, environment=ENV, to_release=rid, live=True, reason="t")
        )
    fm = FaultyMetrics(sim)
    with AppServer(_Prefix(fm.app, "vllm")) as v, AppServer(_Prefix(fm.app, "gateway")) as g:
        env = WatchEnv(project, settings, led, r0, r1, sim, fm, v.url, g.url)
        sim.env = ENV
        env.route_to(r1)
        yield env
    led.close()


def breach(w: WatchEnv, svc: WatchService, clock: FakeClock, n: int = 50) -> None:
    """One 1 s window of `n` requests with TTFT 2 s (above the 1 s rule), then a tick."""
    w.sim.serve(n, ttft=2.0, e2e=3.0)
    clock.advance(1)
    svc.watcher.tick()


# --------------------------------------------------------------------------- plan


def test_plan_takes_rules_slos_baseline_and_urls_from_the_live_release(wenv: WatchEnv) -> None:
    """The plan watches the ledger's live release (r1) with its manifest's watch rules, then
    the load profile's SLO rules over the manifest's window and sustain; its bench points
    become the baseline at their request rates; the URLs come from the deploy state."""
    plan = plan_watch(wenv.settings, ENV, ledger=wenv.ledger)
    assert plan.release_id == wenv.r1 and plan.release_name == "demo-r1"
    names = [r.name for r in plan.rules]
    assert names[:2] == ["ttft_p95_s_absolute", "error_rate_absolute"]
    assert "slo_ttft_p90" in names and "slo_error_rate" in names  # attainment 0.9
    slo = next(r for r in plan.rules if r.name == "slo_ttft_p90")
    assert (slo.above, slo.window_s, slo.sustain) == (1.0, 1.0, 3)
    assert plan.baseline is not None
    assert [p.request_rate for p in plan.baseline.points] == [2.0, 8.0, 30.0]
    assert plan.baseline.points[1].figures["e2e_p95_s"] == pytest.approx(0.5)
    assert plan.baseline.points[0].figures["error_rate"] == pytest.approx(0.01)
    assert plan.target.vllm_metrics_url == f"{wenv.vllm_url}/metrics"
    assert plan.target.gateway_metrics_url == f"{wenv.gateway_url}/metrics"
    assert plan.notes == []


def test_plan_without_anything_live_or_without_a_server_says_so(wenv: WatchEnv) -> None:
    """Nothing live in the environment, or no server recorded for the live release: a
    WatchSetupError naming what is missing, not a watcher scraping nothing."""
    with pytest.raises(WatchSetupError, match="nothing is live in staging"):
        plan_watch(wenv.settings, "staging", ledger=wenv.ledger)
    write_state(wenv.settings.state_dir, EnvState(env=ENV))
    with pytest.raises(WatchSetupError, match="names no server"):
        metrics_urls(wenv.settings, ENV, wenv.r1)


# --------------------------------------------------------------------------- rollback


def test_sustained_breach_rolls_back_once_and_the_ledger_holds_the_windows(
    wenv: WatchEnv, clock: FakeClock
) -> None:
    """Three breaching windows of r1 -> exactly one call of the rollback, as
    releasekit-watch, from r1; the ledger's rollback event holds the three breaching
    windows (TTFT p95 > 1 s from the gateway). The watch then follows r0, and more breaches
    inside the cool-down roll nothing back."""
    impl = StandInRollback(wenv)
    svc = wenv.service(
        clock, rollback=rollback_adapter(wenv.settings, ledger=wenv.ledger, impl=impl)
    )
    svc.watcher.tick()
    for _ in range(3):
        breach(wenv, svc, clock)
    assert len(impl.calls) == 1
    call = impl.calls[0]
    assert call["actor"] == "releasekit-watch" and "ttft_p95_s" in call["reason"]
    (ev,) = wenv.rollback_events()
    assert (ev.from_release, ev.to_release, ev.actor) == (wenv.r1, wenv.r0, "releasekit-watch")
    breaches = [
        b for b in ev.evidence["breaches"] if b["judgement"]["rule"] == "ttft_p95_s_absolute"
    ]
    assert len(breaches) == 3
    for b in breaches:
        assert b["judgement"]["verdict"] == "breach"
        assert b["window"]["figures"]["ttft_p95_s"]["value"] > 1.0
        assert b["window"]["figures"]["ttft_p95_s"]["source"] == "gateway"
        assert b["window"]["release"] == wenv.r1
    assert "ttft_p95_s_absolute" in ev.evidence["rules"]
    # Replayed through the same judge, under the rules derived again from the manifest
    # copy and the floor: every window, rule and the sustained breach come out the same.
    from releasekit.audit.judged import replay_judged
    from releasekit.audit.replay import DecisionReplay
    from releasekit.promote.context import load_release

    d = DecisionReplay(seq=ev.seq, event_id=ev.event_id, type=ev.type, environment=ENV,
                       release_id=wenv.r1)  # fmt: skip
    info = load_release(wenv.settings, wenv.r1, ledger=wenv.ledger)
    replay_judged(d, ev, wenv.settings.environments[ENV], info, wenv.settings)
    assert d.checks and d.same, d.checks
    assert {"parameters", "watch"} <= {c.kind for c in d.checks}
    svc.watcher.tick()  # follows the ledger: r0 is live now
    assert svc.plan.release_id == wenv.r0 and svc.watcher.target.release == wenv.r0
    for _ in range(4):
        breach(wenv, svc, clock)
    assert len(impl.calls) == 1


def test_no_known_good_release_records_instead_of_rolling_back(
    wenv: WatchEnv, clock: FakeClock
) -> None:
    """With the previous release marked bad, a sustained breach does not call the rollback:
    the outcome is no_known_good and the ledger gets no rollback event."""
    wenv.ledger.append(
        Event(type=EventType.MARK_BAD, environment=ENV, from_release=wenv.r1, to_release=wenv.r0)
    )
    impl = StandInRollback(wenv)
    svc = wenv.service(
        clock, rollback=rollback_adapter(wenv.settings, ledger=wenv.ledger, impl=impl)
    )
    svc.watcher.tick()
    outcomes = []
    for _ in range(3):
        wenv.sim.serve(50, ttft=2.0)
        clock.advance(1)
        outcomes.append(svc.watcher.tick().rollback)
    assert impl.calls == []
    assert outcomes[-1] is not None and outcomes[-1].status == "no_known_good"
    assert wenv.rollback_events() == []


def test_healthy_traffic_and_a_vllm_restart_roll_nothing_back(
    wenv: WatchEnv, clock: FakeClock
) -> None:
    """Healthy windows pass; a restarted vLLM server (counters reset) makes a reset window,
    not a breach; a scrape timeout is no window at all: no rollback."""
    impl = StandInRollback(wenv)
    svc = wenv.service(
        clock,
        rollback=rollback_adapter(wenv.settings, ledger=wenv.ledger, impl=impl),
        scrape_timeout_s=0.5,
    )
    svc.watcher.tick()
    verdicts = []
    for i in range(6):
        wenv.sim.serve(40, ttft=0.05, e2e=0.4)
        if i == 2:
            wenv.sim.restart_vllm()
        if i == 4:
            wenv.faults.delay_s["vllm"] = 1.0
        clock.advance(1)
        t = svc.watcher.tick()
        wenv.faults.delay_s.clear()
        verdicts += [j.verdict for j in t.judgements if j.rule == "ttft_p95_s_absolute"]
    assert "breach" not in verdicts and "pass" in verdicts
    assert impl.calls == []


def test_adapter_maps_rollback_errors_to_outcomes(wenv: WatchEnv) -> None:
    """Nothing to go back to -> no_known_good; a held deploy lock -> RollbackTransientError
    (retried); a stale request (another release live) -> not_live, nothing recorded."""
    impl = StandInRollback(wenv)
    adapter = rollback_adapter(wenv.settings, ledger=wenv.ledger, impl=impl)

    def req(from_release: str | None = None) -> RollbackRequest:
        return RollbackRequest(
            env=ENV, from_release=from_release, reason="r", trigger="watch", requested_at=0
        )

    impl.fail = RollbackError("prod has no earlier release that is not marked bad")
    assert adapter(req()).status == "no_known_good"
    impl.fail = DeployStateError("another releasekit command is changing environment 'prod'")
    with pytest.raises(RollbackTransientError):
        adapter(req())
    impl.fail = None
    assert adapter(req(from_release=wenv.r0)).status == "not_live"
    assert wenv.rollback_events() == []


def test_watch_follows_a_rollback_it_did_not_make(wenv: WatchEnv, clock: FakeClock) -> None:
    """A rollback by someone else (the CLI, Alertmanager) moves the ledger: the next tick
    watches the new live release with fresh windows."""
    svc = wenv.service(clock, rollback=lambda r: pytest.fail("no rollback expected"))
    svc.watcher.tick()
    wenv.ledger.append(
        Event(type=EventType.ROLLBACK, environment=ENV, to_release=wenv.r0, live=True)
    )
    wenv.route_to(wenv.r0)
    wenv.sim.serve(50)
    clock.advance(1)
    t = svc.watcher.tick()
    assert svc.followed == [wenv.r1, wenv.r0]
    assert t.judgements == []  # fresh windows: this scrape only starts them


# --------------------------------------------------------------------------- receiver


def _alert(env: str, release: str, fingerprint: str = "abc123") -> dict[str, Any]:
    a = {
        "status": "firing",
        "labels": {"alertname": "ReleasekitWatch_ttft", "releasekit_env": env,
                   "releasekit_release": release},
        "annotations": {"summary": "ttft high"},
        "startsAt": "2026-12-01T10:00:00Z",
        "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": "",
        "fingerprint": fingerprint,
    }  # fmt: skip
    return {
        "version": "4", "groupKey": "{}:{}", "truncatedAlerts": 0, "status": "firing",
        "receiver": "releasekit-prod", "groupLabels": {}, "commonLabels": {},
        "commonAnnotations": {}, "externalURL": "", "alerts": [a],
    }  # fmt: skip


def test_receiver_on_the_watch_port_rolls_back_once_and_shares_the_guard(
    wenv: WatchEnv, tmp_path: Path
) -> None:
    """`serve` answers Alertmanager on /alertmanager: a wrong token is 401 and changes
    nothing; a valid alert sent three times rolls back once (as releasekit-alertmanager);
    the watcher's /metrics answers on the same port."""
    impl = StandInRollback(wenv)
    svc = wenv.service(
        rollback=rollback_adapter(wenv.settings, ledger=wenv.ledger, impl=impl),
        cooldown_from_ledger=False,
    )
    auth = ReceiverAuth.model_validate({"bearer_tokens": ["s3cret"]})
    with svc.serve("127.0.0.1", 0, auth=auth, store_path=tmp_path / "alerts.db") as url:
        body = _alert(ENV, wenv.r1)
        bad = webclient.post(
            f"{url}/alertmanager", json=body, headers={"Authorization": "Bearer x"}
        )
        assert bad.status_code == 401 and impl.calls == []
        codes = [
            webclient.post(
                f"{url}/alertmanager", json=body, headers={"Authorization": "Bearer s3cret"}
            ).status_code
            for _ in range(3)
        ]
        assert codes == [200, 200, 200]
        assert len(impl.calls) == 1 and impl.calls[0]["actor"] == "releasekit-alertmanager"
        (ev,) = wenv.rollback_events()
        assert ev.evidence["alert"]["fingerprint"] == "abc123"
        metrics = webclient.get(f"{url}/metrics").text
        assert "releasekit_receiver_deliveries_total" in metrics
        assert "releasekit_watch_windows_judged" in metrics


def test_the_receiver_has_the_gateways_header_limits(
    wenv: WatchEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver `watch --listen` serves refuses a header flood (too many headers, an
    oversize header block that never ends) with 431 and a header block that never completes
    with 408, and closes the connection each time; Alertmanager's deliveries still pass."""
    # Imported here: test_watch_cli imports this module in a child whose path lacks tests/.
    from rawhttp import raw_exchange

    import releasekit.watch.receiver as receiver_mod

    monkeypatch.setattr(receiver_mod, "HEADER_TIMEOUT_S", 1.0)
    impl = StandInRollback(wenv)
    svc = wenv.service(
        rollback=rollback_adapter(wenv.settings, ledger=wenv.ledger, impl=impl),
        cooldown_from_ledger=False,
    )
    auth = ReceiverAuth.model_validate({"bearer_tokens": ["s3cret"]})
    with svc.serve("127.0.0.1", 0, auth=auth, store_path=tmp_path / "alerts.db") as url:
        start = b"POST /alertmanager HTTP/1.1\r\nhost: x\r\nauthorization: Bearer s3cret\r\n"
        many = start + b"".join(b"x-h%d: v\r\n" % i for i in range(150))
        many += b"content-length: 0\r\n\r\n"
        assert raw_exchange(url, many, wait_s=30).startswith(b"HTTP/1.1 431")
        huge = start + b"x-pad: " + b"a" * (70 * 1024)  # never ends
        assert raw_exchange(url, huge, wait_s=30).startswith(b"HTTP/1.1 431")
        assert raw_exchange(url, start, wait_s=30).startswith(b"HTTP/1.1 408")  # stops mid-headers
        ok = webclient.post(
            f"{url}/alertmanager",
            json=_alert(ENV, wenv.r1),
            headers={"Authorization": "Bearer s3cret"},
        )
        assert ok.status_code == 200 and len(impl.calls) == 1


def test_receiver_auth_comes_from_the_environment(tmp_path: Path) -> None:
    """RELEASEKIT_WEBHOOK_TOKEN(_FILE) give bearer tokens, _USER/_PASSWORD basic auth;
    nothing set gives None (the CLI refuses --listen then)."""
    tok = tmp_path / "tok"
    tok.write_text("from-file\n")
    auth = receiver_auth(
        {
            "RELEASEKIT_WEBHOOK_TOKEN": "t1",
            "RELEASEKIT_WEBHOOK_TOKEN_FILE": str(tok),
            "RELEASEKIT_WEBHOOK_USER": "am",
            "RELEASEKIT_WEBHOOK_PASSWORD": "pw",
        }
    )
    assert auth is not None
    assert auth.check("Bearer t1") and auth.check("Bearer from-file")
    assert auth.check("Basic YW06cHc=")  # am:pw
    assert not auth.check("Bearer nope")
    assert receiver_auth({}) is None


# --------------------------------------------------------------------------- rules as code


def promtool() -> str:
    """promtool's path; skip without it (fail under CI=true)."""
    path = shutil.which("promtool")
    if path is None:
        msg = "promtool is not installed; run scripts/system-deps.sh (Debian package prometheus)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def test_alert_rules_for_the_live_release_pass_promtool(wenv: WatchEnv, tmp_path: Path) -> None:
    """The generated rules cover the live release's watch and SLO rules, labelled with the
    environment and release, and `promtool check rules` accepts the file; the Alertmanager
    snippet routes releasekit_env=prod to the webhook with the token file."""
    res = build_alert_rules(
        wenv.settings,
        ENV,
        ledger=wenv.ledger,
        webhook_url="http://127.0.0.1:27095/alertmanager",
        environ={"RELEASEKIT_WEBHOOK_TOKEN_FILE": "/run/secrets/am-token"},
    )
    assert res.release_id == wenv.r1
    assert "ReleasekitWatch_ttft_p95_s_absolute" in res.rules.alerts
    assert "ReleasekitWatch_slo_error_rate" in res.rules.alerts
    groups = yaml.safe_load(res.rules.yaml)["groups"]
    labels = [r["labels"] for g in groups for r in g["rules"]]
    assert all(lb["releasekit_env"] == ENV and lb["releasekit_release"] == wenv.r1 for lb in labels)
    written = write_alert_rules(
        res, rules_path=tmp_path / "r.yml", alertmanager_path=tmp_path / "am.yml"
    )
    assert "credentials_file: /run/secrets/am-token" in (tmp_path / "am.yml").read_text()
    assert "releasekit_env: prod" in written.scrape_yaml
    proc = subprocess.run(
        [promtool(), "check", "rules", str(tmp_path / "r.yml")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    amtool = shutil.which("amtool")
    if amtool:
        proc = subprocess.run(
            [amtool, "check-config", str(tmp_path / "am.yml")], capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_extra_relative_rule_uses_the_release_benchmark(wenv: WatchEnv, clock: FakeClock) -> None:
    """A relative rule (E2E p95 more than 1.5x the release's own benchmark at a similar
    request rate) is judged against bench.json: 1 s E2E at about 8 req/s (bench 0.5 s)
    breaches; 0.5 s passes."""
    rel20 = Rule(
        name="e2e_rel", metric="e2e_p95_s", kind="relative", factor=1.5, window_s=2.5,
        sustain=3, min_requests=10,
    )  # fmt: skip
    svc = wenv.service(clock, rollback=lambda r: pytest.fail("no rollback"), extra_rules=[rel20])
    svc.watcher.tick()
    got = []
    for e2e in (2.0, 0.45):
        wenv.sim.serve(20, e2e=e2e)
        clock.advance(2.5)
        got += [j for j in svc.watcher.tick().judgements if j.rule == "e2e_rel"]
    assert [j.verdict for j in got] == ["breach", "pass"]
    assert got[0].limit == pytest.approx(0.75)  # 1.5 x 0.5 s at 8 req/s


def test_the_cooldown_reads_rollbacks_and_promotions_from_the_ledger(wenv: WatchEnv) -> None:
    """A rollback in the ledger (manual or by another watcher) cools the environment down;
    a promotion written after it ends the cool-down, so the new release can be rolled back."""
    svc = wenv.service(cooldown_s=900)
    assert svc.guard.cooldown_left(ENV) == 0.0  # two promotions, no rollback
    wenv.rollback_by_hand()
    assert 890 < svc.guard.cooldown_left(ENV) <= 900
    assert last_rollback_time(wenv.ledger)(ENV) is not None
    wenv.ledger.append(
        Event(type=EventType.PROMOTE, environment=ENV, to_release=wenv.r1, live=True, reason="t")
    )
    assert svc.guard.cooldown_left(ENV) == 0.0
    assert (last_promotion_time(wenv.ledger)(ENV) or 0) >= (
        last_rollback_time(wenv.ledger)(ENV) or 0
    )


def test_a_ledger_that_fails_verification_breaks_glass(wenv: WatchEnv) -> None:
    """A rollback record edited in the database (here its reason) breaks the chain: the
    guard's cool-down and known-good read only the records before it (the forged rollback
    does not cool the environment down), and the watcher's rollback request still goes
    back, breaking glass (a way back must always work) rather than failing; a watcher that
    had verified the ledger before the edit checks it afresh for the request."""
    impl = StandInRollback(wenv)
    running = wenv.service(
        cooldown_s=900, rollback=rollback_adapter(wenv.settings, ledger=wenv.ledger, impl=impl)
    )
    assert running.guard.cooldown_left(ENV) == 0.0  # verified, and cached by head
    rb = wenv.rollback_by_hand()
    engine = create_engine(wenv.settings.ledger_url or "")
    with engine.begin() as conn:
        conn.execute(
            events_table.update().where(events_table.c.seq == rb.seq).values(reason="forged")
        )
    engine.dispose()
    led = Ledger(wenv.settings.ledger_url or "", actor=ACTOR)
    with pytest.raises(DecisionRecordsError, match="refusing to act on ledger"):
        led.verified()
    assert last_rollback_time(led)(ENV) is None  # the forged rollback is past the failure
    assert last_promotion_time(led)(ENV) is not None
    req = RollbackRequest(
        env=ENV, from_release=wenv.r1, reason="r", trigger="watch", requested_at=0
    )
    running.watcher.request_rollback(req)
    assert [c["break_glass"] for c in impl.calls] == [True]
    led.close()
