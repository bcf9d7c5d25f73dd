"""A release on a `ray` environment as a KubeRay `RayService` manifest (apiVersion ray.io/v1).

`spec.serveConfigV2` is the Ray Serve config of what the `ray` target deploys: the release's
application (`rk-<env>-<12 hex>`, import path `releasekit.deploy.ray.replica:build_app`,
no HTTP route of its own) with the args `release_app_args` computes, which are the args
`RayTarget.start` builds its application from, and the router application (`rk-router`,
route "/") that is the only way in. Serve's HTTP options are the environment's
(`serve_host`/`serve_port`, proxy on the head only), as `ensure_serve` starts Serve.

The manifest holds no secret. The router admits a request only with the environment's
router secret, whose digest it reads from the cluster's key-value store; releasekit
records it there when it connects to the cluster (`publish_secret`, as `deploy` and
`promote` do), and until then the router answers 401 to everything. The release's own
serving arguments and environment are written as the release's manifest has them.

`spec.rayClusterConfig` is a skeleton: a head group (no CPUs for replicas: it runs Serve's
controller, proxy and the router) and one worker group of one pod per replica sized from
the environment's `cpus_per_replica`/`memory_gb_per_replica`, with an image placeholder
and a model volume placeholder the operator must fill. Paths in the Serve config (model
folder, interpreter, log folder) are this host's: the image and volumes must provide them
at the same paths. Nothing here has been run on Kubernetes.

Reads only: no state folder, router key or log folder is created.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field

from releasekit import __version__
from releasekit.config import EnvironmentConfig, Settings
from releasekit.deploy.ray.target import release_app_args
from releasekit.deploy.target import DeployError, ReleaseSpec

IMAGE_PLACEHOLDER = "REPLACE-ME.example/releasekit-ray:{version}-ray{ray}"
"""The container image: a placeholder to replace with an image that holds releasekit, Ray
and vLLM at the interpreter path the Serve config names."""
MODEL_CLAIM_PLACEHOLDER = "REPLACE-ME-model-claim"
"""The PersistentVolumeClaim that holds the model folder on every pod: a placeholder."""

NOT_RUN = (
    "nothing here was run on Kubernetes; the serveConfigV2 was deployed with Ray's own "
    "`serve deploy` on a local Ray cluster in releasekit's tests"
)


class KubeRayExportError(DeployError):
    """Raised when a release cannot be written as a RayService for an environment."""

    remedy = "read the message; nothing was written"


class NotARayEnvironmentError(KubeRayExportError):
    """Raised when the environment's target is not `ray`."""

    remedy = (
        'export an environment with target = "ray" and an [environments.NAME.ray] table '
        "(see README, Ray target)"
    )


class ModelDirUnreadableError(KubeRayExportError):
    """Raised when the release's model folder is missing or cannot be read here."""

    remedy = "build the release (`releasekit build MANIFEST`) or fix the folder's permissions"


class KubeRayExport(BaseModel):
    """A RayService manifest for one release in one `ray` environment."""

    release_id: str
    environment: str
    app: str = Field(description="the release's Serve application, as the ray target names it")
    serve_config: dict[str, Any] = Field(description="serveConfigV2 as data")
    manifest: dict[str, Any] = Field(description="the RayService object")
    text: str = Field(description="the manifest as YAML, with its notes as comments")


def _check_model_dir(spec: ReleaseSpec) -> None:
    path = Path(spec.model_dir)
    try:
        if not path.is_dir():
            raise ModelDirUnreadableError(
                f"release {spec.release_id[:12]}: model folder {path} is not a folder here"
            )
        if not os.access(path, os.R_OK | os.X_OK):
            raise PermissionError(f"no read access to {path}")
        os.listdir(path)
    except OSError as exc:
        raise ModelDirUnreadableError(
            f"release {spec.release_id[:12]}: model folder {path} cannot be read: "
            f"{exc.strerror or exc}"
        ) from exc


def k8s_name(text: str) -> str:
    """`text` as a Kubernetes object name (DNS-1123: lowercase, digits, '-', 63 at most)."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return name[:63].rstrip("-") or "releasekit"


def _mebibytes(gb: float) -> str:
    return f"{math.ceil(gb * 1024)}Mi"


def serve_config(
    settings: Settings, env: str, cfg: EnvironmentConfig, spec: ReleaseSpec
) -> dict[str, Any]:
    """The Ray Serve config (serveConfigV2) of `spec` on `env`: its application with the
    ray target's args, and the router. NotARayEnvironmentError for another target."""
    from releasekit.deploy.ray.replica import APP_BUILDER, ROUTER_APP, ROUTER_BUILDER

    ray = cfg.ray
    if cfg.target != "ray" or ray is None:
        raise NotARayEnvironmentError(
            f"environment {env!r} deploys to target {cfg.target!r}, not ray: "
            "there is no Ray Serve application to export"
        )
    args = release_app_args(settings, env, cfg, spec)
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": ray.serve_host or ray.host, "port": ray.serve_port},
        "applications": [
            {
                "name": ROUTER_APP,
                "route_prefix": "/",
                "import_path": ROUTER_BUILDER,
                "args": {},
            },
            {
                "name": args.replica.app,
                "route_prefix": None,
                "import_path": APP_BUILDER,
                "args": args.model_dump(mode="json"),
            },
        ],
    }


