"""The manifest's `serving.args` checked against vLLM's own engine-argument parser, before
anything runs: an unknown flag or a wrong value is reported as
`serving.args.max-num-seqs: invalid int value: 'many'`, not when the server fails to start in
the middle of a build.

vLLM takes seconds to import, so `validate` never imports it in-process:

- The option table (flag -> on/off or value, type, choices, nargs, default) is read once
  from the OpenAI server's parser (`make_arg_parser`, i.e. `FrontendArgs` plus
  `AsyncEngineArgs.add_cli_args` on a `FlexibleArgumentParser`) by running `_vllm_probe.py`
  in the interpreter that serves vLLM (`settings.python`), and cached as JSON under
  `<state_dir>/cache/engine-args/`, keyed by the vLLM version and a fingerprint of its
  argument modules (path, size, mtime). A new vLLM gets a new table.
- Values of simple types (int, float, str, human-readable ints such as `1k`, JSON, choices)
  are checked in-process from the table, with the same conversions vLLM's parser applies.
  Values of other types (config objects such as `compilation-config`, custom actions, dotted
  `a.b` JSON keys) are parsed by the real parser in the same probe run; each
  (flag, value) verdict is cached too, so an unchanged manifest never starts the probe.
- Nothing is checked (and nothing is slow) when a manifest has no serving args, or when
  the serving interpreter has no vLLM (the check is then skipped, not failed).

Stricter than vLLM on purpose: argparse accepts a unique prefix (`max-num-seq`) as an
abbreviation; here it is an unknown argument with a suggestion, because a later vLLM can
make the prefix ambiguous. `false` on a flag leaves it out of the command line (see
`releasekit.spec.lock.serving_args`); on a flag whose vLLM default is on, or on an
argument that takes a value, that silently does nothing, so it is reported.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from releasekit._support.files import write_atomic
from releasekit.config import Settings, load_settings
from releasekit.errors import ReleasekitError
from releasekit.spec.manifest import LoadedManifest

ArgValue = str | int | float | bool | None

PROBE = Path(__file__).with_name("_vllm_probe.py")
_MARKER = "@@RELEASEKIT-JSON@@"
_ARG_MODULES = (
    "engine/arg_utils.py",
    "entrypoints/launchers/cli_args.py",
    "entrypoints/openai/cli_args.py",
    "utils/argparse_utils.py",
)
_VERSION = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?["']([^"']+)["']""", re.M)


class EngineArgsUnavailableError(ReleasekitError):
    """Raised when vLLM is installed for the serving interpreter but its argument parser
    cannot be read (the probe crashed, timed out or printed no answer)."""

    remedy = (
        "check that `PYTHON -c 'import vllm'` works for the interpreter in settings.python "
        "(RELEASEKIT_PYTHON), or fix the vLLM install"
    )


class EngineOption(BaseModel):
    """One option of vLLM's server parser, as far as a manifest value needs it."""

    flags: list[str] = Field(description="every spelling, e.g. --enforce-eager, --no-enforce-eager")
    dest: str
    kind: Literal["flag", "flag_or_value", "value"]
    type: str = Field(
        description="int, float, str, human_readable_int, human_readable_int_or_auto, loads "
        "(JSON), or other (checked by the real parser)"
    )
    optional: bool = Field(False, description="also accepts 'None' or '' (as None)")
    nargs: int | str | None = None
    choices: list[str | int | float | bool | None] | None = None
    default_on: bool = False
    negatable: bool = Field(False, description="has a --no- form (BooleanOptionalAction)")


class EngineArgTable(BaseModel):
    """vLLM's server options for one installed vLLM (cached as JSON)."""

    vllm_version: str
    fingerprint: str
    options: list[EngineOption]

    def index(self) -> dict[str, EngineOption]:
        """Every flag spelling -> its option."""
        return {f: o for o in self.options for f in o.flags}


class VllmInstall(BaseModel):
    """Where the serving interpreter finds vLLM, and the cache key that follows from it."""

    python: str
    package_dir: str
    version: str
    fingerprint: str

    @property
    def cache_name(self) -> str:
        """The table's cache file name: vllm-<version>-<fingerprint>.json."""
        safe = re.sub(r"[^A-Za-z0-9._+-]", "_", self.version)
        return f"vllm-{safe}-{self.fingerprint}.json"


class _ValueCache(BaseModel):
    checks: dict[str, str | None] = Field(default_factory=dict)


