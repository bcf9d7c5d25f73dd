"""`serving.args` checked against vLLM's own argument parser: fast tests run the in-process
checks on a table snapshot read from the installed vLLM; slow ones run the real probe."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from releasekit.config import load_settings
from releasekit.spec import engine_args
from releasekit.spec.engine_args import (
    EngineArgChecker,
    EngineArgTable,
    VllmInstall,
    engine_args_cache_dir,
    locate_vllm,
)
from releasekit.spec.manifest import load_manifest

HERE = Path(__file__).parent
REPO = HERE.parents[1]
SNAPSHOT = HERE / "vllm_table_snapshot.json"


@pytest.fixture(scope="module")
def install() -> VllmInstall:
    """The vLLM installed next to the tests (found without importing it)."""
    inst = locate_vllm(sys.executable)
    if inst is None:
        pytest.skip("vLLM is not installed for this interpreter")
    return inst


@pytest.fixture
def warm(tmp_path: Path, install: VllmInstall, monkeypatch: pytest.MonkeyPatch) -> EngineArgChecker:
    """A checker whose cache holds the snapshot table; running the probe fails the test."""
    snap = json.loads(SNAPSHOT.read_text())
    table = EngineArgTable.model_validate({**snap, "fingerprint": install.fingerprint})
    (tmp_path / install.cache_name).write_text(table.model_dump_json())

    def no_probe(*args: object, **kwargs: object) -> object:
        raise AssertionError("the warm path must not import vLLM")

    monkeypatch.setattr(engine_args, "run_probe", no_probe)
    return EngineArgChecker(python=sys.executable, cache_dir=tmp_path)


def test_a_mistyped_engine_argument_is_named_with_its_field_path(warm: EngineArgChecker) -> None:
    """`max-num-seq` is not a vLLM argument: named, with the closest real one."""
    assert warm.problems({"max-num-seq": 32}) == [
        "serving.args.max-num-seq: unknown vLLM engine argument (vLLM 0.32.0); "
        "did you mean `max-num-seqs`?"
    ]


def test_a_wrong_value_is_named_with_vllms_own_words(warm: EngineArgChecker) -> None:
    """`max-num-seqs: many` fails int() as vLLM's parser would; each bad arg is listed."""
    problems = warm.problems(
        {
            "max-num-seqs": "many",
            "gpu-memory-utilization": "0.9x",
            "kv-cache-dtype": "fp9",
            "max-model-len": "2.5K",
            "enforce-eager": 3,
            "max-num-batched-tokens": True,
        }
    )
    assert problems[0] == "serving.args.max-num-seqs: invalid int value: 'many'"
    assert problems[1] == "serving.args.gpu-memory-utilization: invalid float value: '0.9x'"
    assert problems[2].startswith("serving.args.kv-cache-dtype: invalid choice: 'fp9' (choose")
    assert problems[3].startswith("serving.args.max-model-len: invalid human_readable_int_or")
    assert (
        problems[4] == "serving.args.enforce-eager: is an on/off flag: write true or false, not 3"
    )
    assert problems[5] == "serving.args.max-num-batched-tokens: needs a value"
    assert len(problems) == 6


def test_good_values_pass_with_vllms_conversions(warm: EngineArgChecker) -> None:
    """Underscores or dashes, human-readable ints, 'auto', JSON, None for optional values,
    flags on or off: all accepted."""
    assert (
        warm.problems(
            {
                "max_num_seqs": 8,
                "max-model-len": "1k",
                "kv-cache-memory-bytes": "2G",
                "enforce-eager": True,
                "enable-prefix-caching": False,
                "no-enable-prefix-caching": True,
                "speculative-config": "None",
                "api-key": "secret",
                "gpu-memory-utilization": 0.5,
                "hf-token": True,
            }
        )
        == []
    )
    assert warm.problems({"max-model-len": "auto"}) == []


