"""Autoscaling a release's Ray replicas from its own knee (releasekit.deploy.ray.autoscale):
the per-replica target is the knee's requests in flight (from the release's verified load
test, written by the bench's own writer) times (1 - the environment's knee_headroom); a
release without usable knee evidence is refused before any gate or deploy; the policy
(range, headroom, delays) is the environment's committed one; promote, the promote event
and the KubeRay export carry the same derived config, which Ray's own models accept.

No cluster runs here: the environments point at an address nothing listens on, and
nothing in these tests connects to it."""

from __future__ import annotations

import html
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from promote_kit import Kit, commit_config, kill_everything, make_kit
from pydantic import ValidationError
from ray_kit import RayCluster, env_lines
from typer.testing import CliRunner

pytest.importorskip("ray")

from releasekit.bench.runner import BenchResult, knee_in_flight, write_evidence
from releasekit.bench.stats import LatencySummary
from releasekit.cli import app
from releasekit.cli._common import State
from releasekit.config import RayAutoscaling, load_settings
from releasekit.deploy.ray.autoscale import NoKneeEvidenceError, autoscale_plan
from releasekit.deploy.ray.target import app_name, release_app_args
from releasekit.promote.context import load_release, release_spec
from releasekit.promote.policy import PolicyError
from releasekit.promote.promote import promote
from releasekit.promote.report import render_html
from releasekit.releases.register import register_release
from releasekit.stores.ledger import Ledger
from releasekit.stores.results import ReleasePaths

NOWHERE = RayCluster(slot=9, root=Path("/nonexistent"))  # an address only: nothing runs
POLICY = (
    '{ target = "knee", knee_headroom = 0.25, min_replicas = 1, max_replicas = 2, '
    "upscale_delay_s = 10, downscale_delay_s = 30 }"
)
TEXT = (
    "autoscaling 1-2 replicas, target 12 in flight per replica = knee 16 x (1 - 0.25); "
    "up after 10 s, down after 30 s"
)


@pytest.fixture
def akit(
    project: Path, monkeypatch: pytest.MonkeyPatch, mlflow_template_db: Path, stand_in_model: Any
) -> Iterator[Kit]:
    """A deploy-test project whose environments are `ray` environments autoscaling from
    the knee (POLICY), on a cluster that does not run. The kit's builds write a load test
    whose knee is concurrency 16."""
    stand_in_model(project)
    k = make_kit(
        project,
        monkeypatch,
        mlflow_template_db,
        toml_lines=env_lines(NOWHERE, replicas=1, autoscaling=POLICY),
    )
    try:
        yield k
    finally:
        kill_everything(k.settings)


def _spec(k: Kit, rid: str) -> Any:
    led = Ledger(k.settings.ledger_url or "")
    return release_spec(k.settings, load_release(k.settings, rid, ledger=led), ledger=led)


def _bench(k: Kit, rid: str) -> tuple[Path, BenchResult]:
    folder = ReleasePaths.of(k.settings, rid).bench_dir
    return folder, BenchResult.model_validate_json((folder / "bench.json").read_bytes())


# -- the derivation -------------------------------------------------------------------


def test_the_target_is_the_knee_in_flight_times_one_minus_the_headroom(akit: Kit) -> None:
    """From the release's own bench.json (knee: concurrency 16, SLOs holding) the target
    is 16 x (1 - 0.25) = 12 in flight per replica; the promote dry run says so in one line
    (API and CLI), and the Serve options carry Ray's own fields, which Ray's
    AutoscalingConfig accepts as they are."""
    from ray.serve.config import AutoscalingConfig

    rid = akit.build("demo-bf16")
    spec = _spec(akit, rid)
    assert spec.knee is not None and spec.knee.in_flight == 16 and spec.knee.mode == "concurrency"

    res = promote(akit.settings, rid, env="staging", dry_run=True)
    assert res.autoscaling is not None and res.autoscaling.text == TEXT
    assert res.autoscaling.source == "knee" and res.autoscaling.knee_headroom == 0.25
    # The gate report carries the range and target too (JSON and its HTML page).
    assert res.report is not None and res.report.scaling == TEXT
    assert f"<b>Replicas:</b> {html.escape(TEXT)}" in render_html(res.report)

    State.reset()
    r = CliRunner().invoke(
        app, ["promote", rid[:12], "--to", "staging", "--dry-run"], env={"COLUMNS": "300"}
    )
    assert r.exit_code == 0, r.output
    assert TEXT in " ".join(r.output.split()), r.output

    cfg = akit.settings.environments["staging"]
    args = release_app_args(akit.settings, "staging", cfg, spec)
    auto = args.options["autoscaling_config"]
    assert auto == {
        "min_replicas": 1,
        "initial_replicas": 1,
        "max_replicas": 2,
        "target_ongoing_requests": 12.0,
        "upscale_delay_s": 10.0,
        "downscale_delay_s": 30.0,
        "look_back_period_s": 30.0,
        "metrics_interval_s": 10.0,
    }
    assert args.options["num_replicas"] == "auto"
    ray_cfg = AutoscalingConfig(**auto)
    assert ray_cfg.target_ongoing_requests == 12.0 and ray_cfg.upscale_delay_s == 10.0


