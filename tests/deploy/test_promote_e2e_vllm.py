"""End to end on the real demo model (vLLM CPU) through the real gateway: a client streams
continuously while a prompt-only release is promoted and rolled back, and sees no failed or
cut request; a release whose server cannot start never gets traffic; --dry-run changes
nothing. One vLLM server at a time (the prompt-only release shares it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import webclient
from promote_kit import Streamer, kill_everything, make_kit

from releasekit.deploy.state import read_state
from releasekit.promote.promote import promote
from releasekit.promote.rollback import rollback
from releasekit.stores.ledger import Ledger

pytestmark = pytest.mark.slow


def test_real_vllm_promote_and_rollback_with_a_streaming_client(
    project: Path,
    demo_model: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
) -> None:
    """Real vLLM behind the real gateway: promote bf16 (absolute gates, smoke on the core
    suite), dry-run a prompt-only release (nothing changes), promote it while a client
    streams (same vLLM, no restart), fail a release with a bad engine arg (never routed),
    roll back while the client streams: no failed or cut request throughout."""
    k = make_kit(
        project,
        monkeypatch,
        mlflow_template_db,
        python=Path(sys.executable),
        smoke='{ suite = "core", max_items = 4, min_pass_rate = 0.0 }',
    )
    try:
        base = k.build("demo-bf16")
        res = promote(k.settings, base, env="staging", reason="e2e")
        assert res.status == "promoted", res.deploy
        assert res.deploy is not None and res.deploy.smoke_gateway is not None
        assert res.deploy.smoke_gateway.answered == 4
        [server] = read_state(k.settings.state_dir, "staging").servers

        (k.root / "prompts" / "demo" / "user_e2e.txt").write_text("Q: {{ question }}\nA:\n")
        k.variant("demo-bf16", "demo-e2e", {"prompts/demo/user.txt": "prompts/demo/user_e2e.txt"})
        new = k.build("demo-e2e")
        led = Ledger(k.settings.ledger_url or "")
        n_events = led.count()
        dry = promote(k.settings, new, env="staging", dry_run=True)
        assert dry.status == "dry_run" and led.count() == n_events

        k.variant(
            "demo-bf16",
            "demo-broken",
            {"enforce-eager: true": "enforce-eager: true\n    no-such-flag: 1"},
        )
        k.build("demo-broken")

        with Streamer(k.gateway("staging"), chunks=24, exact=False) as s:
            s.wait_for(2, timeout_s=120)
            up = promote(k.settings, new, env="staging", reason="prompt tweak")
            s.wait_for(2, timeout_s=120)
            broken = promote(k.settings, "manifests/demo-broken.yaml", env="staging")
            s.wait_for(2, timeout_s=120)
            back = rollback(k.settings, "staging", reason="e2e rollback")
            s.wait_for(2, timeout_s=120)
        assert up.status == "promoted" and up.deploy is not None and up.deploy.reused_server
        assert broken.status == "deploy_failed" and broken.deploy is not None
        assert broken.deploy.failed_stage == "start"
        assert back.status == "rolled_back" and back.warm and back.to_release == base
        assert s.failures == [], s.failures
        assert set(s.releases) == {base, new}  # the broken one never got a request
        [after] = read_state(k.settings.state_dir, "staging").servers
        assert after.pid == server.pid  # one vLLM all along
        r = webclient.post(
            f"{k.gateway('staging')}/v1/templates/chat/chat/completions",
            json={"variables": {"question": "What is the capital of Pistaeland?"}, "max_tokens": 8},
            timeout=60,
        )
        assert r.status_code == 200 and r.headers["x-releasekit-release"] == base
    finally:
        kill_everything(k.settings)
