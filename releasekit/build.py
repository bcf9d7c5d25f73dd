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
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, computed_field

from releasekit import lock as lockmod
from releasekit.config import Settings
from releasekit.errors import BuildError, LockMismatchError, ReleasekitError
from releasekit.lock import Lock, write_atomic
from releasekit.manifest import LoadedManifest, load_manifest
from releasekit.server import (
    PIDDIR_ENV,
    deferred_signals,
    group_members,
    reap_registered,
    serve_release,
    sigterm_as_interrupt,
)

Progress = Callable[[str, int, int], None]
StageKind = Literal["quantise", "bench", "eval", "report"]

KINDS: tuple[StageKind, ...] = ("quantise", "bench", "eval", "report")
STAGE_CMD = "releasekit stage"
PROGRESS_ENV = "RELEASEKIT_PROGRESS"
PROGRESS_MARK = "@@releasekit-progress "
DVC_YAML = "dvc.yaml"
REMOTE_NAME = "local"

_RUNNING = re.compile(r"^Running stage '([^']+)'")
_UNCHANGED = re.compile(r"^Stage '([^']+)' didn't change, skipping")
_CACHED = re.compile(r"^Stage '([^']+)' is cached - skipping run")
_STAGE_NAME = re.compile(r"[^A-Za-z0-9_-]")


class StageRun(BaseModel):
    """What DVC did with one stage in a build."""

    name: str
    status: Literal["ran", "restored", "unchanged"] = Field(
        description="ran: executed; restored: outputs checked out from DVC's run cache; "
        "unchanged: inputs and outputs matched dvc.lock"
    )
    seconds: float | None = None


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

    @computed_field  # type: ignore[prop-decorator]
    @property
    def summary(self) -> str:
        """One line for humans."""
        if self.up_to_date:
            return "up to date, nothing rebuilt"
        ran = [s.name for s in self.stages if s.status == "ran"]
        restored = [s.name for s in self.stages if s.status == "restored"]
        parts = []
        if ran:
            parts.append(f"ran {', '.join(ran)}")
        if restored:
            parts.append(f"restored from cache {', '.join(restored)}")
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


def _rel(p: Path, root: Path) -> str:
    try:
        return p.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        # Outside the project (absolute path): DVC tracks it as an external dependency.
        return p.absolute().as_posix()


def _rel_link(p: Path, root: Path) -> str:
    """Like _rel but without resolving symlinks inside the project (a linked model folder
    is a dependency under its project path)."""
    absolute = p if p.is_absolute() else Path.cwd() / p
    try:
        return absolute.relative_to(root).as_posix()
    except ValueError:
        return _rel(p, root)


def plan(settings: Settings, manifest_path: Path | str) -> PlannedRelease:
    """Lock a manifest and, recursively, its eval baseline (locking writes lock files only
    when inputs changed)."""
    return _plan(settings, Path(manifest_path), seen=set())


def _plan(settings: Settings, path: Path, *, seen: set[Path]) -> PlannedRelease:
    lm = load_manifest(path, root=settings.root)
    seen = seen | {lm.path}
    lk = lockmod.lock(lm.path, root=settings.root)
    planned = PlannedRelease(lm=lm, lock=lk, manifest_rel=_rel(lm.path, settings.root))
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
    defs[stage_name(m.name, "bench")] = stage(
        "bench", [record, served, r(p.lm.resolve(m.load.profile))], [r(rdir / "bench")]
    )
    e_deps = [record, served, r(p.lm.resolve(m.prompts.user.file))]
    if m.prompts.system is not None:
        e_deps.append(r(p.lm.resolve(m.prompts.system.file)))
    e_deps += [r(p.lm.resolve(s.path)) for s in m.eval.suites]
    if m.eval.judge is not None:
        e_deps.append(r(p.lm.resolve(m.eval.judge.prompt)))
    defs[stage_name(m.name, "eval")] = stage("eval", e_deps, [r(rdir / "eval")])
    if p.baseline is not None:
        bdir = settings.release_dir(p.baseline.lock.release_id)
        defs[stage_name(m.name, "report")] = stage(
            "report",
            [r(rdir / "eval"), r(rdir / "bench"), r(bdir / "eval"), r(bdir / "bench")],
            [r(rdir / "report")],
            extra=f" --baseline {p.baseline.lock.release_id}",
        )
    return defs


