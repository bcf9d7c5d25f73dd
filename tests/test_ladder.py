"""The quantisation ladder without builds: its file, the rung manifests it derives and
checks, its rules (status, stop, cost, recommendation) and its report. The ladder run on
real builds is in tests/deploy/test_ladder_real.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.config import load_settings
from releasekit.errors import LadderError, ManifestError
from releasekit.ladder.decide import cost_per_1k_good, recommend, rung_status, stop_reason
from releasekit.ladder.models import LadderResult, RungRow, SuiteDelta, TagDelta
from releasekit.ladder.report import cost_table, quality_table, tag_rows, write_outputs
from releasekit.ladder.run import prepare
from releasekit.spec.ladder import load_ladder
from releasekit.spec.lock import build_lock, read_lock
from releasekit.spec.manifest import load_manifest

REPO = Path(__file__).resolve().parents[1]
RTN = "rtn"


def _write(path: Path, data: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _ladder(project: Path, rungs: list[dict[str, object]], **extra: object) -> Path:
    return _write(
        project / "manifests" / "ladder" / "t.yaml",
        {"apiVersion": "releasekit/v1", "kind": "QuantisationLadder", **extra, "rungs": rungs},
    )


# ---- the file -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rungs", "needle"),
    [
        ([{"name": "x"}], "give either `manifest` or `quantisation`"),
        (
            [
                {
                    "name": "x",
                    "manifest": "m.yaml",
                    "quantisation": {"scheme": "W8A8", "method": "rtn"},
                }
            ],
            "not both",
        ),
        ([{"name": "x", "quantisation": {"scheme": "W3A16", "method": "rtn"}}], "scheme"),
        ([{"name": "x", "quantisation": {"scheme": "none"}}], "scheme none is the base"),
        (
            [
                {"name": "x", "quantisation": {"scheme": "W8A8", "method": "rtn"}},
                {"name": "x", "quantisation": {"scheme": "W4A16", "method": "rtn"}},
            ],
            "x repeated",
        ),
        ([], "rungs"),
    ],
)
def test_a_bad_ladder_file_is_one_clear_error(tmp_path: Path, rungs: list, needle: str) -> None:
    path = _ladder(tmp_path, rungs)
    with pytest.raises(ManifestError) as exc:
        load_ladder(path)
    assert needle in str(exc.value)
    assert "t.yaml" in str(exc.value)


def test_the_demo_ladder_file_is_valid() -> None:
    ladder = load_ladder(REPO / "manifests" / "ladder" / "demo.yaml")
    assert [r.name for r in ladder.rungs][:2] == ["demo-w8a8", "demo-w4a16"]
    assert any(r.quantisation is not None for r in ladder.rungs)


# ---- the rung manifests -------------------------------------------------------------------


def test_derived_rungs_are_written_once_and_checked_against_the_base(project: Path) -> None:
    """A recipe rung gets a manifest derived from the base (its recipe, its name, the base as
    its baseline), valid and with the base's every other input; a second prepare leaves the
    file's bytes (and so its release id) alone; a manifest rung is used as it is."""
    settings = load_settings(root=project)
    ladder = _ladder(
        project,
        [
            {"name": "demo-w8a8", "manifest": "manifests/demo-w8a8.yaml"},
            {
                "name": "t-w4-rtn",
                "quantisation": {"scheme": "W4A16", "method": "rtn", "ignore": []},
            },
        ],
    )
    base, _, rungs = prepare(settings, project / "manifests" / "demo-bf16.yaml", ladder)
    derived = project / "manifests" / "ladder" / "t" / "t-w4-rtn.yaml"
    assert [lm.path for _, lm in rungs] == [
        (project / "manifests" / "demo-w8a8.yaml").resolve(),
        derived.resolve(),
    ]
    lm = load_manifest(derived, root=project)
    assert lm.manifest.quantisation.method == "rtn" and lm.manifest.quantisation.ignore == []
    assert str(lm.manifest.eval.baseline) == "manifests/demo-bf16.yaml"
    mine, theirs = build_lock(lm).inputs, build_lock(base).inputs
    same = {k for k in mine if mine[k] == theirs.get(k)}
    assert set(mine) - same == {"quantisation/recipe", "identity"}
    first = derived.read_bytes()
    stamp = derived.stat().st_mtime_ns
    os.utime(derived, ns=(stamp - 10**9, stamp - 10**9))
    prepare(settings, project / "manifests" / "demo-bf16.yaml", ladder)
    assert derived.read_bytes() == first
    assert derived.stat().st_mtime_ns == stamp - 10**9


