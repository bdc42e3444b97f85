"""Side-by-side on what users run: image decode, tokenize -> pack, nanoGPT windows.

    python bench/compare_workloads.py                 # every row, 3 repetitions
    python bench/compare_workloads.py --quick         # smaller data, one repetition
    python bench/compare_workloads.py --only image --reps 5   # rows whose name matches
    python bench/compare_workloads.py --python .venv-peers/bin/python   # peers there

Same method as ``bench/compare_torch.py``: every row runs in a **fresh process**
(``python compare_workloads.py --row JSON``); each row is repeated (``--reps``, 3 by
default) in an order rotated by one row per repetition, and the tables show medians
with [min-max]. Ratios are taken between rows of the same run only: absolute numbers
on a shared machine are noise. The last line is machine-readable ``key=value`` pairs.

The script makes its own data, deterministically and without network, under
``--data`` (default ``~/.cache/zephon/workloads``; one directory per size, written once
and reused):

1. **image**: JPEGs (2,560 by default; 500x375 or 375x500, a random smooth image plus
   mild noise, PIL quality 90) in an ImageFolder layout (``class_NN/`` directories) and
   the same samples in 4 WebDataset tar shards (``KEY.jpg``, ``KEY.cls``). Per sample:
   PIL decode, RandomResizedCrop(224) (torchvision's parameter draw, PIL's antialiased
   bilinear resize of the box), horizontal flip with p=0.5, normalise to float32 CHW
   (602 KB); batches of 64. The crop and flip draw from zephon's ``ctx.rng`` (seeded from
   the sample's identity); each peer draws from its own RNG. Rows: ``zephon`` defaults
   (``Pipeline(from_sequence(files)).map(decode, parallelism=2).batch(64)``: the process
   runner, 2 workers), ``zephon autotune`` (the same map without a parallelism, under
   ``RuntimeOptions(runner="process", worker_allocation="autotune")``: the controller
   picks the workers within the process's cores), ``zephon autotune unpinned`` (the
   option alone, ``RuntimeOptions(worker_allocation="autotune")``, as a user writes it:
   the map starts inline and is moved to process workers once a trial shows they pay), ``zephon webdataset`` (the same over
   ``sources.webdataset``),
   ``torch`` (``DataLoader(num_workers=2, batch_size=64, shuffle=True, spawn)`` over an
   ImageFolder-like dataset), ``grain`` (``MapDataset.source -> shuffle -> random_map ->
   batch(64) -> mp_prefetch(2 workers)``), ``tf.data`` (``from_tensor_slices -> shuffle ->
   map(read_file + numpy_function(the same Python transform), AUTOTUNE) -> batch(64) ->
   prefetch``) and ``torchvision`` when importable: its transforms (RandomResizedCrop,
   flip, ToTensor, Normalize) in the torch row's dataset and in zephon's map (``zephon +
   torchvision``: the default runner's one compute thread per worker is what keeps
   torch's intra-op threads from oversubscribing the cores). Rate: steady images/s from a warm-up (10 % of the batches, at least 6) to the last batch,
   and the whole epoch (build to exhausted). Grain reads far ahead (``to_iter_dataset``'s
   defaults: 16 threads and 500 elements of prefetch per worker; its elements are the
   batches here, so the whole epoch may be read ahead), so much of its work is done before
   the steady window: its steady rate then exceeds what two
   workers can decode (``bench/cpu_per_image.py --grain``: its workers' CPU in the window
   was a fifth of the transform's), and only the epoch compares it.
2. **tokenize**: a Parquet corpus (20,000 documents of log-normal length over a Zipf
   vocabulary of made-up words, 4 files of 1,000-row groups) and a byte-level BPE
   (``tokenizers``, vocabulary 8,192) trained on its first 4,000 documents in this
   script. Per document: ``encode(text).ids`` plus an end-of-text id; packed into rows of
   1024 tokens; batches of 8. Rows: ``zephon 2 workers`` (``Pipeline(parquet).map(tokenize,
   parallelism=2).pack_tokens(1024).batch(8)``), ``zephon inline`` (the same on the
   inline runner), ``hf datasets`` (the standard recipe: ``load_dataset("parquet")``,
   ``map(tokenize, batched=True, num_proc=2)``, ``group_texts`` with ``num_proc=2``,
   ``with_format("numpy").iter(batch_size=8)``, in a fresh cache directory deleted after
   the row: cold, end to end) and ``torch`` (``DataLoader(num_workers=2, batch_size=8,
   spawn)`` over an IterableDataset that reads its share of the row groups, tokenizes and
   packs), and ``zephon op 2 workers`` / ``zephon op inline``: the same pipelines with
   the ``tokenize`` op (``.tokenize(tokenizer.json, add_eos=True, eos=EOT)``: one
   ``encode_batch`` call per dispatch part, uint16 ids) in place of ``map(tokenize)``.
   Every row runs with ``TOKENIZERS_PARALLELISM=false`` (one thread per process,
   as ``datasets`` forces in its forked workers). Reported: whole-epoch seconds (from
   building the loader to its exhaustion) and tokens/s.
3. **windows**: a uint16 token file (50M tokens, uniform over 50,257 ids) read in windows
   of 1024+1 tokens, batches of 16, one epoch of non-overlapping windows (48,780).
   Rows: ``zephon inline`` (``Pipeline(token_windows(path, 1025)).batch(16)``, default
   options), ``zephon process`` (the same with ``runner="process", max_workers=2,
   worker_allocation="per_stage_fixed"``: a read-only stage otherwise asks for one
   worker), ``nanogpt get_batch`` (its loop as nanoGPT's ``train.py`` writes it:
   ``np.memmap`` per batch, ``torch.randint`` offsets, ``torch.stack`` of int64 ``x`` and
   ``y``; as many samples as an epoch) and ``torch`` (``DataLoader(num_workers=2,
   batch_size=16, shuffle=True, spawn)`` over the same windows). Rate: steady samples/s.

Ratios (> 1 means zephon is ahead): ``image_defaults_vs_best_peer`` (zephon defaults /
the fastest peer row), ``image_defaults_vs_best_peer_epoch`` (the fastest peer's epoch
seconds / zephon defaults'), ``image_autotune_vs_tfdata`` (zephon autotune / tf.data,
steady) and ``image_autotune_vs_tfdata_epoch`` (by epoch seconds), the same two for
``autotune_unpinned``, ``tokenize_process2_vs_hf`` (HF's epoch seconds / zephon 2
workers'), ``windows_process_vs_get_batch``, ``windows_best_vs_get_batch`` (zephon's
faster runner / get_batch), and each zephon row against each peer row of its table.

**Peers and interpreters.** torch and ``datasets`` are in zephon's development venv;
Grain and tensorflow-cpu are not (zephon's ``bench`` extra pins Grain for
``compare_torch.py``; tensorflow brings keras, h5py and a libclang wheel). They were
installed into a separate clean venv::

    python3 -m venv .venv-peers
    .venv-peers/bin/pip install numpy pillow pyarrow tokenizers torch==2.13.0 \\
        grain==0.2.18 tensorflow-cpu==2.21.0 datasets msgpack zstandard
    .venv-peers/bin/pip install -e . --no-deps

A peer runs in this interpreter when it imports here; ``--python PATH`` adds an
interpreter for the peers that do not (repeatable; ``--python grain=PATH`` names the
peer). zephon's rows always run in this interpreter. A peer found nowhere is named in
the output and gets no rows.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the shared row runner
from _fresh import run_in_child

# -- sizes -------------------------------------------------------------------------------------

FULL = {"images": 2560, "docs": 20_000, "tokens": 50_000_000}
QUICK = {"images": 960, "docs": 4_000, "tokens": 10_000_000}
IMAGE_BATCH, CROP, SHARDS, CLASSES = 64, 224, 4, 10
#: the fewest warm-up batches: more than any loader holds prefetched when its first batch
#: arrives (torch: 2 workers x prefetch_factor 2), or the "steady" window would count them
WARMUP_MIN = 6
DATA_VERSION = 1  # part of the data directories' names: bump it when the generators change
SEQ, TOKEN_BATCH, VOCAB, EOT = 1024, 8, 8192, "<|endoftext|>"
WINDOW, WINDOW_BATCH, GPT2_VOCAB = 1025, 16, 50_257
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


# -- the image transform (module level: picklable into every peer's workers) -----------------

def crop_box(width: int, height: int, rng) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box (scale 0.08-1, ratio 3/4-4/3; torchvision's draw)."""
    area = width * height
    lo, hi = math.log(3 / 4), math.log(4 / 3)
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(lo, hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, left + w, top + h
    ratio = width / height  # the fallback: a centre crop
    w, h = width, height
    if ratio < 3 / 4:
        h = round(w / (3 / 4))
    elif ratio > 4 / 3:
        w = round(h * (4 / 3))
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def transform_image(data: bytes, rng) -> np.ndarray:
    """PIL decode, RandomResizedCrop(224), flip (p=0.5), normalise: float32 (3, 224, 224)."""
    from PIL import Image

    img = Image.open(io.BytesIO(data)).convert("RGB")
    box = crop_box(img.width, img.height, rng)
    img = img.resize((CROP, CROP), Image.Resampling.BILINEAR, box=box)
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    arr = np.asarray(img, dtype=np.float32)
    arr *= 1 / 255
    arr -= MEAN
    arr /= STD
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


def decode_file(sample: dict, ctx) -> dict:
    """zephon's map over the ImageFolder files: ``{"path", "label"}`` -> image, label."""
    with open(sample["path"], "rb") as f:
        data = f.read()
    return {"image": transform_image(data, ctx.rng), "label": sample["label"]}


def decode_wds(sample: dict, ctx) -> dict:
    """zephon's map over the tar shards: ``{"jpg": bytes, "cls": bytes}`` -> image, label."""
    return {"image": transform_image(sample["jpg"], ctx.rng), "label": int(sample["cls"])}


_TV = None


def decode_file_tv(sample: dict, ctx) -> dict:
    """zephon's map with torchvision's transforms (the torch + torchvision row's, made
    once per worker): image (a CHW float32 array), label. The crop and flip draw from
    torch's global generator, seeded per sample from ``ctx.rng`` so that the stream is
    reproducible (zephon's validation refuses an op whose output differs between two
    runs on one sample)."""
    global _TV
    import torch
    from PIL import Image

    torch.manual_seed(int(ctx.rng.integers(2**63)))
    if _TV is None:
        import torchvision.transforms as T

        _TV = T.Compose([T.RandomResizedCrop(CROP), T.RandomHorizontalFlip(), T.ToTensor(),
                         T.Normalize(MEAN.tolist(), STD.tolist())])
    with open(sample["path"], "rb") as f:
        image = Image.open(io.BytesIO(f.read())).convert("RGB")
    return {"image": _TV(image).numpy(), "label": sample["label"]}


def image_files(root: str) -> list[dict]:
    """The ImageFolder layout as ``[{"path", "label"}]``, classes and files sorted."""
    out = []
    for label, cls in enumerate(sorted(os.listdir(root))):
        for name in sorted(os.listdir(os.path.join(root, cls))):
            out.append({"path": os.path.join(root, cls, name), "label": label})
    return out


class ImageFolderDataset:
    """torch's map-style dataset over the same files; its RNG is seeded per worker by torch."""

    def __init__(self, root: str, torchvision: bool = False) -> None:
        self.files, self.torchvision = image_files(root), torchvision
        self._rng = None
        self._tv = None

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        item = self.files[i]
        with open(item["path"], "rb") as f:
            data = f.read()
        if self.torchvision:
            return self._tv_transform(data), item["label"]
        if self._rng is None:
            import torch

            self._rng = np.random.default_rng(torch.initial_seed())
        return transform_image(data, self._rng), item["label"]

    def _tv_transform(self, data: bytes):
        from PIL import Image

        if self._tv is None:
            import torchvision.transforms as T

            self._tv = T.Compose([T.RandomResizedCrop(CROP), T.RandomHorizontalFlip(),
                                  T.ToTensor(), T.Normalize(MEAN.tolist(), STD.tolist())])
        return self._tv(Image.open(io.BytesIO(data)).convert("RGB"))


def _grain_decode(item: dict, rng) -> dict:
    with open(item["path"], "rb") as f:
        data = f.read()
    return {"image": transform_image(data, rng), "label": item["label"]}


def _tf_decode(data: bytes, seed) -> np.ndarray:
    return transform_image(data, np.random.default_rng(int(seed)))


# -- image loaders: each returns (iterable of image batches, close) ---------------------------

def image_zephon(paths: dict, source: str = "files", autotune: bool = False,
                 torchvision: bool = False, pinned: bool = True):
    from zephon import Pipeline, RuntimeOptions, sources

    # autotune: no parallelism given, the controller picks the workers (CPU budget: the
    # cores this process may use)
    par = {} if autotune else {"parallelism": 2}
    if torchvision:
        pipe = Pipeline(sources.from_sequence(image_files(paths["folder"]))) \
            .map(decode_file_tv, **par)
    elif source == "webdataset":
        pipe = Pipeline(sources.webdataset(os.path.join(paths["wds"], "*.tar"))) \
            .map(decode_wds, **par)
    else:
        pipe = Pipeline(sources.from_sequence(image_files(paths["folder"]))) \
            .map(decode_file, **par)
    if autotune:  # pinned: runner="process" too; else the option alone, as a user writes it
        pipe = pipe.options(RuntimeOptions(runner="process", worker_allocation="autotune")
                            if pinned else RuntimeOptions(worker_allocation="autotune"))
    it = iter(pipe.batch(IMAGE_BATCH))
    return (b["image"] for b in it), it.close


def image_torch(paths: dict, torchvision: bool = False):
    import torch.utils.data as tud

    loader = tud.DataLoader(ImageFolderDataset(paths["folder"], torchvision), num_workers=2,
                            batch_size=IMAGE_BATCH, shuffle=True,
                            multiprocessing_context="spawn")
    return (images for images, _ in loader), lambda: None


def image_grain(paths: dict):
    import grain

    ds = grain.MapDataset.source(image_files(paths["folder"])).shuffle(seed=0) \
        .random_map(_grain_decode, seed=0).batch(IMAGE_BATCH).to_iter_dataset() \
        .mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
    return (b["image"] for b in ds), lambda: None


def image_tf(paths: dict):
    import tensorflow as tf

    files = image_files(paths["folder"])
    ds = tf.data.Dataset.from_tensor_slices(([f["path"] for f in files],
                                             [f["label"] for f in files]))

    def load(path, label):
        seed = tf.random.uniform([], maxval=2**31 - 1, dtype=tf.int64)
        image = tf.numpy_function(_tf_decode, [tf.io.read_file(path), seed], tf.float32)
        return tf.ensure_shape(image, (3, CROP, CROP)), label

    ds = ds.shuffle(len(files), seed=0).map(load, num_parallel_calls=tf.data.AUTOTUNE) \
        .batch(IMAGE_BATCH).prefetch(tf.data.AUTOTUNE)
    return (images for images, _ in ds.as_numpy_iterator()), lambda: None


# -- tokenize -> pack ------------------------------------------------------------------------

_TOKENIZERS: dict = {}


def _tokenizer(path: str):
    tok = _TOKENIZERS.get(path)
    if tok is None:
        from tokenizers import Tokenizer

        tok = _TOKENIZERS[path] = Tokenizer.from_file(path)
    return tok


def tokenize(path: str, sample: dict) -> dict:
    """One document's token ids plus end-of-text, int32 (``functools.partial(tokenize, path)``)."""
    tok = _tokenizer(path)
    ids = tok.encode(sample["text"]).ids
    ids.append(tok.token_to_id(EOT))
    return {"tokens": np.asarray(ids, dtype=np.int32)}


def hf_tokenize(path: str, batch: dict) -> dict:
    tok = _tokenizer(path)
    eot = tok.token_to_id(EOT)
    return {"input_ids": [[*e.ids, eot] for e in tok.encode_batch(batch["text"])]}


def hf_group_texts(batch: dict) -> dict:
    """The standard recipe (``run_clm.py``'s ``group_texts``), input ids only."""
    concatenated = [t for ids in batch["input_ids"] for t in ids]
    total = len(concatenated) // SEQ * SEQ
    return {"input_ids": [concatenated[i:i + SEQ] for i in range(0, total, SEQ)]}


def _iter_packed(self):
    """Each DataLoader worker reads every n-th row group, tokenizes, packs rows of 1024."""
    import pyarrow.parquet as pq
    import torch.utils.data as tud

    info = tud.get_worker_info()
    k, n = (0, 1) if info is None else (info.id, info.num_workers)
    pending: list[np.ndarray] = []
    held, unit = 0, 0
    for path in self.files:
        pf = pq.ParquetFile(path)
        for g in range(pf.num_row_groups):
            unit += 1
            if unit % n != k:
                continue
            for text in pf.read_row_group(g, columns=["text"]).column(0).to_pylist():
                tokens = tokenize(self.tokenizer, {"text": text})["tokens"]
                pending.append(tokens)
                held += tokens.size
                if held >= SEQ:
                    flat = np.concatenate(pending)
                    rows = flat.size // SEQ
                    yield from flat[:rows * SEQ].reshape(rows, SEQ)
                    pending, held = [flat[rows * SEQ:]], flat.size - rows * SEQ


def _packed_parquet_class():
    """torch's IterableDataset for the tokenize row, made on first use: importing torch at
    module level would make every zephon row (and each of its spawn workers, which
    re-import this file) pay for it."""
    from torch.utils.data import IterableDataset

    def __init__(self, files: list[str], tokenizer: str) -> None:
        self.files, self.tokenizer = files, tokenizer

    cls = type("PackedParquet", (IterableDataset,),
               {"__init__": __init__, "__iter__": _iter_packed, "__module__": __name__})
    cls.__qualname__ = "PackedParquet"
    return cls


def __getattr__(name: str):
    """``PackedParquet`` on first use (unpickling in a spawn worker looks it up here)."""
    if name == "PackedParquet":
        cls = globals()["PackedParquet"] = _packed_parquet_class()
        return cls
    raise AttributeError(name)


def tokens_zephon(paths: dict, runner: str = "process", op: str = "map"):
    """``op="map"``: the per-sample ``map(tokenize)`` users wrote before the op existed;
    ``op="tokenize"``: zephon's ``tokenize`` op (one ``encode_batch`` per dispatch part;
    the same ids, as uint16)."""
    from zephon import Pipeline, RuntimeOptions, sources

    pipe = Pipeline(sources.parquet(paths["parquet"], columns=["text"]))
    if op == "tokenize":
        pipe = pipe.tokenize(paths["tokenizer"], add_eos=True, eos=EOT, parallelism=2)
    else:
        pipe = pipe.map(functools.partial(tokenize, paths["tokenizer"]), parallelism=2)
    pipe = pipe.pack_tokens(SEQ).batch(TOKEN_BATCH)
    if runner != "process":
        pipe = pipe.options(RuntimeOptions(runner=runner))
    it = iter(pipe)
    return (b["tokens"] for b in it), it.close


def tokens_torch(paths: dict):
    import torch.utils.data as tud

    files = sorted(str(p) for p in Path(paths["parquet_dir"]).glob("*.parquet"))
    dataset = __getattr__("PackedParquet")(files, paths["tokenizer"])
    loader = tud.DataLoader(dataset, num_workers=2, batch_size=TOKEN_BATCH,
                            multiprocessing_context="spawn")
    return iter(loader), lambda: None


def tokens_hf(paths: dict):
    import datasets

    cache = tempfile.mkdtemp(prefix="hf-cache-")
    datasets.disable_progress_bars()
    files = sorted(str(p) for p in Path(paths["parquet_dir"]).glob("*.parquet"))
    ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=cache)
    ds = ds.map(functools.partial(hf_tokenize, paths["tokenizer"]), batched=True, num_proc=2,
                remove_columns=ds.column_names)
    ds = ds.map(hf_group_texts, batched=True, num_proc=2)
    batches = (b["input_ids"] for b in ds.with_format("numpy").iter(batch_size=TOKEN_BATCH))
    return batches, lambda: shutil.rmtree(cache, ignore_errors=True)