def test_an_open_loop_knee_is_its_rate_times_its_mean_e2e(akit: Kit) -> None:
    """A rate sweep's knee (4 req/s, mean E2E 2.5 s) holds 4 x 2.5 = 10 requests in flight
    (Little's law); a sweep with no knee has none to derive from."""
    rid = akit.build("demo-bf16", register=False)
    _, bench = _bench(akit, rid)
    assert bench.knee is not None
    knee = bench.knee.model_copy(
        update={"load": 4.0, "mode": "rate", "e2e": LatencySummary(n=48, mean=2.5, p95=3.0)}
    )
    rate = bench.model_copy(update={"mode": "rate", "knee": knee})
    assert knee_in_flight(rate) == pytest.approx(10.0)
    assert knee_in_flight(bench.model_copy(update={"knee": None})) is None


# -- refusals -------------------------------------------------------------------------


def _no_bench(k: Kit, rid: str) -> None:
    (ReleasePaths.of(k.settings, rid).bench_dir / "bench.json").unlink()


def _other_release(k: Kit, rid: str) -> None:
    folder, bench = _bench(k, rid)
    write_evidence(bench.model_copy(update={"release_id": "f" * 64}), folder)


def _other_profile(k: Kit, rid: str) -> None:
    folder, bench = _bench(k, rid)
    write_evidence(bench.model_copy(update={"profile_digest": "0" * 64}), folder)


def _no_knee(k: Kit, rid: str) -> None:
    folder, bench = _bench(k, rid)
    write_evidence(
        bench.model_copy(update={"knee": None, "knee_stop": "no load met the SLOs"}), folder
    )


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        (_no_bench, "no load test"),
        (_other_release, "bench/bench.json differs from the digest"),
        (_other_profile, "another load profile"),
        (_no_knee, "has no knee (no load met the SLOs)"),
    ],
)
def test_a_release_without_usable_knee_evidence_is_refused_before_anything_runs(
    akit: Kit, spoil: Any, why: str
) -> None:
    """Missing bench, one made for another release or another load profile, or a sweep
    with no knee: promote (API, CLI) and the KubeRay export each
    refuse in one line naming what is missing and what to do, before gates run, before
    the cluster is contacted (nothing listens at its address: reaching it would be
    another error), and with nothing recorded."""
    # Registered as spoiled; another release's bench.json is refused by `register`, so that
    # one is swapped in after: the register event's digest then gives it away.
    swapped = spoil is _other_release
    rid = akit.build("demo-bf16", register=swapped)
    spoil(akit, rid)
    if not swapped:
        register_release(akit.settings, akit.manifest("demo-bf16"))
    with pytest.raises(NoKneeEvidenceError) as info:
        promote(akit.settings, rid, env="staging", reason="try")
    msg = info.value.message
    assert why in msg and "no usable knee evidence" in msg and "\n" not in msg
    assert "releasekit bench" in info.value.remedy
    assert Ledger(akit.settings.ledger_url or "").live_at("staging") is None
    reports = akit.settings.state_dir / "reports"  # no gate ran: no gate report
    assert not reports.exists() or not any(reports.iterdir())

    State.reset()
    r = CliRunner().invoke(app, ["promote", rid[:12], "--to", "staging"], env={"COLUMNS": "400"})
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert lines[0].startswith("error:") and why in lines[0], r.output

    spec = _spec(akit, rid)
    cfg = akit.settings.environments["staging"]
    with pytest.raises(NoKneeEvidenceError):
        release_app_args(akit.settings, "staging", cfg, spec)
    # A start that is not a promotion (a rollback to a release whose evidence went since)
    # is never refused for it: that release runs the environment's max_replicas, unscaled.
    assert cfg.ray is not None and cfg.ray.autoscaling is not None
    top = cfg.ray.autoscaling.max_replicas
    plan = autoscale_plan("staging", cfg.ray.autoscaling, spec, fixed_without_knee=True)
    assert plan.source == "fixed at max" and plan.min_replicas == plan.max_replicas == top
    assert why in plan.text and "autoscaling off for this release" in plan.text
    args = release_app_args(akit.settings, "staging", cfg, spec, fixed_without_knee=True)
    scaling = args.options["autoscaling_config"]
    assert scaling["min_replicas"] == scaling["max_replicas"] == scaling["initial_replicas"] == top

    State.reset()
    out = akit.root / "rayservice.yaml"
    r = CliRunner().invoke(
        app, ["export", "kuberay", rid[:12], "--env", "staging", "--out", str(out)]
    )
    assert r.exit_code == 1 and why in r.output and not out.exists(), r.output


