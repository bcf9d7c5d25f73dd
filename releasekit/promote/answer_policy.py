"""An environment's answer comparison as its committed policy sets it: the statistical
policy (`evaluate.answers.AnswerPolicy`) and the comparator (`exact`, `scorer`, `judge`),
for a shadow, a canary's answers and the after-promotion check alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from releasekit._support.files import write_atomic
from releasekit.config import Settings
from releasekit.config.environments import AnswerJudgeConfig
from releasekit.errors import ConfigError
from releasekit.evaluate.answers import AnswerPolicy, Comparator


def answer_policy(pol: dict[str, Any], *, looks: int = 1) -> AnswerPolicy:
    """The statistical policy of an environment's policy fields (`pol`: as
    `promote.policy.environment_policy` applies them)."""
    raw_min = pol.get("answer_min_pairs")
    return AnswerPolicy(
        comparison=pol.get("answer_comparison") or "exact",
        max_excess=float(pol.get("max_excess_disagreement", 0.1)),
        max_client_share=float(pol.get("answer_max_client_share", 0.1)),
        min_pairs=int(raw_min) if raw_min is not None else None,
        looks=looks,
    )


def answer_comparator(
    settings: Settings, pol: dict[str, Any], *, commit: str | None = None
) -> Comparator:
    """The comparator an environment's policy names. A scorer's known items and a judge's
    prompt are read as committed at `commit` (the policy's own commit, `PolicySource.commit`):
    a local edit to one of them never moves a verdict. Without a commit (a policy that is not
    committed, outside git) they are read under the project root.

    Raises ConfigError naming the field when a file the policy names is not committed at
    `commit`."""
    from releasekit.evaluate.answer_compare import make_comparator

    judge = pol.get("answer_judge")
    judge_cfg = AnswerJudgeConfig.model_validate(judge) if judge is not None else None
    kind = pol.get("answer_comparison") or "exact"
    known = [str(p) for p in pol.get("answer_known_items") or []]
    root = settings.root
    if commit is not None and kind != "exact":
        files = [("answer_known_items", p) for p in known] if kind == "scorer" else []
        if kind == "judge" and judge_cfg is not None and judge_cfg.prompt is not None:
            files.append(("answer_judge.prompt", judge_cfg.prompt.as_posix()))
        root = committed_snapshot(settings, commit, files)
    return make_comparator(
        kind,
        root=root,
        checks=list(pol.get("answer_checks") or ["refusal"]),
        known_items=known,
        judge=judge_cfg,
    )


def committed_snapshot(settings: Settings, commit: str, files: list[tuple[str, str]]) -> Path:
    """A folder holding `files` ((field, path relative to the project root)) as committed at
    `commit`, laid out as in the project: `<state_dir>/policy-files/<commit>/`. Committed
    bytes never change, so a file already there is what the commit holds."""
    from releasekit.stores.anchor import read_committed_file

    snap = settings.state_dir / "policy-files" / commit
    for field, rel in files:
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ConfigError(
                f"{field}: {rel} must be a path inside the project, committed with the policy"
            )
        dest = snap / rel
        if dest.is_file():
            continue
        data = read_committed_file(settings.root, commit, rel)
        if data is None:
            raise ConfigError(
                f"{field}: {rel} is not committed at {commit[:12]}, the policy's commit; "
                "commit it with the policy (a verdict reads it as committed)"
            )
        write_atomic(dest, data)
    return snap
