"""`Settings`, every setting releasekit reads, and its sources: flags > RELEASEKIT_*
environment > releasekit.toml > defaults."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from releasekit.config.environments import EnvironmentConfig
from releasekit.errors import ConfigError

CONFIG_FILE = "releasekit.toml"


def find_root(start: Path | None = None) -> Path:
    """Return the project root: the nearest folder upwards holding releasekit.toml or .git."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / CONFIG_FILE).is_file() or (folder / ".git").exists():
            return folder
    return here


class WebhookConfig(BaseModel):
    """One outbound webhook (`[[webhooks]]`): events are POSTed as JSON (or a Slack-compatible
    `{"text": ...}` body), retried, and written to the dead-letter log when they never land."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(pattern=r"^https?://", description="where events are POSTed")
    format: Literal["json", "slack"] = "json"
    events: list[str] = Field(
        default_factory=list,
        description="event types to send (ledger types: promote, gate_failed, canary_step, "
        "canary_aborted, rollback, ...); empty: all",
    )
    environments: list[str] = Field(default_factory=list, description="empty: all")
    headers: dict[str, str] = Field(default_factory=dict, repr=False)
    timeout_s: float = Field(5.0, gt=0)
    retries: int = Field(3, ge=0, le=20)
    backoff_s: float = Field(0.5, ge=0)

    @field_validator("url")
    @classmethod
    def _safe_url(cls, v: str) -> str:
        """A webhook URL is a credential (a Slack URL is its own secret): https unless the
        listener is on loopback, and no user:password in it. Messages name only scheme and
        host."""
        import ipaddress
        from urllib.parse import urlsplit

        parts = urlsplit(v)
        host = parts.hostname or ""
        shown = f"{parts.scheme}://{host}"
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"webhook {shown}: the URL must not carry user:password")
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if parts.scheme != "https" and not loopback:
            raise ValueError(f"webhook {shown}: a URL off this host's loopback must be https")
        return v


class TrustSettings(BaseModel):
    """`[trust]`: where the protected ref is named when the branch tracks no remote branch.
    Read only from releasekit.toml as committed at HEAD (`releasekit.stores.trust`); the
    copy here (the file on disk, RELEASEKIT_CONFIG, a variable) is accepted and never used."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    protected_revision: str | None = Field(
        None,
        description="a remote-tracking branch (origin/main) or tag (refs/tags/NAME) whose "
        "history policy, keys and approvers must come from, where the branch has no upstream",
    )


