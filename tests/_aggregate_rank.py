"""One rank of a multi-rank checkpoint, as a real process (used by tests/test_aggregate_*.py).

    python _aggregate_rank.py '<json config>'

Config: rank, world, take (batches to consume before checkpoint()), delay (seconds
to sleep before it), out (file for the state), and ``opts`` (RuntimeOptions
fields: aggregate_dir / aggregate_store / aggregate_timeout_s / ...). Exit 0 with
the state written, or exit 3 with ``ERROR <type>: <message>`` on stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_pipeline_elastic import C, pipeline  # noqa: E402

from zephon import RuntimeOptions  # noqa: E402


def main(cfg: dict) -> int:
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
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
