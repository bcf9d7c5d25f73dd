"""The canary judgement on windows built from Prometheus text: which figure is trusted, what
counts as an error, and when a check waits instead of deciding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from releasekit.errors import ManifestError
from releasekit.rollout.judge import ReleaseWindows, judge_check
from releasekit.spec.manifest import CanaryCheck, parse_manifest
from releasekit.watch.windows import Snapshot, build_window, parse_exposition

REPO = Path(__file__).resolve().parents[2]
BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


def _hist(name: str, labels: str, values: list[float]) -> list[str]:
    lines = []
    for le in BUCKETS:
        n = sum(1 for v in values if v <= le)
        lines.append(f'{name}_bucket{{{labels},le="{le}"}} {n}')
    lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {len(values)}')
    lines.append(f"{name}_count{{{labels}}} {len(values)}")
    lines.append(f"{name}_sum{{{labels}}} {sum(values)}")
    return lines


def gateway_text(per_release: dict[str, dict[str, object]]) -> str:
    """Gateway /metrics for releases: {rid: {"ttft": [...], "status": {"200": n}, "chunks": n}}."""
    out = [
        "# TYPE releasekit_gateway_requests_total counter",
    ]
    for rid, r in per_release.items():
        for status, n in dict(r.get("status", {})).items():  # type: ignore[call-overload]
            out.append(
                f'releasekit_gateway_requests_total{{env="staging",release="{rid}",'
                f'route="completions",status="{status}"}} {n}'
            )
    out.append("# TYPE releasekit_gateway_ttft_seconds histogram")
    for rid, r in per_release.items():
        out += _hist(
            "releasekit_gateway_ttft_seconds",
            f'env="staging",release="{rid}"',
            list(r.get("ttft", [])),  # type: ignore[call-overload]
        )
    out.append("# TYPE releasekit_gateway_stream_chunks_total counter")
    for rid, r in per_release.items():
        out.append(
            f'releasekit_gateway_stream_chunks_total{{env="staging",release="{rid}"}} '
            f"{r.get('chunks', 0)}"
        )
    return "\n".join(out) + "\n"


def vllm_text(ttft: list[float], tpot: list[float], requests: int, tokens: int) -> str:
    out = ["# TYPE vllm:time_to_first_token_seconds histogram"]
    out += _hist("vllm:time_to_first_token_seconds", 'model_name="demo"', ttft)
    out.append("# TYPE vllm:request_time_per_output_token_seconds histogram")
    out += _hist("vllm:request_time_per_output_token_seconds", 'model_name="demo"', tpot)
    out.append("# TYPE vllm:request_success_total counter")
    out.append(f'vllm:request_success_total{{finished_reason="length"}} {requests}')
    out.append("# TYPE vllm:generation_tokens_total counter")
    out.append(f"vllm:generation_tokens_total {tokens}")
    return "\n".join(out) + "\n"


EMPTY_GW = gateway_text({"can": {}, "stb": {}})


def windows(
    gw: str, can_vllm: str | None = None, stb_vllm: str | None = None
) -> tuple[ReleaseWindows, ReleaseWindows]:
    g0, g1 = parse_exposition(EMPTY_GW), parse_exposition(gw)
    out = []
    for rid, v in (("can", can_vllm), ("stb", stb_vllm)):
        edge = build_window(Snapshot(0, gateway=g0), Snapshot(10, gateway=g1), env="staging",
                            release=rid)  # fmt: skip
        engine = None
        if v is not None:
            e0 = parse_exposition(vllm_text([], [], 0, 0))
            engine = build_window(Snapshot(0, vllm=e0), Snapshot(10, vllm=parse_exposition(v)))
        out.append(ReleaseWindows(release_id=rid, edge=edge, engine=engine))
    return out[0], out[1]


def test_slow_canary_ttft_breaches_against_stable() -> None:
    """A canary whose edge TTFT p95 is far above stable's over the same window breaches."""
    gw = gateway_text({
        "can": {"ttft": [0.4] * 30, "status": {"200": 30}, "chunks": 300},
        "stb": {"ttft": [0.02] * 100, "status": {"200": 100}, "chunks": 1000},
    })  # fmt: skip
    can, stb = windows(gw)
    res, _ = judge_check(CanaryCheck(metric="ttft_p95_s", tolerance=0.5, slack=0.05), can, stb)
    assert res.verdict == "breach", res.reason
    assert res.source == "gateway" and res.canary is not None and res.canary > res.stable  # type: ignore[operator]


