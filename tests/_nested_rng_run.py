"""Run one nested-pipeline case of tests/test_global_rngs.py in a fresh process and
print a JSON line: the outer pipeline's stream (a summary) or the error's type and text.
``python _nested_rng_run.py <op name> <seed_global_rngs> <consumer seed>``."""

from __future__ import annotations

import faulthandler
import json
import sys

import _rng_fns as F
import numpy as np

from zephon import Pipeline, RuntimeOptions, sources


def main() -> None:
    faulthandler.dump_traceback_later(40, exit=True)  # a hang ends here, loudly
    name, mode, consumer = sys.argv[1], sys.argv[2], int(sys.argv[3])
    np.random.seed(consumer)
    pipe = (Pipeline(sources.from_callable(3, F.make_sample), shuffle=False, seed=5)
            .map(getattr(F, name))
            .options(RuntimeOptions(runner="inline", seed_global_rngs=mode)))
    try:
        out = [{k: v for k, v in s.items() if k in ("own", "inner")} for s in pipe]
        print(json.dumps({"stream": out}))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        text = str(exc)
        print(json.dumps({"error": type(exc).__name__, "text": text[:400]}))
    finally:
        pipe.close()


if __name__ == "__main__":
    main()
