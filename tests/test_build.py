"""The build pipeline: per-manifest DVC stages in dvc.yaml (others' stages kept), `releasekit
build` runs them through DVC, a second build does nothing and says so, and an interrupted
build leaves no vLLM process behind."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import webclient
import yaml
from demo_builds import USES_DEMO_BUILDS, DemoBuilds, command_env, marked_processes

from releasekit.build.dvc import _producers
from releasekit.build.pipeline import _input_paths, build, chain, plan, update_dvc_yaml
from releasekit.build.stages import run_stage
from releasekit.config import Settings
from releasekit.errors import BuildError
from releasekit.spec.manifest import load_manifest

BIN = Path(sys.executable).parent

FOREIGN = """\
# The demo model's training (owned by another part of the project).
stages:
  demo-data:
    cmd: python pipelines/demo/make_data.py
    outs:
      - pipelines/data/train.jsonl
  demo-model:
    cmd: python pipelines/demo/train.py --out models/demo-base  # keep this comment
    deps:
      - pipelines/data/train.jsonl
    outs:
      - models/demo-base
"""

TINY_PROFILE = """\
name: tiny
seed: 7
api: completions
prompt_tokens: {dist: fixed, value: 8}
output_tokens: {dist: fixed, value: 8}
ignore_eos: true
warmup_requests: 1
request_timeout_s: 60
sweep: {mode: concurrency, points: [1, 2], requests_per_point: 4}
slo: {ttft_s: 10.0, tpot_s: 2.0, attainment: 0.5, max_error_rate: 0.5}
"""

BASE = """\
apiVersion: releasekit/v1
kind: Deployment
name: {name}
model: {{source: models/demo-base, dtype: bfloat16, served_name: demo}}
quantisation: {quantisation}
prompts:
  system: {{file: prompts/demo/system.txt}}
  user: {{file: prompts/demo/user.txt}}
serving:
  args: {{max-model-len: 512, max-num-seqs: 8, enforce-eager: true}}
  env: {{VLLM_CPU_KVCACHE_SPACE: "1"}}