# ---- finding vLLM without importing it -----------------------------------------------------


def locate_vllm(python: Path | str) -> VllmInstall | None:
    """Find the vLLM package of `python` without importing vLLM (find_spec only); None if
    that interpreter has no vLLM."""
    python = str(python)
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        spec = importlib.util.find_spec("vllm")
        origin = spec.origin if spec is not None else None
    else:
        code = "import importlib.util as u; s = u.find_spec('vllm'); print(s.origin if s else '')"
        try:
            proc = subprocess.run(
                [python, "-c", code], capture_output=True, text=True, timeout=60, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        origin = proc.stdout.strip() or None if proc.returncode == 0 else None
    if not origin or origin == "None":
        return None
    pkg = Path(origin).parent
    version = "unknown"
    vfile = pkg / "_version.py"
    if vfile.is_file():
        m = _VERSION.search(vfile.read_text(encoding="utf-8", errors="replace"))
        if m:
            version = m.group(1)
    stats: list[object] = [python, str(pkg), version]
    for rel in _ARG_MODULES:
        f = pkg / rel
        if f.is_file():
            st = f.stat()
            stats.append([rel, st.st_size, st.st_mtime_ns])
    fp = hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]
    return VllmInstall(python=python, package_dir=str(pkg), version=version, fingerprint=fp)


# ---- the probe -----------------------------------------------------------------------------


