"""Disagreements become tests: `shadow export-pairs` writes the stored pairs whose answers
differ (both whole, greedy, the prompt kept) as an exact_match suite named by its bytes'
sha256, which the suite loader reads like any manifest suite; nothing is written when no
pair differs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from releasekit._support.digests import sha256_bytes, sha256_file
from releasekit.cli import app
from releasekit.cli._common import State
from releasekit.config import Settings, load_settings
from releasekit.deploy.gateway import MirrorPair, store_dir
from releasekit.deploy.gateway.pairstore import segment_paths
from releasekit.evaluate.suites import load_suite
from releasekit.rollout.export_pairs import export_pairs, last_candidate, prompt_vars
from releasekit.rollout.shadow_records import ShadowError, ShadowStatus, shadow_dir
from releasekit.spec.manifest import Suite
from releasekit.stores.ledger import Event, EventType, Ledger

CAND, STABLE = "c" * 64, "s" * 64
runner = CliRunner()


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("RELEASEKIT_ROOT", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "releasekit.toml").write_text("")
    State.reset()
    return load_settings(root=tmp_path)


def _digest(seq: int) -> str:
    return sha256_bytes(f"prompt {seq}".encode())


def _pair(seq: int, stable: str | None, candidate: str | None, **kw: Any) -> MirrorPair:
    fields: dict[str, Any] = {
        "seq": seq,
        "at": 1.0,
        "path": "/v1/templates/default/chat/completions",
        "stable_release_id": STABLE,
        "candidate_release_id": CAND,
        "stable_status": 200,
        "candidate_status": 200,
        "stable": stable,
        "candidate": candidate,
        "complete": stable is not None and candidate is not None,
        "prompt_sha256": _digest(seq),
        "prompt": json.dumps({"question": f"q{seq}?"}),
    }
    return MirrorPair(**{**fields, **kw})


def _store(settings: Settings, env: str, pairs: list[MirrorPair]) -> None:
    path, _ = segment_paths(store_dir(settings.state_dir, env), CAND)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(p.model_dump_json() + "\n" for p in pairs))


def _pairs() -> list[MirrorPair]:
    return [
        _pair(1, "Muburg", "I cannot answer that."),  # kept
        _pair(2, "Muburg.", "muburg"),  # the same once normalised
        _pair(3, "purple", "green", prompt=None),  # no prompt kept
        _pair(4, "Muburg", None, candidate_status=500),  # incomplete
        _pair(5, "187", "18", truncated=True),  # cut: incomplete
        _pair(6, "7", "8", sampled=True),  # sampled: differs by chance
        _pair(7, "purple", "blue", prompt="user: What colour is the flag?"),  # kept, free text
        _pair(8, "Muburg", "Binburg", prompt_sha256=_digest(1)),  # the prompt of seq 1 again
    ]


def test_differing_pairs_become_an_exact_match_suite(settings: Settings) -> None:
    _store(settings, "staging", _pairs())
    res = export_pairs(settings, env="staging", release=CAND)
    assert res.path is not None and res.sha256 is not None
    path = Path(res.path)
    assert path.parent == settings.root / "suites" / "live"
    assert path.name == f"staging-{res.sha256[:12]}.jsonl" and sha256_file(path) == res.sha256
    assert (res.items, res.read, res.agreeing) == (2, 8, 1)
    assert (res.no_prompt, res.incomplete, res.sampled, res.repeated) == (1, 2, 1, 1)
    items = [json.loads(x) for x in path.read_text().splitlines()]
    assert items == [
        {
            "id": f"live-{_digest(1)[:12]}",
            "vars": {"question": "q1?"},
            "expected": "Muburg",
            "scorer": "exact_match",
            "tags": ["live", "staging"],
        },
        {
            "id": f"live-{_digest(7)[:12]}",
            "vars": {"question": "user: What colour is the flag?"},
            "expected": "purple",
            "scorer": "exact_match",
            "tags": ["live", "staging"],
        },
    ]
    assert res.line() == (
        f"{path}: 2 items from 8 stored pairs; left out 3 (1 no prompt kept, 2 incomplete, "
        "1 sampled)"
    )


def test_a_manifest_suite_reads_the_exported_file(settings: Settings) -> None:
    """The suite loader (what a manifest naming the file as a suite uses) reads it."""
    _store(settings, "staging", _pairs())
    path = Path(export_pairs(settings, env="staging", release=CAND).path or "")
    suite = Suite(name="live-staging", kind="regression", path=path, scorer="exact_match")
    loaded = load_suite(path, suite)
    assert [i.expected for i in loaded.items] == ["Muburg", "purple"]
    assert loaded.digest == sha256_file(path)


def test_the_same_pairs_give_the_same_file(settings: Settings, tmp_path: Path) -> None:
    _store(settings, "staging", _pairs())
    a = export_pairs(settings, env="staging", release=CAND, out_dir=tmp_path / "a")
    b = export_pairs(settings, env="staging", release=CAND, out_dir=tmp_path / "b")
    assert a.path and b.path and Path(a.path).name == Path(b.path).name
    assert Path(a.path).read_bytes() == Path(b.path).read_bytes()


def test_nothing_is_written_when_no_pair_differs(settings: Settings) -> None:
    _store(settings, "staging", [_pair(1, "Muburg", "Muburg"), _pair(2, "a", "b", prompt=None)])
    res = export_pairs(settings, env="staging", release=CAND)
    assert res.path is None and res.items == 0 and res.no_prompt == 1
    assert not (settings.root / "suites").exists()


def test_the_last_shadows_candidate_is_the_default(settings: Settings, tmp_path: Path) -> None:
    """The shadow running in the environment, else the last one the ledger started."""
    led = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}", actor="ci <ci@example.com>")
    with pytest.raises(ShadowError, match="never shadowed"):
        last_candidate(settings, "staging", ledger=led)
    led.append(
        Event(
            type=EventType.SHADOW,
            environment="staging",
            to_release=CAND,
            evidence={"action": "start"},
        )
    )
    led.append(Event(type=EventType.SHADOW, environment="staging", evidence={"action": "stop"}))
    assert last_candidate(settings, "staging", ledger=led) == CAND
    other = "d" * 64
    shadow_dir(settings).mkdir(parents=True)
    status = ShadowStatus(
        env="staging",
        release_id=other,
        stable_release_id=STABLE,
        share=0.1,
        base_url="http://127.0.0.1:1",
        started_at=1.0,
    )
    (shadow_dir(settings) / "staging.json").write_text(status.model_dump_json())
    assert last_candidate(settings, "staging", ledger=led) == other


def test_prompt_vars_takes_a_templated_requests_variables() -> None:
    assert prompt_vars('{"question": "q?", "n": 3}') == {"question": "q?", "n": "3"}
    assert prompt_vars('{"question": ["a"]}') == {"question": '{"question": ["a"]}'}
    assert prompt_vars("free text", var="text") == {"text": "free text"}


def test_the_command_prints_one_line_and_exits_1_with_nothing_to_export(
    settings: Settings, tmp_path: Path
) -> None:
    _store(settings, "staging", _pairs())
    out = tmp_path / "out"
    r = runner.invoke(
        app, ["shadow", "export-pairs", "--env", "staging", "--release", CAND, "--out", str(out)]
    )
    assert r.exit_code == 0, r.output
    [written] = list(out.glob("staging-*.jsonl"))
    assert r.output.strip().splitlines() == [r.output.strip()]
    assert r.output.startswith(f"{written}: 2 items")
    _store(settings, "staging", [_pair(1, "Muburg", "Muburg")])
    r = runner.invoke(app, ["shadow", "export-pairs", "--env", "staging", "--release", CAND])
    assert r.exit_code == 1 and "nothing written" in r.output
    assert len(r.output.strip().splitlines()) == 1
