"""Load tests with LoRA adapters in traffic: requests spread round-robin over a base and its
adapters, the adapter sweeps (extra copies loaded and unloaded), bench.json with and
without them, and the table of what serving N adapters costs. Against the fake vLLM of
test_bench_faults, taught to list and load adapters."""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from test_bench_faults import FakeVLLM, profile

from releasekit.bench import AdapterSweep, BenchResult, load_bench, run_bench, write_evidence
from releasekit.bench.adapter_cost import (
    adapter_cost,
    adapter_cost_markdown,
    adapter_cost_text,
)
from releasekit.bench.adapter_sweep import copy_name, max_loras_of, run_adapter_sweeps
from releasekit.bench.loadgen import iter_specs
from releasekit.bench.plot import plot_sweep
from releasekit.cli.bench_cmds import adapter_table
from releasekit.errors import AdapterLoadError, BenchError


class LoraFake(FakeVLLM):
    """The fake vLLM with run-time LoRA loading: /v1/models lists the base and every adapter
    it holds (with a parent, as vLLM does); load and unload change that list."""

    def __init__(self, adapters: dict[str, str] | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.loaded: dict[str, str] = dict(adapters or {})
        self.loads: list[str] = []
        self.unloads: list[str] = []
        self.refuse: set[str] = set()
        self.app.router.routes.extend(
            [
                Route("/v1/load_lora_adapter", self._load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self._unload, methods=["POST"]),
            ]
        )

    def __enter__(self) -> LoraFake:
        super().__enter__()
        return self

    async def _models(self, request: Request) -> Response:
        data: list[dict[str, object]] = [{"id": self.model, "object": "model"}]
        data += [{"id": n, "parent": self.model, "root": p} for n, p in self.loaded.items()]
        return JSONResponse({"data": data})

    async def _load(self, request: Request) -> Response:
        body = await request.json()
        name = str(body["lora_name"])
        if name in self.refuse:
            return JSONResponse({"error": {"message": "LoRA rank too high"}}, status_code=500)
        self.loaded[name] = str(body["lora_path"])
        self.loads.append(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload(self, request: Request) -> Response:
        name = str((await request.json())["lora_name"])
        self.unloads.append(name)
        if self.loaded.pop(name, None) is None:
            return JSONResponse({"error": {"message": "not found"}}, status_code=404)
        return PlainTextResponse("Success")

    def models_sent(self) -> list[str]:
        return [str(b["model"]) for b in self.bodies]


@pytest.fixture
def lora_fake() -> Iterator[LoraFake]:
    with LoraFake({"json": "/adapters/json"}) as f:
        yield f


@pytest.fixture(autouse=True)
def lenient(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweeps' mechanics, not the cross-check (see test_bench_faults.lenient_check)."""
    monkeypatch.setattr("releasekit.bench.crosscheck.LATENCY_ABS_TOL_S", 10.0)
    monkeypatch.setattr("releasekit.bench.crosscheck.CLIENT_LAG_ABS_TOL_S", 10.0)
    monkeypatch.setattr("releasekit.bench.crosscheck.BURST_DELIVERIES_PER_TOKEN", 0.0)
    monkeypatch.setattr("releasekit.bench.crosscheck.BURSTY_SHARE_TOL", 1.0)


# --- round-robin over models ----------------------------------------------------------------


def _models_of(specs: Iterator[Any], n: int) -> list[str]:
    return [json.loads(next(specs).body)["model"] for _ in range(n)]


def test_requests_go_round_robin_over_the_models_the_same_in_every_run() -> None:
    prof = profile()
    models = ["demo", "json", "json-copy1"]
    first = _models_of(iter_specs(prof, models, key=0), 7)
    assert first == ["demo", "json", "json-copy1", "demo", "json", "json-copy1", "demo"]
    assert _models_of(iter_specs(prof, models, key=0), 7) == first
    # The prompts and lengths do not depend on the models.
    alone = [s.prompt_words for s in islice(iter_specs(prof, "demo", key=0), 5)]
    spread = [s.prompt_words for s in islice(iter_specs(prof, models, key=0), 5)]
    assert alone == spread
    assert set(_models_of(iter_specs(prof, "demo", key=0), 4)) == {"demo"}


def test_run_bench_spreads_each_points_requests_over_the_models(lora_fake: LoraFake) -> None:
    result = run_bench(
        lora_fake.base_url, ["fake", "json"], profile(points=[1, 2], requests=4), repetitions=1
    )
    sent = lora_fake.models_sent()
    assert sent[:4] == ["fake", "json", "fake", "json"]  # concurrency 1: in order
    assert sorted(sent[4:]) == ["fake", "fake", "json", "json"]
    assert result.model == "fake" and result.models == ["fake", "json"]


def test_one_model_is_recorded_as_before(lora_fake: LoraFake) -> None:
    result = run_bench(lora_fake.base_url, "fake", profile(points=[1], requests=2), repetitions=1)
    assert set(lora_fake.models_sent()) == {"fake"}
    assert result.models == []


def test_a_model_the_server_does_not_serve_is_refused(lora_fake: LoraFake) -> None:
    with pytest.raises(BenchError, match="does not serve model 'other'"):
        run_bench(lora_fake.base_url, ["fake", "other"], profile(points=[1]), repetitions=1)
    assert lora_fake.bodies == []


# --- adapter sweeps -------------------------------------------------------------------------


def test_max_loras_comes_from_the_serving_args() -> None:
    assert max_loras_of({"max-loras": "3"}) == 3
    assert max_loras_of({}) == 1  # vLLM's default
    assert max_loras_of({"max-loras": "x"}) == 1


def test_sweeps_with_1_to_max_loras_adapters_load_copies_and_unload_them(
    lora_fake: LoraFake,
) -> None:
    adapters = {"json": Path("/adapters/json")}
    sweeps = run_adapter_sweeps(
        lora_fake.base_url, "fake", adapters, profile(points=[1, 2], requests=4), max_loras=3
    )
    assert [s.adapters for s in sweeps] == [1, 2, 3]
    assert sweeps[0].models == ["fake", "json"] and sweeps[0].copies == []
    assert sweeps[1].models == ["fake", "json", copy_name("json", 1)]
    assert sweeps[2].copies == ["json-copy1", "json-copy2"]
    assert lora_fake.loads == ["json-copy1", "json-copy2"]
    assert lora_fake.loaded == {"json": "/adapters/json"}  # the copies are gone again
    sent = set(lora_fake.models_sent())
    assert sent == {"fake", "json", "json-copy1", "json-copy2"}
    for s in sweeps:
        assert s.knee is not None and s.knee.repetitions == 1
        assert s.ttft_p95_s_at_knee == s.knee.ttft.p95
        assert s.goodput_at_knee == s.knee.goodput


def test_a_release_with_as_many_adapters_as_slots_loads_no_copy(lora_fake: LoraFake) -> None:
    lora_fake.loaded["sql"] = "/adapters/sql"
    adapters = {"json": Path("/adapters/json"), "sql": Path("/adapters/sql")}
    sweeps = run_adapter_sweeps(
        lora_fake.base_url, "fake", adapters, profile(points=[1], requests=3), max_loras=2
    )
    assert [s.models for s in sweeps] == [["fake", "json"], ["fake", "json", "sql"]]
    assert lora_fake.loads == [] and lora_fake.unloads == []


def test_no_adapters_no_sweeps(lora_fake: LoraFake) -> None:
    assert run_adapter_sweeps(lora_fake.base_url, "fake", {}, profile(), max_loras=2) == []
    assert lora_fake.bodies == []


def test_a_failed_sweep_still_unloads_its_copies(lora_fake: LoraFake) -> None:
    def broken(*args: Any, **kw: Any) -> BenchResult:
        raise BenchError("no request of the sweep completed")

    with pytest.raises(BenchError, match="no request"):
        run_adapter_sweeps(
            lora_fake.base_url,
            "fake",
            {"json": Path("/adapters/json")},
            profile(),
            max_loras=2,
            bench=broken,
        )
    assert lora_fake.loaded == {"json": "/adapters/json"}


def test_a_copy_the_engine_refuses_is_an_adapter_load_error(lora_fake: LoraFake) -> None:
    lora_fake.refuse.add("json-copy1")
    with pytest.raises(AdapterLoadError, match="json-copy1: LoRA rank too high"):
        run_adapter_sweeps(
            lora_fake.base_url,
            "fake",
            {"json": Path("/adapters/json")},
            profile(points=[1], requests=2),
            max_loras=2,
        )
    assert lora_fake.loaded == {"json": "/adapters/json"}


# --- bench.json and the cost table ----------------------------------------------------------


@pytest.fixture(scope="module")
def with_sweeps() -> BenchResult:
    """A base sweep and its adapter sweeps from the fake: 1 and 2 adapters in traffic."""
    mp = pytest.MonkeyPatch()
    mp.setattr("releasekit.bench.crosscheck.LATENCY_ABS_TOL_S", 10.0)
    mp.setattr("releasekit.bench.crosscheck.CLIENT_LAG_ABS_TOL_S", 10.0)
    try:
        with LoraFake({"json": "/adapters/json"}) as f:
            prof = profile(points=[1, 2], requests=4)
            bench = run_bench(f.base_url, "fake", prof, repetitions=2)
            bench.adapters = ["json"]
            bench.adapter_sweeps = run_adapter_sweeps(
                f.base_url, "fake", {"json": Path("/adapters/json")}, prof, max_loras=2
            )
    finally:
        mp.undo()
    return bench


def test_bench_json_with_adapter_sweeps_round_trips(
    with_sweeps: BenchResult, tmp_path: Path
) -> None:
    write_evidence(with_sweeps, tmp_path)
    back = load_bench(tmp_path)
    assert back.adapters == ["json"]
    assert [s.adapters for s in back.adapter_sweeps] == [1, 2]
    assert [s.model_dump_json() for s in back.adapter_sweeps] == [
        s.model_dump_json() for s in with_sweeps.adapter_sweeps
    ]
    assert back.adapter_sweep is not None and back.adapter_sweep.adapters == 1


def test_an_older_bench_json_without_adapters_still_loads(
    with_sweeps: BenchResult, tmp_path: Path
) -> None:
    data = json.loads(with_sweeps.model_dump_json())
    for key in ("adapters", "adapter_sweeps", "models"):
        data.pop(key)
    (tmp_path / "bench.json").write_text(json.dumps(data))
    old = load_bench(tmp_path)
    assert old.adapter_sweeps == [] and old.adapters == [] and old.adapter_sweep is None
    assert adapter_cost(old) == [] and adapter_cost_text(old) == ""
    assert adapter_table(old) is None


def _sweep(k: int, knee: Any, ttft: float | None, goodput: float | None) -> AdapterSweep:
    return AdapterSweep(
        adapters=k,
        models=["demo", *[f"a{i}" for i in range(k)]],
        points=[],
        knee=knee,
        knee_stop=None if knee is not None else "c=1: TTFT p95 over its SLO",
        ttft_p95_s_at_knee=ttft,
        goodput_at_knee=goodput,
    )


def test_the_cost_table_compares_each_count_with_the_base_alone(
    with_sweeps: BenchResult,
) -> None:
    base = with_sweeps.model_copy(deep=True)
    assert base.knee is not None
    knee = base.knee.model_copy(update={"load": 4.0, "goodput": 8.0})
    knee.ttft.p95 = 0.2
    half = base.knee.model_copy(update={"load": 2.0})
    base.knee = knee
    base.adapter_sweeps = [_sweep(2, None, None, None), _sweep(1, half, 0.3, 6.0)]
    rows = adapter_cost(base)
    assert [r.adapters for r in rows] == [0, 1, 2]
    assert (rows[0].knee_load, rows[0].ttft_p95_s, rows[0].goodput) == (4.0, 0.2, 8.0)
    one = rows[1]
    assert one.knee_change == pytest.approx(-0.5)
    assert one.ttft_change == pytest.approx(0.5)
    assert one.goodput_change == pytest.approx(-0.25)
    assert rows[2].knee_load is None and rows[2].knee_stop
    text = adapter_cost_text(base)
    lines = text.splitlines()
    assert "adapters in traffic" in lines[0] and "one run each" in lines[0]
    assert lines[2].split()[:5] == ["0", "(base)", "c=4", "200", "8.00"]
    assert lines[3].split() == ["1", "c=2", "300", "6.00", "-50%", "/", "+50%", "/", "-25%"]
    assert lines[4].split() == ["2", "none", "-", "-"]
    md = adapter_cost_markdown(base)
    assert "| 1 | c=2 | 300 | 6.00 | -50% / +50% / -25% |" in md
    assert adapter_table(base) is not None


def test_the_plot_carries_the_cost_table(with_sweeps: BenchResult, tmp_path: Path) -> None:
    plot_sweep(with_sweeps, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 10_000


# --- a release's adapters, as the build's evidence stage and `bench MANIFEST` run them -------


def test_a_release_with_adapters_gets_its_sweeps_after_the_base_sweep() -> None:
    from types import SimpleNamespace

    from releasekit.bench.release import add_adapter_sweeps
    from releasekit.spec.manifest import load_manifest

    root = Path(__file__).resolve().parents[1]
    lm = load_manifest(root / "manifests" / "demo-json.yaml", root=root)
    plain = load_manifest(root / "manifests" / "demo-lora.yaml", root=root)
    prof = profile(points=[1], requests=3)
    with LoraFake({"demo-json": "/staged/json"}, model="demo") as f:
        server: Any = SimpleNamespace(
            base_url=f.base_url, adapters={"demo-json": Path("/staged/json")}
        )
        bench = run_bench(f.base_url, "demo", prof, repetitions=1)
        before = bench.model_dump_json()
        add_adapter_sweeps(bench, server, plain.manifest, prof)
        assert bench.model_dump_json() == before  # no adapters: as it was
        add_adapter_sweeps(bench, server, lm.manifest, prof)
        assert bench.adapters == ["demo-json"]
        # max-loras 2: the adapter alone, then with a copy beside it, unloaded after.
        assert [s.models for s in bench.adapter_sweeps] == [
            ["demo", "demo-json"],
            ["demo", "demo-json", "demo-json-copy1"],
        ]
        assert f.loaded == {"demo-json": "/staged/json"}
    assert bench.adapter_sweep is bench.adapter_sweeps[0]
