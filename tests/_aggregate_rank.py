"""One rank of a multi-rank checkpoint, as a real process (used by tests/test_aggregate_*.py).

    python _aggregate_rank.py '<json config>'

Config: rank, world, take (batches to consume before checkpoint()), delay (seconds
to sleep before it), out (file for the state), init_pg (initialize a gloo default
process group from MASTER_ADDR/MASTER_PORT first), and ``opts`` (RuntimeOptions
fields: aggregate_dir / aggregate_store / aggregate_timeout_s / ...). Exit 0 with
the state written, or exit 3 with ``ERROR <type>: <message>`` on stderr.

The ``launch`` fixture starts such ranks from a test and reaps them whatever happens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_pipeline_elastic import C, pipeline  # noqa: E402

from zephon import RuntimeOptions  # noqa: E402


@pytest.fixture
def launch(tmp_path):
    """``launch(configs, env=None) -> [(returncode, stderr)]``: one process per rank
    config (``tag`` names its output ``state-<tag>-<rank>``; ``env``, if there, is added
    to that rank's environment after ``env``), all started at once; every process is
    killed and reaped even if the test fails."""
    procs = []

    def run(configs, env=None, timeout=120):
        started = []
        for cfg in configs:
            cfg = dict(cfg)
            cfg.setdefault("out", str(tmp_path / f"state-{cfg['tag']}-{cfg['rank']}"))
            extra = {**(env or {}), **cfg.pop("env", {})}
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__),
                 json.dumps({k: v for k, v in cfg.items() if k != "tag"})],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env={**os.environ, **extra} if extra else None)
            procs.append(proc)
            started.append(proc)
        return [(p.wait(timeout=timeout), p.communicate()[1]) for p in started]

    yield run
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(cfg: dict) -> int:
    if cfg.get("init_pg"):
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=cfg["rank"], world_size=cfg["world"])
    opts = RuntimeOptions(world_size=cfg["world"], global_rank=cfg["rank"],
                          canonical_replicas=cfg.get("lanes", C), **cfg.get("opts", {}))
    pipe = pipeline().options(opts)
    it = iter(pipe)
    for _ in range(cfg["take"]):
        next(it)
    time.sleep(cfg.get("delay", 0.0))
    if cfg.get("announce"):
        open(cfg["announce"], "w").close()
    try:
        state = pipe.checkpoint()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        print(f"ERROR {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    finally:
        pipe.close()
    with open(cfg["out"], "wb") as fh:
        fh.write(state)
    if cfg.get("init_pg"):
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))


def ranks_in_threads(world: int, body, timeout: float = 120.0) -> dict:
    """``{rank: body(rank)}`` for ranks ``0 .. world - 1``, each in a thread of this
    process (ranks that exchange through a directory or a store need no processes);
    re-raises the first rank's error."""
    import threading

    errors: list = []
    out: dict = {}

    def run(rank):
        try:
            out[rank] = body(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    return out