def test_a_rung_that_changes_more_than_its_recipe_is_refused(project: Path) -> None:
    """W8A8 with the damaged prompt changes a prompt too: a ladder compares recipes alone, so
    it is refused with the input it changed named, before anything is built."""
    settings = load_settings(root=project)
    data = yaml.safe_load((project / "manifests" / "demo-w8a8.yaml").read_text())
    data["name"] = "w8-damaged"
    data["prompts"]["user"]["file"] = "prompts/demo/user_damaged.txt"
    _write(project / "manifests" / "w8-damaged.yaml", data)
    ladder = _ladder(project, [{"name": "w8-damaged", "manifest": "manifests/w8-damaged.yaml"}])
    with pytest.raises(LadderError) as exc:
        prepare(settings, project / "manifests" / "demo-bf16.yaml", ladder)
    assert "prompt/user" in exc.value.message
    assert not (project / "results").exists() or not any((project / "results").iterdir())


def test_a_quantised_base_is_refused(project: Path) -> None:
    settings = load_settings(root=project)
    ladder = _ladder(project, [{"name": "demo-w4a16", "manifest": "manifests/demo-w4a16.yaml"}])
    with pytest.raises(LadderError, match="must be unquantised"):
        prepare(settings, project / "manifests" / "demo-w8a8.yaml", ladder)


def test_critical_is_not_part_of_the_release_id() -> None:
    """Marking a suite critical decides the ladder's stop; it changes no evidence, so the
    committed demo-bf16 release id stands."""
    lm = load_manifest(REPO / "manifests" / "demo-bf16.yaml", root=REPO)
    assert any(s.critical for s in lm.manifest.eval.suites)
    committed = read_lock(REPO / "manifests" / "demo-bf16.lock.json")
    assert build_lock(lm).release_id == committed.release_id


def test_the_cli_refuses_a_missing_ladder_file_in_one_line(project: Path) -> None:
    r = CliRunner().invoke(
        app,
        [
            "quantise",
            "ladder",
            str(project / "manifests" / "demo-bf16.yaml"),
            "--recipes",
            str(project / "nope.yaml"),
        ],
        env={"RELEASEKIT_ROOT": str(project)},
    )
    assert r.exit_code != 0
    assert "nope.yaml" in r.output and "file not found" in r.output
    assert not (project / ".releasekit" / "ladder").exists()


# ---- the rules ----------------------------------------------------------------------------


def _suite(name: str, verdict: str, *, critical: bool = False, lost: int = 0) -> SuiteDelta:
    return SuiteDelta(
        suite=name,
        critical=critical,
        verdict=verdict,
        margin=0.01,
        delta=-0.005,
        ci_low=-0.01,
        ci_high=0.002,
        lost=[f"{name}-{i}" for i in range(lost)],
    )


def _row(name: str, status: str, *, weights: int, cost: float | None, **kw: object) -> RungRow:
    return RungRow(
        name=name,
        manifest=f"manifests/{name}.yaml",
        recipe="r",
        scheme="W8A8" if status != "base" else "none",
        status=status,  # type: ignore[arg-type]
        weights_bytes=weights,
        cost_per_1k_good=cost,
        **kw,  # type: ignore[arg-type]
    )


def test_a_rung_passes_only_when_every_suite_does() -> None:
    assert rung_status([_suite("a", "non_inferior"), _suite("b", "superior")]) == "passes"
    assert rung_status([_suite("a", "non_inferior"), _suite("b", "inconclusive")]) == (
        "inconclusive"
    )
    assert rung_status([_suite("a", "inferior"), _suite("b", "superior")]) == "inferior"
    assert rung_status([_suite("a", "error_regression")]) == "inferior"
    assert rung_status([]) == "inconclusive"


