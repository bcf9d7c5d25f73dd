"""The environment's watch floor: a release's `watch:` may tighten the committed floor
(`watch_floor`) but not drop or loosen it; each change is reported."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from releasekit.config import Settings, load_settings
from releasekit.promote.policy import PolicyError
from releasekit.spec.lock import lock
from releasekit.stores.ledger import Event, EventType, Ledger
from releasekit.watch.rules import Rule, with_floor
from releasekit.watch.service import plan_watch

ENV = "prod"
FLOOR = """watch_floor = [
  { metric = "ttft_p95_s", max = 5.0, window_s = 60, sustain = 3 },
  { metric = "error_rate", max = 0.1, window_s = 60, sustain = 3 },
]
"""
TTFT_FLOOR = Rule(metric="ttft_p95_s", above=5.0, window_s=60, sustain=3)
ERRORS_FLOOR = Rule(metric="error_rate", above=0.1, window_s=60, sustain=3)


def test_an_empty_watch_still_gets_the_floor() -> None:
    """`watch: []`: the floor's rules are the release's rules, each one reported."""
    rules, notes = with_floor([], [TTFT_FLOOR, ERRORS_FLOOR], env=ENV)
    assert rules == [TTFT_FLOOR, ERRORS_FLOOR]
    assert len(notes) == 2 and all(n.startswith(f"clamped by {ENV}'s policy: ") for n in notes)
    assert "ttft_p95_s above 5 for 3 x 60 s windows added" in notes[0]


def test_a_looser_rule_is_clamped_and_a_stricter_one_kept() -> None:
    """A TTFT rule above 50 s over 20 windows of 10 minutes is lowered to the floor in
    each field (and says which); a stricter error-rate rule is kept as written; a relative
    rule on the floor's metric does not stand in for the absolute floor."""
    loose = Rule(metric="ttft_p95_s", above=50.0, window_s=600, sustain=20, min_requests=500)
    strict = Rule(metric="error_rate", above=0.02, window_s=15, sustain=2)
    relative = Rule(metric="ttft_p95_s", kind="relative", factor=9.0)
    floor = [TTFT_FLOOR, ERRORS_FLOOR]
    rules, notes = with_floor([loose, strict], floor, env=ENV)
    got = rules[0]
    assert (got.above, got.window_s, got.sustain, got.min_requests) == (5.0, 60, 3, 20)
    assert rules[1] == strict and len(rules) == 2
    assert notes == [
        f"clamped by {ENV}'s policy: watch rule ttft_p95_s_absolute: above 50 -> 5, "
        "sustain 20 -> 3, window_s 600 -> 60, min_requests 500 -> 20"
    ]
    rules, notes = with_floor([relative], [TTFT_FLOOR], env=ENV)
    assert rules == [relative, TTFT_FLOOR] and "added" in notes[0]


def _git(root: Path, *args: str) -> None:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "T",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "T",
        "GIT_COMMITTER_EMAIL": "t@example.com",
    }
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, env=env)


@pytest.fixture
def floored(
    project: Path, stand_in_model: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Settings, Ledger, str]]:
    """A project whose committed releasekit.toml gives `prod` a watch floor, with a
    release live there whose manifest says `watch: []`."""
    stand_in_model(project)
    (project / "releasekit.toml").write_text(
        f'[environments.{ENV}]\ntarget = "local"\nport = 27081\ngates_required = false\n' + FLOOR
    )
    _git(project, "add", "releasekit.toml")
    _git(project, "commit", "-qm", "prod's watch floor")
    monkeypatch.chdir(project)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for key in list(os.environ):
        if key.startswith("RELEASEKIT_"):
            monkeypatch.delenv(key)
    settings = load_settings(root=project)
    text = (project / "manifests" / "demo-bf16.yaml").read_text()
    text = text.replace("name: demo-bf16", "name: demo-unwatched")
    path = project / "manifests" / "demo-unwatched.yaml"
    path.write_text(text[: text.index("watch:")] + "watch: []\n")
    lk = lock(path, root=project)
    d = project / "results" / lk.release_id
    d.mkdir(parents=True)
    (d / "lock.json").write_text(lk.model_dump_json(indent=2))
    (d / "manifest.yaml").write_text(path.read_text())
    led = Ledger(settings.ledger_url or "")
    led.append(Event(type=EventType.PROMOTE, environment=ENV, to_release=lk.release_id, live=True))
    yield settings, led, lk.release_id
    led.close()


def test_the_watch_of_a_release_with_no_rules_judges_the_committed_floor(
    floored: tuple[Settings, Ledger, str],
) -> None:
    """The live release says `watch: []` and its load profile's SLOs are left out: the
    watch still judges the floor's two rules, and its notes say the floor added them."""
    settings, led, rid = floored
    plan = plan_watch(
        settings,
        ENV,
        ledger=led,
        include_slo=False,
        vllm_metrics_url="http://127.0.0.1:9/metrics",
        gateway_metrics_url="http://127.0.0.1:9/metrics",
    )
    assert plan.release_id == rid
    assert [(r.metric, r.above, r.window_s, r.sustain) for r in plan.rules] == [
        ("ttft_p95_s", 5.0, 60, 3),
        ("error_rate", 0.1, 60, 3),
    ]
    assert sum(f"clamped by {ENV}'s policy" in n for n in plan.notes) == 2, plan.notes


def test_a_floor_changed_for_one_command_is_refused(
    floored: tuple[Settings, Ledger, str],
) -> None:
    """A watch whose settings drop the committed floor (an uncommitted edit) is refused,
    naming the field."""
    settings, led, _ = floored
    envs = dict(settings.environments)
    envs[ENV] = envs[ENV].model_copy(update={"watch_floor": []})
    loose = settings.model_copy(update={"environments": envs})
    with pytest.raises(PolicyError, match="watch_floor"):
        plan_watch(
            loose,
            ENV,
            ledger=led,
            include_slo=False,
            vllm_metrics_url="http://127.0.0.1:9/metrics",
        )
