"""The Source contract and the in-memory sources.

Every source has a ``name``, a length and ``get(i)``; the identity of sample
``i`` in epoch ``e`` is ``(name, i, e)`` (for a mixture: the component's name and
the component's own index). ``get(i)`` is deterministic: the same ``i`` gives the
same sample in every process and every run, which is what lets the pipeline
checkpoint, restore and re-shard any source generically.

Sources are pickled once per worker process and must not hold open handles
across pickling: :class:`FileSource` keeps its per-process state (open readers,
decoded blocks) out of its pickled state and rebuilds it lazily in whichever
process reads. ``configured(opts)`` returns the source as the runtime options
refine it (``io_options`` for file sources; a copy, never a mutation). A source
may also say what it knows without reading samples (``sample_nbytes``,
``known_tokens_per_sample``, ``shard_bounds``); ``from_sequence`` refuses what has
no length or no indexing by position (a generator; a pandas object, indexed by label;
an object whose first or last item raises KeyError or IndexError: both are read once
to check) when it is built.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from zephon.errors import ZephonConfigError
from zephon.io.config import DEFAULT_IO, IoConfig
from zephon.io.errors import SourceError
from zephon.io.reader import FileReader, open_with_retry
from zephon.io.remote import FileRef

log = logging.getLogger("zephon.sources")

__all__ = [
    "DEFAULT_OPEN_RETRY",
    "CallableSource",
    "FileSource",
    "IndexView",
    "SampleView",
    "SequenceSource",
    "Source",
    "SourceError",
    "io_config",
    "io_of",
    "open_with_retry",
]

# (attempts, first back-off s, longest back-off s): StoreOptions' defaults. Kept as plain
# numbers so that a source unpickled in a worker does not import the options layer.
DEFAULT_OPEN_RETRY = DEFAULT_IO.open_retry


def io_config(opts) -> IoConfig:
    """The :class:`IoConfig` of ``opts.io_options`` (a RuntimeOptions)."""
    return IoConfig.from_store_options(opts.io_options)


def io_of(io_options) -> IoConfig:
    """The :class:`IoConfig` of a source constructor's ``io_options`` (None: the defaults;
    a StoreOptions; an IoConfig as it is)."""
    if io_options is None:
        return DEFAULT_IO
    if isinstance(io_options, IoConfig):
        return io_options
    return IoConfig.from_store_options(io_options)


class Source:
    """A random-access collection of samples with a stable identity per sample.

    Build one with the constructors of :mod:`zephon.sources`; a custom source
    subclasses this and implements ``__len__`` and :meth:`get`. ``get(i)`` must be
    deterministic (the same sample in every process and run) and the source picklable
    without open handles (file handles are reopened lazily where the source is read).

    Examples:
        >>> class Squares(sources.Source):
        ...     name = "squares"
        ...     def __len__(self):
        ...         return 4
        ...     def get(self, i):
        ...         return i * i
        >>> list(Pipeline(Squares(), shuffle=False))
        [0, 1, 4, 9]
    """
    name = "source"
    open_retry = DEFAULT_OPEN_RETRY

    def __len__(self) -> int:
        raise NotImplementedError

    def get(self, i: int) -> Any:
        """The sample at index ``i``.

        Args:
            i: an index, ``0 <= i < len(self)``.

        Returns:
            The sample (any picklable value; ops and ``batch()`` work best on dicts).

        Examples:
            >>> sources.from_sequence([10, 20]).get(1)
            20
        """
        raise NotImplementedError

    def identity(self, i: int) -> tuple[str, int]:
        """The identity of sample ``i``, without the epoch.

        Args:
            i: an index, ``0 <= i < len(self)``.

        Returns:
            ``(name, index)``: the source's name and ``i`` (a mixture: the component's name
            and its own index). With the epoch it seeds ``ctx.rng`` and names the sample in
            ``Batch.meta["sample_ids"]``.

        Examples:
            >>> sources.from_sequence([10, 20], name="nums").identity(1)
            ('nums', 1)
        """
        return self.name, i

    def view(self, indices, epoch: int) -> "SampleView":
        """The samples at ``indices`` of ``epoch``, as the stage program reads them.

        A source whose samples depend on the epoch (a mixture: which component sample a
        position holds changes from epoch to epoch) overrides it; the default reads
        :meth:`identity` and :meth:`get` of each index.

        Args:
            indices: the source indices of one read unit (int64 array).
            epoch: the epoch they belong to.

        Returns:
            An object with ``identity(n)`` and ``get(n)`` for the ``n``-th index.

        Examples:
            >>> sources.from_sequence([10, 20]).view(np.array([1]), 0).get(0)
            20
        """
        return IndexView(self, indices)

    def get_batch(self, indices) -> dict | None:
        """The samples at ``indices``, already collated, if this source has a columnar read.

        A source that can read many rows at once (Parquet) overrides it: a
        ``read -> batch`` stage then costs one vectorised read per batch instead of one
        call per row.

        Args:
            indices: the sample indices of one micro-batch, in order.

        Returns:
            ``{column: array or list}``, exactly what ``batch()`` makes of
            ``[get(i) for i in indices]``; or None when the source has no columnar read
            (then samples are read one by one).

        Examples:
            >>> sources.from_sequence([{"x": 1}]).get_batch([0]) is None
            True
        """
        return None

    def with_weight_overrides(self, overrides) -> "Source":
        """This source with mixture weights a trainer set: only a mixture with a
        position-keyed schedule has them (see ``set_mixture_weights``); any other source
        refuses.

        Args:
            overrides: ``(position, weight vector)`` pairs in order of position.

        Returns:
            The source with those weights from their positions on.

        Raises:
            ZephonConfigError: the source is not a position-keyed mixture.

        Examples:
            >>> sources.from_sequence([1]).with_weight_overrides(())
            Traceback (most recent call last):
            ...
            zephon.errors.ZephonConfigError: set_mixture_weights: the pipeline's source is SequenceSource, not a mixture with a position-keyed schedule (sources.mixture(..., schedule_unit='samples'))
        """
        raise ZephonConfigError(
            f"set_mixture_weights: the pipeline's source is {type(self).__name__}, not a "
            f"mixture with a position-keyed schedule (sources.mixture(..., "
            f"schedule_unit='samples'))")

    def orders_itself(self) -> bool:
        """Whether the source defines the order it is read in (a mixture with a
        position-keyed schedule): the pipeline then reads it in source order and hands
        its ``shuffle`` flag to :meth:`ordered`.

        Examples:
            >>> sources.from_sequence([1]).orders_itself()
            False
        """
        return False

    def ordered(self, shuffle: bool) -> "Source":
        """The source as a pipeline with ``shuffle`` reads it, when it orders itself
        (:meth:`orders_itself`); this default: the source itself.

        Args:
            shuffle: the pipeline's ``shuffle`` flag (True or False).

        Returns:
            The source to read in source order.

        Examples:
            >>> src = sources.from_sequence([1])
            >>> src.ordered(True) is src
            True
        """
        return self

    def sample_nbytes(self) -> float | None:
        """An estimate of one sample's bytes once read, used to size the messages that carry
        many batches read column by column.

        Returns:
            Bytes per sample (a float: an average), or None when the source cannot tell
            cheaply (then each batch travels as its own message).

        Examples:
            >>> sources.from_sequence([{"x": 1}]).sample_nbytes() is None
            True
        """
        return None

    def known_tokens_per_sample(self) -> float | None:
        """The exact mean size of the samples' ``"tokens"`` field, when the source knows it
        without reading samples; ``sources.mixture(by="tokens")`` then takes it instead of
        measuring a probe of samples.

        Returns:
            Tokens per sample (``token_windows``: ``seq_len``), or None (the default: not
            known without reading).

        Examples:
            >>> sources.from_sequence([{"tokens": [1, 2]}]).known_tokens_per_sample() is None
            True
        """
        return None

    def shard_bounds(self) -> np.ndarray | None:
        """The source's shards: contiguous index ranges that are cheap to read in sequence
        (a Parquet row group, a tar shard, a jsonl file), which
        ``Pipeline(shuffle="shards")`` visits one window of shards at a time.

        Returns:
            ``S + 1`` rising int64 offsets from 0 to ``len(self)`` (shard ``s`` holds the
            indices ``[bounds[s], bounds[s + 1])``), or None (the default: no shards of
            its own; the pipeline cuts the index space into blocks of
            :data:`zephon.pipeline.shards.BLOCK` indices).

        Examples:
            >>> sources.from_sequence([1, 2]).shard_bounds() is None
            True
        """
        return None

    def permute_note(self) -> str | None:
        """What a pipeline-level shuffle (``Pipeline(shuffle=True)``) costs with this source,
        when that is worth a line of ``explain()``.

        Returns:
            A sentence, or None (the default: random access costs about what reading in
            order does).

        Examples:
            >>> sources.from_sequence([1, 2]).permute_note() is None
            True
        """
        return None

    def stamps(self, now: bool = False) -> list[tuple[str, int, str]] | None:
        """The files behind the samples, as a checkpoint's proof records them.

        A restore compares the checkpoint's (the files as the source saw them when it was
        built) with the files as they are when it restores
        (:mod:`zephon.pipeline.proof`): a file rewritten in place keeps its name and
        size, and its samples change.

        Args:
            now: the files as they are now (a ``stat`` of each local file) rather than as
                they were when the source was built.

        Returns:
            One ``(name, size in bytes, stamp)`` per file (stamp: ``"mtime:<ns>"`` for a
            local file, ``"etag:..."``/``"mtime:..."`` or the object version for a remote
            one), or None for a source without files (the default), or one whose
            description covers its files already (an image folder lists each image's
            size and mtime in it).

        Examples:
            >>> sources.from_sequence([1, 2]).stamps() is None
            True
        """
        return None

    def describe(self) -> str:
        """A stable description of the source (part of the pipeline fingerprint).

        Returns:
            A string naming the source's class, name and length (and what else defines
            its samples).

        Examples:
            >>> sources.from_sequence([1, 2, 3]).describe()
            'SequenceSource(sequence, n=3)'
        """
        return f"{type(self).__name__}({self.name}, n={len(self)})"

    def configured(self, opts) -> "Source":
        """This source as the runtime options refine it (a copy, never a mutation).

        File sources take ``io_options`` (retries, cache); a mixture also takes
        ``mixture_config`` when it has no config of its own. The engine calls it when it
        plans a run.

        Args:
            opts: the pipeline's :class:`~zephon.RuntimeOptions`.

        Returns:
            ``self`` when the options change nothing, else a refined copy.

        Examples:
            >>> src = sources.from_sequence([1])
            >>> src.configured(RuntimeOptions()) is src
            True
        """
        io = opts.io_options
        retry = (io.open_retry_attempts, io.retry_backoff_initial_s, io.retry_backoff_max_s)
        if self.open_retry == retry:
            return self
        clone = copy.copy(self)
        clone.open_retry = retry
        return clone


class SampleView(Protocol):
    """What :meth:`Source.view` returns: the ``n``-th sample of a read unit."""

    def identity(self, n: int) -> tuple[str, int]: ...

    def get(self, n: int) -> Any: ...


class IndexView:
    """:meth:`Source.view` of a source whose samples do not depend on the epoch."""

    __slots__ = ("indices", "source")

    def __init__(self, source: Source, indices) -> None:
        self.source = source
        self.indices = indices.tolist() if isinstance(indices, np.ndarray) else list(indices)

    def identity(self, n: int) -> tuple[str, int]:
        return self.source.identity(self.indices[n])

    def get(self, n: int) -> Any:
        return self.source.get(self.indices[n])


class PerProcessState:
    """Pickling for a source with per-process state (open handles, decoded blocks): the
    attributes named in ``_per_process`` (and ``_always_dropped``) are dropped when it is
    pickled or copied and rebuilt by ``_fresh()`` where it is read."""

    _per_process: tuple[str, ...] = ()
    _always_dropped: tuple[str, ...] = ()

    def _fresh(self) -> None:
        raise NotImplementedError

    def __getstate__(self):
        drop = {*self._always_dropped, *self._per_process}
        return {k: v for k, v in self.__dict__.items() if k not in drop}

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._fresh()

    def __copy__(self):
        clone = type(self).__new__(type(self))
        clone.__setstate__(self.__getstate__())
        return clone


class IoConfigured(Source):
    """A source read under an :class:`IoConfig` (``self.io``) that the runtime options
    refine: its open retries are the config's, and ``configured`` copies it with the
    pipeline's ``io_options``."""

    io: IoConfig = DEFAULT_IO

    @property
    def open_retry(self) -> tuple:  # type: ignore[override]
        return self.io.open_retry

    def configured(self, opts) -> "Source":
        cfg = io_config(opts)
        if cfg == self.io:
            return self
        clone = copy.copy(self)
        clone.io = cfg
        return clone