def test_the_stop_names_the_critical_suite_and_its_lost_items() -> None:
    row = _row(
        "w4-bad",
        "inferior",
        weights=1,
        cost=1.0,
        suites=[_suite("facts", "inferior", critical=True, lost=7), _suite("core", "inferior")],
    )
    text = stop_reason(row)
    assert "facts (critical) inferior: 7 items lost" in text
    assert "facts-0" in text and "core" not in text


def test_cost_per_good_answer_is_price_over_good_answers_per_hour() -> None:
    assert cost_per_1k_good(3.6, 100.0, 0.5) == pytest.approx(3.6 / (100 * 3600 * 0.5) * 1000)
    assert cost_per_1k_good(None, 100.0, 0.5) is None
    assert cost_per_1k_good(1.0, 0.0, 0.5) is None


def test_the_cheapest_eligible_rung_wins_and_noise_is_a_tie() -> None:
    """Costs within the tolerance are equal: the smallest weights win. A rung measured
    clearly cheaper wins. Inferior, inconclusive and unbuilt rungs are never recommended."""
    rows = [
        _row("bf16", "base", weights=1000, cost=1.00),
        _row("w8", "passes", weights=500, cost=1.10),
        _row("w4", "passes", weights=300, cost=1.20),
        _row("w4-bad", "inferior", weights=250, cost=0.5),
        _row("w2", "not tried", weights=100, cost=None),
    ]
    pick, why = recommend(rows, tolerance=0.25)
    assert pick is not None and pick.name == "w4"
    assert "within 25%" in why and "bf16, w8 measured cheaper" in why
    rows[1] = _row("w8", "passes", weights=500, cost=0.5)
    pick, _ = recommend(rows, tolerance=0.25)
    assert pick is not None and pick.name == "w8"
    rows[2] = _row("w4", "inconclusive", weights=300, cost=0.1)
    pick, _ = recommend(rows, tolerance=0.25)
    assert pick is not None and pick.name == "w8"


def test_without_prices_the_smallest_eligible_weights_win() -> None:
    rows = [
        _row("bf16", "base", weights=1000, cost=None),
        _row("w8", "passes", weights=500, cost=None),
        _row("w4", "not servable here", weights=0, cost=None),
    ]
    pick, why = recommend(rows, tolerance=0.25)
    assert pick is not None and pick.name == "w8"
    assert "smallest weights" in why


# ---- the report ---------------------------------------------------------------------------


def _result() -> LadderResult:
    rows = [
        _row(
            "bf16",
            "base",
            weights=2_000_000,
            cost=0.01,
            memory_bytes=900_000_000,
            knee_load=64,
            knee_tokens_per_s=5000.0,
        ),
        _row(
            "w8",
            "passes",
            weights=1_000_000,
            cost=0.011,
            suites=[_suite("facts", "non_inferior", critical=True), _suite("core", "superior")],
        ),
        _row(
            "w4-bad",
            "inferior",
            weights=600_000,
            cost=0.012,
            suites=[_suite("facts", "inferior", critical=True, lost=3)],
            tags=[
                TagDelta(
                    suite="facts",
                    tag="fact/number",
                    n=480,
                    base_passed=470,
                    passed=467,
                    lost=3,
                    gained=0,
                )
            ],
        ),
        _row("w2", "not tried", weights=100, cost=None, note="below w4-bad"),
    ]
    return LadderResult(
        ladder="manifests/ladder/t.yaml",
        base="manifests/bf16.yaml",
        host="AMD EPYC (avx512)",
        unit_cost_per_hour=1.0,
        cost_tolerance=0.25,
        critical_suites=["facts"],
        rows=rows,
        stopped_at="w4-bad",
        stop_reason=stop_reason(rows[2]),
        recommended="w8",
        recommended_manifest="manifests/w8.yaml",
        recommended_release_id="ab" * 32,
        recommendation="w8: the smallest weights",
    )