def test_a_few_slow_canary_requests_are_sampling_noise_not_a_breach() -> None:
    """A p95 over 40 requests is their second-slowest: 3 slow answers of 40 put the canary's
    p95 far above the limit, but 3 above it is what a canary at the limit gives one time in
    three (5% allowed). The check passes and says why, with the counts; 12 of 40 above it
    cannot be chance and breach."""
    stable = [0.2] * 110 + [0.4] * 10
    gw = gateway_text({
        "can": {"ttft": [0.2] * 37 + [3.0] * 3, "status": {"200": 40}, "chunks": 400},
        "stb": {"ttft": stable, "status": {"200": 120}, "chunks": 1200},
    })  # fmt: skip
    can, stb = windows(gw)
    check = CanaryCheck(metric="ttft_p95_s", tolerance=0.5, slack=0.05)
    res, _ = judge_check(check, can, stb)
    assert res.limit is not None and res.canary is not None and res.canary > res.limit
    assert res.verdict == "pass", res.reason
    assert "within sampling noise" in res.reason and "3 of 40 above the limit" in res.reason
    assert res.above == pytest.approx(3.0) and res.allowed_share == pytest.approx(0.05)
    assert res.p_value is not None and res.p_value > 0.05

    gw = gateway_text({
        "can": {"ttft": [0.2] * 28 + [3.0] * 12, "status": {"200": 40}, "chunks": 400},
        "stb": {"ttft": stable, "status": {"200": 120}, "chunks": 1200},
    })  # fmt: skip
    can, stb = windows(gw)
    res, _ = judge_check(check, can, stb)
    assert res.verdict == "breach", res.reason
    assert res.above == pytest.approx(12.0) and res.p_value is not None and res.p_value < 1e-4
    assert "12 of 40 above the limit" in res.reason


def test_one_server_error_in_twenty_is_not_yet_a_breach() -> None:
    """Error rate limit 2% over stable's 0: one 5xx in 20 requests (5%) is what a canary at
    2% gives one time in three; three in 23 is not."""
    check = CanaryCheck(metric="error_rate", tolerance=0.0, slack=0.02)
    gw = gateway_text({"can": {"status": {"200": 19, "502": 1}}, "stb": {"status": {"200": 100}}})
    can, stb = windows(gw)
    res, _ = judge_check(check, can, stb)
    assert res.verdict == "pass" and res.canary == pytest.approx(0.05), res.reason
    gw = gateway_text({"can": {"status": {"200": 20, "502": 3}}, "stb": {"status": {"200": 100}}})
    can, stb = windows(gw)
    res, _ = judge_check(check, can, stb)
    assert res.verdict == "breach" and res.above == pytest.approx(3.0), res.reason


def test_too_few_canary_samples_waits_instead_of_deciding() -> None:
    """Below the check's minimum sample the verdict is `wait`, even when the canary is slow."""
    gw = gateway_text({
        "can": {"ttft": [2.0] * 5, "status": {"200": 5}},
        "stb": {"ttft": [0.02] * 100, "status": {"200": 100}},
    })  # fmt: skip
    can, stb = windows(gw)
    res, _ = judge_check(CanaryCheck(metric="ttft_p95_s", min_samples=20), can, stb)
    assert res.verdict == "wait"


def test_client_cancellations_do_not_count_as_errors() -> None:
    """499 (the client went away) and 4xx are not errors; 5xx and 504 are."""
    gw = gateway_text({
        "can": {"status": {"200": 20, "499": 15, "429": 5, "client_timeout": 3}},
        "stb": {"status": {"200": 100}},
    })  # fmt: skip
    can, stb = windows(gw)
    check = CanaryCheck(metric="error_rate", tolerance=0.0, slack=0.02)
    assert judge_check(check, can, stb)[0].verdict == "pass"
    gw = gateway_text({"can": {"status": {"200": 20, "502": 3}}, "stb": {"status": {"200": 100}}})
    can, stb = windows(gw)
    assert judge_check(check, can, stb)[0].verdict == "breach"