def test_false_that_silently_does_nothing_is_reported(warm: EngineArgChecker) -> None:
    """`false` leaves a flag out: on a flag that vLLM turns on by default, or on a value
    argument, that does nothing and is reported with the fix."""
    assert warm.problems({"use-tqdm-on-load": False, "max-num-seqs": False}) == [
        "serving.args.use-tqdm-on-load: false leaves --use-tqdm-on-load out, and vLLM's "
        "default is on: write `no-use-tqdm-on-load: true` to turn it off",
        "serving.args.max-num-seqs: needs a value (false leaves --max-num-seqs out: delete "
        "the line instead)",
    ]


@pytest.mark.parametrize("manifest", sorted((REPO / "manifests").glob("*.yaml")), ids=str)
def test_the_demo_manifests_serving_args_are_clean(warm: EngineArgChecker, manifest: Path) -> None:
    """Each demo manifest's serving args pass against the snapshot of vLLM's table."""
    args = load_manifest(manifest, root=REPO).manifest.serving.args
    assert args and warm.problems(args) == []


def test_no_serving_args_never_looks_for_vllm(tmp_path: Path) -> None:
    """An empty args mapping is fine without locating vLLM at all."""
    checker = EngineArgChecker(python=tmp_path / "no-such-python", cache_dir=tmp_path)
    assert checker.problems({}) == []
    assert checker._located is False


def test_without_vllm_the_check_is_skipped(tmp_path: Path) -> None:
    """An interpreter without vLLM (here: one that does not exist) skips the check."""
    checker = EngineArgChecker(python=tmp_path / "no-such-python", cache_dir=tmp_path)
    assert checker.problems({"max-num-seqs": "many"}) == []


def test_validate_says_when_it_could_not_check_engine_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a vLLM in the serving interpreter, validate passes the manifest but says the
    serving args were not checked, naming the interpreter; the CLI prints it as a note."""
    from typer.testing import CliRunner

    from releasekit.cli import app
    from releasekit.spec.validate import validate_one

    python = tmp_path / "no-such-python"
    settings = load_settings(root=REPO, python=python)
    manifest = REPO / "manifests" / "demo-bf16.yaml"
    res = validate_one(manifest, check_files_exist=False, settings=settings)
    assert res.ok and res.problems == []
    assert len(res.notes) == 1
    assert "serving.args not checked against vLLM" in res.notes[0]
    assert str(python) in res.notes[0] and "has no vLLM" in res.notes[0]

    monkeypatch.setenv("RELEASEKIT_PYTHON", str(python))
    monkeypatch.setenv("RELEASEKIT_ROOT", str(REPO))
    r = CliRunner().invoke(app, ["validate", str(manifest), "--no-files"])
    assert r.exit_code == 0, r.output
    assert "ok" in r.output and "note: serving.args not checked against vLLM" in r.output


def test_a_damaged_cache_is_rebuilt_not_trusted(
    tmp_path: Path, install: VllmInstall, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache file that is not a table is ignored: the probe runs again."""
    (tmp_path / install.cache_name).write_text("{not json")
    calls: list[object] = []

    def fake_probe(python: object, *, table: bool, pairs: list[object], timeout_s: float) -> object:
        calls.append(table)
        snap = json.loads(SNAPSHOT.read_text())
        return snap, [None] * len(pairs)

    monkeypatch.setattr(engine_args, "run_probe", fake_probe)
    checker = EngineArgChecker(python=sys.executable, cache_dir=tmp_path)
    assert checker.problems({"max-num-seqs": 4}) == []
    assert calls == [True]
    assert EngineArgTable.model_validate_json((tmp_path / install.cache_name).read_text())


# ---- slow: the real probe (imports vLLM: tens of seconds on a busy 2-core box) -------------


BAD_ARGS: dict[str, str | int | bool] = {
    "max-num-seqs": "many",
    "max-num-seq": 32,
    "compilation-config": '{"levle": 3}',
    "moe-backend": "Triton",  # vLLM lower-cases it: fine
    "enforce-eager": True,
}


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """ONE cold probe of the installed vLLM for this module (each costs a vLLM import): the
    cache folder it filled and its answers for BAD_ARGS."""
    cache = tmp_path_factory.mktemp("engine-args")
    assert not any(cache.iterdir())
    return cache, EngineArgChecker(python=sys.executable, cache_dir=cache).problems(BAD_ARGS)


