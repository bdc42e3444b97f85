"""The Ray cluster, for both faces of zephon: the jobs backend (``RunPolicy(backend="ray")``,
:mod:`zephon.jobs.ray_backend`) and the pipeline's ``runner="ray"`` stages
(:mod:`zephon.runners.ray`). One module owns importing Ray, connecting, where actors
are placed, what a Ray worker reports about itself, and disconnecting.

**Importing.** Ray is an optional extra (``zephon[ray]``); it is imported only by the
functions here, and :func:`import_ray` names the extra when it is missing.

**Connecting.** :func:`connect` joins the connection this process already has
(``ray.init`` called by the user, with whatever ``runtime_env`` they gave it: a
job-level runtime environment reaches every actor zephon starts) and never closes
one it did not make. Otherwise it calls ``ray.init(address=$RAY_ADDRESS)`` when
``RAY_ADDRESS`` is set, else ``ray.init()`` (which joins a cluster ``ray start`` left
on this machine, or starts a local one). Connections zephon made are counted: each
user (a job run, a pipeline's Ray stage, a kept Ray stage between epochs) holds one
:class:`Connection` and releases it once; the last release of a connection zephon
made shuts it down (and a local cluster it started). So a pipeline iterated epoch
after epoch with persistent workers keeps its connection and its actors between
epochs, and nothing of Ray outlives the last user.

**Placement.** :func:`actor_options` is the one place that says what an actor asks of
the cluster: ``num_cpus`` (a core per actor, as a process worker is one process),
``num_gpus``, Ray's own restarts and retries off (zephon re-runs lost work itself,
exactly once), and for pipeline stages the ``SPREAD`` strategy, so that a stage's
actors land on different nodes (a node lost takes a share of the actors, not all of
them, and an I/O-bound stage gets every node's network).

**What a worker says.** :func:`where` runs inside an actor: its pid, node id and node
address, which the drivers use to name a node in errors and in ``explain()``;
:func:`missing_module` finds the module an actor could not import.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading

from zephon.errors import ZephonConfigError

__all__ = [
    "Connection",
    "actor_options",
    "alive_nodes",
    "connect",
    "describe_cluster",
    "import_ray",
    "missing_module",
    "where",
]

log = logging.getLogger("zephon.ray")

_lock = threading.Lock()
#: holds on the connection zephon made, and which connection that is (a count of the
#: connections zephon made: a hold on one the user shut down since counts for nothing)
_users = 0
_made = 0
#: the Ray job of the connection zephon made (a connection the user made since, after
#: shutting zephon's down, is another job)
_job: str | None = None


def import_ray(what: str = "RunPolicy(backend='ray')"):
    """Import ``ray`` or raise a :class:`ZephonConfigError` naming the extra to install.

    Args:
        what: the feature that needs Ray, named in the error.
    """
    try:
        import ray
    except ImportError as exc:
        raise ZephonConfigError(
            f"{what} needs Ray: python -m pip install -e \".[ray]\" (in the zephon "
            f"checkout; or pip install 'ray[default]') (import failed: {exc})") from exc
    return ray


def describe_cluster() -> str:
    """Which Ray cluster a run started now would use, without connecting or importing Ray.

    Example: ``"RAY_ADDRESS=ray://head:10001 ..."`` or ``"a local Ray cluster started by
    zephon for this run ..."``."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        try:
            address = ray.get_runtime_context().gcs_address
        except Exception:  # noqa: BLE001 - a client connection has no gcs address
            address = "?"
        return f"this process's existing Ray connection (ray.init already called; {address})"
    address = os.environ.get("RAY_ADDRESS")
    if address:
        return f"RAY_ADDRESS={address} (zephon connects for the run and disconnects after)"
    return ("a local Ray cluster started by zephon for this run and stopped after it "
            "(no RAY_ADDRESS; ray.init() joins a cluster `ray start` left on this machine "
            "instead, if there is one)")


class Connection:
    """One user's hold on the Ray connection (see the module docstring); ``release()``
    once, more calls are no-ops."""

    __slots__ = ("generation", "made", "ray", "released")

    def __init__(self, ray, made: bool, generation: int = 0) -> None:
        #: whether zephon made the connection this hold is on (the user's own otherwise)
        self.made = made
        self.ray, self.released, self.generation = ray, False, generation

    def release(self) -> None:
        global _users, _made
        with _lock:
            if self.released:
                return
            self.released = True
            if not self.made or self.generation != _made:
                return  # the user's connection, or one zephon made that is gone since
            _users -= 1
            if _users > 0:
                return
            if self.ray.is_initialized():
                self.ray.shutdown()


def connect(what: str) -> Connection:
    """Hold the Ray connection, connecting first where this process has none.

    Raises:
        ZephonConfigError: Ray is not installed, or the cluster cannot be reached.
    """
    global _users, _made, _job
    ray = import_ray(what)
    with _lock:
        if ray.is_initialized():
            if _users > 0 and _job == _job_id(ray):  # zephon's, held by another user
                _users += 1
                return Connection(ray, True, _made)
            return Connection(ray, False)
        address = os.environ.get("RAY_ADDRESS") or None
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except Exception as exc:
            raise ZephonConfigError(
                f"{what} could not reach a Ray cluster (RAY_ADDRESS={address!r}): "
                f"{type(exc).__name__}: {exc}") from exc
        _made, _users, _job = _made + 1, 1, _job_id(ray)
        return Connection(ray, True, _made)


def _job_id(ray) -> str | None:
    try:
        return str(ray.get_runtime_context().get_job_id())
    except Exception:  # noqa: BLE001 - a connection that cannot say: not zephon's
        return None


def alive_nodes(ray) -> dict[str, str]:
    """The cluster's live nodes: node id -> address."""
    return {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()
            if n.get("Alive")}


def actor_options(*, num_cpus: float = 1, num_gpus: float = 0, spread: bool = False) -> dict:
    """What an actor of zephon's asks of the cluster (see the module docstring)."""
    opts: dict = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": 0,
                  "max_task_retries": 0}
    if spread:
        opts["scheduling_strategy"] = "SPREAD"
    return opts


def where() -> tuple[int, str, str]:
    """Inside a Ray worker: ``(pid, node id, node address)``."""
    import ray

    return (os.getpid(), ray.get_runtime_context().get_node_id(),
            ray.util.get_node_ip_address())


_MISSING = re.compile(r"No module named '([^']+)'")


def missing_module(text: str) -> str | None:
    """The module named by a ``ModuleNotFoundError`` in ``text`` (None: none)."""
    found = _MISSING.search(text)
    return found.group(1) if found else None