def test_bursty_stream_judges_ttft_engine_side_for_both() -> None:
    """When tokens arrive merged (few chunks per token), the edge TTFT measures the front
    end: the judgement uses both releases' engine TTFT instead, and a canary that is only
    slow at the edge passes."""
    gw = gateway_text({
        # 30 requests of 32 tokens each delivered in 2 chunks: bursty.
        "can": {"ttft": [0.9] * 30, "status": {"200": 30}, "chunks": 60},
        "stb": {"ttft": [0.02] * 100, "status": {"200": 100}, "chunks": 3200},
    })  # fmt: skip
    can_v = vllm_text([0.01] * 30, [0.01] * 30, 30, 30 * 32)
    stb_v = vllm_text([0.01] * 100, [0.01] * 100, 100, 100 * 32)
    can, stb = windows(gw, can_v, stb_v)
    res, _ = judge_check(CanaryCheck(metric="ttft_p95_s"), can, stb)
    assert res.source == "vllm" and "bursty" in res.reason
    assert res.verdict == "pass"


def test_tpot_is_engine_side_and_not_measured_without_engine_figures() -> None:
    """TPOT comes from each release's own vLLM; without them the check is not measured."""
    gw = gateway_text({"can": {"status": {"200": 30}}, "stb": {"status": {"200": 100}}})
    can, stb = windows(gw)
    assert judge_check(CanaryCheck(metric="tpot_p95_s"), can, stb)[0].verdict == "not_measured"
    can_v = vllm_text([0.01] * 30, [0.4] * 30, 30, 900)
    stb_v = vllm_text([0.01] * 100, [0.01] * 100, 100, 3000)
    can, stb = windows(gw, can_v, stb_v)
    res, _ = judge_check(CanaryCheck(metric="tpot_p95_s"), can, stb)
    assert res.verdict == "breach" and res.source == "vllm"


def test_a_manifest_canary_must_rise_and_name_each_metric_once(tmp_path: Path) -> None:
    """Falling weights, a metric twice, an unknown metric, or a judged weight over 50 with
    a fresh baseline are refused by field."""
    data = yaml.safe_load((REPO / "manifests" / "demo-canary-good.yaml").read_text())
    assert parse_manifest(data, path=tmp_path / "m.yaml").promotion.canary is not None
    bad = [
        {"steps": [{"weight": 50}, {"weight": 25}]},
        {"steps": [{"weight": 5}], "checks": [{"metric": "error_rate"}] * 2},
        {"steps": [{"weight": 5}], "checks": [{"metric": "ttft_p50_s"}]},
        # A fresh baseline takes the canary's share too: a judged weight over 50 cannot be.
        {"steps": [{"weight": 25}, {"weight": 75}, {"weight": 100}], "baseline": "fresh"},
    ]
    for canary in bad:
        with pytest.raises(ManifestError) as e:
            parse_manifest({**data, "promotion": {"canary": canary}}, path=tmp_path / "m.yaml")
        assert "promotion.canary" in str(e.value)
    fresh = {"steps": [{"weight": 25}, {"weight": 50}, {"weight": 100}], "baseline": "fresh"}
    m = parse_manifest({**data, "promotion": {"canary": fresh}}, path=tmp_path / "m.yaml")
    assert m.promotion.canary is not None and m.promotion.canary.baseline == "fresh"


