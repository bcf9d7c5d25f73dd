"""The Alertmanager webhook's side of a watch: the receiver's path, its credentials from the
environment (a bearer token, a token file, or basic auth) and where it keeps its deliveries."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import SecretStr

from releasekit.config import Settings
from releasekit.watch.plan import WatchSetupError
from releasekit.watch.receiver import BasicCredential, ReceiverAuth

TOKEN_ENV = "RELEASEKIT_WEBHOOK_TOKEN"
TOKEN_FILE_ENV = "RELEASEKIT_WEBHOOK_TOKEN_FILE"
USER_ENV = "RELEASEKIT_WEBHOOK_USER"
PASSWORD_ENV = "RELEASEKIT_WEBHOOK_PASSWORD"
RECEIVER_PATH = "/alertmanager"


def receiver_auth(environ: Mapping[str, str] | None = None) -> ReceiverAuth | None:
    """Receiver credentials from the environment: RELEASEKIT_WEBHOOK_TOKEN (or
    RELEASEKIT_WEBHOOK_TOKEN_FILE) for bearer, RELEASEKIT_WEBHOOK_USER and
    RELEASEKIT_WEBHOOK_PASSWORD for basic auth; None when none is set."""
    env = os.environ if environ is None else environ
    tokens: list[SecretStr] = []
    if env.get(TOKEN_ENV):
        tokens.append(SecretStr(env[TOKEN_ENV]))
    if env.get(TOKEN_FILE_ENV):
        try:
            text = Path(env[TOKEN_FILE_ENV]).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise WatchSetupError(
                f"cannot read {TOKEN_FILE_ENV}={env[TOKEN_FILE_ENV]}: {exc}",
                remedy="point it at a readable file holding the token",
            ) from exc
        if text:
            tokens.append(SecretStr(text))
    basic: list[BasicCredential] = []
    if env.get(USER_ENV) and env.get(PASSWORD_ENV):
        basic.append(BasicCredential(username=env[USER_ENV], password=SecretStr(env[PASSWORD_ENV])))
    if not tokens and not basic:
        return None
    return ReceiverAuth(bearer_tokens=tokens, basic=basic)


def receiver_store_path(settings: Settings) -> Path:
    """Where the receiver keeps its deliveries: `<state_dir>/watch/alerts.db`."""
    return settings.state_dir / "watch" / "alerts.db"
