"""The `ray` deploy target's settings: the cluster an environment's releases run on, and
their replicas' autoscaling."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RayAutoscaling(BaseModel):
    """Ray Serve's autoscaling of a release's replicas on requests in flight (running and
    waiting) per replica, between `min_replicas` and `max_replicas`. The per-replica target
    is exactly one of:

    - `target = "knee"`: derived from the release's own load test, the requests in flight
      at its knee (the highest load whose SLOs held) times (1 - `knee_headroom`); a release
      without usable knee evidence is refused (releasekit.deploy.ray.autoscale);
    - `target_queue_depth`: a number set by hand.

    The scale-up and scale-down delays (and Ray's look-back window) are the environment's,
    read from releasekit.toml as committed (a policy field), never from a release."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(ge=1)
    target: Literal["knee"] | None = Field(
        None, description='"knee": the per-replica target comes from the release\'s knee'
    )
    knee_headroom: float | None = Field(
        None,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="with target = knee: the share of the knee kept spare (0.25: scale at "
        "75% of the knee's requests in flight)",
    )
    knee_cores: Literal["match", "scale"] = Field(
        "match",
        description='with target = knee: "match" refuses a knee measured on another core '
        'count than cpus_per_replica (it runs max_replicas on a rollback); "scale" scales it '
        "in proportion (knee x replica CPUs / the bench host's cores), stated in the plan",
    )
    target_queue_depth: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="requests in flight per replica, by hand"
    )
    upscale_delay_s: float = Field(
        30.0, ge=0, allow_inf_nan=False, description="load above target this long adds replicas"
    )
    downscale_delay_s: float = Field(
        600.0, ge=0, allow_inf_nan=False, description="load below target this long removes them"
    )
    look_back_period_s: float = Field(
        30.0, gt=0, allow_inf_nan=False, description="Ray averages the load over this window"
    )
    metrics_interval_s: float = Field(
        10.0, gt=0, allow_inf_nan=False, description="how often Ray reports the load"
    )

    @model_validator(mode="after")
    def _order(self) -> RayAutoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas must be at least min_replicas")
        if (self.target is None) == (self.target_queue_depth is None):
            raise ValueError(
                'give exactly one of target = "knee" (with knee_headroom) and '
                "target_queue_depth (requests in flight per replica, by hand)"
            )
        if self.target == "knee" and self.knee_headroom is None:
            raise ValueError(
                'target = "knee" needs knee_headroom, the share of the knee kept spare (e.g. 0.25)'
            )
        if self.target is None and self.knee_headroom is not None:
            raise ValueError('knee_headroom applies only with target = "knee"')
        return self


class RayTargetConfig(BaseModel):
    """Where an environment's `ray` target runs (`[environments.NAME.ray]`): the Ray cluster
    and the shape of every release's Ray Serve application there."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str = Field(
        pattern=r"^[A-Za-z0-9_.-]+:[0-9]{1,5}$", description="the cluster's GCS address HOST:PORT"
    )
    node_ip: str | None = Field(
        None,
        description="this host's address inside the cluster (Ray's node IP); default: the "
        "address's host when it is a loopback one, else Ray's own guess",
    )
    serve_host: str | None = Field(
        None, description="where Serve's HTTP proxy listens (on the head); default: address host"
    )
    serve_port: int = Field(8000, ge=1, le=65535, description="Serve's HTTP proxy port")
    replicas: int = Field(1, ge=1, le=1024, description="replicas per release (one vLLM each)")
    cpus_per_replica: float = Field(1.0, gt=0, description="Ray CPUs one replica reserves")
    memory_gb_per_replica: float | None = Field(None, gt=0, description="Ray memory reserved")
    max_replicas_per_node: int | None = Field(None, ge=1, description="spread cap per node")
    autoscaling: RayAutoscaling | None = None
    health_check_period_s: float = Field(2.0, gt=0)
    health_check_timeout_s: float = Field(10.0, gt=0)
    connect_timeout_s: float = Field(10.0, gt=0, description="to reach the cluster")

    @property
    def host(self) -> str:
        """The address's host part."""
        return self.address.rsplit(":", 1)[0]
