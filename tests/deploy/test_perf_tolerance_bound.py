"""`max_perf_tolerance` cannot let a halved goodput pass: a throughput's (higher-is-better)
ceiling of 0.5 or more is refused with one clear line, and a "*" of 0.5 or more (a bound
meant for latencies) does not reach the throughputs. Releases are promote_kit's (real files
written by the real writers, registered in a real MLflow store and SQLite ledger)."""

from __future__ import annotations

from pathlib import Path

import pytest
from promote_kit import GOODPUT_LINE, Kit, kit
from pydantic import ValidationError

from releasekit.config import EnvironmentConfig, load_settings
from releasekit.errors import ConfigError
from releasekit.promote.context import load_release
from releasekit.promote.gates import evaluate_gates
from releasekit.stores.ledger import Ledger

__all__ = ["kit"]


@pytest.mark.parametrize("metric", ["goodput", "request_throughput", "output_token_throughput"])
def test_a_throughput_tolerance_of_half_or_more_is_refused(metric: str) -> None:
    with pytest.raises(ValidationError, match=rf"{metric} = 0\.5: .*must be below 0\.5"):
        EnvironmentConfig(port=1, max_perf_tolerance={metric: 0.5})
    ok = EnvironmentConfig(port=1, max_perf_tolerance={metric: 0.49, "ttft_p95_s": 1.0})
    assert ok.tolerance_ceiling(metric) == 0.49 and ok.tolerance_ceiling("ttft_p95_s") == 1.0


def test_the_star_ceiling_for_latencies_does_not_reach_the_throughputs() -> None:
    cfg = EnvironmentConfig(port=1, max_perf_tolerance={"*": 0.9})
    assert cfg.tolerance_ceiling("tpot_p95_s") == 0.9
    assert all(
        cfg.tolerance_ceiling(m) < 0.5
        for m in ("goodput", "request_throughput", "output_token_throughput", "load")
    )
    assert EnvironmentConfig(port=1).tolerance_ceiling("request_throughput") < 0.5


def test_releasekit_toml_with_goodput_tolerance_half_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "manifests").mkdir()
    toml = tmp_path / "releasekit.toml"
    toml.write_text("[environments.staging]\nport = 8780\nmax_perf_tolerance = { goodput = 0.5 }\n")
    monkeypatch.setenv("RELEASEKIT_CONFIG", str(toml))
    with pytest.raises(ConfigError) as err:
        load_settings(root=tmp_path)
    msg = err.value.message
    assert "environments.staging.max_perf_tolerance" in msg and "goodput = 0.5" in msg, msg
    assert "goodput halves would pass" in msg and "\n" not in msg, msg


def test_a_halved_goodput_fails_at_the_widest_allowed_tolerance(kit: Kit) -> None:
    """Live goodput 8 at the knee, the candidate's 4: with the manifest asking 0.9 and the
    environment's ceilings at their widest (goodput 0.49, "*" 1.0), the gate still fails."""
    kit.build("demo-bf16")
    kit.variant(
        "demo-bf16",
        "demo-v2",
        {GOODPUT_LINE: GOODPUT_LINE.replace("0.25", "0.9"), "max-num-seqs: 32": "max-num-seqs: 16"},
    )
    kit.build("demo-v2", knee_goodput=4.0)
    led = Ledger(kit.settings.ledger_url or "")
    cand = load_release(kit.settings, kit.rids["demo-v2"], ledger=led)
    live = load_release(kit.settings, kit.rids["demo-bf16"], ledger=led)
    for tol in ({"goodput": 0.49, "*": 1.0}, {"*": 1.0}):
        policy = EnvironmentConfig(port=1, max_perf_tolerance=tol)
        rep = evaluate_gates(kit.settings, env="staging", candidate=cand, live=live, policy=policy)
        g = next(g for g in rep.gates if g.name == "goodput at the knee")
        assert not g.passed and g.candidate == 4.0, (tol, g)
        assert g.limit is not None and g.limit > 4.0 and "clamped" in g.rule, g.rule
