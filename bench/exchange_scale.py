"""Checkpoint exchange cost against the world size: medium operations per rank and round
time for W simulated ranks (threads running the real protocol, each with its own
connection) over a TCPStore on 127.0.0.1 and over a local directory.

    PYTHONPATH=$PWD python bench/exchange_scale.py [--worlds 2,64,1024] [--media store,dir]
    PYTHONPATH=$PWD python bench/exchange_scale.py --worlds 4096 --procs 8

Prints, per medium and W: rank 0's operations, the largest and the mean count of any
other rank, the round time (wall, this machine, noisy), the merged record's size (what
every rank reads once), what all ranks read of it together, and the round's keys or
files left afterwards.

``--procs P`` (P > 1) runs the ranks in P spawned processes, each with W / P rank threads
(contiguous blocks of ranks, rank 0 in the first): no process holds thousands of threads
and connections. The TCPStore server is then hosted by this process and every rank's
client lives in its rank's process. Every process makes its connections and starts its
threads, which wait; once all processes are there (a barrier) every rank enters the round
at once. ``round s`` is the longest round a process saw from then; every rank's merged
record is checked to be the same bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))

from _exchange_ranks import (
    CountingDir,
    CountingStore,
    StoreWorld,
    dir_media,
    run_round,
)


def _rank_group(medium: str, where: str, world: int, ranks: list[int], timeout_s: float,
                barrier, out) -> None:
    """In a spawned process: ``ranks`` of one round as threads, each on its own connection
    (``where``: the store's port, or the directory), entering the round once every
    process has its threads waiting (``barrier``); puts its figures on ``out``."""
    import datetime
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    if medium == "store":
        import torch.distributed as dist

        from zephon.checkpoint.store import StoreMedium

        timeout = datetime.timedelta(seconds=timeout_s)

        def client(_):
            return CountingStore(dist.TCPStore("127.0.0.1", int(where), world, False,
                                               timeout=timeout))

        # a few connections at a time per process: bursts of hundreds of SYNs overflow the
        # server's accept queue and the dropped ones wait out TCP's retransmission back-off
        with ThreadPoolExecutor(8) as pool:
            clients = dict(zip(ranks, pool.map(client, ranks), strict=True))
        deadline = __import__("time").monotonic() + 3600
        media = {r: StoreMedium(c, f"torch://127.0.0.1:{where}", "scale", deadline,
                                hosted=False) for r, c in clients.items()}
        counted = clients
    else:
        media = {r: CountingDir(os.path.join(where, "run")) for r in ranks}
        counted = media
    # thousands of threads on two cores take longer than the default arrival grace (30 s)
    # to wake from the barrier: they are late, not absent
    got = run_round(media, world, ranks=ranks, timeout_s=timeout_s, ready=barrier.wait,
                    grace_s=timeout_s)
    out.put({"calls": {r: sum(c.calls.values()) for r, c in counted.items()},
             "errors": {r: repr(e)[:300] for r, e in got["errors"].items()},
             "digests": sorted({hashlib.sha256(b).hexdigest()
                                for b in got["results"].values()}),
             "size": max((len(b) for b in got["results"].values()), default=0),
             "seconds": got["seconds"]})


def measure_procs(medium: str, world: int, procs: int, timeout_s: float = 900.0) -> dict:
    """One round of ``world`` ranks in ``procs`` spawned processes (see the docstring)."""
    import multiprocessing

    blocks = [list(range(world * i // procs, world * (i + 1) // procs)) for i in range(procs)]
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as root:
        server = None
        if medium == "store":
            import datetime

            import torch.distributed as dist

            server = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
            where = str(server.port)
        else:
            where = root
        barrier, out = ctx.Barrier(procs), ctx.Queue()
        children = [ctx.Process(target=_rank_group, daemon=True,
                                args=(medium, where, world, block, timeout_s, barrier, out))
                    for block in blocks]
        try:
            for child in children:
                child.start()
            groups = [out.get(timeout=timeout_s + 600) for _ in children]
        finally:
            for child in children:
                child.join(30)
                if child.is_alive():
                    child.kill()
                    child.join()
        if server is not None:
            left = len([k for k in server.list_keys() if k.startswith("zephon/")])
            del server
        else:
            left = sum(len(files) for _, _, files in os.walk(root))
    errors = {r: e for g in groups for r, e in g["errors"].items()}
    if errors:
        raise SystemExit(f"{medium} W={world}: {list(errors.items())[:2]}")
    digests = {d for g in groups for d in g["digests"]}
    if len(digests) != 1:
        raise SystemExit(f"{medium} W={world}: ranks returned {len(digests)} different records")
    calls = [0] * world
    for g in groups:
        for r, c in g["calls"].items():
            calls[r] = c
    size = max(g["size"] for g in groups)
    return {"rank0": calls[0], "max": max(calls[1:]), "mean": sum(calls[1:]) / (world - 1),
            "seconds": max(g["seconds"] for g in groups), "merged": size,
            "read": size * world, "left": left}


def measure(medium: str, world: int) -> dict:
    if medium == "store":
        sw = StoreWorld(world)
        try:
            out = run_round(sw.media, world)
            calls = sw.calls()
            left = sw.keys_left()
        finally:
            sw.close()
    else:
        with tempfile.TemporaryDirectory() as root:
            media = dir_media(root, world)
            out = run_round(media, world)
            calls = [sum(m.calls.values()) for m in media]
            left = sum(len(files) for _, _, files in os.walk(root))
    if out["errors"]:
        raise SystemExit(f"{medium} W={world}: {list(out['errors'].items())[:2]}")
    size = len(out["results"][0])
    return {"rank0": calls[0], "max": max(calls[1:]), "mean": sum(calls[1:]) / (world - 1),
            "seconds": out["seconds"], "merged": size, "read": size * world, "left": left}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,64,1024")
    parser.add_argument("--media", default="store,dir")
    parser.add_argument("--procs", type=int, default=1,
                        help="processes the ranks run in (default 1: threads of this one)")
    args = parser.parse_args()
    print(f"{'medium':6} {'W':>6} {'rank0 ops':>9} {'max ops':>7} {'mean ops':>8} "
          f"{'round s':>8} {'merged B':>9} {'all read MB':>11} {'left':>4}")
    for medium in args.media.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            r = measure(medium, world) if args.procs <= 1 else \
                measure_procs(medium, world, args.procs)
            print(f"{medium:6} {world:>6} {r['rank0']:>9} {r['max']:>7} {r['mean']:>8.1f} "
                  f"{r['seconds']:>8.2f} {r['merged']:>9} {r['read'] / 1e6:>11.2f} "
                  f"{r['left']:>4}", flush=True)


if __name__ == "__main__":
    main()
