"""End to end with REAL Prometheus and Alertmanager processes: Prometheus scrapes a regressed
vLLM + gateway (the fault-injection server), evaluates the generated rules, Alertmanager
routes the alert with a bearer token to releasekit's receiver, and the rollback path is called
exactly once although Alertmanager keeps resending."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml
from pydantic import SecretStr
from watchkit import AppServer, FaultyMetrics, Proc, Sim, free_port, need_binaries, wait_http

from releasekit.watch.alertrules import alert_rules, alertmanager_config, scrape_configs
from releasekit.watch.receiver import ReceiverAuth, create_receiver
from releasekit.watch.rules import Rule
from releasekit.watch.watcher import RollbackOutcome, RollbackRequest

TOKEN = "e2e-token"


def test_regression_fires_rule_and_alertmanager_rolls_back_once(
    tmp_path: Path, sim: Sim, start_proc: Callable[[list[str], str], Proc]
) -> None:
    """Regressed TTFT -> generated rule fires in Prometheus -> Alertmanager -> receiver
    (bearer auth) -> one rollback of prod from r1; repeats are answered as duplicates."""
    bins = need_binaries("prometheus", "prometheus-alertmanager|alertmanager")
    calls: list[RollbackRequest] = []

    def rollback(req: RollbackRequest) -> RollbackOutcome:
        calls.append(req)
        return RollbackOutcome(
            status="rolled_back", env=req.env, from_release=req.from_release, to_release="r0"
        )

    receiver = create_receiver(
        rollback=rollback,
        auth=ReceiverAuth(bearer_tokens=[SecretStr(TOKEN)]),
        store_path=tmp_path / "alerts.db",
        envs={"prod"},
    )
    fm = FaultyMetrics(sim)
    stop = threading.Event()

    def regressed_load() -> None:  # about 30 requests/s, TTFT 2 s at the gateway
        while not stop.is_set():
            sim.serve(3, ttft=2.0, e2e=3.0)
            time.sleep(0.1)

    feeder = threading.Thread(target=regressed_load, daemon=True)
    with AppServer(fm.app) as metrics, AppServer(receiver) as recv:
        feeder.start()
        try:
            am_port, prom_port = free_port(), free_port()
            am = alertmanager_config(
                "prod",
                webhook_url=f"{recv.url}/alertmanager",
                bearer_token=TOKEN,
                group_wait_s=1,
                group_interval_s=1,
                repeat_interval_s=2,
            )
            (tmp_path / "am.yml").write_text(am.yaml)
            am_proc = start_proc(
                [
                    bins["prometheus-alertmanager"],
                    f"--config.file={tmp_path / 'am.yml'}",
                    f"--storage.path={tmp_path / 'am-data'}",
                    f"--web.listen-address=127.0.0.1:{am_port}",
                    "--cluster.listen-address=",
                    "--log.level=warn",
                ],
                "alertmanager",
            )
            rule = Rule(metric="ttft_p95_s", above=1.0, window_s=4, sustain=1, min_requests=5)
            rules = alert_rules("prod", [rule], release="r1", evaluation_interval_s=1)
            (tmp_path / "rules.yml").write_text(rules.yaml)
            target = f"127.0.0.1:{metrics.port}"
            jobs = scrape_configs(
                "prod", vllm_targets=[target], gateway_targets=[target], interval_s=1
            )
            jobs[0]["metrics_path"] = "/vllm/metrics"
            jobs[1]["metrics_path"] = "/gateway/metrics"
            prom_cfg = {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(tmp_path / "rules.yml")],
                "alerting": {
                    "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]
                },
                "scrape_configs": jobs,
            }
            (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prom_cfg))
            wait_http(f"http://127.0.0.1:{am_port}/-/ready", proc=am_proc)
            prom_proc = start_proc(
                [
                    bins["prometheus"],
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                    "--rules.alert.resend-delay=2s",
                    "--log.level=warn",
                ],
                "prometheus",
            )
            wait_http(f"http://127.0.0.1:{prom_port}/-/ready", proc=prom_proc)

            reg = receiver.state.registry

            def delivered() -> float:
                return (
                    reg.get_sample_value("releasekit_receiver_deliveries_total", {"code": "200"})
                    or 0.0
                )

            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and delivered() < 3:
                time.sleep(0.25)
            logs = f"\n--- prometheus\n{prom_proc.tail()}\n--- alertmanager\n{am_proc.tail()}"
            assert calls, "no alert reached the receiver" + logs
            assert delivered() >= 3, "Alertmanager did not resend" + logs
        finally:
            stop.set()
            feeder.join(timeout=5)
    assert len(calls) == 1
    req = calls[0]
    assert (req.env, req.from_release, req.trigger) == ("prod", "r1", "alertmanager")
    assert req.alert is not None
    assert req.alert["labels"]["alertname"] == rules.alerts[0]
    assert req.alert["labels"]["releasekit_source"] == "gateway"
    records = receiver.state.store.records()
    assert [(r.status, r.state) for r in records] == [("firing", "done")]
    assert (
        reg.get_sample_value(
            "releasekit_receiver_alerts_total", {"env": "prod", "action": "duplicate"}
        )
        or 0
    ) >= 2
