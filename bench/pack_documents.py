"""pack_documents: padding fraction and packing rate of each algorithm, and the fit_place
kernel against its NumPy reference, on documents of log-normal lengths (median ~300
tokens, a long tail past seq_len), inline, one lane.

    PYTHONPATH=. python bench/pack_documents.py [--docs 20000] [--seq-len 2048]

Prints, per algorithm, the padding fraction (from the packer's node statistics) and
documents/s through read -> pack_documents (pack_tokens on the same source as the
baseline); then fit_place compiled vs reference
(the ratio with both raw figures).
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np

from zephon import Pipeline, RuntimeOptions, sources
from zephon._kernels import pack_docs as compiled
from zephon.kernels import pack_docs_ref as reference


def document(lengths: np.ndarray, i: int) -> dict:
    return {"tokens": np.arange(int(lengths[i]), dtype=np.int32)}


def lengths_of(docs: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1, rng.lognormal(np.log(300), 1.0, docs).astype(np.int64))


def run(lengths: np.ndarray, seq_len: int, algorithm: str) -> tuple[float, float]:
    src = sources.from_callable(len(lengths), functools.partial(document, lengths))
    pipe = Pipeline(src, seed=0, chunk_size=1024).pack_documents(
        seq_len, algorithm=algorithm, open_bins=32).options(RuntimeOptions(
            runner="inline", canonical_replicas=1, execution_tracking="nodes"))
    start = time.perf_counter()
    it = iter(pipe)
    for _ in it:
        pass
    seconds = time.perf_counter() - start
    return it.stats()["serial1_pack_documents"]["padding_fraction"], len(lengths) / seconds


def baseline(lengths: np.ndarray, seq_len: int) -> float:
    """Documents/s through read -> pack_tokens (no layout), the same source."""
    src = sources.from_callable(len(lengths), functools.partial(document, lengths))
    pipe = Pipeline(src, seed=0, chunk_size=1024).pack_tokens(seq_len).options(
        RuntimeOptions(runner="inline", canonical_replicas=1))
    start = time.perf_counter()
    for _ in pipe:
        pass
    return len(lengths) / (time.perf_counter() - start)


def kernel(lengths: np.ndarray, seq_len: int) -> None:
    items = lengths[lengths < seq_len]
    for name, impl in (("reference", reference), ("compiled", compiled)):
        start = time.perf_counter()
        impl.fit_place(items, [], seq_len, 32, True)
        seconds = time.perf_counter() - start
        print(f"fit_place {name}: {len(items) / seconds:,.0f} documents/s")
        if name == "reference":
            ref_rate = len(items) / seconds
    print(f"fit_place compiled / reference: {len(items) / seconds / ref_rate:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=20_000)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()
    lengths = lengths_of(args.docs)
    print(f"pack_tokens: {baseline(lengths, args.seq_len):,.0f} documents/s (baseline)")
    for algorithm in ("greedy", "first_fit", "best_fit"):
        padding, rate = run(lengths, args.seq_len, algorithm)
        print(f"{algorithm:9s}: padding {padding:.4f}, {rate:,.0f} documents/s")
    kernel(lengths, args.seq_len)


if __name__ == "__main__":
    main()