class FileSource(PerProcessState, IoConfigured):
    """A source over :class:`~zephon.io.FileRef` files read through
    :class:`~zephon.io.FileReader` (local, cached remote or streamed remote).

    Subclasses call ``_set_files(refs)`` (``self.files`` is then the list of URLs
    or paths, ``self.refs`` the FileRefs with sizes and, for remote objects, the
    version seen when the source was built: every process reads that version, see
    :mod:`zephon.io.remote`), set ``self.io`` (IoConfig) and
    ``self.storage_options``, and list their per-process attributes in
    ``_per_process`` (dropped when pickled or reconfigured, rebuilt by ``_fresh``).
    """

    _always_dropped = ("_readers", "_lock")
    files: list
    refs: list
    storage_options: dict | None = None

    def _fresh(self) -> None:
        self._readers: dict[int, FileReader] = {}
        self._lock = threading.RLock()  # guards the per-process state; re-entered by subclasses

    def _set_files(self, refs: list) -> None:
        self.refs = list(refs)
        self.files = [r.url for r in self.refs]
        #: each local file's mtime (ns) when the source was built (-1: remote, or gone)
        self.built_mtimes = self._mtimes()

    def _mtimes(self) -> np.ndarray:
        out = np.full(len(self.refs), -1, dtype=np.int64)
        for k, ref in enumerate(self.refs):
            if not ref.remote:
                try:
                    out[k] = os.stat(ref.url).st_mtime_ns
                except OSError:
                    pass
        return out

    def reader(self, k: int) -> FileReader:
        """The per-process reader of file ``k``."""
        reader = self._readers.get(k)
        if reader is None:
            with self._lock:
                reader = self._readers.get(k)
                if reader is None:
                    ref = self.refs[k]
                    if self.files[k] != ref.url:  # the path was re-pointed after building
                        ref = FileRef(self.files[k], ref.size, ref.version)
                    reader = FileReader(ref, self.io, self.storage_options)
                    self._readers[k] = reader
        return reader

    def file_names(self) -> list[str]:
        return [r.basename for r in self.refs]

    def stamps(self, now: bool = False) -> list[tuple[str, int, str]] | None:
        """Each file's ``(name, size, stamp)`` (see :meth:`Source.stamps`): a remote
        object's version as listed when the source was built; a local file's size and
        mtime when the source was built, or with ``now`` as ``stat`` gives them now."""
        built = getattr(self, "built_mtimes", None)
        if built is None or len(built) != len(self.refs):
            built = self.built_mtimes = self._mtimes()
        out = []
        for k, ref in enumerate(self.refs):
            if ref.remote:
                out.append((ref.url, ref.size, ref.version or ref.version_id))
            elif not now:
                out.append((ref.basename, ref.size, f"mtime:{int(built[k])}"))
            else:
                try:
                    st = os.stat(ref.url)
                except OSError as exc:
                    out.append((ref.basename, -1, f"missing:{exc.errno}"))
                else:
                    out.append((ref.basename, st.st_size, f"mtime:{st.st_mtime_ns}"))
        return out