def run_probe(
    python: Path | str,
    *,
    table: bool,
    pairs: list[tuple[str, str | None]],
    timeout_s: float = 600.0,
) -> tuple[dict[str, object] | None, list[str | None]]:
    """Run `_vllm_probe.py` in `python`: vLLM's option table (if `table`) and the real
    parser's verdict on each (flag, value). EngineArgsUnavailableError if it fails."""
    request = json.dumps({"table": table, "pairs": [list(p) for p in pairs]})
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "TQDM_DISABLE": "1"}
    try:
        proc = subprocess.run(
            [str(python), str(PROBE)],
            input=request,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise EngineArgsUnavailableError(
            f"reading vLLM's engine arguments with {python} took over {timeout_s:g}s"
        ) from exc
    except OSError as exc:
        raise EngineArgsUnavailableError(f"cannot run {python}: {exc}") from exc
    answer = next(
        (ln[len(_MARKER) :] for ln in proc.stdout.splitlines() if ln.startswith(_MARKER)), None
    )
    if proc.returncode != 0 or answer is None:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise EngineArgsUnavailableError(
            f"could not read vLLM's engine arguments with {python} "
            f"(exit {proc.returncode}): {tail or 'no output'}"
        )
    data = json.loads(answer)
    checks = data.get("checks") or []
    if len(checks) != len(pairs):
        raise EngineArgsUnavailableError(
            "vLLM's argument probe answered the wrong number of checks"
        )
    return data.get("table"), list(checks)


# ---- in-process conversions (the same as vLLM's parser types) -----------------------------


def _human_int(value: str) -> int:
    """vllm.utils.argparse_utils.human_readable_int: '1k' = 1000, '1K' = 1024, '25.6k'."""
    value = value.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if m:
        number, suffix = m.groups()
        if suffix in "kmgt":
            return int(float(number) * 10 ** (3 * ("kmgt".index(suffix) + 1)))
        if "." in number:
            raise ValueError(f"decimals are not allowed with binary suffixes like {suffix}")
        return int(number) * 2 ** (10 * ("KMGT".index(suffix) + 1))
    return int(value)


def _convert(type_name: str, text: str) -> object:
    """Convert like the parser's type function; ValueError with argparse's wording."""
    try:
        if type_name == "int":
            return int(text)
        if type_name == "float":
            return float(text)
        if type_name == "human_readable_int":
            return _human_int(text)
        if type_name == "human_readable_int_or_auto":
            return (
                -1
                if text.strip() in ("-1",) or text.strip().lower() == "auto"
                else _human_int(text)
            )
        if type_name == "loads":
            return json.loads(text)
    except ValueError as exc:
        detail = f" ({exc})" if type_name.startswith("human") or type_name == "loads" else ""
        raise ValueError(f"invalid {type_name} value: {text!r}{detail}") from exc
    return text


# ---- the check -----------------------------------------------------------------------------


_DEFER = "defer"


def _local_problem(opt: EngineOption, name: str, value: ArgValue) -> str | None:
    """The problem with one value by the table, None if fine, _DEFER for the real parser."""
    flagged = value is True or value is None
    if opt.kind == "flag":
        if value is False and opt.default_on and opt.negatable:
            return (
                f"false leaves --{name} out, and vLLM's default is on: "
                f"write `no-{name}: true` to turn it off"
            )
        if flagged or value is False:
            return None
        return f"is an on/off flag: write true or false, not {value!r}"
    if opt.kind == "flag_or_value" and (flagged or value is False):
        return None
    if flagged:
        return "needs a value"
    if value is False:
        return f"needs a value (false leaves --{name} out: delete the line instead)"
    if opt.type == "other":
        return _DEFER
    text = str(value)
    if opt.optional and text in ("", "None"):
        return None
    try:
        converted = _convert(opt.type, text)
    except ValueError as exc:
        return str(exc)
    if opt.choices is not None and converted not in opt.choices:
        shown = ", ".join(repr(c) for c in opt.choices)
        return f"invalid choice: {converted!r} (choose from {shown})"
    return None


def _argv_value(value: ArgValue) -> str | None:
    return None if value is True or value is None else str(value)


def _suggest(flag: str, index: Mapping[str, EngineOption]) -> str:
    longs = [f for f in index if f.startswith("--")]
    prefixed = [f for f in longs if f.startswith(flag)]
    close = prefixed[:1] if len(prefixed) == 1 else difflib.get_close_matches(flag, longs, n=1)
    return f"; did you mean `{close[0][2:]}`?" if close else ""


class EngineArgChecker:
    """Checks serving args against one interpreter's vLLM, with the cache described in the
    module docstring. One instance can check many manifests (the table is read once)."""

    def __init__(self, *, python: Path | str, cache_dir: Path, timeout_s: float = 600.0) -> None:
        self.python = str(python)
        self.cache_dir = cache_dir
        self.timeout_s = timeout_s
        self._install: VllmInstall | None = None
        self._located = False
        self._table: EngineArgTable | None = None

    # cache files
    def _table_path(self, inst: VllmInstall) -> Path:
        return self.cache_dir / inst.cache_name

    def _values_path(self, inst: VllmInstall) -> Path:
        return self.cache_dir / inst.cache_name.replace(".json", ".values.json")

    def install(self) -> VllmInstall | None:
        """The vLLM this checker checks against (located once), None if there is none."""
        if not self._located:
            self._install = locate_vllm(self.python)
            self._located = True
        return self._install

    def _cached_table(self, inst: VllmInstall) -> EngineArgTable | None:
        if self._table is not None:
            return self._table
        path = self._table_path(inst)
        if path.is_file():
            try:
                self._table = EngineArgTable.model_validate_json(path.read_bytes())
            except (ValidationError, OSError):
                self._table = None  # a damaged cache is rebuilt, never trusted
        return self._table

    def _values(self, inst: VllmInstall) -> _ValueCache:
        path = self._values_path(inst)
        if path.is_file():
            try:
                return _ValueCache.model_validate_json(path.read_bytes())
            except (ValidationError, OSError):
                pass
        return _ValueCache()

    def table(self) -> EngineArgTable | None:
        """vLLM's option table (from the cache, else one probe run); None without vLLM."""
        inst = self.install()
        if inst is None:
            return None
        cached = self._cached_table(inst)
        if cached is not None:
            return cached
        self._probe(inst, [])
        return self._table

    def _probe(self, inst: VllmInstall, pairs: list[tuple[str, str | None]]) -> list[str | None]:
        need_table = self._cached_table(inst) is None
        raw, checks = run_probe(
            self.python, table=need_table, pairs=pairs, timeout_s=self.timeout_s
        )
        if need_table:
            try:
                table = EngineArgTable.model_validate(
                    {**(raw or {}), "fingerprint": inst.fingerprint, "vllm_version": inst.version}
                )
            except ValidationError as exc:
                raise EngineArgsUnavailableError(
                    f"vLLM's argument probe answered an unreadable table: {exc}"
                ) from exc
            write_atomic(self._table_path(inst), table.model_dump_json().encode())
            self._table = table
        if pairs:
            cache = self._values(inst)
            for (flag, value), problem in zip(pairs, checks, strict=True):
                cache.checks[_key(flag, value)] = problem
            write_atomic(self._values_path(inst), cache.model_dump_json().encode())
        return checks

    def problems(self, args: Mapping[str, ArgValue], *, field: str = "serving.args") -> list[str]:
        """`field.<key>: problem` for each bad argument in `args` (manifest spelling of the
        keys); [] when all are fine, when `args` is empty, or when there is no vLLM."""
        if not args:
            return []
        inst = self.install()
        if inst is None:
            return []
        table = self._cached_table(inst)
        if table is None:
            # Cold: one probe run gets the table and the real parser's verdict on every pair.
            # (`false` puts nothing on the command line: nothing for the parser to check.)
            pairs = [
                ("--" + k.replace("_", "-"), _argv_value(v))
                for k, v in args.items()
                if v is not False
            ]
            self._probe(inst, pairs)
            table = self._table
            if table is None:  # pragma: no cover - _probe sets it or raises
                return []
        index = table.index()
        out: dict[str, str] = {}
        deferred: dict[str, tuple[str, str | None]] = {}
        for key, value in args.items():
            name = key.replace("_", "-")
            base = name.split(".", 1)[0]
            opt = index.get("--" + base)
            if opt is None:
                hint = _suggest("--" + base, index)
                out[key] = f"unknown vLLM engine argument (vLLM {table.vllm_version}){hint}"
                continue
            if "." in name:
                problem: str | None = (
                    _DEFER
                    if opt.type in ("other", "loads")
                    else f"--{base} takes no nested keys (`{name}`)"
                )
                if value is True or value is None or value is False:
                    problem = "a nested key needs a value"
            else:
                problem = _local_problem(opt, name, value)
            if problem == _DEFER:
                deferred[key] = ("--" + name, _argv_value(value))
            elif problem is not None:
                out[key] = problem
        if deferred:
            cache = self._values(inst)
            todo = [p for p in deferred.values() if _key(*p) not in cache.checks]
            if todo:
                self._probe(inst, todo)
                cache = self._values(inst)
            for key, pair in deferred.items():
                verdict = cache.checks.get(_key(*pair))
                if verdict:
                    out[key] = _clean(verdict)
        return [f"{field}.{k}: {out[k]}" for k in args if k in out]


def _key(flag: str, value: str | None) -> str:
    return json.dumps([flag, value])


def _clean(message: str) -> str:
    """vLLM's parser message on one line, without its `argument --x:` prefix."""
    msg = re.sub(r"^argument [^:]+:\s*", "", message.strip())
    lines = [
        ln.strip() for ln in msg.splitlines() if ln.strip() and "errors.pydantic.dev" not in ln
    ]
    return "; ".join(lines)[:400]


def engine_args_cache_dir(settings: Settings) -> Path:
    """Where the option tables are cached: <state_dir>/cache/engine-args."""
    return settings.state_dir / "cache" / "engine-args"


class ServingArgCheck(BaseModel):
    """The outcome of checking a manifest's serving args: the problems found, and, when the
    check could not run at all, why not (`not_checked`; the args were then not judged)."""

    problems: list[str] = Field(default_factory=list)
    not_checked: str | None = None


def check_serving_args(lm: LoadedManifest, *, settings: Settings | None = None) -> ServingArgCheck:
    """Check the manifest's serving args against vLLM's parser (of `settings.python`):
    `serving.args.<key>: problem` for each argument vLLM would refuse or that would silently
    do nothing. Nothing to check without serving args (vLLM is then not looked up). Without a
    vLLM in that interpreter the check is skipped and `not_checked` says so; a vLLM whose
    parser cannot be read is one problem line, `serving.args: ...`."""
    args = lm.manifest.serving.args
    if not args:
        return ServingArgCheck()
    s = settings or load_settings()
    checker = EngineArgChecker(python=s.python, cache_dir=engine_args_cache_dir(s))
    if checker.install() is None:
        return ServingArgCheck(
            not_checked=f"serving.args not checked against vLLM: the serving interpreter "
            f"{s.python} has no vLLM (set `python` in releasekit.toml or RELEASEKIT_PYTHON "
            "to the one that serves)"
        )
    try:
        return ServingArgCheck(problems=checker.problems(args))
    except EngineArgsUnavailableError as exc:
        return ServingArgCheck(problems=[f"serving.args: cannot check against vLLM: {exc.message}"])


def serving_arg_problems(lm: LoadedManifest, *, settings: Settings | None = None) -> list[str]:
    """The problems of `check_serving_args` ([] also when the check was skipped)."""
    return check_serving_args(lm, settings=settings).problems