class Settings(BaseSettings):
    """Every setting releasekit reads. Paths that are relative resolve against `root`."""

    model_config = SettingsConfigDict(
        env_prefix="RELEASEKIT_", extra="forbid", validate_default=True
    )

    root: Path = Field(default_factory=find_root, description="project (git) root")
    state_dir: Path = Field(Path(".releasekit"), description="local state: stores, logs")
    results_dir: Path = Field(Path("results"), description="build outputs, one folder a release")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; default: SQLite store under state_dir"
    )
    ledger_url: str | None = Field(
        None, description="SQLAlchemy URL of the event ledger; default: SQLite under state_dir"
    )
    actor: str | None = Field(None, description="who acts; default: git user.name <user.email>")
    python: Path = Field(Path(sys.executable), description="interpreter that runs vLLM")
    server_host: str = "127.0.0.1"
    server_start_timeout_s: float = Field(300.0, gt=0)
    server_stop_grace_s: float = Field(10.0, gt=0)
    server_preload: bool = Field(
        False,
        description="start vLLM's CPU build with tcmalloc and Intel OpenMP preloaded (its CPU "
        "guide's advice) when the host has them; off by default: on the demo's 2-core host "
        "it did not help (benchmarks/results/bench_vs_vllm*.json)",
    )
    server_start_nice: int | None = Field(
        -10,
        ge=-20,
        le=19,
        description="scheduler autogroup nice of a deployed server until it is healthy, so a "
        "candidate warms up beside a busy live release (None: leave it; negative needs root)",
    )
    canary_judge_nice: int | None = Field(
        -5,
        ge=-20,
        le=19,
        description="scheduler autogroup nice given to BOTH the canary's and the stable "
        "release's own servers while canary steps are judged, the same for both and reset "
        "after, so that neither is judged with more CPU than the other beside the gateway "
        "and clients (None: leave both)",
    )
    canary_judge_spread: bool = Field(
        True,
        description="while canary steps are judged, let every thread of the canary's and the "
        "stable release's own servers run on every core (their workers are otherwise bound "
        "to one core each, and the one beside the gateway and clients is slower); each "
        "thread's binding is put back after",
    )
    gateway_nice: int | None = Field(
        -10,
        ge=-20,
        le=19,
        description="scheduler autogroup nice of an environment's gateway, which relays every "
        "stream and must not wait behind busy servers (None: leave it)",
    )
    bench_reuse: bool = Field(
        True,
        description="a build cites the main load test of a registered release with the same "
        "engine, load profile, served name and harness, measured on this host kind, instead of "
        "running it again (releasekit.bench.reuse); false: every build measures its own",
    )
    scrape_timeout_s: float = Field(
        10.0,
        gt=0,
        description="seconds one /metrics scrape may take (diagnose, watch); a vLLM API "
        "server on a saturated CPU can take several seconds to answer",
    )
    signing_key: Path | None = Field(
        None, description="Ed25519 private key (PEM) that signs ledger records; never committed"
    )
    trusted_keys_rev: str | None = Field(
        None,
        description="refused when set: policy, trusted keys and approvers are read at the "
        "trust commit (releasekit.stores.trust), which no variable or config file chooses",
    )
    trust: TrustSettings = Field(
        default_factory=lambda: TrustSettings(),
        description="[trust]: read only from releasekit.toml as committed at HEAD",
    )
    mlflow_http_timeout_s: float | None = Field(
        None, gt=0, description="MLflow HTTP timeout (MLFLOW_HTTP_REQUEST_TIMEOUT wins); default 4"
    )
    mlflow_http_max_retries: int | None = Field(
        None, ge=0, description="MLflow HTTP retries (MLFLOW_HTTP_REQUEST_MAX_RETRIES wins); 1"
    )
    environments: dict[str, EnvironmentConfig] = Field(
        default_factory=dict, description="[environments.NAME]: deploy target and policy"
    )
    webhooks: list[WebhookConfig] = Field(
        default_factory=list, description="[[webhooks]]: outbound event notifications"
    )
    links_base_url: str | None = Field(
        None, description="prefix for links to gate reports in notifications (default: file path)"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml = TomlConfigSettingsSource(settings_cls, toml_file=_toml_path())
        return (init_settings, env_settings, toml)

    @field_validator("trusted_keys_rev")
    @classmethod
    def _no_trust_override(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError(
                "the trust revision is not a setting: policy, keys and approvers are read at "
                "HEAD when it is on the protected ref (the branch's upstream, or [trust] "
                "protected_revision committed at HEAD); unset it"
            )
        return v

    @model_validator(mode="after")
    def _resolve(self) -> Settings:
        self.root = self.root.resolve()
        self.state_dir = self._abs(self.state_dir)
        self.results_dir = self._abs(self.results_dir)
        if self.mlflow_tracking_uri is None:
            # MLflow's own convention wins over our default.
            self.mlflow_tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or (
                f"sqlite:///{self.state_dir / 'mlflow.db'}"
            )
        if self.ledger_url is None:
            self.ledger_url = f"sqlite:///{self.state_dir / 'ledger.db'}"
        return self

    def _abs(self, p: Path) -> Path:
        return p if p.is_absolute() else self.root / p

    @property
    def mlflow_artifact_root(self) -> Path:
        """Where the embedded MLflow store keeps artifacts."""
        return self.state_dir / "mlartifacts"

    def release_dir(self, release_id: str) -> Path:
        """Folder holding one release's build outputs."""
        return self.results_dir / release_id


def _toml_path() -> Path:
    explicit = os.environ.get("RELEASEKIT_CONFIG")
    if explicit:
        return Path(explicit)
    root = Path(os.environ["RELEASEKIT_ROOT"]) if "RELEASEKIT_ROOT" in os.environ else find_root()
    return root / CONFIG_FILE


def load_settings(**overrides: Any) -> Settings:
    """Build settings once (flags passed as overrides); translate validation errors."""
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"invalid settings: {problems}") from exc
    except (OSError, ValueError) as exc:  # unreadable or malformed TOML
        raise ConfigError(f"cannot read {_toml_path()}: {exc}") from exc
