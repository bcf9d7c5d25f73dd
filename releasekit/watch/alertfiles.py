"""`alert-rules ENV` as files: the Prometheus rules file, the Alertmanager snippet and the
scrape jobs for an environment's live release (from its watch plan), and writing them."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, Field

from releasekit.config import Settings
from releasekit.promote.deploy import env_config
from releasekit.stores.ledger import Ledger
from releasekit.watch.alertrules import (
    AlertmanagerSnippet,
    AlertRulesFile,
    alert_rules,
    alertmanager_config,
    scrape_configs,
)
from releasekit.watch.plan import plan_watch
from releasekit.watch.webhook import (
    PASSWORD_ENV,
    RECEIVER_PATH,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    USER_ENV,
)


class AlertRulesResult(BaseModel):
    """What `alert-rules ENV` produces: the Prometheus rules file, the Alertmanager snippet,
    and the scrape jobs that give vLLM's series the `releasekit_env` label."""

    env: str
    release_id: str
    rules: AlertRulesFile
    alertmanager: AlertmanagerSnippet
    scrape_configs: list[dict[str, Any]]
    notes: list[str] = Field(default_factory=list)


def _hostport(url: str | None) -> str | None:
    if not url:
        return None
    parsed = httpx.URL(url)
    return f"{parsed.host}:{parsed.port}" if parsed.port else parsed.host


def build_alert_rules(
    settings: Settings,
    env: str,
    *,
    ledger: Ledger,
    webhook_url: str | None = None,
    environ: Mapping[str, str] | None = None,
    evaluation_interval_s: float | None = None,
) -> AlertRulesResult:
    """The rules file and Alertmanager snippet for `env`'s live release: its watch rules and
    SLO rules (one alert per benchmark band for a relative rule), labelled with the
    environment and release. The webhook authenticates as the receiver will check:
    RELEASEKIT_WEBHOOK_TOKEN_FILE (as `credentials_file`), else the token inline, else basic
    auth, else a token file path to fill in."""
    env_config(settings, env)
    plan = plan_watch(settings, env, ledger=ledger)
    notes = [
        *plan.notes,
        f"the rules select release {plan.release_id[:12]}: regenerate them after every "
        "promote or rollback of this environment",
    ]
    rules_file = alert_rules(
        env,
        plan.rules,  # the SLO rules are among them, windowed like the manifest's
        baseline=plan.baseline,
        release=plan.release_id,
        gateway=plan.target.gateway_metrics_url is not None,
        evaluation_interval_s=evaluation_interval_s,
    )
    e = os.environ if environ is None else environ
    url = webhook_url or f"http://127.0.0.1:9095{RECEIVER_PATH}"
    if webhook_url is None:
        notes.append(f"webhook URL defaulted to {url}; pass --webhook-url for `watch --listen`")
    auth: dict[str, Any]
    if e.get(TOKEN_FILE_ENV):
        auth = {"bearer_token_file": e[TOKEN_FILE_ENV]}
    elif e.get(TOKEN_ENV):
        auth = {"bearer_token": e[TOKEN_ENV]}
        notes.append("the webhook token is inline in the Alertmanager snippet: keep it private")
    elif e.get(USER_ENV) and e.get(PASSWORD_ENV):
        auth = {"basic_auth": (e[USER_ENV], e[PASSWORD_ENV])}
        notes.append("the basic-auth password is inline in the Alertmanager snippet")
    else:
        path = "/etc/alertmanager/releasekit-webhook-token"
        auth = {"bearer_token_file": path}
        notes.append(
            f"no {TOKEN_ENV} set: the snippet reads the token from {path}; put the same token "
            f"in {TOKEN_ENV} for `releasekit watch --listen`"
        )
    snippet = alertmanager_config(env, webhook_url=url, **auth)
    vllm = _hostport(plan.target.vllm_metrics_url)
    gw = _hostport(plan.target.gateway_metrics_url)
    jobs = scrape_configs(
        env, vllm_targets=[vllm] if vllm else [], gateway_targets=[gw] if gw else []
    )
    return AlertRulesResult(
        env=env,
        release_id=plan.release_id,
        rules=rules_file,
        alertmanager=snippet,
        scrape_configs=jobs,
        notes=notes,
    )


class WrittenAlertRules(BaseModel):
    """Where `write_alert_rules` put the files, and the scrape jobs as YAML to add."""

    rules_path: Path
    alertmanager_path: Path
    scrape_yaml: str
    result: AlertRulesResult


def write_alert_rules(
    result: AlertRulesResult, *, rules_path: Path, alertmanager_path: Path
) -> WrittenAlertRules:
    """Write the rules file and the Alertmanager config atomically (the config is 0600: it
    may hold the webhook's credentials)."""
    import yaml

    from releasekit._support.files import write_atomic

    for path, text in (
        (rules_path, result.rules.yaml),
        (alertmanager_path, result.alertmanager.yaml),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text.encode())
    with contextlib.suppress(OSError):
        rules_path.chmod(0o644)  # Prometheus reads it, often as another user
        alertmanager_path.chmod(0o600)
    scrape = yaml.safe_dump({"scrape_configs": result.scrape_configs}, sort_keys=False)
    return WrittenAlertRules(
        rules_path=rules_path,
        alertmanager_path=alertmanager_path,
        scrape_yaml=scrape,
        result=result,
    )