# -- nanoGPT windows -------------------------------------------------------------------------

class WindowsDataset:
    """torch's map-style dataset over the same non-overlapping windows."""

    def __init__(self, path: str) -> None:
        self.path, self.n = path, os.path.getsize(path) // 2 // WINDOW
        self._tokens = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        return np.array(self._tokens[i * WINDOW:(i + 1) * WINDOW])


def windows_zephon(paths: dict, runner: str = "inline"):
    from zephon import Pipeline, RuntimeOptions, sources

    pipe = Pipeline(sources.token_windows(paths["tokens"], WINDOW)).batch(WINDOW_BATCH)
    if runner == "process":
        pipe = pipe.options(RuntimeOptions(runner="process", max_workers=2,
                                           worker_allocation="per_stage_fixed"))
    it = iter(pipe)
    return (b["tokens"] for b in it), it.close


def windows_get_batch(paths: dict):
    """nanoGPT's ``get_batch('train')`` on the CPU, for as many samples as an epoch."""
    import torch

    path, block_size, batch_size = paths["tokens"], WINDOW - 1, WINDOW_BATCH
    batches = (os.path.getsize(path) // 2 // WINDOW) // batch_size

    def get_batch():
        # nanoGPT: "recreate np.memmap every batch to avoid a memory leak"
        data = np.memmap(path, dtype=np.uint16, mode="r")
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy((data[i:i + block_size]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block_size]).astype(np.int64))
                         for i in ix])
        return x, y

    return (get_batch()[0] for _ in range(batches)), lambda: None


