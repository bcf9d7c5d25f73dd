"""Scorers, suite parsing and judge-verdict parsing: each pins one rule a user relies on."""

from __future__ import annotations

from pathlib import Path

import pytest

from releasekit.errors import EvalError, JudgeError
from releasekit.evaluate import scorers
from releasekit.evaluate.judge import chat_url, parse_verdict
from releasekit.evaluate.scorers import normalise
from releasekit.evaluate.suites import EvalItem, load_suite, parse_items
from releasekit.spec.manifest import Suite

SUITE = Suite(name="core", kind="core", path=Path("core.jsonl"), scorer="exact_match")

# ---- exact match and its normalisation ----------------------------------------------


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("Birthasdale", "Birthasdale"),
        ("  birthasdale.\n", "Birthasdale"),
        ('"Birthasdale."', "Birthasdale"),
        ("**Birthasdale**", "Birthasdale"),
        ("BIRTHASDALE!", "birthasdale"),
        ("New   York", "new york"),
        ("\u201cKaesholm\u201d", "Kaesholm"),
        ("St. Louis.", "St. Louis"),
    ],
)
def test_exact_match_ignores_case_whitespace_wrapping_and_trailing_punctuation(
    output: str, expected: str
) -> None:
    assert scorers.exact_match(output, expected).outcome == "pass"


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("Birthasdale is the capital", "Birthasdale"),
        ("The Hague", "Hague"),  # articles are part of the answer
        ("St Louis", "St. Louis"),  # inner punctuation is kept
        ("", "x"),
        ("Birthasdal", "Birthasdale"),
    ],
)
def test_exact_match_fails_on_anything_more_or_less_than_the_answer(
    output: str, expected: str
) -> None:
    s = scorers.exact_match(output, expected)
    assert s.outcome == "fail"
    assert s.score == 0.0
    assert "expected" in s.detail


def test_exact_match_accepts_any_listed_answer() -> None:
    assert scorers.exact_match("grey.", ["gray", "grey"]).outcome == "pass"
    assert scorers.exact_match("green", ["gray", "grey"]).outcome == "fail"


def test_normalise_is_idempotent() -> None:
    for text in ['"Paris."', "  A  b ", "**x**.", "'q'!", "ok"]:
        once = normalise(text)
        assert normalise(once) == once


# ---- contains, regex ---------------------------------------------------------------


def test_contains_needs_every_listed_string_case_insensitively() -> None:
    assert scorers.contains("The capital is Kaesholm.", "kaesholm").outcome == "pass"
    assert scorers.contains("red and  blue", ["RED", "and blue"]).outcome == "pass"
    s = scorers.contains("red only", ["red", "blue"])
    assert s.outcome == "fail"
    assert "blue" in s.detail


def test_regex_searches_and_anchors_demand_a_full_match() -> None:
    assert scorers.regex("answer: 42", r"\d+").outcome == "pass"
    assert scorers.regex("answer: 42", r"^\d+$").outcome == "fail"
    assert scorers.regex("YES", r"(?i)^yes$").outcome == "pass"


# ---- numeric -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("68", 68.0),
        ("The answer is 68.", 68.0),
        ("-3", -3.0),
        ("1,234.5 units", 1234.5),
        ("2e3", 2000.0),
        ("\u22127", -7.0),
        ("68 or 70", 68.0),
        ("no digits", None),
        ("W4A16", None),
    ],
)
def test_extract_number_takes_the_first_number_written(text: str, value: float | None) -> None:
    assert scorers.extract_number(text) == value


def test_numeric_passes_within_absolute_tolerance_only() -> None:
    assert scorers.numeric("68", 68).outcome == "pass"
    assert scorers.numeric("69", 68).outcome == "fail"
    assert scorers.numeric("69", 68, tolerance=1).outcome == "pass"
    assert scorers.numeric("3.14159", 3.14, tolerance=0.01).outcome == "pass"
    s = scorers.numeric("I cannot answer that.", 68)
    assert s.outcome == "fail"
    assert "no number" in s.detail


# ---- json_schema -------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"capital": {"type": "string"}, "lucky": {"type": "integer"}},
    "required": ["capital", "lucky"],
    "additionalProperties": False,
}


def test_json_schema_accepts_valid_json_even_inside_a_fence() -> None:
    assert scorers.json_schema('{"capital": "X", "lucky": 3}', SCHEMA).outcome == "pass"
    fenced = '```json\n{"capital": "X", "lucky": 3}\n```'
    assert scorers.json_schema(fenced, SCHEMA).outcome == "pass"


@pytest.mark.parametrize(
    ("output", "hint"),
    [
        ("not json", "not JSON"),
        ('{"capital": "X"}', "lucky"),
        ('{"capital": "X", "lucky": "3"}', "lucky"),
        ('{"capital": "X", "lucky": 3, "extra": 1}', "extra"),
    ],
)
def test_json_schema_fails_and_says_where(output: str, hint: str) -> None:
    s = scorers.json_schema(output, SCHEMA)
    assert s.outcome == "fail"
    assert hint in s.detail


# ---- refusal -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "I cannot answer that.",
        "i can't answer that",
        "I can\u2019t help with that.",
        "Sorry, I'm unable to help.",
        "I am sorry, but no.",
        "I do not know.",
        "As an AI, I won't.",
        "We cannot share that.",
    ],
)
def test_refusals_are_detected(text: str) -> None:
    assert scorers.is_refusal(text)
    assert scorers.refusal(text).outcome == "pass"


