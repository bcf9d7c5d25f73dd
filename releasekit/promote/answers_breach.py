"""A breach follows the weights: the key of what a release's answers come from
(`answers_key`), the ledger records whose live answers breached for the same weights and
prompts (`breaches_for`), and the promote gate that refuses them ("answers breach of these
weights").

A live answer comparison (a shadow's `compare`, the comparison `after_promotion`, a
`canary_aborted`, a watch `rollback`) records, next to its verdict (`evidence["answers"]`,
`AnswerVerdict.evidence()`), the key of the release whose answers it judged
(`evidence["answers_key"]`): the digest of its weights (`model`: every `model/*` input, the
chat template and the `quantisation/*` inputs), of its rendered prompts (`prompts`) and its
serving parameters (`serving`). A breach belongs to the weights and prompts, not to the
release id: the same weights repackaged with other serving parameters breach the same way,
so they are refused until forced (`--force quality` with a reason). Another prompt clears
it, because the prompt may be what broke the answers.

The gate is a pure function of the records before a decision and the candidate's lock
inputs (`breach_gate`), so a decision's verdict replays from the verified ledger.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from releasekit._support.digests import digest_obj
from releasekit.promote.gate_results import GateResult
from releasekit.stores.ledger import EventType, Ledger, LedgerRecord

GATE_NAME = "answers breach of these weights"
GATE_RULE = (
    "weights and prompts whose live answers breached are refused (`--force quality` with a reason)"
)
BREACH_TYPES = (
    EventType.SHADOW.value,
    EventType.CANARY_ABORTED.value,
    EventType.ROLLBACK.value,
)
"""The event types that record a live answer comparison."""
SHADOW_ACTIONS = ("compare", "after_promotion")
"""The `shadow` events (by their evidence's action) that judge answers."""
SHORT = 12


def _model_input(name: str) -> bool:
    return name.startswith(("model/", "adapter/", "quantisation/")) or name == "chat_template"


def answers_key(inputs: Mapping[str, str]) -> dict[str, str]:
    """What a release's answers come from, from its lock's inputs (`Lock.inputs`): `model`
    (digest of the `model/*`, `chat_template` and `quantisation/*` inputs), `prompts` (digest
    of the `prompt/*` inputs) and `serving` (the `serving` input, as it is)."""
    model = {k: v for k, v in inputs.items() if _model_input(k)}
    prompts = {k: v for k, v in inputs.items() if k.startswith("prompt/")}
    return {
        "model": digest_obj(dict(sorted(model.items()))),
        "prompts": digest_obj(dict(sorted(prompts.items()))),
        "serving": str(inputs.get("serving", "")),
    }


def breached_release(rec: LedgerRecord) -> str | None:
    """The release whose answers a comparison record judged: the one rolled back, else the
    candidate (`to_release`)."""
    return rec.from_release if rec.type == EventType.ROLLBACK.value else rec.to_release


def _answers_breach(rec: LedgerRecord) -> Mapping[str, Any] | None:
    """The record's answers key when it is an answer comparison whose verdict is a breach."""
    ev = rec.evidence if isinstance(rec.evidence, dict) else {}
    if rec.type not in BREACH_TYPES:
        return None
    if rec.type == EventType.SHADOW.value and ev.get("action") not in SHADOW_ACTIONS:
        return None
    answers, key = ev.get("answers"), ev.get("answers_key")
    if not isinstance(answers, dict) or answers.get("verdict") != "breach":
        return None
    return key if isinstance(key, dict) else None


def breaches_in(
    records: Iterable[LedgerRecord], key: Mapping[str, str], *, env: str | None = None
) -> list[LedgerRecord]:
    """The records among `records` (in `env`, None: any) whose answers breached for the
    same `model` and `prompts` as `key`, in chain order. Serving parameters do not count."""
    out = []
    for rec in records:
        if env is not None and rec.environment != env:
            continue
        got = _answers_breach(rec)
        if got is None:
            continue
        if got.get("model") == key.get("model") and got.get("prompts") == key.get("prompts"):
            out.append(rec)
    return sorted(out, key=lambda r: r.seq)


def breaches_for(
    ledger: Ledger, key: Mapping[str, str], *, env: str | None = None
) -> list[LedgerRecord]:
    """Every record of `ledger` (in `env`, None: any environment) whose live answers
    breached for the weights and prompts of `key` (`answers_key`)."""
    return breaches_in(ledger.records(environment=env, types=list(BREACH_TYPES)), key, env=env)


def _where(rec: LedgerRecord, key: Mapping[str, str]) -> str:
    rid = breached_release(rec) or "-"
    return (
        f"record {rec.seq} in {rec.environment or '-'}: release {rid[:SHORT]} breached its "
        f"answers ({rec.type}) on model {str(key.get('model', ''))[:SHORT]}"
    )


def breach_gate(records: Iterable[LedgerRecord], inputs: Mapping[str, str]) -> GateResult:
    """The "answers breach of these weights" gate of a release with lock `inputs`, over
    `records` (the ledger before the decision: a replay passes the verified records before
    the decision's seq). It fails on any breach of the same weights and prompts, in any
    environment, naming the latest."""
    key = answers_key(inputs)
    found = breaches_in(records, key)
    if not found:
        detail = f"no live answers breach of model {key['model'][:SHORT]} with these prompts"
    else:
        last = found[-1]
        detail = _where(last, key)
        if len(found) > 1:
            earlier = ", ".join(str(r.seq) for r in found[:-1])
            detail += f"; {len(found) - 1} earlier (records {earlier})"
    return GateResult(
        name=GATE_NAME,
        kind="quality",
        passed=not found,
        rule=GATE_RULE,
        detail=detail[:2000],
    )


def answers_breach_gate(ledger: Ledger, inputs: Mapping[str, str]) -> GateResult:
    """The "answers breach of these weights" gate of a release with lock `inputs`, from
    `ledger` (see `breach_gate`)."""
    return breach_gate(ledger.records(types=list(BREACH_TYPES)), inputs)
