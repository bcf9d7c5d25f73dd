"""Answer comparators: `exact`, `scorer` (known items, reference-free checks) and the
policy's choice of comparator."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from releasekit.config import Settings
from releasekit.config.environments import AnswerJudgeConfig
from releasekit.errors import ConfigError
from releasekit.evaluate.answer_compare import (
    ExactComparator,
    ScorerComparator,
    make_comparator,
    prompt_questions,
)
from releasekit.evaluate.answers import AnswerPolicy, ComparedRequest, judge_answers

REPO = Path(__file__).resolve().parents[1]

CAPITALS = {f"Land{i}": f"City{i}" for i in range(60)}


def _question(land: str) -> str:
    return f"What is the capital of {land}?"


@pytest.fixture
def known(tmp_path: Path) -> Path:
    """A suite-format file of known questions (scored by `contains`, as a prompt fix that
    rewords answers needs), plus one numeric and one judge-scored item."""
    lines = [
        {
            "id": f"cap-{i}",
            "vars": {"question": _question(land)},
            "expected": city,
            "scorer": "contains",
        }
        for i, (land, city) in enumerate(CAPITALS.items())
    ]
    lines.append(
        {
            "id": "num",
            "vars": {"question": "What is the lucky number of Land0?"},
            "expected": "187",
            "scorer": "numeric",
        }
    )
    lines.append({"id": "j", "vars": {"question": "Tell a story."}, "scorer": "judge"})
    path = tmp_path / "known.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _scorer(known: Path, checks: list[str] | None = None) -> ScorerComparator:
    comparator = make_comparator(
        "scorer", root=known.parent, checks=checks or ["refusal"], known_items=[known.name]
    )
    assert isinstance(comparator, ScorerComparator)
    return comparator


# ---- exact --------------------------------------------------------------------------


def test_exact_is_same_after_normalisation_else_worse_never_better() -> None:
    exact = ExactComparator()
    assert exact.compare("Muburg", '"muburg."', prompt=None) == "same"
    assert exact.compare("Muburg", "The capital is Muburg.", prompt=None) == "worse"
    assert exact.compare("wrong", "Muburg", prompt=None) == "worse"
    assert exact.identity()["kind"] == "exact"


# ---- scorer: known items ------------------------------------------------------------


def test_a_prompt_is_matched_to_its_item_in_every_form_the_gateway_keeps(known: Path) -> None:
    scorer = _scorer(known)
    q = _question("Land3")
    forms = [
        json.dumps({"question": q}, sort_keys=True),  # template variables
        f"system: You answer briefly.\nuser: Question: {q}\nAnswer:",  # rendered chat
        f"user: {q.upper()}",  # chat, other case
        q + "  ",  # completion prompt
    ]
    for prompt in forms:
        hit = scorer.known_item(prompt)
        assert hit is not None and hit.item.id == "cap-3", prompt
    assert scorer.known_item("user: What is the capital of Nowhere?") is None
    assert scorer.known_item(None) is None
    assert scorer.known_item("Tell a story.") is None  # judge-scored items are not known
    assert f"Question: {q}" in prompt_questions(forms[1])


def test_known_items_are_scored_by_their_scorer(known: Path) -> None:
    scorer = _scorer(known)
    prompt = json.dumps({"question": _question("Land1")})
    assert scorer.compare("City1", "The capital of Land1 is City1.", prompt=prompt) == "same"
    assert scorer.compare("Paris", "It is City1.", prompt=prompt) == "better"
    assert scorer.compare("City1", "Paris", prompt=prompt) == "worse"
    assert scorer.compare("Paris", "Rome", prompt=prompt) == "same"
    lucky = json.dumps({"question": "What is the lucky number of Land0?"})
    assert scorer.compare("187", "It is 187.", prompt=lucky) == "same"
    assert scorer.compare("187", "188", prompt=lucky) == "worse"


def test_a_prompt_fix_breaches_under_exact_and_passes_under_scorer(known: Path) -> None:
    """The candidate rewords every answer and is right more often than the live release."""
    pairs = []
    for seq, (land, city) in enumerate(CAPITALS.items()):
        live = city if seq % 4 else "I think Paris"  # the live release is wrong on 1 in 4
        pairs.append(
            ComparedRequest(
                seq=seq,
                reference=live,
                judged=f"The capital of {land} is {city}.",
                floor=live,
                has_floor=True,
                prompt=json.dumps({"question": _question(land)}),
            )
        )
    exact = judge_answers(pairs, AnswerPolicy(), ExactComparator())
    assert exact.verdict == "breach"
    scored = judge_answers(pairs, AnswerPolicy(comparison="scorer"), _scorer(known))
    assert scored.verdict == "pass", scored.reason
    assert scored.strata[0].better == 15 and scored.strata[0].worse == 0


# ---- scorer: reference-free checks --------------------------------------------------


def test_checks_judge_unknown_requests(known: Path) -> None:
    scorer = _scorer(known, ["refusal", "json", "number"])
    # refusing where the reference answered is worse; answering where it refused is not
    # better (nobody knows the refusal was wrong)
    assert scorer.compare("Sure: 42 apples", "I'm sorry, I cannot help.", prompt=None) == "worse"
    assert scorer.compare("I cannot help with that.", "Here: 42", prompt=None) == "same"
    assert scorer.compare('{"a": 1}', "a is 1", prompt=None) == "worse"
    assert scorer.compare("a is one", '```json\n{"a": 1}\n```', prompt=None) == "better"
    assert scorer.compare("about 42", "about forty", prompt=None) == "worse"
    assert scorer.compare("about forty", "about 42", prompt=None) == "same"
    assert scorer.compare("hello", "good day", prompt="user: unknown question") == "same"


def test_identity_names_checks_and_known_files_with_digests(known: Path) -> None:
    identity = _scorer(known, ["number", "refusal"]).identity()
    assert identity["kind"] == "scorer"
    assert identity["checks"] == ["refusal", "number"]
    (entry,) = identity["known_items"]
    assert entry["path"] == "known.jsonl"
    assert entry["sha256"] == hashlib.sha256(known.read_bytes()).hexdigest()


def test_the_demo_suites_load_as_known_items() -> None:
    scorer = make_comparator(
        "scorer",
        root=REPO,
        known_items=["pipelines/eval/core.jsonl", "pipelines/eval/regression.jsonl"],
    )
    assert isinstance(scorer, ScorerComparator) and scorer.known_questions > 0
    prompt = json.dumps({"question": "What is the capital of Pistaeland?"})
    assert scorer.compare("Muburg", "Paris", prompt=prompt) == "worse"


# ---- the policy's comparator --------------------------------------------------------


def test_make_comparator_by_kind_and_its_config_errors(tmp_path: Path) -> None:
    assert isinstance(make_comparator("exact", root=tmp_path), ExactComparator)
    with pytest.raises(ConfigError, match=r"answer_known_items: missing\.jsonl does not exist"):
        make_comparator("scorer", root=tmp_path, known_items=["missing.jsonl"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(ConfigError, match=r"answer_known_items: .*bad\.jsonl:1"):
        make_comparator("scorer", root=tmp_path, known_items=["bad.jsonl"])
    with pytest.raises(ConfigError, match="answer_checks: unknown check 'tone'"):
        make_comparator("scorer", root=tmp_path, checks=["tone"])
    with pytest.raises(ConfigError, match="needs answer_judge"):
        make_comparator("judge", root=tmp_path)
    with pytest.raises(ConfigError, match="unknown kind 'fuzzy'"):
        make_comparator("fuzzy", root=tmp_path)


def test_make_comparator_builds_the_pinned_judge(tmp_path: Path) -> None:
    config = AnswerJudgeConfig(endpoint="http://127.0.0.1:9/v1", model="judge")
    judge = make_comparator("judge", root=tmp_path, judge=config)
    assert judge.kind == "judge"
    assert judge.identity()["model"] == "judge"


# ---- files read as the policy committed them ------------------------------------------


def _git(root: Path, *args: str) -> str:
    import subprocess

    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.org",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.org",
        "PATH": "/usr/bin:/bin",
    }
    done = subprocess.run(
        ["git", "-C", str(root), *args], check=True, capture_output=True, text=True, env=env
    )
    return done.stdout.strip()


def test_known_items_are_read_as_committed_at_the_policys_commit(
    known: Path, settings_tmp: Settings
) -> None:
    """A local edit to a known-items file moves no verdict: the comparator reads the file as
    the policy's commit holds it, and a file that commit lacks is refused naming the field."""
    from releasekit.promote.answer_policy import answer_comparator

    root = settings_tmp.root
    target = root / "known.jsonl"
    target.write_bytes(known.read_bytes())
    _git(root, "init", "-q")
    _git(root, "add", "known.jsonl")
    _git(root, "commit", "-q", "-m", "policy files")
    commit = _git(root, "rev-parse", "HEAD")
    committed_sha = hashlib.sha256(target.read_bytes()).hexdigest()
    pol = {"answer_comparison": "scorer", "answer_known_items": ["known.jsonl"]}

    target.write_text(target.read_text().replace("City1", "Elsewhere"))  # a local edit
    comparator = answer_comparator(settings_tmp, pol, commit=commit)
    assert isinstance(comparator, ScorerComparator)
    (entry,) = comparator.identity()["known_items"]
    assert entry["path"] == "known.jsonl"
    assert entry["sha256"] == committed_sha
    ok = comparator.compare("City1", "City1", prompt=_question("Land1"))
    assert ok == "same"

    without = answer_comparator(settings_tmp, pol)  # no commit: the working tree, as edited
    (edited,) = without.identity()["known_items"]
    assert edited["sha256"] != committed_sha

    with pytest.raises(ConfigError) as info:
        answer_comparator(
            settings_tmp,
            {**pol, "answer_known_items": ["known.jsonl", "later.jsonl"]},
            commit=commit,
        )
    assert "answer_known_items: later.jsonl is not committed at" in str(info.value)
