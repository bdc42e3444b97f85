"""``python -m zephon demo``: a real pipeline on an embedded default data set.

1. On first run, write a deterministic synthetic token corpus (a seeded
   Zipf-like stream of uint16 "token ids", 8 Mi tokens = 16 MiB) to the cache
   directory (``$ZEPHON_CACHE_DIR`` or ``~/.cache/zephon``); later runs reuse it.
2. Build ``token_windows(seq_len=1024) -> shuffle(256) -> pack_tokens(2048) ->
   batch(8)`` and print ``explain()`` for the process runner.
3. Run it uninterrupted on the process runner (2 workers) with a progress bar,
   and report the throughput.
4. Run it again, stop half-way and take a checkpoint; resume in a fresh
   pipeline on the threads runner with 3 workers; check that the concatenated
   stream is identical, batch for batch, to the uninterrupted one.

Each phase is announced on stdout (runner and workers per stage), so a run off a
terminal, where the progress bars are silent, still says what was run.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import numpy as np

from zephon import Pipeline, RuntimeOptions, sources

CORPUS_TOKENS = 8 << 20
CORPUS_NAME = "demo-tokens-v1.u16"
FIRST_RUNNER, FIRST_WORKERS = "process", 2
RESUME_RUNNER, RESUME_WORKERS = "threads", 3


def cache_dir() -> str:
    return os.environ.get("ZEPHON_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "zephon")


def ensure_corpus() -> str:
    path = os.path.join(cache_dir(), CORPUS_NAME)
    if os.path.exists(path) and os.path.getsize(path) == CORPUS_TOKENS * 2:
        return path
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    rng = np.random.default_rng(20261130)
    tokens = np.minimum(rng.zipf(1.3, CORPUS_TOKENS), 50_000).astype(np.uint16)
    tmp = f"{path}.tmp-{os.getpid()}"
    tokens.tofile(tmp)
    os.replace(tmp, path)
    return path


def build(path: str) -> Pipeline:
    return (Pipeline(sources.token_windows(path, seq_len=1024), seed=42, chunk_size=32)
            .shuffle(256).pack_tokens(2048).batch(8))


def digest(batch) -> str:
    # a lane's last, shorter row comes as a batch of its own: rows of another length
    h = hashlib.sha256(b"".join(np.asarray(row).tobytes() for row in batch["tokens"]))
    h.update(repr((batch.meta["lane"], batch.meta["lane_index"])).encode())
    return h.hexdigest()


class Bar:
    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.n = total, label, 0
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()

    def step(self) -> None:
        self.n += 1
        if self.tty and (self.n % 4 == 0 or self.n == self.total):
            done = min(30, 30 * self.n // max(1, self.total))
            sys.stderr.write(f"\r  {self.label} [{'#' * done}{'.' * (30 - done)}] "
                             f"{self.n}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def main() -> int:
    path = ensure_corpus()
    print(f"corpus: {path} ({CORPUS_TOKENS:,} tokens)")
    process = RuntimeOptions(runner=FIRST_RUNNER, max_workers=FIRST_WORKERS,
                             worker_allocation="per_stage_fixed")
    pipe = build(path).options(process)
    print(pipe.explain())

    expected_batches = CORPUS_TOKENS // (2048 * 8)
    first_label = f"{FIRST_RUNNER} runner, {FIRST_WORKERS} workers per stage"
    print(f"run 1: uninterrupted, {first_label}")
    bar = Bar(expected_batches, f"uninterrupted, {first_label}")
    start = time.perf_counter()
    reference = []
    first_at = None
    for batch in pipe:
        if first_at is None:
            first_at = time.perf_counter() - start
        reference.append(digest(batch))
        bar.step()
    elapsed = time.perf_counter() - start
    bar.close()
    tokens = len(reference) * 8 * 2048
    print(f"throughput: {len(reference)} batches, {tokens / elapsed / 1e6:.1f} M tokens/s, "
          f"{tokens * 2 / elapsed / 1e6:.0f} MB/s of uint16 tokens; first batch after "
          f"{first_at:.2f} s")

    half = len(reference) // 2
    first = build(path).options(process)
    print(f"run 2: first half ({half} batches), {first_label}, then a checkpoint")
    bar = Bar(half, f"first half, {first_label}")
    got = []
    it = iter(first)
    for _ in range(half):
        got.append(digest(next(it)))
        bar.step()
    state = first.checkpoint()
    first.close()
    bar.close()
    print(f"checkpoint after {half} batches: {len(state)} bytes")

    resumed = build(path).options(RuntimeOptions(runner=RESUME_RUNNER, max_workers=RESUME_WORKERS,
                                                 worker_allocation="per_stage_fixed"))
    resumed.restore(state)
    resume_label = f"{RESUME_RUNNER} runner, {RESUME_WORKERS} workers per stage"
    print(f"run 2: resumed from the checkpoint on the {resume_label} (the checkpoint was "
          f"taken on the {first_label})")
    bar = Bar(len(reference) - half, f"resumed, {resume_label}")
    for batch in resumed:
        got.append(digest(batch))
        bar.step()
    bar.close()
    if got == reference:
        print(f"resumed stream identical to the uninterrupted one: {len(got)} batches, "
              f"batch for batch (resumed on the {resume_label})")
        return 0
    mismatch = next((i for i, (a, b) in enumerate(zip(got, reference, strict=False)) if a != b),
                    min(len(got), len(reference)))
    print(f"MISMATCH: the resumed stream differs from batch {mismatch} "
          f"({len(got)} vs {len(reference)} batches)")
    return 1