def test_a_target_set_by_hand_needs_no_knee(akit: Kit) -> None:
    """`target_queue_depth` is the by-hand alternative: no bench needed, said so."""
    toml = akit.root / "releasekit.toml"
    toml.write_text(
        toml.read_text().replace('target = "knee", knee_headroom = 0.25', "target_queue_depth = 6")
    )
    commit_config(akit.root, "by hand")
    akit.settings = load_settings(root=akit.root)
    rid = akit.build("demo-bf16")
    _no_bench(akit, rid)
    res = promote(akit.settings, rid, env="staging", dry_run=True)
    assert res.autoscaling is not None
    assert res.autoscaling.text.startswith(
        "autoscaling 1-2 replicas, target 6 in flight per replica (target_queue_depth, set by hand)"
    )


# -- the policy -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"max_replicas": 2}, "exactly one of"),
        ({"max_replicas": 2, "target": "knee", "knee_headroom": 0.2, "target_queue_depth": 4},
         "exactly one of"),
        ({"max_replicas": 2, "target": "knee"}, "needs knee_headroom"),
        ({"max_replicas": 2, "target_queue_depth": 4, "knee_headroom": 0.2}, "only with"),
        ({"max_replicas": 2, "target": "knee", "knee_headroom": 1.0}, "less than 1"),
        ({"max_replicas": 2, "target": "knee", "knee_headroom": -0.1}, "greater than or equal"),
        ({"max_replicas": 2, "target": "p95", "knee_headroom": 0.2}, "'knee'"),
        ({"min_replicas": 3, "max_replicas": 2, "target_queue_depth": 4}, "at least min"),
        ({"max_replicas": 2, "target_queue_depth": 4, "upscale_delay_s": -1}, "greater than"),
        ({"max_replicas": 2, "target_queue_depth": 4, "cooldown": 5}, "Extra inputs"),
    ],
)  # fmt: skip
def test_an_autoscaling_policy_that_says_too_little_or_too_much_is_refused(
    fields: dict[str, Any], error: str
) -> None:
    """Exactly one of the knee (with its headroom, below 1) and a target by hand; a sane
    range; no negative delay; no unknown field."""
    with pytest.raises(ValidationError, match=error):
        RayAutoscaling.model_validate(fields)


