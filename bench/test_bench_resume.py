"""Resume benchmarks (pytest-benchmark): the first batch after a restore vs a fresh start.

    python -m pytest bench/test_bench_resume.py [--enforce-ratios]

A 200,000-sample ``from_callable -> map -> batch(32)`` pipeline (every op
preserves cursor order: cursor resume) and the same with ``shuffle(256)``
before the batch (replay from the last flush boundary, ``K = 8``), inline
runner. A state is taken after 10 %, 50 % and 90 % of the epoch; each round
then restores it into a new pipeline and takes the first batch. The baseline
is a fresh start of the same pipeline taking its first batch. Ratio = fresh /
restored (target >= 0.5: a resume costs at most twice a fresh start, wherever
in the epoch it was taken); ``extra_info["reads"]`` is the number of source
reads before the first restored batch (bar: ``chunk_size x (1 + K)``, plus the
validation probe of the source's first sample).

The proof check (``zephon.pipeline.proof``): the same restore + first batch from
the state as written (with its proof, checked on restore) and from that state with
the proof taken out (what a format-4 state restores with): inline on 8 and on 1024
lanes (every lane's next 8 sample identities are recomputed; a first batch of about
a millisecond, where the check's fixed cost shows: reported, no target) and on the
process runner with 2 workers (target >= 0.95: nothing measurable in the first batch
a training script waits for). Ratio = unproven / proven.
"""

from __future__ import annotations

import numpy as np
import pytest

from zephon import Pipeline, RuntimeOptions, sources
from zephon.checkpoint import decode_state, encode_state

N, CHUNK, BATCH = 200_000, 64, 32
_reads = [0]


def load(i: int) -> dict:
    _reads[0] += 1
    return {"x": np.full(16, i, dtype=np.int64), "id": i}


def scale(sample: dict) -> dict:
    return {"x": sample["x"] * 2, "id": sample["id"]}


def build(chain: str) -> Pipeline:
    pipe = Pipeline(sources.from_callable(N, load), seed=1, chunk_size=CHUNK).map(scale)
    if chain == "shuffle":
        pipe = pipe.shuffle(256)
    return pipe.batch(BATCH).options(RuntimeOptions(runner="inline"))


_STATES: dict = {}


def state_at(chain: str, fraction: float) -> bytes:
    key = (chain, fraction)
    if key not in _STATES:
        pipe = build(chain)
        it = iter(pipe)
        for _ in range(int(N / BATCH * fraction)):
            next(it)
        _STATES[key] = it.checkpoint()
        it.close()
    return _STATES[key]


def first_batch(state: bytes | None) -> int:
    pipe = build(_chain[0])
    if state is not None:
        pipe.restore(state)
    _reads[0] = 0
    it = iter(pipe)
    next(it)
    reads = _reads[0]
    it.close()
    return reads


_chain = ["cursor"]


@pytest.mark.parametrize("chain", ["cursor", "shuffle"])
def test_fresh_start(benchmark, record_ratio, chain):
    _chain[0] = chain
    benchmark.group = f"first batch, {chain} chain"
    reads = benchmark.pedantic(first_batch, args=(None,), rounds=15, warmup_rounds=2)
    benchmark.extra_info["reads"] = reads
    for fraction in (0.1, 0.5, 0.9):
        record_ratio(f"resume_{chain}_{int(fraction * 100)}pct_vs_fresh", "baseline")


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("chain", ["cursor", "shuffle"])
def test_restored(benchmark, record_ratio, chain, fraction):
    _chain[0] = chain
    state = state_at(chain, fraction)
    benchmark.group = f"first batch, {chain} chain"
    reads = benchmark.pedantic(first_batch, args=(state,), rounds=15, warmup_rounds=2)
    benchmark.extra_info["reads"] = reads
    k = 0 if chain == "cursor" else 8
    benchmark.extra_info["reads_bar"] = bar = CHUNK * (1 + k) + 1
    assert reads <= bar, f"{reads} source reads before the first restored batch (bar {bar})"
    record_ratio(f"resume_{chain}_{int(fraction * 100)}pct_vs_fresh", "subject", target=0.5)


def build_lanes(lanes: int, runner: str = "inline") -> Pipeline:
    workers = {"max_workers": 2} if runner == "process" else {}
    return Pipeline(sources.from_callable(N, load), seed=1, chunk_size=CHUNK).map(scale) \
        .batch(BATCH).options(RuntimeOptions(runner=runner, canonical_replicas=lanes,
                                             **workers))


_PROOF_STATES: dict = {}


def proof_states(lanes: int) -> tuple[bytes, bytes]:
    """(the state as written, the same without its proof) after half an epoch."""
    if lanes not in _PROOF_STATES:
        it = iter(build_lanes(lanes))
        for _ in range(N // BATCH // 2):
            next(it)
        proven = it.checkpoint()
        it.close()
        bare = decode_state(proven)
        del bare["proof"]
        _PROOF_STATES[lanes] = (proven, encode_state(bare))
    return _PROOF_STATES[lanes]


def restore_first_batch(lanes: int, state: bytes, runner: str = "inline") -> None:
    pipe = build_lanes(lanes, runner)
    pipe.restore(state)
    it = iter(pipe)
    next(it)
    it.close()
    pipe.close()


@pytest.mark.parametrize("case", ["8-inline", "1024-inline", "8-process"])
@pytest.mark.parametrize("proof", ["unproven", "proven"])
def test_restore_proof_check(benchmark, record_ratio, proof, case):
    """The inline rows are the worst case (a first batch of about a millisecond: the
    check's fixed cost, about 0.1 ms, and its 3 us a lane show); the process row is a
    first batch as a training script meets it (workers started)."""
    lanes, runner = int(case.split("-")[0]), case.split("-")[1]
    proven, bare = proof_states(lanes)
    benchmark.group = f"restore + first batch, {case}"
    rounds = 8 if runner == "process" else 60
    benchmark.pedantic(restore_first_batch,
                       args=(lanes, proven if proof == "proven" else bare, runner),
                       rounds=rounds, warmup_rounds=2)
    target = 0.95 if runner == "process" else None
    record_ratio(f"proof_check_{case}", "subject" if proof == "proven" else "baseline",
                 target=target)
