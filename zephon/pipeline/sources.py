"""Sources: random-access sample collections with a stable identity per sample.

Every source has a ``name``, a length and ``get(i)``; the identity of sample
``i`` in epoch ``e`` is ``(name, i, e)`` (for a mixture: the component's name
and the component's own index). Sources are pickled once per worker process
and must not hold open handles across pickling: files are (re)opened lazily in
whichever process reads.

- :func:`from_sequence` — an in-memory list/array; sample = item.
- :func:`from_callable` — ``fn(i)`` for ``i < n`` (a map-style dataset).
- :func:`token_windows` — a flat binary token file (nanoGPT style), memmapped;
  sample ``i`` is ``{"tokens": tokens[i*seq_len:(i+1)*seq_len]}``.
- :func:`jsonl` — one dict per line over files and globs (sorted); the line
  index is built once; a bad line raises an error naming file and line.
- :func:`mixture` — components interleaved by a deterministic schedule
  (:class:`~zephon.options.MixtureReadConfig`): smooth weighted round-robin
  or seeded weighted random; every component sample appears once per epoch.
"""

from __future__ import annotations

import copy
import glob as globlib
import json
import logging
import os
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from zephon.errors import ZephonConfigError, ZephonError

log = logging.getLogger("zephon.sources")

__all__ = ["Source", "from_sequence", "from_callable", "token_windows", "jsonl", "mixture",
           "SourceError"]


class SourceError(ZephonError):
    """A sample could not be read (the message names the file and line or index)."""


# (attempts, first back-off s, longest back-off s): StoreOptions' defaults. Kept as plain
# numbers so that a source unpickled in a worker does not import the options layer.
DEFAULT_OPEN_RETRY = (5, 0.1, 2.0)


def open_with_retry(path: str, mode: str, retry: tuple = DEFAULT_OPEN_RETRY):
    """``open`` with ``attempts`` tries and doubling back-off (``io_options``:
    ``open_retry_attempts``, ``retry_backoff_initial_s``, ``retry_backoff_max_s``):
    transient failures of shared file systems (a stale handle, a file not visible yet)
    get another chance; the last attempt's error is raised."""
    attempts, delay, longest = retry
    for attempt in range(1, attempts + 1):
        try:
            return open(path, mode)
        except OSError as exc:
            if attempt == attempts:
                raise
            log.warning("opening %s failed (%s); attempt %d of %d in %.2f s", path, exc,
                        attempt + 1, attempts, delay)
            time.sleep(delay)
            delay = min(longest, delay * 2 if delay else 0.0)
    raise AssertionError("unreachable")


class Source:
    name = "source"
    open_retry = DEFAULT_OPEN_RETRY

    def __len__(self) -> int:
        raise NotImplementedError

    def get(self, i: int) -> Any:
        raise NotImplementedError

    def identity(self, i: int) -> tuple[str, int]:
        return self.name, i

    def describe(self) -> str:
        """A stable description (part of the pipeline fingerprint)."""
        return f"{type(self).__name__}({self.name}, n={len(self)})"

    def configured(self, opts) -> "Source":
        """This source as the runtime options refine it: file sources take
        ``io_options``; a mixture also its default read policy."""
        io = opts.io_options
        retry = (io.open_retry_attempts, io.retry_backoff_initial_s, io.retry_backoff_max_s)
        if self.open_retry == retry:
            return self
        clone = copy.copy(self)
        clone.open_retry = retry
        return clone


class SequenceSource(Source):
    def __init__(self, items: Sequence[Any], name: str) -> None:
        self.items, self.name = items, name

    def __len__(self) -> int:
        return len(self.items)

    def get(self, i: int) -> Any:
        return self.items[i]


class CallableSource(Source):
    def __init__(self, n: int, fn: Callable[[int], Any], name: str) -> None:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ZephonConfigError(f"from_callable: n must be an int >= 0, got {n!r}")
        if not callable(fn):
            raise ZephonConfigError(f"from_callable: fn must be callable, got {fn!r}")
        self.n, self.fn, self.name = int(n), fn, name

    def __len__(self) -> int:
        return self.n

    def get(self, i: int) -> Any:
        return self.fn(i)

    def describe(self) -> str:
        from zephon.pipeline.ops import fn_identity

        return f"CallableSource({self.name}, n={self.n}, fn={fn_identity(self.fn)})"


class TokenWindows(Source):
    def __init__(self, path: str, seq_len: int, dtype: str, name: str) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ZephonConfigError(f"token_windows: seq_len must be an int >= 1, got {seq_len!r}")
        self.path, self.seq_len, self.name = os.fspath(path), seq_len, name
        self.dtype = np.dtype(dtype)
        try:
            size = os.path.getsize(self.path)
        except OSError as exc:
            raise SourceError(f"token_windows: cannot read {self.path}: {exc}") from exc
        self.n_tokens = size // self.dtype.itemsize
        self._tokens = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_tokens"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._tokens = None

    def __len__(self) -> int:
        return self.n_tokens // self.seq_len

    def get(self, i: int) -> Any:
        if self._tokens is None:
            with open_with_retry(self.path, "rb", self.open_retry) as fh:
                self._tokens = np.memmap(fh, dtype=self.dtype, mode="r",
                                         shape=(self.n_tokens,))
        start = i * self.seq_len
        return {"tokens": np.array(self._tokens[start:start + self.seq_len])}

    def describe(self) -> str:
        return (f"TokenWindows({self.name}, {os.path.basename(self.path)}, "
                f"tokens={self.n_tokens}, seq_len={self.seq_len}, {self.dtype.str})")


