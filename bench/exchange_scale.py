"""Checkpoint exchange cost against the world size: medium operations per rank and round
time for W simulated ranks (threads running the real protocol, each with its own
connection) over a TCPStore on 127.0.0.1 and over a local directory.

    PYTHONPATH=$PWD python bench/exchange_scale.py [--worlds 2,64,1024] [--media store,dir]

Prints, per medium and W: rank 0's operations, the largest and the mean count of any
other rank, the round time (wall, this machine, noisy), the merged record's size (what
every rank reads once) and what all ranks read of it together.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))

from _exchange_ranks import StoreWorld, dir_media, run_round  # noqa: E402


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
    args = parser.parse_args()
    print(f"{'medium':6} {'W':>6} {'rank0 ops':>9} {'max ops':>7} {'mean ops':>8} "
          f"{'round s':>8} {'merged B':>9} {'all read MB':>11} {'left':>4}")
    for medium in args.media.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            r = measure(medium, world)
            print(f"{medium:6} {world:>6} {r['rank0']:>9} {r['max']:>7} {r['mean']:>8.1f} "
                  f"{r['seconds']:>8.2f} {r['merged']:>9} {r['read'] / 1e6:>11.2f} "
                  f"{r['left']:>4}", flush=True)


if __name__ == "__main__":
    main()
