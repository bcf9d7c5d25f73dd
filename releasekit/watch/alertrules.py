"""Rules as code: a Prometheus alerting-rules file for one environment from its live
release's watch rules (and SLOs), over the vLLM and gateway metric names, plus the matching
Alertmanager receiver and route, and the Prometheus scrape jobs that label the series.

Each rule becomes `EXPR > LIMIT and on() (requests in the window >= min_requests)` with
`for: window x sustain`: rate()/increase() handle counter resets (a restart is not a spike),
and the `and` clause keeps a quiet window from firing on three slow requests. vLLM series are
selected by the `releasekit_env` target label the scrape job adds (vLLM itself labels only
model and engine); gateway series by their own `env` (and `release`) labels.

A relative rule ("e2e_p95_s more than 1.5x its benchmark") becomes one alert per benchmark
point, each guarded to the band of request rates closest to that point.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field

from releasekit.watch.rules import Baseline, Rule, SLOLike, rules_from_slo
from releasekit.watch.windows import (
    ABORT_STATUSES,
    ERROR_WORDS,
    GENERATION_TOKENS,
    GW_FEEDBACK,
    GW_IN_FLIGHT,
    GW_QUEUE_WAIT,
    GW_REJECTIONS,
    GW_REQUESTS,
    GW_STREAM_CHUNKS,
    KV_USAGE,
    LATENCY_FAMILIES,
    METRICS,
    NON_INFERENCE_ROUTES,
    PREEMPTIONS,
    PROMPT_TOKENS,
    REQUEST_SUCCESS,
    RUNNING,
    TIMEOUT_STATUSES,
    WAITING,
)

Source = Literal["vllm", "gateway"]
_GW_ENV_ONLY = frozenset({GW_QUEUE_WAIT, GW_REJECTIONS})


def duration(seconds: float) -> str:
    """A Prometheus duration: 30 -> '30s', 2.5 -> '2500ms'."""
    if seconds <= 0 or not math.isfinite(seconds):
        raise ValueError(f"duration must be positive, got {seconds!r}")
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{round(seconds * 1000)}ms"


def _sel(matchers: Mapping[str, str], extra: str = "") -> str:
    parts = [f'{k}="{_escape(v)}"' for k, v in matchers.items()]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"')


def _alt(values: Sequence[str]) -> str:
    return "|".join(re.escape(v) for v in sorted(values))


_ROUTES = f'route!~"{_alt(sorted(NON_INFERENCE_ROUTES))}|.*feedback.*"'
_ERR = f'status=~"5..|{_alt(sorted(ERROR_WORDS | TIMEOUT_STATUSES))}"'
_TIMEOUT = f'status=~"{_alt(sorted(TIMEOUT_STATUSES))}"'
_ABORT = f'status=~"{_alt(sorted(ABORT_STATUSES))}"'


class _Expr(BaseModel):
    expr: str
    source: Source
    traffic: str = Field(description="requests (or feedback) in the window, for the guard")
    rate: str = Field(description="requests per second, for relative rules' bands")


class AlertRulesFile(BaseModel):
    """A generated rules file: the YAML text, the alerts in it, and the rules left out."""

    env: str
    yaml: str
    alerts: list[str]
    skipped: list[str] = Field(default_factory=list, description="`rule: why` for each")


class AlertmanagerSnippet(BaseModel):
    """The Alertmanager route and receiver for an environment, and a whole config using them
    (a root route with a do-nothing default receiver) that runs as is."""

    route: dict[str, Any]
    receiver: dict[str, Any]
    yaml: str


class _Selectors:
    def __init__(self, env: str, release: str | None, vllm: Mapping[str, str] | None) -> None:
        self.vllm = dict(vllm) if vllm is not None else {"releasekit_env": env}
        self.gw = {"env": env} | ({"release": release} if release else {})
        self.gw_env = {"env": env}

    def gateway(self, family: str) -> dict[str, str]:
        return self.gw_env if family in _GW_ENV_ONLY else self.gw


def _expression(metric: str, w: str, s: _Selectors, gateway: bool) -> _Expr | None:
    """PromQL for a window figure over a `w` window, or None when it has none."""
    gw_req = f"{GW_REQUESTS}{_sel(s.gw, _ROUTES)}"
    vl_req = f"{REQUEST_SUCCESS}{_sel(s.vllm)}"
    req_total = gw_req if gateway else vl_req
    traffic = f"sum(increase({req_total}[{w}]))"
    rate = f"sum(rate({req_total}[{w}]))"

    def mk(expr: str, source: Source, traffic_: str = traffic) -> _Expr:
        return _Expr(expr=expr, source=source, traffic=traffic_, rate=rate)

    m = re.fullmatch(r"(.+)_(p\d+|mean)_s", metric)
    if m and m.group(1) in LATENCY_FAMILIES:
        vllm_fam, gw_fam = LATENCY_FAMILIES[m.group(1)]
        if gateway and gw_fam is not None:
            fam, sel, source = gw_fam, _sel(s.gateway(gw_fam)), "gateway"
        elif vllm_fam is not None:
            fam, sel, source = vllm_fam, _sel(s.vllm), "vllm"
        else:
            return None
        if m.group(2) == "mean":
            e = f"sum(rate({fam}_sum{sel}[{w}])) / sum(rate({fam}_count{sel}[{w}]))"
        else:
            q = int(m.group(2)[1:]) / 100
            e = f"histogram_quantile({q:g}, sum by (le) (rate({fam}_bucket{sel}[{w}])))"
        return mk(e, source)  # type: ignore[arg-type]
    gsel, vsel = _sel(s.gw), _sel(s.vllm)
    ratio = "sum(rate({num}[{w}])) / sum(rate({den}[{w}]))"
    if metric in ("error_rate", "timeout_rate", "abort_rate"):
        if gateway:
            which = {"error_rate": _ERR, "timeout_rate": _TIMEOUT, "abort_rate": _ABORT}[metric]
            num = f"{GW_REQUESTS}{_sel(s.gw, _ROUTES + ',' + which)}"
            return mk(ratio.format(num=num, den=gw_req, w=w), "gateway")
        if metric == "timeout_rate":
            return None
        reason = "error" if metric == "error_rate" else "abort"
        num = f"{REQUEST_SUCCESS}{_sel(s.vllm, f'finished_reason={chr(34)}{reason}{chr(34)}')}"
        return mk(ratio.format(num=num, den=vl_req, w=w), "vllm")
    simple: dict[str, tuple[str, Source]] = {
        "request_rate": (rate, "gateway" if gateway else "vllm"),
        "preemptions_per_s": (f"sum(rate({PREEMPTIONS}{vsel}[{w}]))", "vllm"),
        "generation_tokens_per_s": (f"sum(rate({GENERATION_TOKENS}{vsel}[{w}]))", "vllm"),
        "prompt_tokens_per_s": (f"sum(rate({PROMPT_TOKENS}{vsel}[{w}]))", "vllm"),
        "waiting_requests": (f"sum({WAITING}{vsel})", "vllm"),
        "waiting_requests_max": (f"sum(max_over_time({WAITING}{vsel}[{w}]))", "vllm"),
        "running_requests": (f"sum({RUNNING}{vsel})", "vllm"),
        "kv_cache_usage": (f"max({KV_USAGE[0]}{vsel})", "vllm"),
    }
    if gateway:
        simple |= {
            "in_flight": (f"sum({GW_IN_FLIGHT}{gsel})", "gateway"),
            "rejections_per_s": (
                f"sum(rate({GW_REJECTIONS}{_sel(s.gw_env)}[{w}]))",
                "gateway",
            ),
            "chunks_per_request": (
                ratio.format(num=f"{GW_STREAM_CHUNKS}{gsel}", den=gw_req, w=w),
                "gateway",
            ),
        }
    if metric in simple:
        e, src = simple[metric]
        return mk(e, src)
    if metric == "negative_feedback_rate" and gateway:
        fb = f"{GW_FEEDBACK}{gsel}"
        neg = f"{GW_FEEDBACK}{_sel(s.gw, 'score=' + chr(34) + 'negative' + chr(34))}"
        return mk(ratio.format(num=neg, den=fb, w=w), "gateway", f"sum(increase({fb}[{w}]))")
    return None


def _alert_name(rule: Rule) -> str:
    return "ReleasekitWatch_" + re.sub(r"[^a-zA-Z0-9_]", "_", rule.name)


def _bands(baseline: Baseline, metric: str, tol: float) -> list[tuple[float, float, float]]:
    """(low rate, high rate, benchmark value) per benchmark point having `metric`."""
    pts = sorted(
        (p.request_rate, p.figures[metric]) for p in baseline.points if metric in p.figures
    )
    out = []
    for i, (r, v) in enumerate(pts):
        lo = r / (1 + tol) if i == 0 else (pts[i - 1][0] + r) / 2
        hi = r * (1 + tol) if i == len(pts) - 1 else (r + pts[i + 1][0]) / 2
        out.append((lo, hi, v))
    return out


def alert_rules(
    env: str,
    rules: Sequence[Rule],
    *,
    slo: SLOLike | None = None,
    slo_window_s: float = 60.0,
    slo_sustain: int = 3,
    baseline: Baseline | None = None,
    release: str | None = None,
    gateway: bool = True,
    vllm_selector: Mapping[str, str] | None = None,
    evaluation_interval_s: float | None = None,
) -> AlertRulesFile:
    """A Prometheus rules file for `env`: one alert per rule (per benchmark band for a
    relative rule), each labelled releasekit_env=ENV, severity, releasekit_rule (and
    releasekit_release when `release` is given, so the receiver can tell a stale alert).
    `gateway`: prefer the gateway's series for TTFT/E2E/error rates (else vLLM's only).
    `vllm_selector`: label matchers for the vLLM series (default releasekit_env=ENV)."""
    s = _Selectors(env, release, vllm_selector)
    all_rules = list(rules)
    if slo is not None:
        all_rules += rules_from_slo(slo, window_s=slo_window_s, sustain=slo_sustain)
    out_rules: list[dict[str, Any]] = []
    names: list[str] = []
    skipped: list[str] = []
    for rule in all_rules:
        w = duration(rule.window_s)
        ex = _expression(rule.metric, w, s, gateway)
        if ex is None:
            skipped.append(f"{rule.name}: {rule.metric} has no PromQL form without the gateway")
            continue
        name = _alert_name(rule)
        labels: dict[str, str] = {
            "releasekit_env": env,
            "severity": rule.severity,
            "releasekit_rule": rule.name,
            "releasekit_metric": rule.metric,
            "releasekit_source": ex.source,
        }
        if release:
            labels["releasekit_release"] = release
        guard = f" and on() ({ex.traffic} >= {rule.min_requests})" if rule.min_requests else ""
        info = METRICS[rule.metric]
        unit = "s" if info.unit == "s" else ""
        traffic_note = (
            f"; judged only with at least {rule.min_requests} requests per window"
            if rule.min_requests
            else ""
        )
        annotations = {
            "summary": f"{env}: {rule.metric} is {{{{ $value | humanize }}}}{unit} "
            f"({rule.describe()})",
            "description": f"releasekit watch rule {rule.name!r} on {env}: {rule.describe()}, "
            f"from {ex.source} metrics{traffic_note}.",
        }
        base = {"alert": name, "for": duration(rule.window_s * rule.sustain)}
        if rule.kind == "absolute":
            out_rules.append(
                base
                | {
                    "expr": f"({ex.expr}) > {rule.above!r}{guard}",
                    "labels": labels,
                    "annotations": annotations,
                }
            )
        else:
            if baseline is None or not (
                bands := _bands(baseline, rule.metric, rule.rate_tolerance)
            ):
                skipped.append(f"{rule.name}: relative rule needs a benchmark with {rule.metric}")
                continue
            for i, (lo, hi, bench) in enumerate(bands):
                limit = (rule.factor or 1.0) * bench
                band = f" and on() ({ex.rate} >= {lo:.6g}) and on() ({ex.rate} < {hi:.6g})"
                out_rules.append(
                    base
                    | {
                        "expr": f"({ex.expr}) > {limit:.6g}{guard}{band}",
                        "labels": labels | {"releasekit_band": str(i)},
                        "annotations": annotations
                        | {"benchmark": f"{bench:.6g} at {lo:.3g}-{hi:.3g} req/s"},
                    }
                )
        names.append(name)
    group: dict[str, Any] = {"name": f"releasekit-{env}", "rules": out_rules}
    if evaluation_interval_s is not None:
        group["interval"] = duration(evaluation_interval_s)
    text = (
        f"# Generated by releasekit for environment {env!r}"
        + (f" (release {release})" if release else "")
        + "; regenerate, do not edit.\n"
        + yaml.safe_dump({"groups": [group]}, sort_keys=False, width=1000)
    )
    return AlertRulesFile(env=env, yaml=text, alerts=names, skipped=skipped)


def alertmanager_config(
    env: str,
    *,
    webhook_url: str,
    bearer_token: str | None = None,
    bearer_token_file: str | None = None,
    basic_auth: tuple[str, str] | None = None,
    group_wait_s: float = 10.0,
    group_interval_s: float = 60.0,
    repeat_interval_s: float = 3600.0,
) -> AlertmanagerSnippet:
    """The Alertmanager route (matching releasekit_env=ENV) and webhook receiver for `env`,
    authenticated with a bearer token (inline or from a file) or basic auth."""
    if sum(x is not None for x in (bearer_token, bearer_token_file, basic_auth)) != 1:
        raise ValueError("give exactly one of bearer_token, bearer_token_file, basic_auth")
    http: dict[str, Any]
    if basic_auth is not None:
        http = {"basic_auth": {"username": basic_auth[0], "password": basic_auth[1]}}
    elif bearer_token_file is not None:
        http = {"authorization": {"type": "Bearer", "credentials_file": bearer_token_file}}
    else:
        http = {"authorization": {"type": "Bearer", "credentials": bearer_token}}
    name = f"releasekit-{env}"
    receiver = {
        "name": name,
        "webhook_configs": [
            {"url": webhook_url, "send_resolved": True, "max_alerts": 0, "http_config": http}
        ],
    }
    route = {
        "receiver": name,
        "matchers": [f'releasekit_env="{_escape(env)}"'],
        "group_by": ["alertname", "releasekit_env", "releasekit_rule"],
        "group_wait": duration(group_wait_s),
        "group_interval": duration(group_interval_s),
        "repeat_interval": duration(repeat_interval_s),
        "continue": False,
    }
    full = {
        "route": {"receiver": "releasekit-default", "routes": [route]},
        "receivers": [{"name": "releasekit-default"}, receiver],
    }
    text = f"# Generated by releasekit for environment {env!r}.\n" + yaml.safe_dump(
        full, sort_keys=False, width=1000
    )
    return AlertmanagerSnippet(route=route, receiver=receiver, yaml=text)


def scrape_configs(
    env: str,
    *,
    vllm_targets: Sequence[str],
    gateway_targets: Sequence[str] = (),
    interval_s: float = 15.0,
) -> list[dict[str, Any]]:
    """Prometheus scrape jobs for `env` that add the `releasekit_env` label the vLLM
    expressions select on (host:port targets, path /metrics)."""
    jobs = [
        {
            "job_name": f"releasekit-{env}-vllm",
            "scrape_interval": duration(interval_s),
            "static_configs": [{"targets": list(vllm_targets), "labels": {"releasekit_env": env}}],
        }
    ]
    if gateway_targets:
        jobs.append(
            {
                "job_name": f"releasekit-{env}-gateway",
                "scrape_interval": duration(interval_s),
                "static_configs": [
                    {"targets": list(gateway_targets), "labels": {"releasekit_env": env}}
                ],
            }
        )
    return jobs
