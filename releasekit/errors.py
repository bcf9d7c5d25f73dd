"""The one error tree: every failure a user can meet, with what to do about it.

ReleasekitError                 root; the CLI prints `error: <message>` + remedy, exit 1
├── ConfigError                 releasekit.toml / RELEASEKIT_* settings are invalid
├── ManifestError               a manifest is unreadable or invalid (all problems at once)
├── InputMissingError           a file the manifest names does not exist
├── PromptError                 a prompt template cannot be rendered (placeholder without value)
├── TimeParseError              a time an auditor typed is not a time
├── LockError                   a lock file is missing or unreadable
│   └── LockMismatchError       inputs changed since the lock (`lock --check`)
├── GitError                    git provenance could not be read
├── ServerError                 a vLLM server could not be started or reached
│   ├── ServerStartError        the server died or never became healthy (quotes its log)
│   ├── ServerUnreachableError  a running server does not answer
│   └── ReleaseNotBuiltError    a quantised release is served before its build made the model
├── BuildError                  a build stage failed
│   └── QuantiseError           llm-compressor failed
├── BenchError                  a load test could not run or produced no data
├── EvalError                   an eval suite could not run
│   └── JudgeError              the pinned judge timed out or answered unparseably
├── RegistryError               MLflow refused or failed an operation
├── LedgerError                 the event ledger could not be read or appended
│   └── LedgerIntegrityError    the hash chain is broken (edited/deleted/reordered row)
└── ReleaseNotFoundError        a release reference matches nothing (or too much)
"""

from __future__ import annotations

from pathlib import Path


class ReleasekitError(Exception):
    """Root of every error releasekit raises on purpose.

    `message` says what is wrong; `remedy` says what to do. The CLI prints both on
    one line and exits 1.
    """

    remedy: str = ""

    def __init__(self, message: str, *, remedy: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if remedy is not None:
            self.remedy = remedy

    def __str__(self) -> str:
        return self.message


class ConfigError(ReleasekitError):
    """Raised when releasekit.toml or a RELEASEKIT_* variable fails validation."""

    remedy = "fix the setting named above in releasekit.toml or the environment"


class ManifestError(ReleasekitError):
    """Raised when a manifest cannot be parsed or validated.

    `problems` holds every `field.path: problem` found, so a user fixes all at once.
    """

    remedy = "fix the fields listed and run `releasekit validate` again"

    def __init__(self, path: Path | str, problems: list[str], *, remedy: str | None = None) -> None:
        self.path = Path(path)
        self.problems = problems
        super().__init__("\n".join(f"{path}: {p}" for p in problems), remedy=remedy)


class InputMissingError(ReleasekitError):
    """Raised when a file or folder that a manifest names does not exist."""

    remedy = "create the file, fix the path in the manifest, or run `dvc repro` to produce it"

    def __init__(self, path: Path | str, *, what: str) -> None:
        self.path = Path(path)
        super().__init__(f"{what} not found: {path}")


class PromptError(ReleasekitError):
    """Raised when a prompt template cannot be rendered: a placeholder has no value."""

    remedy = "give every `{{ name }}` placeholder a value (manifest prompt variables or item vars)"


class TimeParseError(ReleasekitError):
    """Raised when a time given to `at` or `history --since` is not a time."""

    remedy = "use ISO 8601 like 2025-05-01T12:00:00Z, 'now' or a relative time like '2h ago'"


class LockError(ReleasekitError):
    """Raised when a lock file is missing, unreadable or belongs to another manifest."""

    remedy = "run `releasekit lock MANIFEST` to (re)create it"


class LockMismatchError(LockError):
    """Raised by `lock --check` when inputs changed since the lock was written.

    `changed` names each input whose digest differs, was added or removed.
    """

    remedy = "review the change, then run `releasekit lock MANIFEST` to lock a new release"

    def __init__(self, path: Path | str, changed: list[str]) -> None:
        self.path = Path(path)
        self.changed = changed
        super().__init__(f"{path}: inputs changed since lock: {', '.join(changed)}")


class GitError(ReleasekitError):
    """Raised when git provenance cannot be read (not a repository, git missing)."""

    remedy = "run inside a git repository (`git init`), or check that git is installed"


class ServerError(ReleasekitError):
    """Raised when a vLLM server cannot be used."""

    remedy = "check the server's log and the manifest's serving arguments"


class ServerStartError(ServerError):
    """Raised when vLLM exits or never becomes healthy; `log_tail` quotes its log."""

    def __init__(self, message: str, *, log_tail: str = "", log_path: Path | None = None) -> None:
        self.log_tail = log_tail
        self.log_path = log_path
        full = message
        if log_tail:
            full += "\n--- last lines of the server log ---\n" + log_tail
        super().__init__(full)


class ServerUnreachableError(ServerError):
    """Raised when a server URL does not answer (connection refused, timeout)."""

    remedy = "check the URL and that the server is running (`curl URL/health`)"


class BuildError(ReleasekitError):
    """Raised when a build stage fails."""

    remedy = "read the stage's output above, fix the cause and rerun `releasekit build`"


class QuantiseError(BuildError):
    """Raised when llm-compressor fails or writes an unusable model."""

    remedy = "check the quantisation section of the manifest (scheme, ignore list, calibration)"


class BenchError(ReleasekitError):
    """Raised when a load test cannot run or every request failed."""

    remedy = "check that the server is healthy and the load profile is valid"


class EvalError(ReleasekitError):
    """Raised when an eval suite cannot be read or run."""

    remedy = "check the suite files and the manifest's eval section"


class JudgeError(EvalError):
    """Raised when the pinned LLM judge times out or answers unparseably."""

    remedy = "check the judge endpoint and its timeout; judged items are marked as errors"


class RegistryError(ReleasekitError):
    """Raised when MLflow refuses or fails an operation."""

    remedy = "check MLFLOW_TRACKING_URI and that the tracking server is reachable"


class LedgerError(ReleasekitError):
    """Raised when the event ledger cannot be read or appended to."""

    remedy = "check the ledger URL (RELEASEKIT_LEDGER_URL or releasekit.toml)"


class LedgerIntegrityError(LedgerError):
    """Raised when the hash chain is broken; `seq` is the first bad record."""

    remedy = "restore the ledger from a backup; the named record was edited, deleted or reordered"

    def __init__(self, message: str, *, seq: int | None = None) -> None:
        self.seq = seq
        super().__init__(message)


class ReleaseNotFoundError(ReleasekitError):
    """Raised when a release reference (id, prefix, name@version, manifest) matches nothing
    or more than one release."""

    remedy = "run `releasekit history` to list known releases"


class ReleaseNotBuiltError(ServerError):
    """Raised when a quantised release is served before `releasekit build` made its model."""

    remedy = "run `releasekit build MANIFEST` first"