def _is_owned(stage: Any) -> bool:
    return isinstance(stage, dict) and str(stage.get("cmd", "")).startswith(STAGE_CMD + " ")


def _yaml() -> Any:
    from ruamel.yaml import YAML

    y = YAML()  # round trip: keeps the comments and order of stages we do not own
    y.indent(mapping=2, sequence=4, offset=2)
    y.width = 4096
    return y


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
        for kind in KINDS:  # drop a stage this manifest no longer has (e.g. its report)
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


def _bin_dir() -> Path:
    return Path(sys.executable).parent


def _dvc() -> list[str]:
    exe = _bin_dir() / "dvc"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "dvc"]


def child_env(settings: Settings, **extra: str) -> dict[str, str]:
    """Environment for DVC and the stages it runs: this interpreter's bin dir first on PATH
    (so `releasekit` resolves to this install) and these settings as RELEASEKIT_* values."""
    env = dict(os.environ)
    env["PATH"] = f"{_bin_dir()}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    # DVC's analytics run as a detached daemon that would outlive the build (and try the
    # network): off for the commands a build runs.
    env["DVC_NO_ANALYTICS"] = "1"
    for field, value in settings.model_dump().items():
        if value is not None:
            env[f"RELEASEKIT_{field.upper()}"] = str(value)
    env.update(extra)
    return env


