"""Side-by-side on the language-model path: tokenize -> pack 1024 -> batch 8.

    python bench/compare_lm.py                      # every row, 3 repetitions
    python bench/compare_lm.py --quick              # 4,000 documents, one repetition
    python bench/compare_lm.py --only parquet --reps 5   # rows whose name matches
    python bench/compare_lm.py --upstream .venv-upstream/bin/python   # upstream's venv

Same method as ``bench/compare_torch.py``: every row runs in a **fresh process**
(``python compare_lm.py --row JSON``); each row is repeated (``--reps``, 3 by default)
in an order rotated by one row per repetition, and the table shows medians with
[min-max]. Ratios are taken between rows of the same run only: absolute numbers on a
shared machine are noise. The last line is machine-readable ``key=value`` pairs.

Data (made once, deterministically and without network, under ``--data``): the corpus
of ``bench/compare_workloads.py`` (20,000 documents of log-normal length over a Zipf
vocabulary of made-up words; 4 Parquet files of 1,000-row groups) and the same
documents as 4 JSONL files (``{"id", "text"}`` per line), with the byte-level BPE
(``tokenizers``, vocabulary 8,192) that script trains on the first 4,000 documents.
Per document: its ids plus an end-of-text id, packed greedily into rows of 1024 tokens
(no padding), batches of 8; every row runs with ``TOKENIZERS_PARALLELISM=false``.

Rows, for JSONL and for Parquet:

- ``zephon inline`` / ``zephon 2 workers``: ``Pipeline(sources.jsonl|parquet)
  .tokenize(tokenizer.json, add_eos=True, eos=EOT, parallelism=2).pack_tokens(1024)
  .batch(8)``, on the inline runner / the process runner with 2 workers;
- ``upstream inline`` / ``upstream 2 workers``: upstream Zephon 0.2.0 (the ``zephon``
  package on the index), its own ops: ``Pipeline(StaticMixtureWorkSource([Dataset
  .from_path(dir, fmt=...)], {"docs": 1.0})).tokenize(PreTrainedTokenizerFast(the same
  tokenizer.json), field="text", special_tokens="eos", add_attention_mask=False)
  .pack_flat(1024, algorithm="wrap", emit_positions=False).batch(8)``
  (uncapped ``wrap`` is the same greedy packing), ``runner="inline"`` / ``"process"``
  with ``max_workers=2`` and ``parallelism=2``. Both packages are named ``zephon``, so
  these rows run in the interpreter of another venv (``--upstream PATH``, default
  ``.venv-upstream/bin/python`` in the checkout when it exists) with ``PYTHONPATH`` removed::

      python3 -m venv .venv-upstream
      .venv-upstream/bin/pip install zephon==0.2.0 tokenizers pyarrow transformers

  (``transformers``: upstream's ``tokenize`` calls an HF tokenizer object.) Without
  that interpreter the rows are named as missing and skipped;
- ``hf datasets``: ``load_dataset("json"|"parquet")``, ``map(tokenize, batched=True,
  num_proc=2)``, ``group_texts`` with ``num_proc=2``, ``with_format("numpy")
  .iter(batch_size=8)``, in a fresh cache directory deleted after the row (cold, end to
  end). All its work is done before its first batch, so its steady tokens/s is the
  reading of the finished dataset: compare its epoch seconds. It has no mid-epoch
  restore.

Reported per row: ``first`` (seconds from building the pipeline to its first batch),
``epoch`` (building to exhausted and closed), steady tokens/s (from a warm-up of 10 % of
the batches to the last), and ``restore`` (seconds from building a new pipeline and
restoring the checkpoint taken at the epoch's middle batch to its first batch; in the
same process after the epoch, so imports are warm for every library alike).

Ratios, for each format and runner: ``tokens_FMT_RUNNER_vs_upstream`` (zephon's steady
tokens/s / upstream's: > 1 is zephon ahead), ``first_...`` and ``restore_...``
(zephon's seconds / upstream's: < 1 is zephon ahead; the restore bar is <= 0.2), and
``e2e_FMT_process2_vs_hf`` (HF's epoch seconds / zephon 2 workers': > 1 is zephon ahead).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the shared row runner
from _fresh import run_in_child  # noqa: E402

SEQ, BATCH, EOT = 1024, 8, "<|endoftext|>"
FULL_DOCS, QUICK_DOCS = 20_000, 4_000
DATA_VERSION = 1  # part of the data directory's name: bump it when the data changes
UPSTREAM_VENV = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             ".venv-upstream", "bin", "python")
FORMATS = ("jsonl", "parquet")


# -- data --------------------------------------------------------------------------------------

def ensure_data(root: Path, docs: int) -> dict:
    """The corpus (Parquet, JSONL) and tokenizer, made on first use."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import compare_workloads as cw

    def build(out: Path) -> None:
        import pyarrow.parquet as pq

        cw._make_corpus(docs, out)
        (out / "jsonl").mkdir()
        for path in sorted((out / "parquet").glob("*.parquet")):
            rows = pq.read_table(path).to_pylist()
            with open(out / "jsonl" / (path.stem + ".jsonl"), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)

    d = cw._atomic_dir(root / f"lm-corpus-{docs}-v{DATA_VERSION}", build)
    return {"parquet": str(d / "parquet"), "jsonl": str(d / "jsonl"),
            "tokenizer": str(d / "tokenizer.json"), "docs": docs}