eval:
  suites:
    - {{name: core, kind: core, path: pipelines/eval/tiny-core.jsonl, scorer: exact_match}}
    - {{name: edge, kind: edge, path: pipelines/eval/tiny-edge.jsonl, scorer: refusal}}
{baseline}load: {{profile: pipelines/load/tiny.yaml}}
"""

W8A8 = (
    "{scheme: W8A8, method: gptq, calibration: "
    "{dataset: pipelines/data/calibration.jsonl, samples: 16, max_seq_length: 64}}"
)

StandIn = Callable[[Path], Path]


def tiny_manifests(project: Path) -> None:
    """t-base (bf16) and t-w8 (GPTQ W8A8, baseline t-base) with a few eval items and a
    small load profile, so a full build takes a few vLLM starts, not minutes of traffic."""
    ev = project / "pipelines" / "eval"
    for suite, n in (("core", 6), ("edge", 3)):
        lines = (ev / f"{suite}.jsonl").read_text().splitlines()[:n]
        (ev / f"tiny-{suite}.jsonl").write_text("\n".join(lines) + "\n")
    (project / "pipelines" / "load" / "tiny.yaml").write_text(TINY_PROFILE)
    (project / "manifests" / "t-base.yaml").write_text(
        BASE.format(name="t-base", quantisation="{scheme: none}", baseline="")
    )
    (project / "manifests" / "t-w8.yaml").write_text(
        BASE.format(name="t-w8", quantisation=W8A8, baseline="  baseline: manifests/t-base.yaml\n")
    )


@pytest.fixture
def settings(project: Path, settings_tmp: Settings) -> Settings:
    """Settings rooted at the project copy."""
    return settings_tmp.model_copy(
        update={
            "root": project,
            "results_dir": project / "results",
            "state_dir": project / ".releasekit",
        }
    )


# ---- fast: dvc.yaml ----------------------------------------------------------------------


def test_stages_for_a_release_and_its_baseline_keep_foreign_stages(
    project: Path, settings: Settings, stand_in_model: StandIn
) -> None:
    """dvc.yaml gets quantise/evidence/report for t-w8 and quantise/evidence for its
    baseline (bench and eval share one stage, so one vLLM start); the demo model's stages
    and their comments stay; rewriting is a no-op."""
    stand_in_model(project)
    tiny_manifests(project)
    (project / "dvc.yaml").write_text(FOREIGN)
    planned = plan(settings, project / "manifests" / "t-w8.yaml")
    releases = chain(planned)
    assert [p.lm.manifest.name for p in releases] == ["t-w8", "t-base"]
    assert update_dvc_yaml(settings, releases) is True

    text = (project / "dvc.yaml").read_text()
    assert text.startswith(FOREIGN.splitlines()[0])
    assert "# keep this comment" in text
    stages = yaml.safe_load(text)["stages"]
    assert list(stages) == [
        "demo-data",
        "demo-model",
        "t-w8-quantise",
        "t-w8-evidence",
        "t-w8-report",
        "t-base-quantise",
        "t-base-evidence",
    ]
    rid, bid = planned.lock.release_id, releases[1].lock.release_id
    q = stages["t-w8-quantise"]
    assert q["cmd"] == f"releasekit stage quantise manifests/t-w8.yaml --release {rid}"
    assert q["deps"] == ["models/demo-base", "pipelines/data/calibration.jsonl"]
    assert f"results/{rid}/model" in q["outs"]
    assert "models/demo-base" not in stages["t-w8-evidence"]["deps"]  # serves the quantised one
    assert f"results/{rid}/model" in stages["t-w8-evidence"]["deps"]
    assert {f"results/{rid}/bench", f"results/{rid}/eval"} <= set(stages["t-w8-evidence"]["outs"])
    assert "models/demo-base" in stages["t-base-evidence"]["deps"]  # scheme none: the source
    assert f"results/{bid}/eval" in stages["t-w8-report"]["deps"]
    assert stages["t-w8-report"]["cmd"].endswith(f"--baseline {bid}")
    assert "t-base-report" not in stages  # no baseline, no report

    assert update_dvc_yaml(settings, releases) is False  # deterministic


def test_dropping_the_baseline_drops_the_report_stage(
    project: Path, settings: Settings, stand_in_model: StandIn
) -> None:
    """A stage the manifest no longer has is removed; others' stages are untouched."""
    stand_in_model(project)
    tiny_manifests(project)
    (project / "dvc.yaml").write_text(FOREIGN)
    w8 = project / "manifests" / "t-w8.yaml"
    update_dvc_yaml(settings, chain(plan(settings, w8)))
    w8.write_text(w8.read_text().replace("  baseline: manifests/t-base.yaml\n", ""))
    update_dvc_yaml(settings, chain(plan(settings, w8)))
    stages = yaml.safe_load((project / "dvc.yaml").read_text())["stages"]
    assert "t-w8-report" not in stages
    assert {"demo-data", "demo-model", "t-w8-evidence"} <= set(stages)


def test_a_foreign_stage_with_our_name_is_not_overwritten(
    project: Path, settings: Settings, stand_in_model: StandIn
) -> None:
    """A stage named like ours but not run by releasekit is an error, not overwritten."""
    stand_in_model(project)
    tiny_manifests(project)
    (project / "dvc.yaml").write_text("stages:\n  t-base-evidence:\n    cmd: make eval\n")
    with pytest.raises(BuildError, match="not a releasekit stage"):
        update_dvc_yaml(settings, [plan(settings, project / "manifests" / "t-base.yaml")])


def test_inputs_made_by_other_stages_are_found(
    project: Path, settings: Settings, stand_in_model: StandIn
) -> None:
    """The demo model's training stage is found as the producer of models/demo-base, so a
    build makes it (in a fresh clone) before locking."""
    stand_in_model(project)
    (project / "dvc.yaml").write_text(FOREIGN)
    lm = load_manifest(project / "manifests" / "demo-w4a16.yaml", root=project)
    assert _producers(settings, _input_paths(lm)) == ["demo-model"]


