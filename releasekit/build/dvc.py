"""DVC process control: the dvc binary beside our interpreter, the child environment,
running `dvc repro` with progress, stopping it (and its servers) cleanly."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from releasekit._support.procs import (
    deferred_signals,
    group_members,
    reap_registered,
)
from releasekit._support.progress import (
    PROGRESS_ENV,
    Progress,
    is_marker,
    parse_marker,
)
from releasekit.build.engines import ENGINES_ENV
from releasekit.config import Settings
from releasekit.errors import BuildError
from releasekit.serving.vllm import PIDDIR_ENV

_RUNNING = re.compile(r"^Running stage '([^']+)'")


_UNCHANGED = re.compile(r"^Stage '([^']+)' didn't change, skipping")


_CACHED = re.compile(r"^Stage '([^']+)' is cached - skipping run")


_KEPT = re.compile(r"^vLLM kept from release ([0-9a-f]+)")


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
    for field, value in settings.model_dump(mode="json").items():
        if value is None:
            continue
        # Nested settings (environments) travel as JSON, which pydantic-settings parses back.
        text = json.dumps(value) if isinstance(value, dict | list) else str(value)
        env[f"RELEASEKIT_{field.upper()}"] = text
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
                if not is_marker(raw):
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
        self._reported: int | None = None  # the overall count last reported
        self._part: tuple[str, float] | None = None  # the running stage's part, since when
        self._parts: dict[str, float] = {}  # the running stage's parts and their seconds

    def _finish_current(self) -> None:
        if self.current is not None:
            run = self.runs[self.current]
            run.seconds = round(time.monotonic() - self.started, 2)
            self._next_part(None)
            if len(self._parts) > 1:
                part, took = max(self._parts.items(), key=lambda kv: kv[1])
                run.longest = f"{part} {took:.1f} s"
            self._parts = {}
            self.progress(self.current, 1, 1)
            self.current = None

    def _next_part(self, part: str | None) -> None:
        """The running stage moves on to `part` (None: it ends); time the part it leaves."""
        now = time.monotonic()
        if self._part is not None and self._part[0] == part:
            return
        if self._part is not None:
            name, since = self._part
            self._parts[name] = self._parts.get(name, 0.0) + now - since
        self._part = (part, now) if part is not None else None

    def _done(self) -> None:
        """Report the overall count when it changes (a stage's end and the lock file's update
        both end in here: the same count is said once)."""
        finished = min(sum(1 for n in self.runs if n != self.current), len(self.planned))
        if finished != self._reported:
            self._reported = finished
            self.progress("build", finished, len(self.planned))

    def line(self, raw: str) -> None:
        text = raw.rstrip("\n")
        if is_marker(text):
            if (call := parse_marker(text)) is not None:
                label, done, total = call
                if self.current is not None:
                    self._next_part(label.split(" (", 1)[0])
                    if m := _KEPT.match(label):
                        self.runs[self.current].server_from = m.group(1)
                self.progress(f"{self.current or 'stage'}: {label}", done, total)
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
    engines: Path | None = None,
) -> list[StageRun]:
    """Run `dvc repro TARGETS` (with their upstream stages) in a process group of its own,
    in the caller's session (a server a stage leaves running for the next one stays in the
    session of the load clients that use it); on Ctrl-C/SIGTERM stop it and every vLLM
    server its stages started. `engines`: the build's folder of kept servers
    (`releasekit.build.engines`). Raises BuildError quoting the end of the output if a
    stage fails."""
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    piddir = Path(tempfile.mkdtemp(prefix="servers-", dir=settings.state_dir))
    extra = {PROGRESS_ENV: "lines", PIDDIR_ENV: str(piddir)}
    if engines is not None:
        extra[ENGINES_ENV] = str(engines)
    env = child_env(settings, **extra)
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
                        process_group=0,
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


class StageRun(BaseModel):
    """What DVC did with one stage in a build."""

    name: str
    status: Literal["ran", "restored", "unchanged"] = Field(
        description="ran: executed; restored: outputs checked out from DVC's run cache; "
        "unchanged: inputs and outputs matched dvc.lock"
    )
    seconds: float | None = None
    longest: str | None = Field(
        None, description="the stage's longest part and its time, when it had several parts"
    )
    server_from: str | None = Field(
        None,
        description="the release whose vLLM server the stage ran on, kept from earlier in "
        "the build (`releasekit.build.engines`); None when it started its own or none",
    )

    def line(self, release_name: str) -> str:
        """`evidence 107.7 s (longest: starting vLLM 36.8 s)`: the stage by its kind, for a
        line that already names the release."""
        name = self.name.removeprefix(f"{release_name}-")
        took = f" {self.seconds:.0f} s" if self.seconds is not None else ""
        notes = (
            [f"on the vLLM server kept from {self.server_from[:12]}"] if self.server_from else []
        )
        notes += [f"longest: {self.longest}"] if self.longest else []
        return f"{name}{took}" + (f" ({'; '.join(notes)})" if notes else "")


DVC_YAML = "dvc.yaml"


REMOTE_NAME = "local"


def _rel_link(p: Path, root: Path) -> str:
    """Like _rel but without resolving symlinks inside the project (a linked model folder
    is a dependency under its project path)."""
    absolute = p if p.is_absolute() else Path.cwd() / p
    try:
        return absolute.relative_to(root).as_posix()
    except ValueError:
        return project_relative(p, root)


def _is_owned(stage: Any) -> bool:
    return isinstance(stage, dict) and str(stage.get("cmd", "")).startswith(STAGE_CMD + " ")


def _yaml() -> Any:
    from ruamel.yaml import YAML

    y = YAML()  # round trip: keeps the comments and order of stages we do not own
    y.indent(mapping=2, sequence=4, offset=2)
    y.width = 4096
    return y


def _inside(p: Path, root: Path) -> bool:
    try:
        p.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


STAGE_CMD = "releasekit stage"


def project_relative(p: Path, root: Path) -> str:
    try:
        return p.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        # Outside the project (absolute path): DVC tracks it as an external dependency.
        return p.absolute().as_posix()
