"""Suites of an adapter: the eval asks the adapter's model name for them (the base's for the
others), records which model answered, and the report names an adapter suite as such."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from test_eval_run import TIMEOUT_S, FakeOpenAI, model_handler, write_project

from releasekit.errors import EvalError
from releasekit.evaluate import compare, load_result, run_eval, write_outputs
from releasekit.evaluate.report import render_report
from releasekit.spec.manifest import LoadedManifest, load_manifest


def adapter_project(root: Path) -> LoadedManifest:
    """The runner tests' project with adapter `json-ad` and a suite `json` that scores it."""
    path = write_project(root)
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    data["adapters"] = [{"name": "json-ad", "path": "adapters/json", "rank": 8, "base": "0" * 64}]
    data["serving"] = {"args": {"enable-lora": True, "max-loras": 2, "max-lora-rank": 8}}
    data["eval"]["suites"].append(
        {"name": "json", "kind": "core", "path": "eval/core.jsonl", "adapter": "json-ad"}
    )
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_manifest(path, root=root)


@pytest.fixture
def lm(tmp_path: Path) -> LoadedManifest:
    return adapter_project(tmp_path / "proj")


def test_a_suite_with_an_adapter_asks_that_model_and_records_it(
    lm: LoadedManifest, tmp_path: Path
) -> None:
    with FakeOpenAI(model_handler, models=("demo", "json-ad")) as srv:
        result = run_eval(srv.base_url, "demo", lm, noise_runs=1, timeout_s=TIMEOUT_S)
    asked = [r["model"] for r in srv.requests]
    assert asked.count("json-ad") == 6  # the json suite's six items, nothing else
    assert asked.count("demo") == len(asked) - 6
    assert (result.suites["json"].model, result.suites["json"].adapter) == ("json-ad", "json-ad")
    assert (result.suites["core"].model, result.suites["core"].adapter) == ("demo", None)
    write_outputs(result, tmp_path / "eval")
    assert load_result(tmp_path / "eval") == result


def test_a_server_without_the_adapter_is_refused_before_any_request(lm: LoadedManifest) -> None:
    with (
        FakeOpenAI(model_handler, models=("demo",)) as srv,
        pytest.raises(EvalError, match="does not serve adapter\\(s\\) 'json-ad'"),
    ):
        run_eval(srv.base_url, "demo", lm, noise_runs=1, timeout_s=TIMEOUT_S)
    assert srv.requests == []


def test_the_comparison_pairs_by_suite_and_the_report_names_the_adapter(
    lm: LoadedManifest,
) -> None:
    with FakeOpenAI(model_handler, models=("demo", "json-ad")) as srv:
        result = run_eval(srv.base_url, "demo", lm, noise_runs=1, timeout_s=TIMEOUT_S)
    c = compare(result, result, lm, min_paired=1)
    assert c.suites["json"].adapter == "json-ad" and c.suites["core"].adapter is None
    assert c.suites["json"].n_paired == c.suites["core"].n_paired == 6
    md, html = render_report(c)
    assert "| json (adapter json-ad) |" in md and "| core |" in md
    assert "scores the answers of that LoRA adapter" in md
    assert "(adapter json-ad)" in html