def test_the_step_table_says_how_many_are_over_the_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`promote` prints, for a figure over its limit, how many of the canary's answers are
    over it and how likely that is by chance: what a reader needs to see why it passed."""
    from releasekit.cli.rollout_cmds import print_canary
    from releasekit.rollout.canary import CanaryRun, StepReport
    from releasekit.rollout.judge import judge_step

    gw = gateway_text({
        "can": {"ttft": [0.2] * 37 + [3.0] * 3, "status": {"200": 40}, "chunks": 400},
        "stb": {"ttft": [0.2] * 110 + [0.4] * 10, "status": {"200": 120}, "chunks": 1200},
    })  # fmt: skip
    can, stb = windows(gw)
    j = judge_step([CanaryCheck(metric="ttft_p95_s", tolerance=0.5, slack=0.05)], can, stb)
    step = StepReport(index=0, weight=25, status="passed", started_at=0, ended_at=40,
                      canary_requests=40, stable_requests=120, judgement=j)  # fmt: skip
    run = CanaryRun(env="staging", release_id="can", stable_release_ids=["stb"],
                    outcome="passed", steps=[step])  # fmt: skip
    print_canary(run.model_dump(mode="json"))
    text = capsys.readouterr().out
    assert "pass (3 of 40 over the limit, p=0.32)" in " ".join(text.split())


# -- stated power (rollout.power)


def _slow_share_windows(above: int, n: int) -> tuple[ReleaseWindows, ReleaseWindows]:
    """A canary with `above` of its `n` answers far above the limit, the rest at stable's."""
    gw = gateway_text({
        "can": {"ttft": [0.2] * (n - above) + [3.0] * above, "status": {"200": n},
                "chunks": 10 * n},
        "stb": {"ttft": [0.2] * 120, "status": {"200": 120}, "chunks": 1200},
    })  # fmt: skip
    return windows(gw)


def test_a_p95_check_states_what_it_detects_and_the_judge_agrees() -> None:
    """At 20 samples a p95 check breaches on 4 requests above the limit (p = 0.016) and
    not on 3 (p = 0.076); a canary with three times the allowed slow share (15%) breaches a
    judgement about 35% of the time, and one with 26% of its requests above the limit 80%
    of the time. The judge itself breaches exactly from the stated count on."""
    from releasekit.rollout.power import check_power

    check = CanaryCheck(metric="ttft_p95_s", tolerance=0.5, slack=0.05, min_samples=20)
    p = check_power(check)
    assert p.breach_at == 4 and p.allowed_share == pytest.approx(0.05)
    assert p.at_3x == pytest.approx(0.352, abs=0.001)
    assert p.at_2x == pytest.approx(0.133, abs=0.001)
    assert p.detects == pytest.approx(0.259, abs=0.001)
    assert "breaches on 4 requests above the limit" in p.words()
    res, _ = judge_check(check, *_slow_share_windows(p.breach_at, 20))
    assert res.verdict == "breach" and res.above == pytest.approx(4.0), res.reason
    res, _ = judge_check(check, *_slow_share_windows(p.breach_at - 1, 20))
    assert res.verdict == "pass" and "within sampling noise" in res.reason, res.reason


def test_a_rate_check_states_its_power_from_the_limit_at_stable_zero() -> None:
    """An error-rate limit of 2% over 10 requests breaches on 2 errors; a limit that allows
    none breaches on the first one."""
    from releasekit.rollout.power import check_power

    p = check_power(CanaryCheck(metric="error_rate", tolerance=0.0, slack=0.02, min_samples=10))
    assert p.breach_at == 2 and p.allowed_share == pytest.approx(0.02)
    assert p.at_3x is not None and p.at_2x is not None and p.at_2x < p.at_3x < 0.5
    strict = check_power(CanaryCheck(metric="error_rate", tolerance=0, slack=0, min_samples=10))
    assert strict.breach_at == 1 and strict.at_2x is None
    assert strict.detects == pytest.approx(1 - 0.2 ** (1 / 10))
    # A stable release at 4% errors moves the limit to 6%: it takes more to breach.
    busy = check_power(
        CanaryCheck(metric="error_rate", tolerance=0.0, slack=0.02, min_samples=10),
        stable_rate=0.04,
    )
    assert busy.allowed_share == pytest.approx(0.06) and busy.breach_at == 3


