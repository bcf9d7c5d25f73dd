"""The build pipeline: a manifest's DVC stages (quantise -> bench, eval -> report) in
dvc.yaml, run through `dvc repro` so that nothing whose inputs did not change is recomputed.

Each release's outputs live under results/<release_id>/ and are DVC outputs (pushable to the
DVC remote). Stage commands are `releasekit stage KIND MANIFEST --release ID`; the stage
checks that the manifest still locks to that id, so a stale dvc.yaml fails loudly instead
of writing one release's results under another's id.

    result = build(settings, "manifests/demo-w4a16.yaml", progress=cb)
    result.up_to_date   # True when nothing needed doing
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import re
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, computed_field

from releasekit._support.files import write_atomic
from releasekit._support.progress import (
    Progress,
)
from releasekit.build.dvc import (
    DVC_YAML,
    STAGE_CMD,
    StageRun,
    _dvc_call,
    _inside,
    _is_owned,
    _producers,
    _rel_link,
    _yaml,
    ensure_dvc,
    project_relative,
    repro,
)
from releasekit.build.stages import StageKind
from releasekit.config import Settings
from releasekit.errors import BuildError, ReleasekitError
from releasekit.spec import lock as lockmod
from releasekit.spec.lock import Lock
from releasekit.spec.manifest import LoadedManifest, load_manifest, named_files
from releasekit.stores.results import ReleasePaths

KINDS: tuple[StageKind, ...] = ("quantise", "evidence", "report")
"""The stages a build writes: bench and eval share one stage (and one vLLM server)."""
_OWNED_KINDS: tuple[StageKind, ...] = ("quantise", "bench", "eval", "evidence", "report")
"""Every kind a releasekit stage ever had: older dvc.yaml files may hold bench/eval ones."""

_STAGE_NAME = re.compile(r"[^A-Za-z0-9_-]")


class BuildResult(BaseModel):
    """The outcome of building one manifest (and, through DVC, its baseline)."""

    manifest: str
    name: str
    release_id: str
    release_dir: str
    baseline_release_id: str | None = None
    stages: list[StageRun] = Field(default_factory=list)
    up_to_date: bool = Field(description="True when DVC found nothing to do")
    seconds: float
    pushed: bool = False
    registered: dict[str, Any] | None = Field(
        None, description="registry.register_release's result, when registered"
    )
    log_path: str
    load_test_from: str | None = Field(
        None,
        description="the release whose main load test this one cites (same engine and load "
        "profile: releasekit.bench.reuse), None when it measured its own",
    )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def summary(self) -> str:
        """One line for humans."""
        if self.up_to_date:
            return "up to date, nothing rebuilt"
        ran = [s.line(self.name) for s in self.stages if s.status == "ran"]
        restored = [s.name for s in self.stages if s.status == "restored"]
        parts = []
        if ran:
            parts.append(f"ran {', '.join(ran)}")
        if restored:
            parts.append(f"restored from cache {', '.join(restored)}")
        if self.load_test_from:
            parts.append(f"load test cited from release {self.load_test_from[:12]} (same engine)")
        return "; ".join(parts)


class PlannedRelease(BaseModel):
    """A locked manifest in a build, with the baseline its report compares against."""

    lm: LoadedManifest
    lock: Lock
    manifest_rel: str
    baseline: PlannedRelease | None = None


# ---- planning ---------------------------------------------------------------------------


def stage_name(manifest_name: str, kind: str) -> str:
    """The DVC stage name of a manifest's stage, e.g. `demo-w4a16-quantise`."""
    return f"{_STAGE_NAME.sub('-', manifest_name)}-{kind}"


def plan(settings: Settings, manifest_path: Path | str) -> PlannedRelease:
    """Lock a manifest and, recursively, its eval baseline (locking writes lock files only
    when inputs changed)."""
    return _plan(settings, Path(manifest_path), seen=set())


def _plan(settings: Settings, path: Path, *, seen: set[Path]) -> PlannedRelease:
    lm = load_manifest(path, root=settings.root)
    seen = seen | {lm.path}
    lk = lockmod.lock(lm.path, root=settings.root)
    planned = PlannedRelease(lm=lm, lock=lk, manifest_rel=project_relative(lm.path, settings.root))
    base = lm.manifest.eval.baseline
    if base is not None:
        base_path = lm.resolve(base).resolve()
        if base_path in seen:
            raise BuildError(
                f"{lm.path}: eval.baseline {base} leads back to a manifest already in this "
                "build (baselines form a cycle)"
            )
        planned.baseline = _plan(settings, base_path, seen=seen)
        if planned.baseline.lock.release_id == lk.release_id:
            planned.baseline = None  # comparing a release with itself tells nothing
    return planned


def chain(p: PlannedRelease) -> list[PlannedRelease]:
    """The release and its baselines, candidate first."""
    out = [p]
    while (b := out[-1].baseline) is not None:
        out.append(b)
    return out


