"""The test session's Ray, shared by the jobs backend's tests (``test_jobs_ray.py``) and
the pipeline's Ray runner tests (``test_pipeline_ray.py``): one process holds one Ray
connection, so :class:`RayClusters` starts the kind a test asks for and stops the one
that was up before. The ``clusters`` fixture (``conftest.py``) makes one per session and
shuts down whichever is up at the end.

Everything is real Ray on this machine: ``local()`` is ``ray.init`` with its own
resources; ``two_nodes()`` and ``three_nodes()`` are ``ray.cluster_utils.Cluster`` (the
harness Ray's own tests use): a head and worker nodes, each a raylet of its own with
its own resources and object store, on this machine's address. Ray workers import the tests' helper
modules by name: this directory goes on their ``PYTHONPATH`` (set before any raylet
starts, which they inherit).
"""

from __future__ import annotations

import os

TESTS = os.path.dirname(os.path.abspath(__file__))


class RayClusters:
    """The session's Ray: ``local()``, ``two_nodes()`` or ``three_nodes()``, one at a time."""

    def __init__(self) -> None:
        self.kind = None
        self.cluster = None
        self.old_pythonpath = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (TESTS, self.old_pythonpath) if p)

    def local(self, num_gpus: int = 0) -> None:
        """A local cluster with 2 CPUs (and ``num_gpus`` GPU resources: Ray only counts
        them, so they need no hardware)."""
        import ray

        if self.kind != ("local", num_gpus):
            self.stop()
            ray.init(num_cpus=2, num_gpus=num_gpus, include_dashboard=False)
            self.kind = ("local", num_gpus)

    def _nodes(self, head_cpus: int, workers: list[int]):
        import ray
        from ray.cluster_utils import Cluster

        self.stop()
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": head_cpus, "include_dashboard": False})
        nodes = [self.cluster.add_node(num_cpus=cpus) for cpus in workers]
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address)
        return nodes

    def two_nodes(self):
        """A fresh head (2 CPUs) plus a second node (2 CPUs); returns (cluster, node)."""
        second, = self._nodes(2, [2])
        self.kind = "two_nodes"
        return self.cluster, second

    def three_nodes(self, head_cpus: int = 2, node_cpus: int = 2):
        """A head and two worker nodes (``head_cpus`` and ``node_cpus`` logical CPUs each:
        Ray counts them, the machine's cores are shared); returns (cluster, [node, node]).
        Kept for the next test that asks for the same."""
        kind = ("three_nodes", head_cpus, node_cpus)
        if self.kind == kind and self.cluster is not None and \
                len(self.cluster.worker_nodes) == 2:
            return self.cluster, list(self.cluster.worker_nodes)
        nodes = self._nodes(head_cpus, [node_cpus, node_cpus])
        self.kind = kind
        return self.cluster, nodes

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
        self.kind = None

    def close(self) -> None:
        self.stop()
        if self.old_pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = self.old_pythonpath