def windows_torch(paths: dict):
    import torch.utils.data as tud

    loader = tud.DataLoader(WindowsDataset(paths["tokens"]), num_workers=2,
                            batch_size=WINDOW_BATCH, shuffle=True,
                            multiprocessing_context="spawn")
    return iter(loader), lambda: None


LOADERS = {
    "image/zephon": image_zephon, "image/torch": image_torch, "image/grain": image_grain,
    "image/tf": image_tf, "tokenize/zephon": tokens_zephon, "tokenize/torch": tokens_torch,
    "tokenize/hf": tokens_hf, "windows/zephon": windows_zephon,
    "windows/get_batch": windows_get_batch, "windows/torch": windows_torch,
}
#: peer -> the module it needs
PEER_MODULES = {"torch": "torch", "torchvision": "torchvision", "grain": "grain",
                "tf": "tensorflow", "hf": "datasets"}


# -- one row -----------------------------------------------------------------------------------

def _rows_of(batch) -> int:
    n = int(batch.shape[0])
    assert n > 0 and batch.shape[1] > 0
    float(batch[0, 0] if batch.ndim == 2 else batch[0, 0, 0, 0])  # touch one element
    return n


def run_row(spec: dict) -> dict:
    """Run one row here: items (samples), first_s, epoch_s (build to exhausted and
    closed), items_per_s (steady: from the warm-up, 10 % of the batches and at least
    WARMUP_MIN, to the last batch), end_s."""
    t0 = time.perf_counter()
    batches, close = LOADERS[spec["loader"]](spec["paths"], **spec.get("kw", {}))
    warmup = max(WARMUP_MIN, spec["batches"] // 10)
    got = items = steady_from = 0
    first, t_steady, t_last = float("nan"), t0, t0
    try:
        for batch in batches:
            items += _rows_of(batch)
            got += 1
            t_last = time.perf_counter()
            if got == 1:
                first = t_last - t0
            if got == warmup:
                t_steady, steady_from = t_last, items
            del batch
    finally:
        close()
    t_end = time.perf_counter()
    return {"items": items, "first_s": first, "epoch_s": t_end - t0, "end_s": t_end - t_last,
            "items_per_s": (items - steady_from) / max(t_last - t_steady, 1e-9)}


# -- data --------------------------------------------------------------------------------------

def _atomic_dir(final: Path, build) -> Path:
    """Build a directory in a sibling temp dir and rename it into place (once)."""
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    try:
        build(tmp)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _make_images(n: int, out: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    folder, wds = out / "folder", out / "wds"
    for c in range(CLASSES):
        (folder / f"class_{c:02d}").mkdir(parents=True)
    wds.mkdir()
    per_shard = -(-n // SHARDS)
    grain = rng.normal(0, 6, (500, 500, 3)).astype(np.int16)  # film grain, shifted per image
    tars = [tarfile.open(wds / f"train-{s:03d}.tar", "w") for s in range(SHARDS)]
    try:
        for i in range(n):
            size = (500, 375) if rng.random() < 0.75 else (375, 500)
            coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
            img = np.asarray(Image.fromarray(coarse).resize(size, Image.Resampling.BICUBIC),
                             dtype=np.int16)
            dy, dx = rng.integers(0, 500 - size[1] + 1), rng.integers(0, 500 - size[0] + 1)
            img += grain[dy:dy + size[1], dx:dx + size[0]]
            img = np.clip(img, 0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=90)
            data, label = buf.getvalue(), i % CLASSES
            (folder / f"class_{label:02d}" / f"{i:06d}.jpg").write_bytes(data)
            tar = tars[i // per_shard]
            for name, payload in ((f"{i:06d}.jpg", data), (f"{i:06d}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    finally:
        for tar in tars:
            tar.close()


def _make_corpus(n: int, out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(1)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    lengths = rng.integers(2, 11, 20_000)
    words = np.array(["".join(rng.choice(letters, k)) for k in lengths])
    p = 1.0 / (np.arange(words.size) + 2.7)
    doc_words = np.clip(rng.lognormal(5.3, 0.8, n).astype(np.int64), 20, 4000)
    picks = rng.choice(words.size, int(doc_words.sum()), p=p / p.sum())
    ends = np.cumsum(doc_words)
    texts = [" ".join(words[picks[e - k:e]]) for e, k in zip(ends, doc_words, strict=True)]
    files = out / "parquet"
    files.mkdir()
    per_file = -(-n // 4)
    for f in range(4):
        part = texts[f * per_file:(f + 1) * per_file]
        table = pa.table({"id": np.arange(f * per_file, f * per_file + len(part)), "text": part})
        pq.write_table(table, files / f"part-{f}.parquet", row_group_size=1000)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts[:4000], trainer=trainer)
    tok.save(str(out / "tokenizer.json"))


def _make_tokens(n: int, out: Path) -> None:
    rng = np.random.default_rng(2)
    rng.integers(0, GPT2_VOCAB, n, dtype=np.uint16).tofile(out / "train.bin")


def ensure_data(root: Path, sizes: dict, need: set[str]) -> dict:
    """Paths of the workloads in ``need`` (made on first use), and each one's batch count."""
    paths: dict = {}
    if "image" in need:
        d = _atomic_dir(root / f"images-{sizes['images']}-v{DATA_VERSION}",
                        functools.partial(_make_images, sizes["images"]))
        paths.update(folder=str(d / "folder"), wds=str(d / "wds"))
    if "tokenize" in need:
        d = _atomic_dir(root / f"corpus-{sizes['docs']}-v{DATA_VERSION}",
                        functools.partial(_make_corpus, sizes["docs"]))
        paths.update(parquet=str(d / "parquet" / "*.parquet"), parquet_dir=str(d / "parquet"),
                     tokenizer=str(d / "tokenizer.json"))
    if "windows" in need:
        d = _atomic_dir(root / f"tokens-{sizes['tokens']}-v{DATA_VERSION}",
                        functools.partial(_make_tokens, sizes["tokens"]))
        paths["tokens"] = str(d / "train.bin")
    return paths


# -- the plan ------------------------------------------------------------------------------------

def _expected_batches(workload: str, sizes: dict) -> int:
    if workload == "image":
        return -(-sizes["images"] // IMAGE_BATCH)
    if workload == "windows":
        return sizes["tokens"] // WINDOW // WINDOW_BATCH
    return max(1, sizes["docs"] * 250 // (SEQ * TOKEN_BATCH))  # a rough count: warm-up only


def plan(sizes: dict, peers: dict[str, str]) -> list[dict]:
    """Every row: name, workload, loader, kw, python (None: this interpreter)."""
    def row(name, workload, loader, python=None, **kw):
        return {"name": name, "workload": workload, "loader": f"{workload}/{loader}",
                "kw": kw, "python": python, "batches": _expected_batches(workload, sizes)}

    rows = [row("zephon defaults", "image", "zephon"),
            row("zephon autotune", "image", "zephon", autotune=True),
            row("zephon autotune unpinned", "image", "zephon", autotune=True, pinned=False),
            row("zephon webdataset", "image", "zephon", source="webdataset")]
    if "torch" in peers:
        rows.append(row("torch DataLoader", "image", "torch", peers["torch"]))
    if "torchvision" in peers:
        # zephon must be importable there too (an editable install, or PYTHONPATH)
        rows.append(row("zephon + torchvision", "image", "zephon", peers["torchvision"],
                        torchvision=True))
        rows.append(row("torch + torchvision", "image", "torch", peers["torchvision"],
                        torchvision=True))
    if "grain" in peers:
        rows.append(row("grain", "image", "grain", peers["grain"]))
    if "tf" in peers:
        rows.append(row("tf.data", "image", "tf", peers["tf"]))
    rows += [row("zephon 2 workers", "tokenize", "zephon"),
             row("zephon inline", "tokenize", "zephon", runner="inline"),
             row("zephon op 2 workers", "tokenize", "zephon", op="tokenize"),
             row("zephon op inline", "tokenize", "zephon", runner="inline", op="tokenize")]
    if "hf" in peers:
        rows.append(row("hf datasets", "tokenize", "hf", peers["hf"]))
    if "torch" in peers:
        rows.append(row("torch DataLoader", "tokenize", "torch", peers["torch"]))
    rows += [row("zephon inline", "windows", "zephon"),
             row("zephon process", "windows", "zephon", runner="process")]
    if "torch" in peers:
        rows += [row("nanogpt get_batch", "windows", "get_batch", peers["torch"]),
                 row("torch DataLoader", "windows", "torch", peers["torch"])]
    return rows


def find_peers(pythons: list[str]) -> tuple[dict[str, str], list[str]]:
    """peer -> interpreter (None: this one), and the peers found nowhere."""
    named = dict(p.split("=", 1) for p in pythons if "=" in p)
    plain = [p for p in pythons if "=" not in p]
    found, missing = {}, []
    for peer, module in PEER_MODULES.items():
        if peer in named:
            found[peer] = named[peer]
        elif importlib.util.find_spec(module) is not None:
            found[peer] = None
        else:
            where = next((py for py in plain if _imports(py, module)), "")
            if where:
                found[peer] = where
            else:
                missing.append(peer)
    return found, missing


def _imports(python: str, module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=120,
                              check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_fresh(spec: dict, timeout: float) -> dict | None:
    """One row in a fresh interpreter; None (and the reason on stderr) if it failed."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TF_CPP_MIN_LOG_LEVEL": "2",
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    label = f"{spec['workload']}: {spec['name']}"
    return run_in_child(str(Path(__file__).resolve()), spec, timeout, env, label,
                   python=spec.get("python"))[0]


# -- the report ----------------------------------------------------------------------------------

KEYS = ("items", "first_s", "epoch_s", "end_s", "items_per_s")


def summarise(results: list[dict]) -> dict:
    """Median, min and max of every key."""
    out = {}
    for k in KEYS:
        values = [r[k] for r in results]
        out[k] = statistics.median(values)
        out[k + "_min"], out[k + "_max"] = min(values), max(values)
    return out


def _spread(row: dict, key: str, fmt: str) -> str:
    return f"{row[key]:{fmt}} [{row[key + '_min']:{fmt}}-{row[key + '_max']:{fmt}}]"


def print_tables(rows: list[dict], table: dict) -> None:
    titles = {"image": "image decode: JPEG -> RandomResizedCrop(224) + flip + normalise, "
                       "batch 64 (steady images/s)",
              "tokenize": "tokenize -> pack 1024 -> batch 8 over Parquet (whole epoch)",
              "windows": "nanoGPT windows of 1025 tokens, batch 16 (steady samples/s)"}
    for workload, title in titles.items():
        mine = [r for r in rows if r["workload"] == workload]
        if not mine:
            continue
        print(f"\n{title}")
        for spec in mine:
            row = table.get((workload, spec["name"]))
            if row is None:
                print(f"  {spec['name']:<22} failed")
            elif workload == "tokenize":
                tokens = row["items"] * SEQ
                print(f"  {spec['name']:<22} {_spread(row, 'epoch_s', '.2f')} s  "
                      f"{tokens / row['epoch_s'] / 1e3:8.1f}k tokens/s  ({tokens:,} tokens, "
                      f"first batch {row['first_s']:.2f} s)")
            else:
                print(f"  {spec['name']:<22} {_spread(row, 'items_per_s', '.0f')} /s  "
                      f"(first batch {row['first_s']:.2f} s, epoch {row['epoch_s']:.2f} s, "
                      f"{row['items'] / row['epoch_s']:.0f}/s over the epoch)")


def _image_epoch_ratios(table: dict) -> list[tuple[str, float]]:
    """The image bar on whole epochs (a peer's epoch seconds / zephon defaults'): the
    steady rate flatters a loader that reads far ahead (Grain prefetches 500 elements,
    here batches, per worker: the whole epoch, before and during the warm-up), the epoch
    does not."""
    mine = table.get(("image", "zephon defaults"))
    peers = {n: r["epoch_s"] for (w, n), r in table.items()
             if w == "image" and not n.startswith("zephon") and "torchvision" not in n}
    if mine is None or not peers:
        return []
    best = min(peers, key=lambda n: peers[n])
    return [(f"image_defaults_vs_best_peer_epoch({best.split()[0]})",
             peers[best] / mine["epoch_s"])]


def _image_ratios(table: dict) -> list[tuple[str, float]]:
    """The image rows' ratios (> 1: zephon ahead): defaults against every PIL peer and
    the best, autotune against tf.data, and the two torchvision rows."""
    out: list[tuple[str, float]] = []

    def rate(name: str) -> float | None:
        row = table.get(("image", name))
        return None if row is None else row["items_per_s"]

    zephon_img = rate("zephon defaults")
    # the PIL transform's peers; the torchvision rows compare with each other below
    peers = {n: r["items_per_s"] for (w, n), r in table.items()
             if w == "image" and not n.startswith("zephon") and "torchvision" not in n}
    if zephon_img and peers:
        best = max(peers, key=lambda n: peers[n])
        out.append((f"image_defaults_vs_best_peer({best.split()[0]})", zephon_img / peers[best]))
        for name, value in peers.items():
            out.append((f"image_defaults_vs_{name.split()[0].replace('.', '')}",
                        zephon_img / value))
        out += _image_epoch_ratios(table)
    ztv, ttv = rate("zephon + torchvision"), rate("torch + torchvision")
    if ztv and ttv:
        out.append(("image_torchvision_zephon_vs_torch", ztv / ttv))
    tf = table.get(("image", "tf.data"))
    for name, key in (("zephon autotune", "autotune"), ("zephon autotune unpinned",
                                                        "autotune_unpinned")):
        auto = table.get(("image", name))
        if auto and tf:
            out.append((f"image_{key}_vs_tfdata", auto["items_per_s"] / tf["items_per_s"]))
            out.append((f"image_{key}_vs_tfdata_epoch", tf["epoch_s"] / auto["epoch_s"]))
    return out


def ratios(table: dict) -> list[tuple[str, float]]:
    """The bars' ratios from the medians (> 1: zephon ahead), for the rows that ran."""
    out: list[tuple[str, float]] = []

    def rate(workload: str, name: str) -> float | None:
        row = table.get((workload, name))
        return None if row is None else row["items_per_s"]

    def seconds(name: str) -> float | None:
        row = table.get(("tokenize", name))
        return None if row is None else row["epoch_s"]

    out += _image_ratios(table)
    a, b = seconds("zephon op 2 workers"), seconds("zephon op inline")
    if a and b:
        out.append(("tokenize_op_process2_vs_op_inline", b / a))
    for zname, key in (("zephon 2 workers", "process2"), ("zephon inline", "inline"),
                       ("zephon op 2 workers", "op_process2"),
                       ("zephon op inline", "op_inline")):
        for peer, pkey in (("hf datasets", "hf"), ("torch DataLoader", "torch")):
            a, b = seconds(zname), seconds(peer)
            if a and b:
                out.append((f"tokenize_{key}_vs_{pkey}", b / a))
    base = rate("windows", "nanogpt get_batch")
    zp, zi = rate("windows", "zephon process"), rate("windows", "zephon inline")
    if base and zp:
        out.append(("windows_process_vs_get_batch", zp / base))
    if base and (zp or zi):
        out.append(("windows_best_vs_get_batch", max(zp or 0.0, zi or 0.0) / base))
    tdl = rate("windows", "torch DataLoader")
    if tdl and zp:
        out.append(("windows_process_vs_torch", zp / tdl))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller data, one repetition")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per row (3)")
    parser.add_argument("--only", default="",
                        help="rows whose 'workload: name' contains this (e.g. image, hf; "
                             "several, comma-separated: any of them)")
    parser.add_argument("--no-peers", action="store_true", help="zephon rows only")
    parser.add_argument("--python", action="append", default=[],
                        help="an interpreter for peers missing here; PEER=PATH names one "
                             f"({', '.join(PEER_MODULES)})")
    parser.add_argument("--data", default=os.path.expanduser("~/.cache/zephon/workloads"),
                        help="where the generated data is kept")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per row run")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row, print JSON
    args = parser.parse_args(argv)
    if args.row:
        print(json.dumps(run_row(json.loads(args.row))), flush=True)
        return 0
    reps = args.reps or (1 if args.quick else 3)
    sizes = QUICK if args.quick else FULL
    peers, missing = ({}, []) if args.no_peers else find_peers(args.python)
    wanted = args.only.split(",")
    rows = [r for r in plan(sizes, peers)
            if any(w in f"{r['workload']}: {r['name']}" for w in wanted)]
    t = time.perf_counter()
    paths = ensure_data(Path(args.data), sizes, {r["workload"] for r in rows})
    print(f"data ready in {time.perf_counter() - t:.1f} s under {args.data}", file=sys.stderr)
    results: dict[tuple, list[dict]] = {(r["workload"], r["name"]): [] for r in rows}
    for rep in range(reps):  # rotated: a slow phase of the machine hits every row
        k = rep % max(1, len(rows))
        for spec in rows[k:] + rows[:k]:
            got = run_fresh({**spec, "paths": paths}, args.timeout)
            if got is not None:
                results[(spec["workload"], spec["name"])].append(got)
                print(f"  {spec['workload']}: {spec['name']}: {got['items_per_s']:.0f}/s steady, "
                      f"epoch {got['epoch_s']:.2f} s", file=sys.stderr, flush=True)
        print(f"repetition {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    table = {key: summarise(rs) for key, rs in results.items() if rs}
    print(f"medians [min-max] of {reps} run(s), each in a fresh process")
    print_tables(rows, table)
    for peer in missing:
        print(f"{peer} ({PEER_MODULES[peer]}) is not importable here nor in --python: "
              f"no {peer} rows")
    print()
    print(" ".join(f"{k}={v:.3f}" for k, v in ratios(table)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
