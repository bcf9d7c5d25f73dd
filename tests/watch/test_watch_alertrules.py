"""Generated Prometheus rules and Alertmanager config, checked by the real promtool and
amtool: syntax, the value an expression computes, and the low-traffic guard."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from watchkit import need_binaries

from releasekit.spec.loadprofile import SLO
from releasekit.watch.alertrules import (
    alert_rules,
    alertmanager_config,
    duration,
    scrape_configs,
)
from releasekit.watch.rules import Baseline, BaselinePoint, Rule

RULES = [
    Rule(metric="ttft_p95_s", above=1.0, window_s=30, sustain=3),
    Rule(metric="error_rate", above=0.05, window_s=60, sustain=2, min_requests=10),
    Rule(metric="e2e_p95_s", kind="relative", factor=1.5, window_s=30),
    Rule(metric="queue_mean_s", above=0.5),
    Rule(metric="itl_p99_s", above=0.2),
    Rule(metric="preemptions_per_s", above=0.1, min_requests=0),
    Rule(metric="negative_feedback_rate", above=0.3, min_requests=5, severity="warning"),
    Rule(metric="waiting_requests_max", above=50),
    Rule(metric="kv_cache_usage", above=0.95, min_requests=0),
]
BASE = Baseline(
    points=[
        BaselinePoint(request_rate=2, figures={"e2e_p95_s": 0.8}),
        BaselinePoint(request_rate=8, figures={"e2e_p95_s": 1.6}),
    ]
)
SLOS = SLO(ttft_s=0.8, e2e_s=5.0, attainment=0.99, max_error_rate=0.01)


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60)


def test_generated_rules_pass_promtool_check(tmp_path: Path) -> None:
    """Every rule kind (absolute, relative per benchmark band, SLO-derived), with and
    without the gateway, is a valid rules file; `for:` is window x sustain."""
    promtool = need_binaries("promtool")["promtool"]
    for gateway in (True, False):
        f = alert_rules(
            "prod",
            RULES,
            slo=SLOS,
            baseline=BASE,
            release="r1",
            gateway=gateway,
            evaluation_interval_s=5,
        )
        path = tmp_path / f"rules-{gateway}.yml"
        path.write_text(f.yaml)
        res = run([promtool, "check", "rules", str(path)], tmp_path)
        assert res.returncode == 0, res.stdout + res.stderr
        doc = yaml.safe_load(f.yaml)
        rules = doc["groups"][0]["rules"]
        assert all(r["labels"]["releasekit_env"] == "prod" for r in rules)
        ttft = next(r for r in rules if r["labels"]["releasekit_rule"] == "ttft_p95_s_absolute")
        assert ttft["for"] == "90s"
        assert "histogram_quantile(0.95, sum by (le) (rate(" in ttft["expr"]
        assert ">= 20" in ttft["expr"]  # the low-traffic guard
        bands = [r for r in rules if r["labels"]["releasekit_rule"] == "e2e_p95_s_relative"]
        assert len(bands) == 2
        if gateway:
            assert "releasekit_gateway_ttft_seconds_bucket" in ttft["expr"]
            assert f.skipped == []
        else:
            assert "vllm:time_to_first_token_seconds_bucket" in ttft["expr"]
            assert any("negative_feedback_rate" in s for s in f.skipped)


def test_relative_rule_without_benchmark_is_skipped_and_said_so() -> None:
    """No baseline: the relative rule is listed in `skipped`, not silently dropped."""
    f = alert_rules("prod", [Rule(metric="e2e_p95_s", kind="relative", factor=1.5)])
    assert f.alerts == [] and "benchmark" in f.skipped[0]


def test_expression_computes_the_window_figure_and_guards_low_traffic(tmp_path: Path) -> None:
    """promtool's rule unit tests: the TTFT p95 expression yields the interpolated quantile
    (all observations in (1, 2.5]: 1 + 1.5 x 0.95), a counter reset does not disturb it, and
    the same latency at 3 requests per window neither yields a value nor fires."""
    promtool = need_binaries("promtool")["promtool"]
    rule = Rule(metric="ttft_p95_s", above=1.0, window_s=30, sustain=1, min_requests=20)
    f = alert_rules("prod", [rule], release="r1")
    (tmp_path / "rules.yml").write_text(f.yaml)
    expr = yaml.safe_load(f.yaml)["groups"][0]["rules"][0]["expr"]
    sel = 'env="prod",release="r1"'
    req = f'releasekit_gateway_requests_total{{{sel},route="/v1/completions",status="200"}}'

    def series(per_s: float, reset: bool = False) -> list[dict[str, str]]:
        v = f"0+{per_s}x60 0+{per_s}x60" if reset else f"0+{per_s}x120"
        return [
            {
                "series": f'releasekit_gateway_ttft_seconds_bucket{{{sel},le="1"}}',
                "values": "0x120",
            },
            {"series": f'releasekit_gateway_ttft_seconds_bucket{{{sel},le="2.5"}}', "values": v},
            {"series": f'releasekit_gateway_ttft_seconds_bucket{{{sel},le="+Inf"}}', "values": v},
            {"series": req, "values": v},
        ]

    tests = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1s",
        "tests": [
            {
                "interval": "1s",
                "input_series": series(10),
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "90s",
                        "exp_samples": [{"labels": "{}", "value": 2.425}],
                    }
                ],
            },
            {
                "interval": "1s",
                "input_series": series(10, reset=True),
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "75s",
                        "exp_samples": [{"labels": "{}", "value": 2.425}],
                    }
                ],
            },
            {
                "interval": "1s",
                "input_series": series(0.1),
                "promql_expr_test": [{"expr": expr, "eval_time": "90s", "exp_samples": []}],
                "alert_rule_test": [
                    {"eval_time": "110s", "alertname": f.alerts[0], "exp_alerts": []}
                ],
            },
        ],
    }
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    res = run([promtool, "test", "rules", "tests.yml"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize(
    "auth",
    [
        {"bearer_token": "s3cret"},
        {"bearer_token_file": "/etc/releasekit/token"},
        {"basic_auth": ("am", "pw")},
    ],
)
def test_alertmanager_config_passes_amtool(tmp_path: Path, auth: dict[str, object]) -> None:
    """The receiver/route snippet, as a whole config, passes `amtool check-config`, routes
    on releasekit_env and sends resolved alerts."""
    amtool = need_binaries("amtool")["amtool"]
    snip = alertmanager_config("prod", webhook_url="http://127.0.0.1:19999/alertmanager", **auth)  # type: ignore[arg-type]
    (tmp_path / "am.yml").write_text(snip.yaml)
    res = run([amtool, "check-config", "am.yml"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert snip.route["matchers"] == ['releasekit_env="prod"']
    assert snip.receiver["webhook_configs"][0]["send_resolved"] is True


def test_alertmanager_config_needs_exactly_one_credential() -> None:
    """No credential, or two, is a ValueError (never an unauthenticated webhook)."""
    with pytest.raises(ValueError):
        alertmanager_config("prod", webhook_url="http://x")
    with pytest.raises(ValueError):
        alertmanager_config("prod", webhook_url="http://x", bearer_token="a", basic_auth=("u", "p"))


def test_duration_and_scrape_configs() -> None:
    """Durations in Prometheus' syntax; scrape jobs add the releasekit_env label."""
    assert (duration(30), duration(2.5), duration(90.0)) == ("30s", "2500ms", "90s")
    with pytest.raises(ValueError):
        duration(0)
    jobs = scrape_configs("prod", vllm_targets=["127.0.0.1:8000"], gateway_targets=["gw:80"])
    assert [j["static_configs"][0]["labels"] for j in jobs] == [{"releasekit_env": "prod"}] * 2