@pytest.mark.parametrize("text", ["Birthasdale", "68", "", "   ", "Sure! Here is a haiku."])
def test_answers_and_silence_are_not_refusals(text: str) -> None:
    assert not scorers.is_refusal(text)
    assert scorers.refusal(text).outcome == "fail"


def test_a_server_rejection_is_handled_only_for_items_that_expect_one() -> None:
    handled = scorers.rejected(400, "too long", expect_error=True)
    assert (handled.outcome, handled.score) == ("pass", 1.0)
    unexpected = scorers.rejected(400, "too long", expect_error=False)
    assert unexpected.outcome == "fail"
    assert "HTTP 400" in unexpected.detail


def test_score_output_dispatches_on_the_items_scorer() -> None:
    num = EvalItem(id="n", expected="70", scorer="numeric", tolerance=0)
    assert scorers.score_output(num, "numeric", "70").outcome == "pass"
    assert scorers.score_output(num, "numeric", "71").outcome == "fail"
    with pytest.raises(ValueError, match="judge"):
        scorers.score_output(num, "judge", "70")


# ---- suites: every bad line named by file:line ---------------------------------------


def _suite_file(tmp_path: Path, *lines: str) -> Path:
    p = tmp_path / "core.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


GOOD = '{"id": "a", "vars": {"question": "q?"}, "expected": "x"}'


def test_a_valid_suite_loads_with_its_digest(tmp_path: Path) -> None:
    p = _suite_file(tmp_path, GOOD, "", '{"id": "b", "expected": ["x", "y"], "tags": ["t"]}')
    ls = load_suite(p, SUITE)
    assert [i.id for i in ls.items] == ["a", "b"]
    assert len(ls.digest) == 64
    assert ls.items[1].scorer_for(SUITE) == "exact_match"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('{"id": "b", "vars": {"question": "q"}', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"id": "b", "expeted": "x"}', "expeted: unknown key"),
        ('{"id": "b", "vars": {"question": 3}, "expected": "x"}', "vars.question"),
        ('{"id": "b"}', "exact_match needs `expected`"),
        ('{"id": "b", "scorer": "numeric", "expected": "many"}', "numeric needs"),
        ('{"id": "b", "scorer": "regex", "expected": "(unclosed"}', "regular expression"),
        ('{"id": "b", "scorer": "json_schema"}', "json_schema needs `schema`"),
        ('{"id": "b", "scorer": "json_schema", "schema": {"type": 5}}', "not a valid JSON Schema"),
        ('{"id": "b", "scorer": "bleu", "expected": "x"}', "scorer"),
        ('{"id": "a", "expected": "x"}', "duplicate id 'a' (first on line 1)"),
    ],
)
def test_a_bad_line_is_an_eval_error_naming_file_and_line(
    tmp_path: Path, bad: str, message: str
) -> None:
    p = _suite_file(tmp_path, GOOD, bad)
    with pytest.raises(EvalError) as info:
        load_suite(p, SUITE)
    assert f"{p}:2:" in str(info.value)
    assert message in str(info.value)


def test_an_empty_suite_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(EvalError, match="no items"):
        parse_items("\n\n", path=tmp_path / "x.jsonl", suite=SUITE)


def test_a_refusal_item_needs_no_expected_answer(tmp_path: Path) -> None:
    suite = Suite(name="edge", kind="edge", path=Path("edge.jsonl"), scorer="refusal")
    items = parse_items(
        '{"id": "e1", "vars": {"question": ""}, "expect_error": true}', path=tmp_path, suite=suite
    )
    assert items[0].expect_error is True


def test_the_shipped_demo_suites_are_valid() -> None:
    """The suites under pipelines/eval load with the demo manifest's scorers."""
    root = Path(__file__).resolve().parents[1]
    sizes = {}
    for name, kind, scorer in [
        ("core", "core", "exact_match"),
        ("edge", "edge", "refusal"),
        ("regression", "regression", "exact_match"),
    ]:
        path = root / "pipelines" / "eval" / f"{name}.jsonl"
        if not path.is_file():
            pytest.skip(f"{path} not shipped yet")
        suite = Suite(name=name, kind=kind, path=path, scorer=scorer)  # type: ignore[arg-type]
        sizes[name] = len(load_suite(path, suite).items)
    assert sizes["core"] >= 200
    assert sizes["edge"] >= 50


# ---- judge verdicts ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "passed", "score"),
    [
        ('{"verdict": "pass", "score": 0.8, "reason": "close"}', True, 0.8),
        ('{"verdict": "FAIL"}', False, 0.0),
        ('```json\n{"pass": true}\n```', True, 1.0),
        ("PASS - the answer matches", True, 1.0),
        ("fail.", False, 0.0),
        ("Reasoning first.\nVERDICT: FAIL", False, 0.0),
        ("**Verdict:** pass", True, 1.0),
    ],
)
def test_judge_verdicts_in_the_documented_formats_parse(
    text: str, passed: bool, score: float
) -> None:
    v = parse_verdict(text)
    assert (v.passed, v.score) == (passed, score)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "I cannot answer that.",
        "The answer looks right to me",
        '{"verdict": "maybe"}',
        '{"verdict": "pass", "score": 7}',
        "passable",
    ],
)
def test_unparseable_judge_answers_raise_judge_error(text: str) -> None:
    with pytest.raises(JudgeError, match="unparseable"):
        parse_verdict(text)


def test_judge_endpoint_forms_all_reach_chat_completions() -> None:
    want = "http://h:1/v1/chat/completions"
    for e in ("http://h:1", "http://h:1/", "http://h:1/v1", want):
        assert chat_url(e) == want
