"""A breach follows the weights: a live answers breach is keyed by the digest of the weights
and of the prompts, so the same weights repackaged with other serving parameters are found
by it, and another prompt is not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from releasekit.promote.answers_breach import (
    GATE_NAME,
    answers_breach_gate,
    answers_key,
    breach_gate,
    breaches_for,
)
from releasekit.spec.lock import read_lock
from releasekit.stores.ledger import Event, EventType, Ledger

MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"
V2, V21 = "a" * 64, "b" * 64


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return Ledger(f"sqlite:///{tmp_path / 'ledger.db'}", actor="ci <ci@example.com>")


def _inputs(name: str) -> dict[str, str]:
    return read_lock(MANIFESTS / f"{name}.lock.json").inputs


def _answers(verdict: str) -> dict[str, Any]:
    """An `AnswerVerdict.evidence()` as recorded (the fields the breach reads)."""
    return {"comparison": "exact", "verdict": verdict, "reason": "r", "strata": []}


def _compare(
    led: Ledger,
    inputs: dict[str, str],
    *,
    verdict: str = "breach",
    env: str = "staging",
    to: str = V2,
    action: str = "compare",
) -> int:
    rec = led.append(
        Event(
            type=EventType.SHADOW,
            environment=env,
            from_release="c" * 64,
            to_release=to,
            evidence={
                "action": action,
                "answers": _answers(verdict),
                "answers_key": answers_key(inputs),
            },
        )
    )
    return rec.seq


def test_the_same_weights_repackaged_share_the_model_and_prompts_key() -> None:
    """demo-v2-1 is demo-v2 with one serving variable changed: same model and prompts,
    other serving."""
    a, b = answers_key(_inputs("demo-v2")), answers_key(_inputs("demo-v2-1"))
    assert (a["model"], a["prompts"]) == (b["model"], b["prompts"])
    assert a["serving"] != b["serving"]
    assert a["serving"] == _inputs("demo-v2")["serving"]


def test_the_model_key_covers_weights_chat_template_and_quantisation() -> None:
    base = _inputs("demo-v2")
    for name in ("model/model.safetensors", "chat_template", "quantisation/recipe"):
        changed = {**base, name: "0" * 64}
        assert answers_key(changed)["model"] != answers_key(base)["model"], name
        assert answers_key(changed)["prompts"] == answers_key(base)["prompts"]
    other_prompt = {**base, "prompt/system": "0" * 64}
    assert answers_key(other_prompt)["prompts"] != answers_key(base)["prompts"]
    assert answers_key(other_prompt)["model"] == answers_key(base)["model"]


def test_a_shadow_breach_of_demo_v2_is_found_for_demo_v2_1(ledger: Ledger) -> None:
    seq = _compare(ledger, _inputs("demo-v2"))
    found = breaches_for(ledger, answers_key(_inputs("demo-v2-1")))
    assert [r.seq for r in found] == [seq]


def test_a_prompt_change_clears_the_breach(ledger: Ledger) -> None:
    _compare(ledger, _inputs("demo-v2"))
    reprompted = {**_inputs("demo-v2-1"), "prompt/system": "0" * 64}
    assert breaches_for(ledger, answers_key(reprompted)) == []


def test_only_breach_verdicts_of_answer_comparisons_count(ledger: Ledger) -> None:
    """A pass, an insufficient verdict, a shadow start and a comparison without a key
    (recorded before keys existed) are no breach."""
    inputs = _inputs("demo-v2")
    _compare(ledger, inputs, verdict="pass")
    _compare(ledger, inputs, verdict="insufficient")
    _compare(ledger, inputs, action="start")
    ledger.append(
        Event(
            type=EventType.SHADOW,
            environment="staging",
            to_release=V2,
            evidence={"action": "compare", "answers": _answers("breach")},
        )
    )
    assert breaches_for(ledger, answers_key(inputs)) == []


def test_every_live_comparison_kind_counts_and_env_filters(ledger: Ledger) -> None:
    """A shadow after the promotion, a canary abort and a watch rollback breach too; `env`
    keeps one environment's."""
    inputs, key = _inputs("demo-v2"), answers_key(_inputs("demo-v2"))
    ev = {"answers": _answers("breach"), "answers_key": key}
    after = _compare(ledger, inputs, action="after_promotion", env="production")
    aborted = ledger.append(
        Event(type=EventType.CANARY_ABORTED, environment="staging", to_release=V2, evidence=ev)
    ).seq
    rolled = ledger.append(
        Event(
            type=EventType.ROLLBACK,
            environment="production",
            from_release=V2,
            to_release="c" * 64,
            evidence={**ev, "trigger": "watch"},
        )
    ).seq
    assert [r.seq for r in breaches_for(ledger, key)] == [after, aborted, rolled]
    assert [r.seq for r in breaches_for(ledger, key, env="staging")] == [aborted]


def test_the_gate_names_the_record_environment_release_and_model(ledger: Ledger) -> None:
    _compare(ledger, _inputs("demo-v2"), env="production")
    seq = _compare(ledger, _inputs("demo-v2"), env="staging")
    gate = answers_breach_gate(ledger, _inputs("demo-v2-1"))
    model = answers_key(_inputs("demo-v2"))["model"][:12]
    assert gate.name == GATE_NAME and gate.kind == "quality" and not gate.passed
    assert gate.detail.startswith(f"record {seq} in staging: release {V2[:12]} ")
    assert f"model {model}" in gate.detail and "1 earlier" in gate.detail
    assert "--force quality" in gate.rule


def test_the_gate_passes_for_other_weights(ledger: Ledger) -> None:
    _compare(ledger, _inputs("demo-v2"))
    gate = answers_breach_gate(ledger, _inputs("demo-bf16"))
    assert gate.passed and gate.detail.startswith("no live answers breach")


def test_the_gate_replays_from_the_records_before_a_decision(ledger: Ledger) -> None:
    """`breach_gate` is a function of the records and the lock inputs: the records up to a
    seq give the verdict as it was then."""
    seq = _compare(ledger, _inputs("demo-v2"))
    before = [r for r in ledger.records() if r.seq < seq]
    assert breach_gate(before, _inputs("demo-v2-1")).passed
    assert not breach_gate(ledger.records(), _inputs("demo-v2-1")).passed


def test_a_watch_rollback_on_answers_is_found_as_the_watch_records_it(ledger: Ledger) -> None:
    """The watch's rollback event holds the after-promotion check's evidence under `answers`
    (its verdict, the comparison's verdict nested, the live release's key) and the key at the
    top (`watch.rollbacks`): the weights it rolled back are refused as a shadow's would be."""
    key = answers_key(_inputs("demo-v2-1"))
    check = {"verdict": "breach", "answers": _answers("breach"), "answers_key": key, "looks": 2}
    rolled = ledger.append(
        Event(
            type=EventType.ROLLBACK,
            environment="staging",
            from_release=V21,
            to_release="c" * 64,
            evidence={
                "trigger": "watch",
                "rules": ["after_promotion_answers"],
                "answers": check,
                "answers_key": check["answers_key"],
            },
        )
    ).seq
    assert [r.seq for r in breaches_for(ledger, answers_key(_inputs("demo-v2")))] == [rolled]