def _dvc_call(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            [*_dvc(), *args],
            cwd=settings.root,
            env=child_env(settings),
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except OSError as exc:
        raise BuildError(f"cannot run dvc: {exc}") from exc


def ensure_dvc(settings: Settings) -> None:
    """Make the project a DVC repository with a default remote, if it is not one yet: `dvc
    init` (with git when the root is a git repository) and a local remote under the state
    folder (`<state_dir>/dvc-remote`), so `releasekit build --push` works out of the box."""
    root = settings.root
    if not (root / ".dvc").is_dir():
        args = ["init", "-q"] if (root / ".git").exists() else ["init", "-q", "--no-scm"]
        r = _dvc_call(settings, *args)
        if r.returncode != 0:
            raise BuildError(f"dvc init failed in {root}: {(r.stderr or r.stdout).strip()}")
    r = _dvc_call(settings, "remote", "default")
    if r.returncode == 0 and r.stdout.strip():
        return
    remote = settings.state_dir / "dvc-remote"
    remote.mkdir(parents=True, exist_ok=True)
    # DVC stores a relative URL relative to .dvc/, so clones find their own remote.
    url = os.path.relpath(remote, root) if _inside(remote, root) else str(remote)
    r = _dvc_call(settings, "remote", "add", "-d", "-f", REMOTE_NAME, url)
    if r.returncode != 0:
        raise BuildError(f"cannot configure the DVC remote: {(r.stderr or r.stdout).strip()}")


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


def _wait_group(proc: subprocess.Popen[str], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc.poll()  # reap DVC itself
        if not group_members(proc.pid):
            return True
        time.sleep(0.2)
    return False


def _stop_dvc(proc: subprocess.Popen[str], piddir: Path, grace_s: float) -> None:
    """Stop a DVC run and everything under it: SIGINT (stages stop their servers), then
    SIGTERM, then SIGKILL; finally stop any server whose stage died before stopping it."""
    with deferred_signals():
        for sig, wait_s in ((signal.SIGINT, grace_s + 30), (signal.SIGTERM, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            if _wait_group(proc, wait_s):
                break
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            _wait_group(proc, 5.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        reap_registered(piddir, grace_s=grace_s)


def _drain(proc: subprocess.Popen[str], log: io.TextIOBase) -> None:
    """Keep reading a stopping DVC's output in the background, so that no stage blocks on a
    full pipe while it stops its server."""

    def run() -> None:
        with contextlib.suppress(OSError, ValueError):
            for raw in proc.stdout or ():
                if not raw.startswith(PROGRESS_MARK):
                    log.write(raw)

    threading.Thread(target=run, name="dvc-drain", daemon=True).start()


class _ReproWatcher:
    """Turns `dvc repro` output into StageRuns and progress calls."""

    def __init__(self, planned: list[str], progress: Progress, log: io.TextIOBase) -> None:
        self.planned = planned
        self.progress = progress
        self.log = log
        self.runs: dict[str, StageRun] = {}
        self.current: str | None = None
        self.started = 0.0
        self.tail: deque[str] = deque(maxlen=40)

    def _finish_current(self) -> None:
        if self.current is not None:
            run = self.runs[self.current]
            run.seconds = round(time.monotonic() - self.started, 2)
            self.progress(self.current, 1, 1)
            self.current = None

    def _done(self) -> None:
        finished = sum(1 for n in self.runs if n != self.current)
        self.progress("build", min(finished, len(self.planned)), len(self.planned))

    def line(self, raw: str) -> None:
        text = raw.rstrip("\n")
        if text.startswith(PROGRESS_MARK):
            with contextlib.suppress(ValueError, TypeError):
                label, done, total = json.loads(text[len(PROGRESS_MARK) :])
                where = self.current or "stage"
                self.progress(f"{where}: {label}", int(done), int(total))
            return
        self.log.write(text + "\n")
        self.log.flush()
        self.tail.append(text)
        if m := _RUNNING.match(text):
            self._finish_current()
            self.current = m.group(1)
            self.started = time.monotonic()
            self.runs[self.current] = StageRun(name=self.current, status="ran")
            self.progress(self.current, 0, 0)
        elif m := _UNCHANGED.match(text):
            self._finish_current()
            self.runs[m.group(1)] = StageRun(name=m.group(1), status="unchanged")
        elif m := _CACHED.match(text):
            self._finish_current()
            self.runs[m.group(1)] = StageRun(name=m.group(1), status="restored")
        elif text.startswith(("Updating lock file", "Generating lock file")):
            self._finish_current()
        else:
            return
        self._done()

    def close(self) -> None:
        self._finish_current()
        self._done()


def repro(
    settings: Settings,
    targets: list[str],
    *,
    progress: Progress,
    log_path: Path,
    planned: list[str] | None = None,
) -> list[StageRun]:
    """Run `dvc repro TARGETS` (with their upstream stages) in a process group of its own;
    on Ctrl-C/SIGTERM stop it and every vLLM server its stages started. Raises BuildError
    quoting the end of the output if a stage fails."""
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    piddir = Path(tempfile.mkdtemp(prefix="servers-", dir=settings.state_dir))
    env = child_env(settings, **{PROGRESS_ENV: "lines", PIDDIR_ENV: str(piddir)})
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a", encoding="utf-8") as log:
        log.write(f"$ dvc repro {' '.join(targets)}\n")
        watcher = _ReproWatcher(planned or targets, progress, log)
        proc: subprocess.Popen[str] | None = None
        try:
            with deferred_signals():  # no window where DVC runs and nobody would stop it
                try:
                    proc = subprocess.Popen(
                        [*_dvc(), "repro", *targets],
                        cwd=settings.root,
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        text=True,
                        errors="replace",
                        bufsize=1,
                        start_new_session=True,
                    )
                except OSError as exc:
                    raise BuildError(f"cannot run dvc: {exc}") from exc
            for raw in proc.stdout or ():
                watcher.line(raw)
            rc = proc.wait()
        except BaseException:
            if proc is not None:
                _drain(proc, log)
                _stop_dvc(proc, piddir, settings.server_stop_grace_s)
            raise
        finally:
            reap_registered(piddir, grace_s=settings.server_stop_grace_s)
            shutil.rmtree(piddir, ignore_errors=True)
        if rc == 0:
            watcher.close()
    if rc != 0:
        where = f" in stage '{watcher.current}'" if watcher.current else ""
        raise BuildError(
            f"dvc repro failed{where} (exit {rc}; log: {log_path}):\n" + "\n".join(watcher.tail)
        )
    return list(watcher.runs.values())


def _producers(settings: Settings, paths: list[Path]) -> list[str]:
    """Stages in dvc.yaml not owned by releasekit whose outputs hold any of `paths` (e.g.
    the demo model's training stage for models/demo-base)."""
    path = settings.root / DVC_YAML
    if not path.is_file():
        return []
    try:
        data = _yaml().load(path.read_text(encoding="utf-8")) or {}
    except Exception as exc:
        raise BuildError(f"{path}: not valid YAML ({exc})") from exc
    wanted = {_rel_link(p, settings.root) for p in paths}
    names = []
    for name, stage in (data.get("stages") or {}).items():
        if not isinstance(stage, dict) or _is_owned(stage) or "foreach" in stage:
            continue
        for out in stage.get("outs") or []:
            out_path = next(iter(out)) if isinstance(out, dict) else str(out)
            out_path = out_path.rstrip("/")
            if any(w == out_path or w.startswith(out_path + "/") for w in wanted):
                names.append(str(name))
                break
    return names


def _input_paths(lm: LoadedManifest, seen: set[Path] | None = None) -> list[Path]:
    """Every file a manifest (and its baselines) reads, for finding their producer stages."""
    m = lm.manifest
    seen = (seen or set()) | {lm.path}
    paths = [m.model.source, m.load.profile, m.prompts.user.file, *(s.path for s in m.eval.suites)]
    if m.prompts.system:
        paths.append(m.prompts.system.file)
    if m.quantisation.calibration:
        paths.append(m.quantisation.calibration.dataset)
    if m.eval.judge:
        paths.append(m.eval.judge.prompt)
    out = [lm.resolve(p) for p in paths]
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
) -> BuildResult:
    """Build a manifest's release through DVC: make the inputs other stages produce (e.g.
    the demo model), lock the manifest (and its baseline), write its stages to dvc.yaml,
    `dvc repro` them (building the baseline's bench and eval first when missing), then
    optionally `dvc push` the outputs and register the release in MLflow.

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
        runs = repro(settings, targets, progress=say, log_path=log_path, planned=all_stages)
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
        manifest=planned.manifest_rel,
        name=planned.lm.manifest.name,
        release_id=rid,
        release_dir=_rel(settings.release_dir(rid), settings.root),
        baseline_release_id=planned.baseline.lock.release_id if planned.baseline else None,
        stages=runs,
        up_to_date=up_to_date,
        seconds=round(time.monotonic() - started, 2),
        pushed=pushed,
        registered=registered,
        log_path=str(log_path),
    )


def _inside(p: Path, root: Path) -> bool:
    try:
        p.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


def _register(settings: Settings, manifest: Path, say: Progress) -> dict[str, Any] | None:
    """Register the release in MLflow when the registry module is installed."""
    try:
        from releasekit import registry
    except ModuleNotFoundError as exc:
        if exc.name == "releasekit.registry":
            return None
        raise
    say("register", 0, 1)
    result = registry.register_release(settings, manifest)
    say("register", 1, 1)
    return result.model_dump(mode="json")


# ---- stages (run by DVC through `releasekit stage`) -------------------------------------


def _checked_lock(settings: Settings, lm: LoadedManifest, release_id: str) -> Lock:
    """The manifest's lock, after checking that the inputs still lock to `release_id`."""
    try:
        lockmod.check(lm.path, root=settings.root)
    except LockMismatchError as exc:
        raise BuildError(
            f"{lm.path}: inputs changed since dvc.yaml was written ({', '.join(exc.changed)})",
            remedy="run `releasekit build MANIFEST` (it relocks and rewrites the stages)",
        ) from exc
    lk = lockmod.read_lock(lockmod.lock_path_for(lm.path))
    if lk.release_id != release_id:
        raise BuildError(
            f"{lm.path} locks to release {lk.short_id}, but this stage is for {release_id[:12]}",
            remedy="run `releasekit build MANIFEST` (it rewrites the stages in dvc.yaml)",
        )
    return lk


def run_stage(
    settings: Settings,
    kind: StageKind,
    manifest_path: Path | str,
    *,
    release_id: str,
    baseline_release_id: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Run one build stage of a locked release and return the folder it wrote. This is what
    `releasekit stage KIND MANIFEST --release ID` (the command in dvc.yaml) calls."""
    say = progress or (lambda label, done, total: None)
    lm = load_manifest(manifest_path, root=settings.root)
    lk = _checked_lock(settings, lm, release_id)
    rdir = settings.release_dir(release_id)
    rdir.mkdir(parents=True, exist_ok=True)
    with sigterm_as_interrupt():
        if kind == "quantise":
            return _stage_quantise(settings, lm, lk, say)
        if kind == "bench":
            return _stage_bench(settings, lm, lk, say)
        if kind == "eval":
            return _stage_eval(settings, lm, lk, say)
        if kind == "report":
            return _stage_report(settings, lm, lk, baseline_release_id, say)
    raise BuildError(f"unknown stage kind {kind!r}")


def _stage_quantise(settings: Settings, lm: LoadedManifest, lk: Lock, say: Progress) -> Path:
    from releasekit.quantise import quantise_release

    rdir = settings.release_dir(lk.release_id)
    write_atomic(rdir / "lock.json", (lk.model_dump_json(indent=2) + "\n").encode())
    write_atomic(rdir / "manifest.yaml", lm.path.read_bytes())
    quantise_release(settings, lm, lk, progress=say)
    return rdir


def _stage_bench(settings: Settings, lm: LoadedManifest, lk: Lock, say: Progress) -> Path:
    from releasekit.bench import bench_release

    _, out = bench_release(
        lm.path,
        settings=settings,
        out_dir=settings.release_dir(lk.release_id) / "bench",
        progress=say,
    )
    return out


def _stage_eval(settings: Settings, lm: LoadedManifest, lk: Lock, say: Progress) -> Path:
    from releasekit.evaluate import run_eval, write_outputs

    m = lm.manifest
    out = settings.release_dir(lk.release_id) / "eval"
    out.mkdir(parents=True, exist_ok=True)
    say("starting vLLM", 0, 0)
    with serve_release(settings, lm, lk, log_path=out / "server.log") as server:
        result = run_eval(
            server.base_url, m.served_name, lm, release_id=lk.release_id, progress=say
        )
        server.check_alive()
    write_outputs(result, out)
    return out


def _stage_report(
    settings: Settings,
    lm: LoadedManifest,
    lk: Lock,
    baseline_release_id: str | None,
    say: Progress,
) -> Path:
    from releasekit.evaluate import compare, load_result, write_report

    if baseline_release_id is None:
        raise BuildError(f"{lm.path}: the report stage needs --baseline RELEASE_ID")
    rdir = settings.release_dir(lk.release_id)
    bdir = settings.release_dir(baseline_release_id)
    say("compare", 0, 1)
    comparison = compare(load_result(rdir / "eval"), load_result(bdir / "eval"), lm)
    out = rdir / "report"
    cand_bench, base_bench = rdir / "bench" / "bench.json", bdir / "bench" / "bench.json"
    write_report(
        comparison,
        out,
        candidate_bench=cand_bench if cand_bench.is_file() else None,
        baseline_bench=base_bench if base_bench.is_file() else None,
    )
    say("compare", 1, 1)
    return out