# -- the loaders: each returns build() -> (iterator, checkpoint(), close()) and restore ---------

def zephon_rows(paths: dict, fmt: str, runner: str):
    from zephon import Pipeline, RuntimeOptions, sources

    def build(state=None):
        files = sorted(str(p) for p in Path(paths[fmt]).glob(f"*.{fmt}"))
        source = sources.parquet(files, columns=["text"]) if fmt == "parquet" else \
            sources.jsonl(files)
        pipe = (Pipeline(source)
                .tokenize(paths["tokenizer"], add_eos=True, eos=EOT, parallelism=2)
                .pack_tokens(SEQ).batch(BATCH))
        opts = RuntimeOptions(runner="inline") if runner == "inline" else \
            RuntimeOptions(runner="process", max_workers=2)
        pipe = pipe.options(opts)
        if state is not None:
            pipe.restore(state)
        it = iter(pipe)
        return (b["tokens"] for b in it), it.checkpoint, it.close

    return build


def upstream_rows(paths: dict, fmt: str, runner: str):
    from transformers import PreTrainedTokenizerFast

    from zephon import Dataset, Pipeline, StaticMixtureWorkSource

    tok = PreTrainedTokenizerFast(tokenizer_file=paths["tokenizer"], eos_token=EOT)

    def build(state=None):
        ds = Dataset.from_path("docs", paths[fmt], fmt=fmt)
        pipe = (Pipeline(StaticMixtureWorkSource(
            [ds], {"docs": 1.0}, seed=0, exhausted_policy="stop",
            chunk_size=min(16384, paths["docs"])))
                .tokenize(tok, field="text", special_tokens="eos", add_attention_mask=False,
                          parallelism=2)
                .pack_flat(SEQ, algorithm="wrap", emit_positions=False).batch(BATCH))
        pipe = pipe.options(runner="inline") if runner == "inline" else \
            pipe.options(runner="process", max_workers=2)
        if state is not None:
            pipe.restore(state)
        it = iter(pipe)
        return (_upstream_tokens(b) for b in it), pipe.checkpoint, \
            getattr(it, "close", lambda: None)

    return build


def _upstream_tokens(batch) -> np.ndarray:
    """The (rows, 1024) token ids of one of upstream's batches."""
    records = getattr(batch, "samples", None) or getattr(batch, "records", None) or batch
    return np.stack([np.asarray(_payload(r)["input_ids"]) for r in records])


def _payload(record):
    return getattr(record, "payload", record)


def hf_rows(paths: dict, fmt: str, runner: str = "process"):
    import datasets

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import compare_workloads as cw

    def build(state=None):
        cache = tempfile.mkdtemp(prefix="hf-cache-")
        datasets.disable_progress_bars()
        files = sorted(str(p) for p in Path(paths[fmt]).glob(f"*.{fmt}"))
        ds = datasets.load_dataset("json" if fmt == "jsonl" else "parquet", data_files=files,
                                   split="train", cache_dir=cache)
        ds = ds.map(functools.partial(cw.hf_tokenize, paths["tokenizer"]), batched=True,
                    num_proc=2, remove_columns=ds.column_names)
        ds = ds.map(cw.hf_group_texts, batched=True, num_proc=2)
        batches = (b["input_ids"] for b in ds.with_format("numpy").iter(batch_size=BATCH))
        return batches, None, lambda: shutil.rmtree(cache, ignore_errors=True)

    return build