def served_model_path(settings: Settings, p: PlannedRelease) -> Path:
    """The folder a release will serve once quantised (results/<id>/model) or its source."""
    m = p.lm.manifest
    if m.quantisation.scheme == "none":
        return p.lm.resolve(m.model.source)
    return settings.release_dir(p.lock.release_id) / "model"


def stage_defs(settings: Settings, p: PlannedRelease) -> dict[str, dict[str, Any]]:
    """The DVC stage definitions of one release (quantise, bench, eval and, with a
    baseline, report), deterministic so an unchanged manifest gives an unchanged dvc.yaml."""
    root = settings.root
    m = p.lm.manifest
    rid = p.lock.release_id
    rdir = settings.release_dir(rid)
    r = lambda path: _rel_link(path, root)  # noqa: E731 - local shorthand
    manifest = shlex.quote(p.manifest_rel)
    cmd = f"{STAGE_CMD} {{kind}} {manifest} --release {rid}"
    served = r(served_model_path(settings, p))
    q = m.quantisation

    def stage(kind: str, deps: list[str], outs: list[str], extra: str = "") -> dict[str, Any]:
        return {
            "cmd": cmd.format(kind=kind) + extra,
            "desc": f"{kind} release {p.lock.short_id} of {p.manifest_rel}",
            "deps": sorted(set(deps)),
            "outs": sorted(set(outs)),
        }

    q_deps = [r(p.lm.resolve(m.model.source))]
    if q.scheme != "none" and q.calibration is not None:
        q_deps.append(r(p.lm.resolve(q.calibration.dataset)))
    q_outs = [r(rdir / f) for f in ("quantise.json", "lock.json", "manifest.yaml")]
    if q.scheme != "none":
        q_outs.append(r(rdir / "model"))
    defs = {stage_name(m.name, "quantise"): stage("quantise", q_deps, q_outs)}

    record = r(rdir / "quantise.json")
    deps = [record, served, r(p.lm.resolve(m.load.profile)), r(p.lm.resolve(m.prompts.user.file))]
    if m.prompts.system is not None:
        deps.append(r(p.lm.resolve(m.prompts.system.file)))
    deps += [r(p.lm.resolve(s.path)) for s in m.eval.suites]
    deps += [r(p.lm.resolve(a.path)) for a in m.adapters]  # served and scored with the base
    if m.eval.judge is not None:
        deps.append(r(p.lm.resolve(m.eval.judge.prompt)))
    defs[stage_name(m.name, "evidence")] = stage(
        "evidence", deps, [r(rdir / "bench"), r(rdir / "eval"), r(rdir / "server.log")]
    )
    if p.baseline is not None:
        bdir = settings.release_dir(p.baseline.lock.release_id)
        defs[stage_name(m.name, "report")] = stage(
            "report",
            [r(rdir / "eval"), r(rdir / "bench"), r(bdir / "eval"), r(bdir / "bench")],
            [r(rdir / "report")],
            extra=f" --baseline {p.baseline.lock.release_id}",
        )
    return defs


def update_dvc_yaml(settings: Settings, releases: list[PlannedRelease]) -> bool:
    """Write (or update) the stages of `releases` in dvc.yaml; stages owned by others (any
    whose command is not `releasekit stage ...`) are kept as they are. Returns True if the
    file changed."""
    path = settings.root / DVC_YAML
    y = _yaml()
    old_text = path.read_text(encoding="utf-8") if path.is_file() else ""
    try:
        data = y.load(old_text) if old_text.strip() else None
    except Exception as exc:  # ruamel raises many YAMLError subclasses
        raise BuildError(f"{path}: not valid YAML ({exc})") from exc
    if data is None:
        from ruamel.yaml.comments import CommentedMap

        data = CommentedMap()
    if not isinstance(data, dict):
        raise BuildError(f"{path}: expected a mapping with `stages`")
    if data.get("stages") is None:
        data["stages"] = {}
    stages = data["stages"]
    for p in releases:
        m = p.lm.manifest
        defs = stage_defs(settings, p)
        for kind in _OWNED_KINDS:  # drop a stage this manifest no longer has (e.g. its report)
            name = stage_name(m.name, kind)
            if name not in defs and _is_owned(stages.get(name)):
                del stages[name]
        for name, d in defs.items():
            if name in stages and not _is_owned(stages[name]):
                raise BuildError(
                    f"{path}: stage '{name}' exists and is not a releasekit stage; rename "
                    f"the manifest '{m.name}' or that stage"
                )
            if stages.get(name) != d:
                stages[name] = d
    buf = io.StringIO()
    y.dump(data, buf)
    new_text = buf.getvalue()
    if new_text == old_text:
        return False
    write_atomic(path, new_text.encode())
    return True


# ---- DVC plumbing -----------------------------------------------------------------------


