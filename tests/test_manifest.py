"""Manifest validation: every problem reported at once with its field path, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.errors import ManifestError
from releasekit.spec.manifest import load_manifest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "manifests").glob("*.yaml"))
runner = CliRunner()


def _write(tmp_path: Path, data: object, name: str = "m.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return p


def _demo_data() -> dict:
    return yaml.safe_load((REPO / "manifests" / "demo-bf16.yaml").read_text())


def test_example_manifests_cover_the_demo_variants() -> None:
    names = {p.stem for p in EXAMPLES}
    assert {"demo-bf16", "demo-w8a8", "demo-w4a16", "demo-damaged-prompt"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_manifest_schema_is_valid(path: Path) -> None:
    lm = load_manifest(path, root=REPO)
    assert lm.manifest.api_version == "releasekit/v1"


@pytest.mark.slow  # the first run reads vLLM's engine-argument parser (imports vLLM)
@pytest.mark.parallel_safe
def test_validate_cli_accepts_examples_when_files_exist() -> None:
    """The demo manifests validate clean, engine arguments included."""
    if not (REPO / "models" / "demo-base" / "config.json").is_file():
        pytest.skip("demo model not trained yet (dvc repro demo-model)")
    res = runner.invoke(app, ["validate", *map(str, EXAMPLES)])
    if "avx512f" not in Path("/proc/cpuinfo").read_text():
        # vLLM's CPU build has no 4-bit GEMM without AVX-512: that one release is refused.
        assert res.exit_code == 1
        assert "demo-w4a16.yaml: quantisation.scheme: W4A16 cannot be served" in res.output
        return
    assert res.exit_code == 0, res.output


def test_two_mistakes_are_both_reported_with_field_paths(tmp_path: Path) -> None:
    data = _demo_data()
    data["quantisation"] = {"scheme": "W3A16"}  # not a scheme
    data["serving"]["argz"] = {}  # typo of args
    p = _write(tmp_path, data)
    res = runner.invoke(app, ["validate", "--no-files", str(p)])
    assert res.exit_code == 1
    assert "quantisation.scheme" in res.output
    assert "serving.argz: unknown key" in res.output
    assert f"{p}: " in res.output
    assert "Traceback" not in res.output


def test_nested_list_errors_name_the_index(tmp_path: Path) -> None:
    data = _demo_data()
    data["eval"]["suites"][1]["scorer"] = "vibes"
    data["eval"]["suites"][2].pop("path")
    with pytest.raises(ManifestError) as info:
        load_manifest(_write(tmp_path, data))
    problems = info.value.problems
    assert any(p.startswith("eval.suites[1].scorer:") for p in problems)
    assert any(p.startswith("eval.suites[2].path: required field is missing") for p in problems)


def test_missing_files_are_problems_not_crashes(tmp_path: Path) -> None:
    data = _demo_data()
    data["prompts"]["user"]["file"] = "prompts/nope.txt"
    p = _write(tmp_path, data)
    res = runner.invoke(app, ["validate", str(p)])
    assert res.exit_code == 1
    assert "prompts.user.file: file not found: prompts/nope.txt" in res.output


def test_malformed_yaml_is_one_clear_line(tmp_path: Path) -> None:
    p = _write(tmp_path, "apiVersion: releasekit/v1\nname: [unclosed\n")
    res = runner.invoke(app, ["validate", str(p)])
    assert res.exit_code == 1
    assert "not valid YAML" in res.output and "line" in res.output
    assert "Traceback" not in res.output


def test_wrong_api_version_is_rejected(tmp_path: Path) -> None:
    data = _demo_data()
    data["apiVersion"] = "releasekit/v0"
    with pytest.raises(ManifestError) as info:
        load_manifest(_write(tmp_path, data))
    assert any(p.startswith("apiVersion:") for p in info.value.problems)


def test_gptq_without_calibration_is_an_error(tmp_path: Path) -> None:
    data = _demo_data()
    data["quantisation"] = {"scheme": "W4A16", "method": "gptq"}
    with pytest.raises(ManifestError) as info:
        load_manifest(_write(tmp_path, data))
    assert any("calibration" in p for p in info.value.problems)


def test_serving_args_may_not_override_owned_flags(tmp_path: Path) -> None:
    data = _demo_data()
    data["serving"]["args"]["port"] = 9000
    with pytest.raises(ManifestError) as info:
        load_manifest(_write(tmp_path, data))
    assert any(p.startswith("serving.args:") and "port" in p for p in info.value.problems)


def test_defaults_fill_what_users_expect(tmp_path: Path) -> None:
    data = _demo_data()
    del data["quantisation"], data["gates"], data["watch"]
    m = load_manifest(_write(tmp_path, data)).manifest
    assert m.quantisation.scheme == "none"
    assert [e.name for e in m.environments] == ["staging", "production"]
    assert m.served_name == "demo"


def _gate_problems(tmp_path: Path, gates: list[dict]) -> list[str]:
    from releasekit.spec.manifest import check_gates

    data = _demo_data()
    data["gates"] = gates
    return check_gates(load_manifest(_write(tmp_path, data), root=REPO).manifest)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_demo_manifests_have_no_gate_line_that_decides_nothing(path: Path) -> None:
    from releasekit.spec.manifest import check_gates

    assert check_gates(load_manifest(path, root=REPO).manifest) == []


def test_gate_lines_that_decide_nothing_are_rejected_naming_the_field_that_decides(
    tmp_path: Path,
) -> None:
    """A relative line on an eval suite is never read (the suite's margin decides); a
    min/max line without a threshold does nothing; a field the kind ignores, an unknown
    metric, a suite the manifest lacks and a repeated line are each one problem."""
    problems = _gate_problems(
        tmp_path,
        [
            {"metric": "eval.core.pass_rate", "kind": "non_inferior"},
            {"metric": "eval.edge.pass_rate", "kind": "min"},
            {"metric": "bench.knee.ttft_p95_s", "kind": "max"},
            {"metric": "bench.knee.goodput", "kind": "non_inferior", "threshold": 3.0},
            {"metric": "eval.core.pass_rate", "kind": "min", "threshold": 0.9, "margin": 0.1},
            {"metric": "eval.nosuch.pass_rate", "kind": "min", "threshold": 0.9},
            {"metric": "latency.p95", "kind": "max", "threshold": 1.0},
            {"metric": "bench.knee.ttft_p95_s", "kind": "max_increase", "margin": 0.2},
            {"metric": "bench.knee.ttft_p95_s", "kind": "non_inferior", "margin": 0.9},
        ],
    )
    by_index = {int(p.split("]")[0].removeprefix("gates[")): p for p in problems}
    assert sorted(by_index) == [0, 1, 2, 3, 4, 5, 6, 8], problems  # 7 is the one that decides
    assert "never read" in by_index[0] and "eval.suites[0].margin" in by_index[0]
    assert "max_margin" in by_index[0] and "min_pass_rate" in by_index[0]
    assert "does nothing without a threshold" in by_index[1]
    assert "does nothing without a threshold" in by_index[2]
    assert "reads margin" in by_index[3] and "not threshold" in by_index[3]
    assert "reads threshold, not margin" in by_index[4]
    assert "'nosuch'" in by_index[5]
    assert "never read" in by_index[6]
    assert "gates[7] already sets" in by_index[8]


def test_validate_rejects_a_gate_line_that_decides_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`validate` reports the gate lines with the manifest's other problems (the engine
    argument check, which imports vLLM, is not what this test is about)."""
    from releasekit.spec import validate as validate_mod
    from releasekit.spec.engine_args import ServingArgCheck

    monkeypatch.setattr(validate_mod, "check_serving_args", lambda lm, settings: ServingArgCheck())
    data = _demo_data()
    data["gates"] = [{"metric": "eval.core.pass_rate", "kind": "non_inferior"}]
    res = validate_mod.validate_one(_write(tmp_path, data), check_files_exist=False)
    assert not res.ok
    assert res.problems[0].startswith(
        "gates[0]: {metric: eval.core.pass_rate, kind: non_inferior} is never read"
    )


def test_a_weight_recipe_field_the_scheme_cannot_take_is_one_line(tmp_path: Path) -> None:
    """`validate` names the recipe field and why, in one line: W8A8's int8 kernels take
    per-channel weight scales, so a group size is refused (and the scheme, a known one, is
    not reported)."""
    data = yaml.safe_load((REPO / "manifests" / "demo-w8a8.yaml").read_text())
    data["quantisation"]["group_size"] = 64
    p = _write(tmp_path, data)
    res = runner.invoke(app, ["validate", "--no-files", str(p)])
    assert res.exit_code == 1
    lines = [ln for ln in res.output.splitlines() if "quantisation" in ln]
    assert len(lines) == 1, res.output
    assert "quantisation.group_size: W8A8 takes per-channel weight scales" in lines[0]
    assert "Traceback" not in res.output