def test_the_delays_and_headroom_are_the_committed_policy_not_one_commands(
    akit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scale-up and scale-down delays and the headroom are policy: an uncommitted edit
    or a RELEASEKIT_* variable that changes them for one command is refused naming
    `autoscaling`; committed, the new values apply."""
    rid = akit.build("demo-bf16")
    toml = akit.root / "releasekit.toml"
    committed = toml.read_text()
    toml.write_text(committed.replace("downscale_delay_s = 30", "downscale_delay_s = 1"))
    with pytest.raises(PolicyError, match="in autoscaling"):
        promote(load_settings(root=akit.root), rid, env="staging", dry_run=True)

    toml.write_text(committed)
    env = load_settings(root=akit.root).environments["staging"].model_dump(mode="json")
    env["ray"]["autoscaling"]["knee_headroom"] = 0.0
    monkeypatch.setenv("RELEASEKIT_ENVIRONMENTS", json.dumps({"staging": env}))
    lax = load_settings(root=akit.root)
    assert lax.environments["staging"].ray.autoscaling.knee_headroom == 0.0  # type: ignore[union-attr]
    with pytest.raises(PolicyError, match="in autoscaling"):
        promote(lax, rid, env="staging", dry_run=True)
    monkeypatch.delenv("RELEASEKIT_ENVIRONMENTS")

    toml.write_text(committed.replace("upscale_delay_s = 10", "upscale_delay_s = 3"))
    commit_config(akit.root, "faster scale-up")
    res = promote(load_settings(root=akit.root), rid, env="staging", dry_run=True)
    assert res.autoscaling is not None and res.autoscaling.upscale_delay_s == 3


# -- the KubeRay export ---------------------------------------------------------------


def test_the_kuberay_export_carries_the_derived_autoscaling(akit: Kit) -> None:
    """The exported serveConfigV2 (validated with Ray's own Serve schema) gives the
    release's deployment the same autoscaling_config the Ray target deploys: target 12
    from the knee, the environment's range and delays; the worker group spans the range."""
    from ray.serve.schema import ServeDeploySchema

    rid = akit.build("demo-bf16")
    out = akit.root / "rayservice.yaml"
    State.reset()
    r = CliRunner().invoke(
        app, ["export", "kuberay", rid[:12], "--env", "staging", "--out", str(out)]
    )
    assert r.exit_code == 0, r.output
    doc = yaml.safe_load(out.read_text())
    config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    schema = ServeDeploySchema.model_validate(config)
    mine = next(a for a in schema.applications if a.name == app_name("staging", rid))
    cfg = akit.settings.environments["staging"]
    shared = release_app_args(akit.settings, "staging", cfg, _spec(akit, rid))
    assert mine.args["options"]["autoscaling_config"] == shared.options["autoscaling_config"]
    assert mine.args["options"]["autoscaling_config"]["target_ongoing_requests"] == 12.0
    workers = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert (workers["minReplicas"], workers["maxReplicas"]) == (1, 2)
    assert doc["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True


# -- every scale change is visible to watch ----------------------------------------------


def test_watch_windows_read_the_fleet_pages_replica_gauge() -> None:
    """The router's fleet page ends with `releasekit:replicas` (REPLICAS_GAUGE): a watch
    window over it has a `replicas` figure, the count at the window's end; a single
    server's page (local target) has none."""
    from releasekit.deploy.ray.metrics import REPLICAS_GAUGE, merge_expositions
    from releasekit.watch.windows import METRICS, Snapshot, build_window, parse_exposition

    def fleet(pages: list[str]) -> str:  # what Router._fleet_metrics answers
        return (
            merge_expositions(pages)
            + f"# TYPE {REPLICAS_GAUGE} gauge\n{REPLICAS_GAUGE} {len(pages)}\n"
        )

    one = 'vllm:num_requests_running{model_name="demo"} 3\n'
    a = Snapshot(t=0, vllm=parse_exposition(fleet([one])))
    b = Snapshot(t=10, vllm=parse_exposition(fleet([one, one])))
    w = build_window(a, b)
    assert "replicas" in METRICS
    assert w.figures["replicas"].value == 2 and w.figures["running_requests"].value == 6
    back = build_window(b, Snapshot(t=20, vllm=parse_exposition(fleet([one]))))
    assert back.figures["replicas"].value == 1
    local = build_window(
        Snapshot(t=0, vllm=parse_exposition(one)), Snapshot(t=10, vllm=parse_exposition(one))
    )
    assert not local.figure("replicas").has_data


def test_a_release_manifest_cannot_carry_its_own_scaling(akit: Kit) -> None:
    """Neither a top-level `autoscaling` nor one under `serving` is a manifest field: the
    candidate cannot set its range, headroom or delays."""
    from releasekit.errors import ManifestError
    from releasekit.spec.manifest import load_manifest

    base = akit.manifest("demo-bf16").read_text()
    path = akit.root / "manifests" / "scaled.yaml"
    for text in (
        base + "autoscaling: {downscale_delay_s: 0}\n",
        base.replace("serving:\n", "serving:\n  autoscaling: {max_replicas: 64}\n"),
    ):
        assert text != base
        path.write_text(text)
        with pytest.raises(ManifestError, match="autoscaling"):
            load_manifest(path, root=akit.root)


def test_a_knee_from_another_core_count_is_refused_or_scaled_as_the_policy_says() -> None:
    """A knee measured on the 2-core build host does not apply to 1-CPU replicas: the
    default policy refuses it, naming both core counts; `knee_cores = "scale"` halves it and
    the plan says it was scaled."""
    from releasekit.deploy.ray.autoscale import plan_for
    from releasekit.deploy.target import KneeEvidence

    knee = KneeEvidence(
        in_flight=64, load=64, mode="concurrency", source="results/x/bench/bench.json", cores=2
    )
    base = {"target": "knee", "knee_headroom": 0.5, "max_replicas": 2}
    with pytest.raises(NoKneeEvidenceError, match=r"measured on 2 cores.*gets 1 CPU"):
        plan_for("staging", RayAutoscaling.model_validate(base), "ab" * 32, knee, replica_cpus=1)
    scaled = plan_for(
        "staging",
        RayAutoscaling.model_validate({**base, "knee_cores": "scale"}),
        "ab" * 32,
        knee,
        replica_cpus=1,
    )
    assert scaled.knee_in_flight == 32 and scaled.target_in_flight == 16
    assert "scaled from knee 64 measured on 2 cores to 1 CPU" in scaled.text
    same = plan_for("staging", RayAutoscaling.model_validate(base), "ab" * 32, knee, replica_cpus=2)
    assert same.knee_in_flight == 64 and same.knee_scaled is None
