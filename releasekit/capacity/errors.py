"""The errors of capacity planning, rooflines and diagnosis:

ReleasekitError
└── CapacityError               numbers that cannot make a plan (zero, negative, missing)
    └── CapacityEvidenceError   a release's evidence cannot carry a plan or roofline
                                (no bench result, no knee, no weight files)
"""

from __future__ import annotations

from releasekit.errors import ReleasekitError


class CapacityError(ReleasekitError):
    """Raised when the numbers given cannot make a plan: a zero, negative or non-finite
    figure, a missing business number, or a mix of options that contradict each other. The
    message names the option."""

    remedy = "see `releasekit capacity --help` for the options and a worked example"


class CapacityEvidenceError(CapacityError):
    """Raised when a release's evidence cannot carry a plan or a roofline: no bench result,
    an unreadable one, a sweep with no knee (no trusted load point met the SLOs), no model
    folder or no weight files."""

    remedy = (
        "run `releasekit bench MANIFEST` for the release (its sweep needs a point that meets "
        "the SLOs), or plan by hand with --concurrency, --tokens-per-second, --output-tokens"
    )