def test_the_tables_say_each_rungs_cost_and_loss_in_short_cells() -> None:
    result = _result()
    cols, rows = cost_table(result)
    assert cols[:3] == ["rung", "status", "weights"]
    assert rows[1][:3] == ["w8", "recommended", "1.00 MB"]
    assert rows[2][1] == "inferior"
    assert rows[0][3] == "900 MB"
    q_cols, q_rows = quality_table(result)
    assert q_cols[:4] == ["rung", "suite", "delta [95% CI], pts", "verdict"]
    assert q_rows[0] == ["w8", "facts!", "-0.5 [-1.0, +0.2]", "ok", "0", "0"]
    assert q_rows[2] == ["w4-bad", "facts!", "-0.5 [-1.0, +0.2]", "LOSS", "3", "0"]
    assert len(q_rows) == 3  # the base and the rung not tried have no suites
    assert tag_rows(result) == [["w4-bad", "facts", "fact/number", "470/480", "467/480", "-3 +0"]]


def test_the_report_writes_json_html_and_a_png(tmp_path: Path) -> None:
    paths = write_outputs(_result(), tmp_path / "out")
    assert LadderResult.model_validate(json.loads(paths["json"].read_text())).recommended == "w8"
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = paths["html"].read_text()
    assert "Recommended: w8" in page and "stopped at w4-bad" in page
    assert "data:image/png;base64," in page


def test_a_4bit_lm_head_is_refused_as_not_servable(project: Path) -> None:
    """vLLM cannot load a packed 4-bit output layer: validate and the ladder say so before a
    build quantises it, naming the field."""
    from releasekit.spec.hostcaps import check_scheme

    settings = load_settings(root=project)
    _, _, rungs = prepare(
        settings,
        project / "manifests" / "demo-bf16.yaml",
        project / "manifests" / "ladder" / "demo.yaml",
    )
    head = dict((r.name, lm) for r, lm in rungs)["demo-w4a16-head"]
    problems = check_scheme(head, python=settings.python).problems
    assert problems and problems[0].startswith("quantisation.ignore:")
    assert "lm_head" in problems[0]


def test_calibration_rows_that_collapse_under_the_cut_are_noted() -> None:
    """Cut at 48 tokens, the demo's calibration rows are all the 49-token system prompt: the
    ladder's short-calibration rung says so (validate too); the shipped recipes say nothing."""
    from releasekit.spec.quantrecipe import calibration_notes

    short = load_manifest(
        REPO / "manifests" / "ladder" / "demo" / "demo-w4a16-short-calib.yaml", root=REPO
    )
    (note,) = calibration_notes(short)
    assert note.startswith("quantisation.calibration.max_seq_length: cut at 48 tokens")
    assert "256 calibration rows are 1 distinct sequence" in note
    for name in ("demo-w4a16", "demo-w8a8"):
        assert (
            calibration_notes(load_manifest(REPO / "manifests" / f"{name}.yaml", root=REPO)) == []
        )


def test_a_rung_whose_best_run_costs_within_the_tolerance_is_a_tie() -> None:
    """A rung whose cost is just outside the tolerance but whose best run at the knee is
    inside it ties with the cheapest (its own runs span the difference): the smallest
    weights win. Without such a run, or with a best run outside too, it does not."""
    rows = [
        _row("bf16", "base", weights=1000, cost=1.00, cost_best_run_per_1k_good=0.95),
        _row("w8", "passes", weights=500, cost=1.26, cost_best_run_per_1k_good=1.20),
    ]
    pick, why = recommend(rows, tolerance=0.25)
    assert pick is not None and pick.name == "w8"
    assert "at the knee or at its best run" in why
    rows[1] = _row("w8", "passes", weights=500, cost=1.26, cost_best_run_per_1k_good=1.26)
    pick, _ = recommend(rows, tolerance=0.25)
    assert pick is not None and pick.name == "bf16"
    rows[1] = _row("w8", "passes", weights=500, cost=1.26)
    pick, _ = recommend(rows, tolerance=0.25)
    assert pick is not None and pick.name == "bf16"
