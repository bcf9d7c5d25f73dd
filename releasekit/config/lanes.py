"""Adapter lanes: an environment's LoRA adapters released one by one on its live base.

A lane is named `<env>:<adapter>` (`staging:demo-json`): the environment whose gateway,
engine, policy and lock it shares, and the adapter's client name (the request's `model`).
Its releases have their own ledger records under that name, so `history`, `at`, `status`,
`rollback` and `audit` answer per lane, and a lane's change never moves the base's route or
another lane's."""

from __future__ import annotations

import re

LANE_SEP = ":"


def split_lane(name: str) -> tuple[str, str | None]:
    """(`env`, `adapter`) of a lane name, (`name`, None) for a plain environment."""
    env, sep, lane = name.partition(LANE_SEP)
    return (env, lane) if sep and lane else (name, None)


def parent_env(name: str) -> str:
    """The environment a lane belongs to (`name` itself for a plain environment)."""
    return split_lane(name)[0]


def lane_name(env: str, adapter: str) -> str:
    """`<env>:<adapter>`."""
    return f"{env}{LANE_SEP}{adapter}"


def is_lane(name: str) -> bool:
    """Whether `name` names an adapter lane."""
    return split_lane(name)[1] is not None


def flat_name(name: str) -> str:
    """An environment's name where only letters, digits, `-` and `_` go (an MLflow model or
    prompt alias, a file name, a link): its name, and for a lane `<env>__<adapter>`."""
    env, lane = split_lane(name)
    if lane is None:
        return name
    return f"{env}__{re.sub(r'[^A-Za-z0-9_-]', '-', lane)}"[:63]