def test_stage_refuses_a_release_id_the_manifest_no_longer_locks_to(
    project: Path, settings: Settings, stand_in_model: StandIn
) -> None:
    """A stale dvc.yaml stage fails loudly instead of writing results under the wrong id."""
    stand_in_model(project)
    tiny_manifests(project)
    manifest = project / "manifests" / "t-base.yaml"
    planned = plan(settings, manifest)
    with pytest.raises(BuildError, match="but this stage is for 000000000000"):
        run_stage(settings, "quantise", manifest, release_id="0" * 64)
    (project / "prompts" / "demo" / "user.txt").write_text("changed {{ question }}\n")
    with pytest.raises(BuildError, match=r"inputs changed since dvc\.yaml was written"):
        run_stage(settings, "quantise", manifest, release_id=planned.lock.release_id)
    assert not settings.results_dir.exists()


def test_stage_command_reports_a_stale_stage_as_one_error_line(
    project: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch, stand_in_model: StandIn
) -> None:
    """`releasekit stage` (what dvc.yaml runs): a bad release id is an error, exit 1."""
    from typer.testing import CliRunner

    from releasekit.cli import app

    stand_in_model(project)
    tiny_manifests(project)
    plan(settings, project / "manifests" / "t-base.yaml")  # locks it
    monkeypatch.chdir(project)
    res = CliRunner().invoke(
        app, ["stage", "bench", "manifests/t-base.yaml", "--release", "f" * 64]
    )
    assert res.exit_code == 1
    assert "but this stage is for ffffffffffff" in res.output
    assert "hint: run `releasekit build MANIFEST`" in res.output


def test_results_outside_the_project_are_refused(
    project: Path, settings: Settings, tmp_path: Path
) -> None:
    """DVC outputs must live in the repository."""
    outside = settings.model_copy(update={"results_dir": tmp_path / "elsewhere"})
    with pytest.raises(BuildError, match="outside the project"):
        build(outside, project / "manifests" / "demo-bf16.yaml", register=False)


# ---- slow: real builds -------------------------------------------------------------------


def _releasekit(project: Path, mark: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "releasekit"), *args],
        cwd=project,
        env=command_env(mark),
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
@USES_DEMO_BUILDS
def test_build_quantises_benches_evaluates_reports_then_does_nothing(
    demo_builds: DemoBuilds,
) -> None:
    """Cold (the session's build of the demo releases, `demo_builds`): the baseline's bench
    and eval are built first, the candidate is quantised, served, load-tested, evaluated
    and compared; outputs are pushed to the DVC remote; no vLLM survives. Warm: nothing runs
    and the build says so (and names the registered release)."""
    cold, project = demo_builds.build, demo_builds.project
    assert cold.returncode == 0, cold.stdout[-3000:] + cold.stderr[-3000:]
    assert demo_builds.left_running == []
    # One line per release, each stage by its kind with its time and its longest part.
    line = next(x for x in cold.stdout.splitlines() if x.startswith("demo-w8a8 release"))
    assert re.search(r"ran quantise \d+ s", line), line
    assert re.search(r"[ ,]evidence \d+ s \(longest: [^)]* \d+\.\d s\)", line), line
    # The damaged prompt, built right after bf16 on bf16's engine, cites bf16's load test and
    # runs its suites on the server bf16's stage left running: no second start of vLLM.
    base_rid = demo_builds.release_id("demo-bf16")
    dmg_rid = demo_builds.release_id("demo-damaged-prompt")
    dmg = next(x for x in cold.stdout.splitlines() if x.startswith("demo-damaged-prompt release"))
    assert f"load test cited from release {base_rid[:12]}" in dmg, dmg
    assert re.search(rf"evidence \d+ s \(on the vLLM server kept from {base_rid[:12]}", dmg), dmg
    dmg_log = (project / "results" / dmg_rid / "server.log").read_text()
    assert dmg_log.splitlines()[0].startswith("# releasekit: the vLLM server (pid ")
    assert f"started for release {base_rid}" in dmg_log.splitlines()[0]
    assert (
        "Starting vLLM" not in dmg_log
        and "Starting vLLM" in (project / "results" / base_rid / "server.log").read_text()
    )

    rid = demo_builds.release_id("demo-w8a8")
    rdir = project / "results" / rid
    q = json.loads((rdir / "quantise.json").read_text())
    assert q["model_dir"] == f"results/{rid}/model"
    assert "quantization_config" in json.loads((rdir / "model" / "config.json").read_text())
    assert json.loads((rdir / "lock.json").read_text())["release_id"] == rid
    bench = json.loads((rdir / "bench" / "bench.json").read_text())
    assert bench["release_id"] == rid and bench["points"]
    assert (rdir / "bench" / "bench.png").is_file()
    suites = set(json.loads((rdir / "eval" / "eval.json").read_text())["suites"])
    assert suites == {"core", "edge", "regression", "facts"}
    compare = json.loads((rdir / "report" / "compare.json").read_text())
    assert compare["baseline_release_id"] == base_rid
    assert (rdir / "report" / "report.md").is_file()
    bdir = project / "results" / base_rid
    assert (bdir / "eval" / "eval.json").is_file() and not (bdir / "model").exists()
    assert any((project / ".releasekit" / "dvc-remote").rglob("*")), "nothing was pushed"
    dvc_lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert {"demo-w8a8-quantise", "demo-w8a8-report", "demo-bf16-evidence"} <= set(dvc_lock)

    warm = demo_builds.run("build", "manifests/demo-w8a8.yaml", "--json")
    assert warm.returncode == 0, warm.stdout + warm.stderr
    (res,) = json.loads(warm.stdout)
    assert res["up_to_date"] is True
    assert res["summary"] == "up to date, nothing rebuilt"
    assert {s["status"] for s in res["stages"]} == {"unchanged"}
    assert res["registered"]["release_id"] == rid
    again = demo_builds.run("build", "manifests/demo-w8a8.yaml", "--no-register")
    assert "up to date, nothing rebuilt" in again.stdout
    assert marked_processes(demo_builds.mark) == []