class JsonlSource(Source):
    def __init__(self, paths: str | Sequence[str], name: str) -> None:
        patterns = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        files: list[str] = []
        for pattern in patterns:
            pattern = os.fspath(pattern)
            matched = sorted(globlib.glob(pattern)) if globlib.has_magic(pattern) else [pattern]
            if not matched:
                raise SourceError(f"jsonl: no file matches {pattern!r}")
            files.extend(matched)
        self.files, self.name = files, name
        offsets, file_index, line_no = [], [], []
        for k, path in enumerate(files):
            try:
                with open(path, "rb") as fh:
                    pos = 0
                    for n, line in enumerate(fh, 1):
                        if line.strip():
                            offsets.append(pos)
                            file_index.append(k)
                            line_no.append(n)
                        pos += len(line)
            except OSError as exc:
                raise SourceError(f"jsonl: cannot read {path}: {exc}") from exc
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.file_index = np.asarray(file_index, dtype=np.int32)
        self.line_no = np.asarray(line_no, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.offsets)

    def get(self, i: int) -> Any:
        path = self.files[self.file_index[i]]
        with open_with_retry(path, "rb", self.open_retry) as fh:
            fh.seek(int(self.offsets[i]))
            line = fh.readline()
        try:
            value = json.loads(line)
        except ValueError as exc:
            raise SourceError(f"jsonl: {path}, line {int(self.line_no[i])}: invalid JSON "
                              f"({exc})") from None
        if not isinstance(value, dict):
            raise SourceError(f"jsonl: {path}, line {int(self.line_no[i])}: expected an "
                              f"object, got {type(value).__name__}")
        return value

    def describe(self) -> str:
        return f"JsonlSource({self.name}, files={[os.path.basename(f) for f in self.files]}, " \
               f"n={len(self)})"


class MixtureSource(Source):
    def __init__(self, components: Mapping[str, Source], weights: Mapping[str, float] | None,
                 config, name: str) -> None:
        from zephon.options import MixtureReadConfig

        if not components:
            raise ZephonConfigError("mixture: at least one component is needed")
        self.names = list(components)
        self.components = [components[k] for k in self.names]
        weights = weights or {k: 1.0 for k in self.names}
        unknown = set(weights) - set(self.names)
        if unknown or set(self.names) - set(weights):
            raise ZephonConfigError(f"mixture: weights must name exactly the components "
                                    f"{self.names}, got {sorted(weights)}")
        self.weights = np.array([float(weights[k]) for k in self.names])
        if not np.all(np.isfinite(self.weights)) or np.any(self.weights <= 0):
            raise ZephonConfigError(f"mixture: weights must be positive, got {dict(weights)}")
        self.own_config = config is not None  # else RuntimeOptions.mixture_config applies
        self.config, self.name = config or MixtureReadConfig(), name
        self.comp, self.comp_index = self._schedule()

    def configured(self, opts) -> "Source":
        components = {n: c.configured(opts) for n, c in zip(self.names, self.components)}
        changed = any(a is not b for a, b in zip(components.values(), self.components))
        if self.own_config or opts.mixture_config is None or \
                opts.mixture_config == self.config:
            if not changed:
                return self
            clone = copy.copy(self)
            clone.components = list(components.values())
            return clone
        weights = dict(zip(self.names, self.weights.tolist()))
        return MixtureSource(components, weights, opts.mixture_config, self.name)

    def _schedule(self) -> tuple[np.ndarray, np.ndarray]:
        sizes = np.array([len(c) for c in self.components], dtype=np.int64)
        total = int(sizes.sum())
        comp = np.empty(total, dtype=np.int32)
        left = sizes.copy()
        w = self.weights / self.weights.sum()
        rng = np.random.default_rng(self.config.seed)
        credit = np.zeros(len(sizes))
        for i in range(total):
            live = left > 0
            if self.config.mode == "weighted_random":
                p = np.where(live, w, 0.0)
                k = int(rng.choice(len(sizes), p=p / p.sum()))
            else:  # smooth weighted round robin over the components that have samples left
                credit[live] += w[live]
                k = int(np.argmax(np.where(live, credit, -np.inf)))
                credit[k] -= w[live].sum()
            comp[i] = k
            left[k] -= 1
        index = np.empty(total, dtype=np.int64)
        for k, size in enumerate(sizes):
            order = np.arange(size)
            if self.config.within_component == "shuffle":
                order = np.random.default_rng([self.config.seed, k]).permutation(size)
            index[comp == k] = order
        return comp, index

    def __len__(self) -> int:
        return len(self.comp)

    def get(self, i: int) -> Any:
        return self.components[self.comp[i]].get(int(self.comp_index[i]))

    def identity(self, i: int) -> tuple[str, int]:
        return self.names[self.comp[i]], int(self.comp_index[i])

    def describe(self) -> str:
        parts = ", ".join(f"{n}: {c.describe()} x{w:g}" for n, c, w in
                          zip(self.names, self.components, self.weights))
        return f"MixtureSource({parts}; {self.config.to_dict()})"


def from_sequence(items: Sequence[Any], *, name: str = "sequence") -> Source:
    return SequenceSource(items, name)


def from_callable(n: int, fn: Callable[[int], Any], *, name: str = "callable") -> Source:
    return CallableSource(n, fn, name)


def token_windows(path: str, seq_len: int, dtype: str = "uint16", *,
                  name: str = "tokens") -> Source:
    return TokenWindows(path, seq_len, dtype, name)


def jsonl(paths: str | Sequence[str], *, name: str = "jsonl") -> Source:
    return JsonlSource(paths, name)


def mixture(components: Mapping[str, Source], weights: Mapping[str, float] | None = None, *,
            config=None, name: str = "mixture") -> Source:
    """``config``: a :class:`~zephon.options.MixtureReadConfig` (None: the pipeline's
    ``mixture_config`` if set, else the defaults)."""
    return MixtureSource(components, weights, config, name)