@pytest.mark.slow
@pytest.mark.parallel_safe
def test_the_real_parser_names_bad_args_and_the_cache_makes_the_second_run_instant(
    probed: tuple[Path, list[str]], install: VllmInstall
) -> None:
    """Cold: one probe run reads the table and checks config-typed values with vLLM's own
    parser; warm: the same answers from the cache without the probe."""
    cache, cold = probed
    assert cold[0] == "serving.args.max-num-seqs: invalid int value: 'many'"
    assert cold[1].startswith("serving.args.max-num-seq: unknown vLLM engine argument")
    assert cold[2].startswith("serving.args.compilation-config: 1 validation error for")
    assert "levle" in cold[2]
    assert len(cold) == 3
    assert (cache / install.cache_name).is_file()

    def no_probe(*a: object, **k: object) -> object:
        raise AssertionError("the warm path must not import vLLM")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_args, "run_probe", no_probe)
        warm = EngineArgChecker(python=sys.executable, cache_dir=cache).problems(BAD_ARGS)
    assert warm == cold


@pytest.mark.slow
@pytest.mark.parallel_safe
def test_the_snapshot_still_matches_the_installed_vllm(
    probed: tuple[Path, list[str]], install: VllmInstall, tmp_path: Path
) -> None:
    """The fast tests' snapshot is what the probe of the installed vLLM read today (catches
    a stale snapshot)."""
    cache, _ = probed
    shutil.copy(cache / install.cache_name, tmp_path / install.cache_name)
    table = EngineArgChecker(python=sys.executable, cache_dir=tmp_path).table()
    assert table is not None
    real = {o.flags[0]: o for o in table.options}
    snap = EngineArgTable.model_validate_json(SNAPSHOT.read_text())
    assert snap.vllm_version == table.vllm_version
    for opt in snap.options:
        assert real[opt.flags[0]] == opt


@pytest.mark.slow
@pytest.mark.parallel_safe
def test_the_demo_manifests_validate_clean(
    probed: tuple[Path, list[str]], install: VllmInstall, tmp_path: Path
) -> None:
    """Every manifest in manifests/ passes validate, engine arguments included (checked
    against the table this module's probe read from the installed vLLM). Where this host's
    vLLM cannot serve a manifest's scheme (W4A16 without AVX-512), that is its one problem,
    named, and the test says so."""
    from releasekit.spec.hostcaps import check_scheme
    from releasekit.spec.validate import validate_many

    root = tmp_path / "proj"
    shutil.copytree(REPO / "manifests", root / "manifests")
    for sub in ("prompts", "pipelines"):
        shutil.copytree(REPO / sub, root / sub)
    settings = load_settings(root=root)
    cache_dir = engine_args_cache_dir(settings)
    cache_dir.mkdir(parents=True)
    shutil.copy(probed[0] / install.cache_name, cache_dir / install.cache_name)
    paths = sorted((root / "manifests").glob("*.yaml"))
    assert paths
    results = validate_many(paths, check_files=False, settings=settings)
    expected: list[list[str]] = []
    for p in paths:
        lm = load_manifest(p, root=root)
        host = check_scheme(lm, python=sys.executable).problems  # W4A16 without AVX-512
        for problem in host:
            print(f"\n{p.name}: not servable on this host: {problem}")
        expected.append(host)
    # Only 4-bit weights depend on the CPU (vLLM's CPU build has their GEMM for AVX-512).
    assert all("W4A16" in q for e in expected for q in e), expected
    got = [r.problems for r in results]
    assert got == expected, [r.problems for r in results]
    for p in paths:  # and each really has serving args that were checked
        assert load_manifest(p, root=root).manifest.serving.args