def _server_port(mark: str) -> int | None:
    for p in marked_processes(mark):
        if "vllm.entrypoints.openai.api_server" in p and "--port " in p:
            return int(p.split("--port ", 1)[1].split()[0])
    return None


@pytest.mark.slow
@pytest.mark.parallel_safe
@pytest.mark.parametrize(
    "sig, when",
    [(signal.SIGINT, "serving"), (signal.SIGTERM, "starting")],
    ids=["SIGINT-while-serving", "SIGTERM-while-starting"],
)
def test_interrupted_build_leaves_no_vllm_process(
    demo_model: Path, project: Path, sig: signal.Signals, when: str
) -> None:
    """Ctrl-C (SIGINT) to `releasekit build` while a stage's vLLM serves traffic, or SIGTERM
    while it starts: the build exits 130 and no process of its tree, vLLM included, is left."""
    tiny_manifests(project)
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(
        [str(BIN / "releasekit"), "build", "manifests/t-base.yaml", "--no-register"],
        cwd=project,
        env=command_env(mark),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        port = None
        while time.monotonic() < deadline and proc.poll() is None and port is None:
            port = _server_port(mark)
            time.sleep(0.5)
        assert port is not None, "the build ended before vLLM started"
        if when == "serving":
            health = f"http://127.0.0.1:{port}/health"
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if webclient.get(health, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            time.sleep(0.5)
        else:
            time.sleep(3)  # well into vLLM's start-up
        assert proc.poll() is None, "the build ended before it could be interrupted"
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 130, stderr
        assert "interrupted" in stderr
        assert marked_processes(mark) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stage_processes_get_every_setting_back(settings: Settings, tmp_path: Path) -> None:
    """A build stage (a separate `releasekit stage` process) reads the same settings as the
    build, nested ones (environments) included."""
    import subprocess
    import sys

    from releasekit.build.dvc import child_env
    from releasekit.config import EnvironmentConfig

    s = settings.model_copy(update={"environments": {"staging": EnvironmentConfig(port=8780)}})
    code = (
        "from releasekit.config import load_settings; s = load_settings(); "
        "print(s.environments['staging'].port, s.results_dir)"
    )
    env = {**child_env(s), "RELEASEKIT_CONFIG": str(tmp_path / "none.toml")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["8780", str(s.results_dir)]
