"""The `kvforge serve` app as a Ray Serve deployment: N replicas behind Ray Serve's HTTP proxy.

Each replica builds the same FastAPI app (kvforge/serve/app.py) around its own Generator and
continuous-batching scheduler; Ray Serve routes requests between replicas (and autoscales them with
`autoscaling_config`). Import it into your own Ray app:

    from ray import serve
    from kvforge.serve.ray_serve import deployment
    serve.run(deployment("/models/smollm2-export", replicas=4), route_prefix="/")

On a multi-node cluster (`ray start --head` on one node, `ray start --address HEAD:6379` on the
others), the export folder must exist at the same path on every node that may host a replica.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvforge.core.errors import BackendUnavailableError, InputError


def _ray_serve():
    try:
        from ray import serve
    except ImportError as err:
        raise BackendUnavailableError("--ray needs Ray Serve: pip install -e '.[ray]'") from err
    return serve


def deployment(export_dir: str | Path, *, replicas: int = 2, autoscaling_config: dict[str, Any] | None = None,
               ray_actor_options: dict[str, Any] | None = None, max_ongoing_requests: int = 64,
               **app_options: Any):
    """A bound Ray Serve application serving `export_dir` (app options: those of create_app, e.g.
    max_batch, max_seq_len, api_key, threads). `autoscaling_config` replaces the fixed replica count."""
    serve = _ray_serve()
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise InputError(f"replicas must be a positive integer, got {replicas!r}")
    folder = Path(export_dir).resolve()
    if not (folder / "kvforge.json").is_file():
        raise InputError(f"{folder} is not a kvforge export folder (no kvforge.json)")
    from kvforge.serve.app import create_app

    # The builder runs on each replica, so every replica loads its own model and scheduler. (A plain
    # function: Ray Serve would take a functools.partial for the ASGI app itself.)
    def builder():
        return create_app(str(folder), **app_options)

    scale = {"autoscaling_config": autoscaling_config} if autoscaling_config else {"num_replicas": replicas}
    app = serve.deployment(
        serve.ingress(builder)(),
        name="kvforge",
        ray_actor_options=ray_actor_options or {"num_cpus": 1},
        max_ongoing_requests=max_ongoing_requests,
        **scale,
    )
    return app.bind()


def run(export_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, replicas: int = 2,
        address: str | None = None, ready: Callable[[], None] | None = None, **app_options: Any) -> None:
    """Start (or join, with `address`) a Ray instance and serve until interrupted."""
    serve = _ray_serve()
    app = deployment(export_dir, replicas=replicas, **app_options)  # checks the folder before Ray starts
    from kvforge.serve.app import bind_socket

    bind_socket(host, port).close()  # a busy port or a bad host: one line now, not after Ray has started
    import ray

    ray.init(address=address, include_dashboard=False, ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    if ready is not None:
        ready()
    serve.run(app, route_prefix="/", blocking=True)