def _validate(config: dict[str, Any]) -> None:
    """Ray's own checks, here, before anything is written: the config against Serve's
    schema, and each application's args through its builder (Serve's option checks)."""
    from ray.serve.schema import ServeDeploySchema

    from releasekit.deploy.ray.replica import build_app

    try:
        ServeDeploySchema.model_validate(config)
        for a in config["applications"]:
            if a["import_path"].endswith(":build_app"):
                build_app(a["args"])
    except (ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KubeRayExportError(f"Ray refuses the Serve config: {first}") from exc


class _Literal(str):
    """A string written as a YAML block literal (`|`)."""


def _literal(dumper: yaml.SafeDumper, data: _Literal) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", str(data), style="|")


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Literal, _literal)


def kuberay_export(
    settings: Settings, env: str, cfg: EnvironmentConfig, spec: ReleaseSpec
) -> KubeRayExport:
    """The RayService manifest of `spec` on `env` (see the module docstring). Raises
    NotARayEnvironmentError, ModelDirUnreadableError, KubeRayExportError; reads only."""
    config = serve_config(settings, env, cfg, spec)
    _check_model_dir(spec)
    _validate(config)
    import ray

    ray_cfg = cfg.ray
    assert ray_cfg is not None  # serve_config checked it
    app = config["applications"][1]
    args = app["args"]
    image = IMAGE_PLACEHOLDER.format(version=__version__, ray=ray.__version__)
    cpus = max(1, math.ceil(ray_cfg.cpus_per_replica))
    auto = ray_cfg.autoscaling
    pods = args["options"].get("num_replicas")
    lo = auto.min_replicas if auto else int(pods)
    hi = auto.max_replicas if auto else int(pods)
    worker_res: dict[str, Any] = {"cpu": str(cpus)}
    worker_params = {"num-cpus": str(cpus)}
    if ray_cfg.memory_gb_per_replica is not None:
        worker_res["memory"] = _mebibytes(ray_cfg.memory_gb_per_replica + 2.0)
        worker_params["memory"] = str(int(ray_cfg.memory_gb_per_replica * 1024**3))
    model_dir = args["replica"]["model_dir"]
    mounts = [{"name": "model", "mountPath": model_dir, "readOnly": True}]
    volumes = [{"name": "model", "persistentVolumeClaim": {"claimName": MODEL_CLAIM_PLACEHOLDER}}]
    serve_port = ray_cfg.serve_port
    manifest: dict[str, Any] = {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {
            "name": k8s_name(app["name"]),
            "labels": {
                "app.kubernetes.io/managed-by": "releasekit",
                "releasekit/environment": k8s_name(env),
                "releasekit/release": spec.release_id[:12],
            },
        },
        "spec": {
            "serveConfigV2": _Literal(yaml.dump(config, Dumper=_Dumper, sort_keys=False)),
            "rayClusterConfig": {
                "rayVersion": ray.__version__,
                **({"enableInTreeAutoscaling": True} if auto else {}),
                "headGroupSpec": {
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "ray-head",
                                    "image": image,
                                    "resources": {
                                        "requests": {"cpu": "1", "memory": "4Gi"},
                                        "limits": {"cpu": "2", "memory": "4Gi"},
                                    },
                                    "ports": [
                                        {"containerPort": 6379, "name": "gcs-server"},
                                        {"containerPort": 8265, "name": "dashboard"},
                                        {"containerPort": serve_port, "name": "serve"},
                                    ],
                                }
                            ]
                        }
                    },
                },
                "workerGroupSpecs": [
                    {
                        "groupName": "replicas",
                        "replicas": lo,
                        "minReplicas": lo,
                        "maxReplicas": hi,
                        "rayStartParams": worker_params,
                        "template": {
                            "spec": {
                                "containers": [
                                    {
                                        "name": "ray-worker",
                                        "image": image,
                                        "resources": {
                                            "requests": dict(worker_res),
                                            "limits": dict(worker_res),
                                        },
                                        "volumeMounts": mounts,
                                    }
                                ],
                                "volumes": volumes,
                            }
                        },
                    }
                ],
            },
        },
    }
    notes = [
        f"RayService for release {spec.release_id} ({spec.name}) in environment {env!r},",
        f"written by releasekit {__version__} (`releasekit export kuberay`).",
        "serveConfigV2 is the Ray Serve config the `ray` target deploys for this release,",
        "plus the router (rk-router). No secret is written: the router answers 401 until",
        "releasekit, connected to this cluster's GCS, records the environment's router",
        "secret digest in the cluster's key-value store.",
        f"REPLACE: the image ({image}): releasekit, Ray {ray.__version__} and vLLM, with",
        f"  the interpreter at {args['replica']['python']};",
        f"REPLACE: the model claim ({MODEL_CLAIM_PLACEHOLDER}), mounted at {model_dir}.",
        "rayClusterConfig is a skeleton (one worker pod per replica). " + NOT_RUN + ".",
    ]
    text = "".join(f"# {n}\n" for n in notes) + yaml.dump(manifest, Dumper=_Dumper, sort_keys=False)
    return KubeRayExport(
        release_id=spec.release_id,
        environment=env,
        app=app["name"],
        serve_config=config,
        manifest=yaml.safe_load(text),
        text=text,
    )