@contextlib.contextmanager
def _exclusive(settings: Settings, progress: Progress) -> Iterator[None]:
    """One build at a time per project (DVC would refuse a second concurrent repro)."""
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    with (settings.state_dir / "build.lock").open("w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress("waiting for another build", 0, 0)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _input_paths(lm: LoadedManifest, seen: set[Path] | None = None) -> list[Path]:
    """Every file a manifest (and its baselines) reads, for finding their producer stages."""
    m = lm.manifest
    seen = (seen or set()) | {lm.path}
    out = [lm.resolve(f.path) for f in named_files(m) if f.role != "baseline"]
    if m.eval.baseline is not None:
        base = lm.resolve(m.eval.baseline).resolve()
        if base.is_file() and base not in seen:
            with contextlib.suppress(ReleasekitError):
                out += _input_paths(load_manifest(base, root=lm.base), seen)
    return out


# ---- build ------------------------------------------------------------------------------


def build(
    settings: Settings,
    manifest_path: Path | str,
    *,
    progress: Progress | None = None,
    push: bool = False,
    register: bool = True,
    engines: Path | None = None,
) -> BuildResult:
    """Build a manifest's release through DVC: make the inputs other stages produce (e.g.
    the demo model), lock the manifest (and its baseline), write its stages to dvc.yaml,
    `dvc repro` them (building the baseline's bench and eval first when missing), then
    optionally `dvc push` the outputs and register the release in MLflow.

    `engines`: the folder of servers kept across one `releasekit build`'s releases
    (`releasekit.build.engines.kept_engines`); None, each stage starts and stops its own.

    A second build of an unchanged manifest runs nothing (`up_to_date`). Ctrl-C or SIGTERM
    stops DVC, the running stage and its vLLM server. Raises BuildError when a stage fails,
    ManifestError/LockError for bad input.
    """
    say = progress or (lambda label, done, total: None)
    started = time.monotonic()
    if not _inside(settings.results_dir, settings.root):
        raise BuildError(
            f"results_dir {settings.results_dir} is outside the project {settings.root}: "
            "DVC outputs must live inside the repository"
        )
    with _exclusive(settings, say):
        lm0 = load_manifest(manifest_path, root=settings.root)
        log_path = settings.state_dir / "logs" / f"build-{lm0.manifest.name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("")  # the log of the latest build only
        say("prepare", 0, 3)
        ensure_dvc(settings)
        upstream = _producers(settings, _input_paths(lm0))
        upstream_runs: list[StageRun] = []
        if upstream:  # e.g. train the demo model in a fresh clone, before hashing it
            say("inputs: " + ", ".join(upstream), 0, 0)
            upstream_runs = repro(settings, upstream, progress=say, log_path=log_path)
        say("prepare", 1, 3)
        planned = plan(settings, lm0.path)
        releases = chain(planned)
        update_dvc_yaml(settings, releases)
        say("prepare", 2, 3)
        targets = list(stage_defs(settings, planned))
        all_stages = [n for p in releases for n in stage_defs(settings, p)]
        say("prepare", 3, 3)
        runs = repro(
            settings,
            targets,
            progress=say,
            log_path=log_path,
            planned=all_stages,
            engines=engines,
        )
        runs = upstream_runs + [r for r in runs if r.name in set(all_stages)]
        up_to_date = all(r.status == "unchanged" for r in runs)
        pushed = False
        if push:
            say("push", 0, 1)
            r = _dvc_call(settings, "push", "--with-deps", *targets)
            if r.returncode != 0:
                raise BuildError(f"dvc push failed: {(r.stderr or r.stdout).strip()}")
            pushed = True
            say("push", 1, 1)
        registered = _register(settings, lm0.path, say) if register else None
    rid = planned.lock.release_id
    return BuildResult(
        load_test_from=_cited_release(settings, rid),
        manifest=planned.manifest_rel,
        name=planned.lm.manifest.name,
        release_id=rid,
        release_dir=project_relative(settings.release_dir(rid), settings.root),
        baseline_release_id=planned.baseline.lock.release_id if planned.baseline else None,
        stages=runs,
        up_to_date=up_to_date,
        seconds=round(time.monotonic() - started, 2),
        pushed=pushed,
        registered=registered,
        log_path=str(log_path),
    )


def _cited_release(settings: Settings, release_id: str) -> str | None:
    """The release whose main load test results/<id>/bench/bench.json cites, if any."""
    import json

    try:
        data = json.loads(ReleasePaths.of(settings, release_id).bench.read_bytes())
        cited = data.get("measured_for") if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None
    rid = cited.get("release_id") if isinstance(cited, dict) else None
    return rid if isinstance(rid, str) else None


def _register(settings: Settings, manifest: Path, say: Progress) -> dict[str, Any] | None:
    """Register the release in MLflow when the registry module is installed."""
    try:
        from releasekit.releases import register as registry
    except ModuleNotFoundError as exc:
        if exc.name == "releasekit.stores.mlflow":
            return None
        raise
    say("register", 0, 1)
    result = registry.register_release(settings, manifest)
    say("register", 1, 1)
    return result.model_dump(mode="json")


# ---- stages (run by DVC through `releasekit stage`) -------------------------------------
