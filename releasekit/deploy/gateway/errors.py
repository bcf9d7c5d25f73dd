"""The gateway's errors.

ReleasekitError
└── GatewayError                 root of everything the gateway and its client raise
    ├── GatewayConfigError       the config file is unreadable or invalid
    ├── GatewayStartError        the process could not listen, or never became ready
    ├── GatewayUnreachableError  the admin API does not answer
    ├── GatewayAuthError         the admin API refused the admin token (401)
    ├── GatewayRequestError      the admin API rejected a request (422 routes, 409 drain)
    └── PromptTemplateError      a templated request names an unknown prompt or misses
                                 variables (the gateway answers it with 400)
"""

from __future__ import annotations

from pathlib import Path

from releasekit.errors import ReleasekitError


class GatewayError(ReleasekitError):
    """Root of every error the gateway and its client raise."""

    remedy = "check the gateway's log and its config file"


class GatewayConfigError(GatewayError):
    """Raised when the gateway's config file is unreadable or fails validation; `problems`
    lists each `field: problem`."""

    remedy = "fix the fields listed in the gateway config file (written by the deployer)"

    def __init__(self, path: Path | str, problems: list[str]) -> None:
        self.path = Path(path)
        self.problems = problems
        super().__init__("\n".join(f"{path}: {p}" for p in problems))


class GatewayStartError(GatewayError):
    """Raised when the gateway cannot listen on its address, or its process exits or does
    not write its ready file in time; `log_tail` quotes its log when known."""

    remedy = "check that the gateway's port is free and read its log"

    def __init__(self, message: str, *, log_tail: str = "") -> None:
        self.log_tail = log_tail
        if log_tail:
            message += "\n--- last lines of the gateway log ---\n" + log_tail
        super().__init__(message)


class GatewayUnreachableError(GatewayError):
    """Raised when the gateway's admin API does not answer (not running, wrong address)."""

    remedy = "check that the gateway process runs (`releasekit status`) and its address"


class GatewayAuthError(GatewayError):
    """Raised when the gateway's admin API answers 401: the admin token is wrong."""

    remedy = "use the admin token from the gateway's config file"


class GatewayRequestError(GatewayError):
    """Raised when the admin API rejects a request: an invalid route table (422, `problems`
    lists each `field: problem`) or a drain of a release that still carries traffic (409)."""

    remedy = "fix the request named above"

    def __init__(self, message: str, *, status: int, problems: list[str] | None = None) -> None:
        self.status = status
        self.problems = problems or []
        super().__init__(message)


class PromptTemplateError(GatewayError):
    """Raised when a templated request names a prompt the pinned release lacks, or misses
    variables its templates need; the gateway answers it with 400 and this message."""

    remedy = "send the variables the release's templates name, or use a prompt it defines"
