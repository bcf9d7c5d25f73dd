"""Adapters staged for an engine: verified against the lock, copied once into a
content-addressed folder, refused (naming the file) when they differ from what was locked."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from releasekit.errors import AdapterLoadError
from releasekit.serving.adapter_store import stage_adapters
from releasekit.spec.adapters import Adapter, adapter_inputs

BASE = "ab" * 32


def make_adapter(folder: Path, *, rank: int = 8, weights: bytes = b"lora-weights") -> Path:
    """A stand-in peft adapter folder (config and weights; the store reads bytes only)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16}))
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def declared(name: str, path: Path, rank: int = 8) -> Adapter:
    return Adapter(name=name, path=path, rank=rank, base=BASE)


def locked(*pairs: tuple[Adapter, Path]) -> dict[str, str]:
    """The lock inputs `releasekit lock` writes for these adapters."""
    return adapter_inputs([a for a, _ in pairs], [f for _, f in pairs])


def resolver(root: Path) -> Callable[[Path], Path]:
    return lambda p: p if p.is_absolute() else root / p


def test_staging_copies_verified_files_into_a_folder_named_by_digest(tmp_path: Path) -> None:
    src = make_adapter(tmp_path / "repo" / "adapters" / "json")
    a = declared("json-ad", Path("adapters/json"))
    inputs = locked((a, src))
    (staged,) = stage_adapters(tmp_path / "store", [a], inputs, resolver(tmp_path / "repo"))
    assert staged.name == "json-ad"
    assert staged.engine_name == f"json-ad@{staged.digest[:12]}"
    assert staged.path == tmp_path / "store" / staged.digest
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        assert (staged.path / f).read_bytes() == (src / f).read_bytes()
    # Nothing half-copied is left beside it.
    assert [p.name for p in (tmp_path / "store").iterdir()] == [staged.digest]


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (
            lambda f: (f / "adapter_model.safetensors").write_bytes(b"tampered"),
            "adapter_model.safetensors has sha256",
        ),
        (lambda f: (f / "notes.txt").write_text("extra"), "notes.txt is not in the lock"),
        (lambda f: (f / "adapter_config.json").unlink(), "adapter_config.json is missing"),
    ],
    ids=["tampered", "extra", "missing"],
)
def test_files_that_differ_from_the_lock_are_refused_with_the_file_named(
    tmp_path: Path, edit: Callable[[Path], object], named: str
) -> None:
    src = make_adapter(tmp_path / "ad")
    a = declared("json-ad", src)
    inputs = locked((a, src))
    edit(src)
    with pytest.raises(AdapterLoadError, match=named) as exc:
        stage_adapters(tmp_path / "store", [a], inputs, resolver(tmp_path))
    assert "json-ad" in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").iterdir())


def test_a_second_call_reuses_the_copy(tmp_path: Path) -> None:
    src = make_adapter(tmp_path / "ad")
    a = declared("json-ad", src)
    inputs = locked((a, src))
    (first,) = stage_adapters(tmp_path / "store", [a], inputs, resolver(tmp_path))
    stamp = (first.path / "adapter_model.safetensors").stat().st_mtime_ns
    shutil.rmtree(src)  # the verified copy is all a second call needs
    (again,) = stage_adapters(tmp_path / "store", [a], inputs, resolver(tmp_path))
    assert again == first
    assert (again.path / "adapter_model.safetensors").stat().st_mtime_ns == stamp


def test_two_versions_of_one_adapter_get_two_engine_names(tmp_path: Path) -> None:
    src = make_adapter(tmp_path / "ad", weights=b"v1")
    a = declared("json-ad", src)
    v1 = locked((a, src))
    (one,) = stage_adapters(tmp_path / "store", [a], v1, resolver(tmp_path))
    make_adapter(src, weights=b"v2")
    v2 = locked((a, src))
    (two,) = stage_adapters(tmp_path / "store", [a], v2, resolver(tmp_path))
    assert one.name == two.name == "json-ad"
    assert one.engine_name != two.engine_name and one.path != two.path
    assert (one.path / "adapter_model.safetensors").read_bytes() == b"v1"
    assert (two.path / "adapter_model.safetensors").read_bytes() == b"v2"


def test_an_adapter_the_lock_does_not_pin_is_refused(tmp_path: Path) -> None:
    src = make_adapter(tmp_path / "ad")
    a = declared("json-ad", src)
    with pytest.raises(AdapterLoadError, match="pins no adapter named json-ad"):
        stage_adapters(tmp_path / "store", [a], {}, resolver(tmp_path))
