"""The one error tree: every failure a user can meet, with what to do about it.

ReleasekitError                 root; the CLI prints `error: <message>` + remedy, exit 1
├── ConfigError                 releasekit.toml / RELEASEKIT_* settings are invalid
│   └── PolicyError             an environment's policy differs from the committed one
│                               (releasekit.promote.policy)
├── ManifestError               a manifest is unreadable or invalid (all problems at once)
├── InputMissingError           a file the manifest names does not exist
├── PromptError                 a prompt template cannot be rendered (placeholder without value)
├── TimeParseError              a time an auditor typed is not a time
├── LockError                   a lock file is missing or unreadable
│   └── LockMismatchError       inputs changed since the lock (`lock --check`)
├── GitError                    git provenance could not be read
│   └── AnchorError             the ledger's git anchor ref cannot be read or written
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
│   ├── RegistryUnreachableError  the tracking server does not answer (bounded wait)
│   ├── RegistryStoreMissingError a read-only command found no MLflow store at the URI
│   └── AliasDriftError         the event was recorded but the alias could not be moved
├── LedgerError                 the event ledger could not be read or appended
│   ├── LedgerNotFoundError     a read-only command found no ledger at the URL
│   ├── LedgerLockTimeoutError  an environment's or release's lock stayed held too long
│   ├── SigningKeyError         a signing key file is unreadable, of the wrong type, ambiguous
│   │   └── SigningRequiredError  an unsigned append to a ledger that must be signed
│   └── LedgerIntegrityError    the hash chain is broken (edited/deleted/reordered row)
│       ├── SignatureError      a record's signature fails or names an untrusted key
│       └── AnchorMismatchError the ledger contradicts its git anchor
├── ApprovalError               an environment needs an approval the release lacks, or an
│                               approval cannot be recorded (releasekit.promote.approvals)
├── RolloutResumeError          `promote --resume` finds no interrupted canary for that
│                               release (releasekit.rollout.progressive)
├── ShadowError                 shadow traffic cannot be started, compared or stopped
│                               (releasekit.rollout.shadow)
├── ReleaseNotFoundError        a release reference matches nothing (or too much)
└── NotAProjectError            a command runs outside a releasekit project
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


class AnchorError(GitError):
    """Raised when the anchor ref cannot be read or written: not a git repository, git
    missing, or a malformed anchor commit. Appends treat it as a warning, never a crash."""

    remedy = (
        "run inside the project's git repository (`git init`), or check that git is installed; "
        "then `releasekit ledger anchor`"
    )


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


class AdapterLoadError(ServerError):
    """Raised when a running engine refuses or fails to load (or unload) a LoRA adapter, or
    an adapter's files no longer match the digests its release locked."""

    remedy = (
        "check the adapter's files against its release (`releasekit show`), its rank against "
        "the engine's max-lora-rank and the count against max-loras; the route did not move"
    )


class ServerUnreachableError(ServerError):
    """Raised when a server URL does not answer (connection refused, timeout)."""

    remedy = "check the URL and that the server is running (`curl URL/health`)"


class BuildError(ReleasekitError):
    """Raised when a build stage fails."""

    remedy = "read the stage's output above, fix the cause and rerun `releasekit build`"


class LadderError(ReleasekitError):
    """Raised when a quantisation ladder cannot run: a base that is already quantised, a
    rung manifest that differs from the base in more than its recipe."""

    remedy = "fix the ladder file or the manifest it names, then rerun `releasekit quantise ladder`"


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


class RegistryUnreachableError(RegistryError):
    """Raised when the MLflow tracking server does not answer within the HTTP timeout and
    retry budget (connection refused, timed out, unknown host); `uri` is the server tried.
    Never reported as "no release matches": nothing could be looked up."""

    remedy = (
        "check MLFLOW_TRACKING_URI and that the tracking server is up "
        "(`curl URI/health`); raise MLFLOW_HTTP_REQUEST_TIMEOUT for a slow server"
    )

    def __init__(self, message: str, *, uri: str) -> None:
        self.uri = uri
        super().__init__(message)


class RegistryStoreMissingError(RegistryError):
    """Raised when a command that only reads finds no MLflow store at the tracking URI (the
    SQLite file does not exist); nothing is created."""

    remedy = (
        "point MLFLOW_TRACKING_URI (or `mlflow_tracking_uri` in releasekit.toml) at the "
        "team's MLflow, or run the command from the project that holds the store"
    )

    def __init__(self, message: str, *, uri: str) -> None:
        self.uri = uri
        super().__init__(message)