LOADERS = {"zephon": zephon_rows, "upstream": upstream_rows, "hf": hf_rows}


def run_row(spec: dict) -> dict:
    """One row here: the epoch (first batch, tokens/s, seconds), then a restore from the
    checkpoint taken at its middle batch (seconds to the first batch after it)."""
    t0 = time.perf_counter()
    build = LOADERS[spec["loader"]](spec["paths"], spec["fmt"], spec["runner"])
    batches, checkpoint, close = build()
    expected = spec["batches"]
    warmup, middle = max(4, expected // 10), expected // 2
    got = tokens = steady_from = 0
    first, t_steady, t_last, state = float("nan"), t0, t0, None
    try:
        for batch in batches:
            tokens += _tokens_of(batch)
            got += 1
            t_last = time.perf_counter()
            if got == 1:
                first = t_last - t0
            if got == warmup:
                t_steady, steady_from = t_last, tokens
            if got == middle and checkpoint is not None:
                state = checkpoint()
    finally:
        close()
    t_end = time.perf_counter()
    out = {"batches": got, "tokens": tokens, "first_s": first, "epoch_s": t_end - t0,
           "tokens_per_s": (tokens - steady_from) / max(t_last - t_steady, 1e-9),
           "restore_s": float("nan")}
    if state is not None:
        t1 = time.perf_counter()
        batches, _, close = build(state)
        try:
            next(iter(batches))
            out["restore_s"] = time.perf_counter() - t1
        finally:
            close()
    return out


def _tokens_of(batch) -> int:
    """Tokens in a batch of rows of 1024 (a lane's last rows may be shorter: a list, or an
    array of one short row when the last batch holds only that row)."""
    if isinstance(batch, np.ndarray):
        assert batch.ndim == 2 and (batch.shape[1] == SEQ or
                                    (batch.shape[0] == 1 and batch.shape[1] < SEQ)), batch.shape
        float(batch[0, 0])  # touch one element
        return int(batch.size)
    assert all(len(row) <= SEQ for row in batch)
    return sum(len(row) for row in batch)


# -- the plan and the report -------------------------------------------------------------------

def plan(upstream: str | None) -> list[dict]:
    rows = []
    for fmt in FORMATS:
        for runner, label in (("inline", "inline"), ("process", "2 workers")):
            rows.append({"name": f"{fmt}: zephon {label}", "loader": "zephon", "fmt": fmt,
                         "runner": runner})
            if upstream:
                rows.append({"name": f"{fmt}: upstream {label}", "loader": "upstream",
                             "fmt": fmt, "runner": runner, "python": upstream})
        rows.append({"name": f"{fmt}: hf datasets", "loader": "hf", "fmt": fmt,
                     "runner": "process"})
    return rows


def expected_batches(paths: dict) -> int:
    """Batches of one epoch (what the zephon pipeline yields), counted once here."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(paths["tokenizer"])
    texts = [t for p in sorted(Path(paths["parquet"]).glob("*.parquet"))
             for t in pq.read_table(p, columns=["text"]).column(0).to_pylist()]
    total = sum(len(e.ids) + 1 for e in tok.encode_batch(texts))
    return total // SEQ // BATCH


def run_fresh(spec: dict, timeout: float) -> dict | None:
    """One row in a fresh interpreter; None (and the reason on stderr) if it failed. An
    upstream row runs without PYTHONPATH: it must import upstream's ``zephon``."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if spec["loader"] == "upstream":
        env.pop("PYTHONPATH", None)
    return run_in_child(str(Path(__file__).resolve()), spec, timeout, env, spec["name"],
                   python=spec.get("python"))[0]


KEYS = ("first_s", "epoch_s", "tokens_per_s", "restore_s")


def summarise(results: list[dict]) -> dict:
    out: dict = {"batches": results[0]["batches"]}
    for k in KEYS:
        values = [r[k] for r in results if r[k] == r[k]]  # not NaN
        if values:
            out[k] = statistics.median(values)
            out[k + "_min"], out[k + "_max"] = min(values), max(values)
    return out


def _spread(row: dict, key: str, fmt: str) -> str:
    if key not in row:
        return "n/a"
    return f"{row[key]:{fmt}} [{row[key + '_min']:{fmt}}-{row[key + '_max']:{fmt}}]"


def ratios(table: dict) -> list[tuple[str, float]]:
    out = []
    for fmt in FORMATS:
        for label, key in (("inline", "inline"), ("2 workers", "process2")):
            z, u = table.get(f"{fmt}: zephon {label}"), table.get(f"{fmt}: upstream {label}")
            if z and u:
                out.append((f"tokens_{fmt}_{key}_vs_upstream",
                            z["tokens_per_s"] / u["tokens_per_s"]))
                out.append((f"first_{fmt}_{key}_vs_upstream", z["first_s"] / u["first_s"]))
                if "restore_s" in z and "restore_s" in u:
                    out.append((f"restore_{fmt}_{key}_vs_upstream",
                                z["restore_s"] / u["restore_s"]))
        z, h = table.get(f"{fmt}: zephon 2 workers"), table.get(f"{fmt}: hf datasets")
        if z and h:
            out.append((f"e2e_{fmt}_process2_vs_hf", h["epoch_s"] / z["epoch_s"]))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4,000 documents, one repetition")
    parser.add_argument("--docs", type=int, default=None, help="documents in the corpus")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per row (3)")
    parser.add_argument("--only", default="", help="rows whose name contains this")
    parser.add_argument("--upstream", default=UPSTREAM_VENV if os.path.exists(UPSTREAM_VENV)
                        else None, help="the interpreter of upstream Zephon 0.2.0's venv")
    parser.add_argument("--data", default=os.path.expanduser("~/.cache/zephon/workloads"),
                        help="where the generated data is kept")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per row run")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row, print JSON
    args = parser.parse_args(argv)
    if args.row:
        print(json.dumps(run_row(json.loads(args.row))), flush=True)
        return 0
    reps = args.reps or (1 if args.quick else 3)
    docs = args.docs or (QUICK_DOCS if args.quick else FULL_DOCS)
    t = time.perf_counter()
    paths = ensure_data(Path(args.data), docs)
    batches = expected_batches(paths)
    print(f"data ready in {time.perf_counter() - t:.1f} s under {args.data}: {docs} documents, "
          f"{batches} batches of {BATCH}x{SEQ}", file=sys.stderr)
    rows = [r for r in plan(args.upstream) if args.only in r["name"]]
    results: dict[str, list[dict]] = {r["name"]: [] for r in rows}
    for rep in range(reps):  # rotated: a slow phase of the machine hits every row
        k = rep % max(1, len(rows))
        for spec in rows[k:] + rows[:k]:
            got = run_fresh({**spec, "paths": paths, "batches": batches}, args.timeout)
            if got is not None:
                results[spec["name"]].append(got)
                print(f"  {spec['name']}: {got['tokens_per_s']:.0f} tokens/s, first "
                      f"{got['first_s']:.2f} s, epoch {got['epoch_s']:.2f} s, restore "
                      f"{got['restore_s']:.2f} s", file=sys.stderr, flush=True)
        print(f"repetition {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    table = {name: summarise(rs) for name, rs in results.items() if rs}
    print(f"medians [min-max] of {reps} run(s), each in a fresh process; {docs} documents")
    print(f"{'row':28} {'batches':>7} {'first s':>18} {'epoch s':>20} {'tokens/s':>28} "
          f"{'restore s':>18}")
    for r in rows:
        row = table.get(r["name"])
        if row is None:
            print(f"{r['name']:28} failed")
            continue
        print(f"{r['name']:28} {row['batches']:7d} {_spread(row, 'first_s', '.2f'):>18} "
              f"{_spread(row, 'epoch_s', '.1f'):>20} {_spread(row, 'tokens_per_s', '.0f'):>28} "
              f"{_spread(row, 'restore_s', '.2f'):>18}")
    if not args.upstream:
        print(f"no upstream interpreter ({UPSTREAM_VENV} missing, no --upstream): "
              f"no upstream rows")
    print()
    print(" ".join(f"{k}={v:.3f}" for k, v in ratios(table)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