def test_a_quantile_check_on_fewer_than_10_samples_is_refused(tmp_path: Path) -> None:
    """With `min_samples: 1` a p95 check can never breach (1 of 1 above the limit is
    p = 0.05, not below it): the manifest is refused, naming the field and the minimum.
    Rate checks may judge on fewer (one error can be evidence)."""
    from releasekit.rollout.power import check_power

    never = CanaryCheck.model_construct(
        metric="ttft_p95_s", tolerance=0.5, slack=0.05, min_samples=1, confidence=0.95
    )
    assert check_power(never).breach_at is None
    assert "can never breach" in check_power(never).words()
    data = yaml.safe_load((REPO / "manifests" / "demo-canary-good.yaml").read_text())
    for metric, n in (("ttft_p95_s", 1), ("tpot_p95_s", 9)):
        canary = {"steps": [{"weight": 5}], "checks": [{"metric": metric, "min_samples": n}]}
        with pytest.raises(ManifestError) as e:
            parse_manifest({**data, "promotion": {"canary": canary}}, path=tmp_path / "m.yaml")
        [line] = [ln for ln in str(e.value).splitlines() if "min_samples" in ln]
        assert "promotion.canary.checks[0].min_samples" in line and "at least 10" in line
    ok = {"steps": [{"weight": 5}], "checks": [{"metric": "error_rate", "min_samples": 1}]}
    parse_manifest({**data, "promotion": {"canary": ok}}, path=tmp_path / "m.yaml")


def _demo_power() -> list[list[str]]:
    from releasekit.rollout.power import policy_power

    data = yaml.safe_load((REPO / "manifests" / "demo-canary-good.yaml").read_text())
    policy = parse_manifest(data, path=REPO / "m.yaml").promotion.canary
    assert policy is not None
    return [p.cells() for p in policy_power(list(policy.checks))]


def test_the_docs_state_the_demo_checks_power_as_the_function_gives_it() -> None:
    """The progressive-delivery page's power table for the demo's canary checks is the
    function's output."""
    page = (REPO / "docs" / "concepts" / "progressive-delivery.md").read_text()
    for cells in _demo_power():
        row = "| " + " | ".join(cells) + " |"
        assert row in page, row


def test_promote_explain_prints_each_checks_power(capsys: pytest.CaptureFixture[str]) -> None:
    """`promote --explain` prints a row a check: what one judgement breaches on and detects."""
    from releasekit.cli.rollout_cmds import print_canary_power
    from releasekit.rollout.power import policy_power

    checks = [
        CanaryCheck(metric="ttft_p95_s", tolerance=0.5, slack=0.05, min_samples=20),
        CanaryCheck(metric="error_rate", tolerance=0, slack=0.02, min_samples=10),
    ]
    print_canary_power([p.model_dump(mode="json") for p in policy_power(checks)])
    text = " ".join(capsys.readouterr().out.split())
    assert "4 of 20" in text and "35%" in text and "2 of 10" in text
    assert "sustain" in text


# -- checks that were not measured are printed with why


def _scrapes(can_after: str | None, errors: dict[str, str]) -> tuple[Any, Any]:
    """Two scrapes 10 s apart: the gateway's and both vLLMs' (the canary's second one
    `can_after`, None when it did not answer)."""
    from releasekit.rollout.canary import Scrape

    gw = gateway_text({
        "can": {"ttft": [0.1] * 30, "status": {"200": 30}, "chunks": 900},
        "stb": {"ttft": [0.1] * 90, "status": {"200": 90}, "chunks": 2700},
    })  # fmt: skip
    e0 = parse_exposition(vllm_text([], [], 0, 0))
    stb = parse_exposition(vllm_text([0.01] * 90, [0.01] * 90, 90, 2700))
    can = parse_exposition(can_after) if can_after is not None else None
    before = Scrape(0.0, parse_exposition(EMPTY_GW), e0, e0, {})
    return before, Scrape(10.0, parse_exposition(gw), can, stb, errors)


def _demo_checks() -> list[CanaryCheck]:
    data = yaml.safe_load((REPO / "manifests" / "demo-canary-good.yaml").read_text())
    policy = parse_manifest(data, path=REPO / "m.yaml").promotion.canary
    assert policy is not None
    return list(policy.checks)