class SequenceSource(Source):
    def __init__(self, items: Sequence[Any], name: str) -> None:
        if isinstance(items, Mapping) or not (hasattr(items, "__getitem__")
                                              and _has_len(items)):
            raise ZephonConfigError(
                f"from_sequence: items must be a sequence (a length and indexing by "
                f"position: a list, tuple, range or array), got a {type(items).__name__}; "
                f"give list(items) (it is held in memory), or from_callable(n, fn) to make "
                f"sample i where it is read")
        _probe_positions(items)
        self.items, self.name = items, name

    def __len__(self) -> int:
        return len(self.items)

    def get(self, i: int) -> Any:
        return self.items[i]


def _has_len(items: Any) -> bool:
    try:
        len(items)
    except TypeError:  # no __len__, or a 0-d array
        return False
    except OverflowError:  # range(10**20): more than a source may hold
        raise ZephonConfigError(
            f"from_sequence: {type(items).__name__} {items!r:.60} has more items than len() "
            f"holds (2**63 - 1); a source is at most that long") from None
    return True


#: what pandas objects are: indexed by label, not by position
_PANDAS_FIX = {"DataFrame": 'df.to_dict("records") (a list of row dicts)',
               "Series": "series.to_list()"}


def _probe_positions(items: Any) -> None:
    """Refuse, at construction, what has a length and ``[]`` but is not indexed by position:
    a pandas object (indexed by label), or one whose first or last item raises
    KeyError/IndexError (a table indexed by column, a length past its items). Any other
    error reading them is left to the read (the pipeline's error policy)."""
    kind = type(items).__name__
    if hasattr(items, "iloc") and kind in _PANDAS_FIX:
        raise ZephonConfigError(
            f"from_sequence: a pandas {kind} is indexed by label, not by position; give "
            f"{_PANDAS_FIX[kind]}, or from_callable(len(x), fn) with fn reading x.iloc[i]")
    n = len(items)
    for i in dict.fromkeys((0, n - 1)) if n else ():
        try:
            items[i]
        except (KeyError, IndexError) as exc:
            raise ZephonConfigError(
                f"from_sequence: items[{i}] raised {type(exc).__name__}: {exc!s:.80} (a "
                f"{kind} of length {n}, not indexed by position); give list(...) of its "
                f"samples (e.g. a table's rows), or from_callable(n, fn) to make sample i "
                f"where it is read") from None
        except Exception:  # noqa: BLE001  a sample that fails to read fails where it is
            return         # read, under the pipeline's error policy: not a shape problem


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
        from zephon.pipeline.fingerprint import fn_identity

        return f"CallableSource({self.name}, n={self.n}, fn={fn_identity(self.fn)})"