class AliasDriftError(RegistryError):
    """Raised when an assignment was recorded in the ledger but the MLflow alias could not
    be moved afterwards; the ledger is right and the alias lags (`environment`, `seq`)."""

    remedy = "run `releasekit reconcile` once MLflow answers; it moves the alias to match"

    def __init__(self, message: str, *, environment: str, seq: int) -> None:
        self.environment = environment
        self.seq = seq
        super().__init__(message)


class LedgerError(ReleasekitError):
    """Raised when the event ledger cannot be read or appended to."""

    remedy = "check the ledger URL (RELEASEKIT_LEDGER_URL or releasekit.toml)"


class LedgerNotFoundError(LedgerError):
    """Raised when a command that only reads finds no ledger at the URL in force (a missing
    SQLite file, or a server database without the ledger's tables). Nothing is created."""

    remedy = (
        "point RELEASEKIT_LEDGER_URL (or `ledger_url` in releasekit.toml) at the team's "
        "ledger, or run the command from the project that holds it"
    )

    def __init__(self, message: str, *, url: str) -> None:
        self.url = url
        super().__init__(message)


class LedgerLockTimeoutError(LedgerError):
    """Raised when a named lock (an environment's assignment lock, a release's register
    lock) stays held by another process for longer than the wait allows; `name` is the lock
    and `holder` says who holds it when the database can tell."""

    remedy = (
        "another releasekit command is changing the same environment or release: wait for it "
        "and retry (a lease left by a killed process on another host expires by itself)"
    )

    def __init__(self, message: str, *, name: str, holder: str | None = None) -> None:
        self.name = name
        self.holder = holder
        super().__init__(message)


class SigningKeyError(LedgerError):
    """Raised when a signing key (private or public) cannot be read, has the wrong type, or
    when more than one private key could be meant and none is named."""

    remedy = (
        "set RELEASEKIT_SIGNING_KEY to the private key's PEM file, or create one with "
        "`releasekit ledger keygen`"
    )


class SigningRequiredError(SigningKeyError):
    """Raised when a record would be appended unsigned to a ledger that must be signed: the
    repository trusts a key, or the ledger's newest record is signed. Nothing is written."""

    remedy = (
        "set RELEASEKIT_SIGNING_KEY (or `signing_key` in releasekit.toml) to the private key "
        "whose keys/<key id>.pub is committed, then retry; a new key: `releasekit ledger "
        "keygen`, then commit its .pub"
    )


class LedgerIntegrityError(LedgerError):
    """Raised when the hash chain is broken; `seq` is the first bad record."""

    remedy = "restore the ledger from a backup; the named record was edited, deleted or reordered"

    def __init__(self, message: str, *, seq: int | None = None) -> None:
        self.seq = seq
        super().__init__(message)


class SignatureError(LedgerIntegrityError):
    """Raised when a record's signature does not verify, or names a key the repository does
    not trust; `seq` is the record and `key_id` the key it names."""

    remedy = (
        "the record was changed after signing or signed by an untrusted key: restore the "
        "ledger from a backup, or add the signer's keys/<key id>.pub if it is a legitimate key"
    )

    def __init__(self, message: str, *, seq: int | None = None, key_id: str | None = None) -> None:
        self.key_id = key_id
        super().__init__(message, seq=seq)


class AnchorMismatchError(LedgerIntegrityError):
    """Raised when asked to anchor a head that contradicts the anchor already there (same
    sequence number, another hash): the ledger diverged from its anchored history."""

    remedy = (
        "run `releasekit ledger verify`: the ledger no longer extends its git anchor; restore "
        "it from a backup"
    )


class ReleaseNotFoundError(ReleasekitError):
    """Raised when a release reference (id, prefix, name@version, manifest) matches nothing
    or more than one release."""

    remedy = "run `releasekit history` to list known releases"


class ReleaseNotBuiltError(ServerError):
    """Raised when a quantised release is served before `releasekit build` made its model."""

    remedy = "run `releasekit build MANIFEST` first"


class NotAProjectError(ReleasekitError):
    """Raised when a command runs outside a releasekit project (no releasekit.toml, .git or
    manifests/ at or above the current folder), instead of making state in a random folder."""

    remedy = "cd into the project (the folder with releasekit.toml), or set RELEASEKIT_ROOT"

    def __init__(self, message: str, *, root: Path) -> None:
        self.root = root
        super().__init__(message)