def test_unmeasured_checks_say_why_in_the_progress_line_and_the_step_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A canary whose vLLM /metrics timed out has no TPOT, and with no feedback sent the
    feedback check cannot be judged: both are printed with why in the progress line, next
    to the checks that were judged, and once under the step table (no step measured them)."""
    from releasekit.cli.rollout_cmds import print_canary
    from releasekit.rollout.canary import CanaryRun, StepReport, pair_windows, summarise
    from releasekit.rollout.judge import judge_step

    before, after = _scrapes(None, {"candidate": "/metrics did not answer (timed out after 5 s)"})
    j = judge_step(_demo_checks(), *pair_windows("staging", "can", "stb", before, after))
    by = {c.metric: c for c in j.checks}
    assert by["ttft_p95_s"].verdict == "pass" and by["error_rate"].verdict == "pass"
    assert by["tpot_p95_s"].verdict == "not_measured"
    assert by["negative_feedback_rate"].verdict == "not_measured"
    timed_out = (
        "tpot_p95_s not measured (no engine figures: the canary's vLLM /metrics did not "
        "answer (timed out after 5 s))"
    )
    no_feedback = (
        "negative_feedback_rate not measured (no feedback sent through the gateway yet "
        "(POST /v1/feedback))"
    )
    line = summarise(j)
    assert timed_out in line and no_feedback in line and "ttft_p95_s 0.0975 vs 0.0975 pass" in line
    step = StepReport(index=0, weight=25, status="passed", started_at=0, ended_at=40,
                      canary_requests=30, stable_requests=90, judgement=j)  # fmt: skip
    run = CanaryRun(env="staging", release_id="can", stable_release_ids=["stb"],
                    outcome="passed", steps=[step])  # fmt: skip
    print_canary(run.model_dump(mode="json"))
    text = " ".join(capsys.readouterr().out.split())
    # A check no step could measure is said once under the table, with why, not per step.
    for said in (timed_out, no_feedback):
        metric, _, why = said.partition(" not measured ")
        once = " ".join(f"{metric}: not measured in any step {why}".split())
        assert text.count(once) == 1, text
        assert text.count(f"{metric} not measured") == 0
    assert "ttft_p95_s 0.0975 vs 0.0975 pass" in text


def test_tpot_on_a_shared_server_says_so() -> None:
    """A prompt-only canary shares stable's server: TPOT is not measured, and says why."""
    from releasekit.rollout.canary import SHARED_SERVER, Scrape, pair_windows
    from releasekit.rollout.judge import judge_step

    before, after = _scrapes(None, {})
    shared = {"candidate": SHARED_SERVER, "stable": SHARED_SERVER}
    before = Scrape(before.at, before.gateway, None, None, shared)
    after = Scrape(after.at, after.gateway, None, None, shared)
    j = judge_step(_demo_checks(), *pair_windows("staging", "can", "stb", before, after))
    tpot = j.by_metric("tpot_p95_s")
    assert tpot is not None and tpot.verdict == "not_measured"
    assert tpot.brief() == f"tpot_p95_s not measured (no engine figures: {SHARED_SERVER})"


def test_the_shadow_table_prints_unmeasured_checks_with_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shadow compare` lists every check, and one that was not judged says why."""
    import releasekit.rollout.shadow as shadow_mod
    from releasekit.cli import rollout_cmds
    from releasekit.cli._common import State
    from releasekit.rollout.canary import pair_windows
    from releasekit.rollout.judge import judge_step
    from releasekit.rollout.shadow import ShadowComparison

    before, after = _scrapes(None, {"candidate": "/metrics did not answer (HTTP 503)"})
    j = judge_step(_demo_checks(), *pair_windows("staging", "can", "stb", before, after))
    cmp = ShadowComparison(env="staging", release_id="can", stable_release_id="stb",
                           verdict="pass", window_s=10, at=0.0, judgement=j)  # fmt: skip
    monkeypatch.setattr(shadow_mod, "compare_shadow", lambda *a, **k: cmp)
    monkeypatch.setattr(State, "_settings", object())
    rollout_cmds.shadow_compare_cmd(env="staging", window=10.0, json_=False)
    text = " ".join(capsys.readouterr().out.split())
    assert "not measured (no engine figures: the canary's vLLM /metrics did not answer" in text
    assert "HTTP 503" in text
    assert "not measured (no feedback sent through the gateway yet" in text
