"""Locks: same inputs give the same release id; any changed byte changes it; --check names it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.errors import LockMismatchError, ManifestError
from releasekit.spec import lock as lockmod

runner = CliRunner()


@pytest.fixture
def proj(project: Path, stand_in_model: Callable[[Path], Path]) -> Path:
    """The project copy with a small stand-in model folder (locking only hashes bytes)."""
    model = stand_in_model(project)
    (model / "tokenizer.json").write_text('{"model": {}}')
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return project


def _lock(proj: Path, name: str = "demo-bf16") -> dict:
    res = runner.invoke(app, ["lock", "--json", str(proj / "manifests" / f"{name}.yaml")])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_lock_twice_gives_the_same_id(proj: Path) -> None:
    first = _lock(proj)
    lock_file = proj / "manifests" / "demo-bf16.lock.json"
    before = lock_file.read_bytes()
    second = _lock(proj)
    assert first["release_id"] == second["release_id"]
    assert len(first["release_id"]) == 64
    assert lock_file.read_bytes() == before  # a no-op, not a rewrite


def test_lock_pins_every_input(proj: Path) -> None:
    _lock(proj, "demo-w4a16")
    lk = lockmod.read_lock(proj / "manifests" / "demo-w4a16.lock.json")
    keys = set(lk.inputs)
    for expected in (
        "model/config.json",
        "model/model.safetensors",
        "model/tokenizer.json",
        "chat_template",
        "prompt/system",
        "prompt/user",
        "quantisation/recipe",
        "quantisation/calibration",
        "serving",
        "eval/core",
        "eval/edge",
        "eval/regression",
        "load/profile",
    ):
        assert expected in keys
    assert all(len(v) == 64 for v in lk.inputs.values())


def test_one_prompt_byte_changes_the_id_and_check_names_it(proj: Path) -> None:
    rid = _lock(proj)["release_id"]
    user = proj / "prompts" / "demo" / "user.txt"
    user.write_bytes(user.read_bytes() + b" ")
    res = runner.invoke(app, ["lock", "--check", str(proj / "manifests" / "demo-bf16.yaml")])
    assert res.exit_code == 1
    assert "prompt/user" in res.output
    assert "model/" not in res.output
    assert _lock(proj)["release_id"] != rid


@pytest.mark.parametrize(
    "mutate, changed",
    [
        (
            lambda p: (p / "models/demo-base/model.safetensors").write_bytes(b"x"),
            "model/model.safetensors",
        ),
        (lambda p: _append(p / "pipelines/eval/core.jsonl", b"\n"), "eval/core"),
        (lambda p: _append(p / "pipelines/load/demo.yaml", b"# c\n"), "load/profile"),
        (
            lambda p: _sub(p / "manifests/demo-bf16.yaml", "max-num-seqs: 32", "max-num-seqs: 16"),
            "serving",
        ),
    ],
    ids=["weights", "suite", "load-profile", "serving-args"],
)
def test_check_names_the_changed_input(proj: Path, mutate, changed: str) -> None:  # type: ignore[no-untyped-def]
    manifest = proj / "manifests" / "demo-bf16.yaml"
    lockmod.lock(manifest)
    mutate(proj)
    with pytest.raises(LockMismatchError) as info:
        lockmod.check(manifest)
    assert info.value.changed == [changed]


def test_check_passes_when_unchanged(proj: Path) -> None:
    manifest = proj / "manifests" / "demo-bf16.yaml"
    lockmod.lock(manifest)
    assert lockmod.check(manifest).ok


def test_provenance_is_recorded_but_not_hashed(proj: Path) -> None:
    manifest = proj / "manifests" / "demo-bf16.yaml"
    first = lockmod.lock(manifest)
    assert first.provenance.commit and first.provenance.dirty is not None
    # Commit the lock: same inputs, new commit -> same release.
    subprocess.run(["git", "add", "-A"], cwd=proj, check=True)
    subprocess.run(["git", "commit", "-qm", "lock"], cwd=proj, check=True)
    manifest.write_text(manifest.read_text().replace("Demo fact", "The demo fact"))
    again = lockmod.lock(manifest)
    assert again.release_id == first.release_id
    assert again.provenance.commit != first.provenance.commit


def test_manifest_description_is_not_part_of_the_release(proj: Path) -> None:
    manifest = proj / "manifests" / "demo-bf16.yaml"
    rid = lockmod.lock(manifest).release_id
    manifest.write_text(manifest.read_text().replace("unquantised (bf16)", "bf16 baseline"))
    assert lockmod.lock(manifest).release_id == rid


def test_missing_model_fails_before_writing(proj: Path) -> None:
    manifest = proj / "manifests" / "demo-bf16.yaml"
    import shutil

    shutil.rmtree(proj / "models" / "demo-base")
    with pytest.raises(ManifestError) as info:
        lockmod.lock(manifest)
    assert any(p.startswith("model.source: folder not found") for p in info.value.problems)
    assert not (proj / "manifests" / "demo-bf16.lock.json").exists()
    res = runner.invoke(app, ["lock", str(manifest)])
    assert res.exit_code == 1 and "Traceback" not in res.output


def _append(p: Path, data: bytes) -> None:
    p.write_bytes(p.read_bytes() + data)


def _sub(p: Path, old: str, new: str) -> None:
    text = p.read_text()
    assert old in text
    p.write_text(text.replace(old, new))


def test_plain_chat_through_the_templates_is_part_of_the_release(proj: Path) -> None:
    """`prompts.plain_chat: template` is locked (a release of its own, its answers key
    differs: the breach gate tells the two apart); `as_sent`, the default, keeps the id; a
    user template that leaves the client's message no single placeholder is refused by
    lock and by validate, naming the field, before anything is written."""
    from releasekit.promote.answers_breach import answers_key

    manifest = proj / "manifests" / "demo-bf16.yaml"
    first = lockmod.lock(manifest)
    _sub(
        manifest,
        "    file: prompts/demo/user.txt\n",
        "    file: prompts/demo/user.txt\n  plain_chat: as_sent\n",
    )
    assert lockmod.lock(manifest).release_id == first.release_id
    _sub(manifest, "plain_chat: as_sent", "plain_chat: template")
    fixed = lockmod.lock(manifest)
    assert fixed.release_id != first.release_id and "prompt/plain_chat" in fixed.inputs
    assert answers_key(fixed.inputs)["prompts"] != answers_key(first.inputs)["prompts"]
    assert answers_key(fixed.inputs)["model"] == answers_key(first.inputs)["model"]

    lock_file = proj / "manifests" / "demo-bf16.lock.json"
    before = lock_file.read_bytes()
    (proj / "prompts" / "demo" / "user.txt").write_text("{{ question }} ({{ tone }})\n")
    with pytest.raises(ManifestError) as info:
        lockmod.lock(manifest)
    assert any("prompts.plain_chat" in p and "tone" in p for p in info.value.problems)
    assert lock_file.read_bytes() == before
    res = runner.invoke(app, ["validate", str(manifest)])
    assert res.exit_code == 1 and "prompts.plain_chat" in res.output, res.output
