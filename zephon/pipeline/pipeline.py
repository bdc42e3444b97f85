"""``Pipeline``: the user-facing definition of a pipeline and its builder methods.

A ``Pipeline`` is an immutable definition: every builder method (``map``,
``filter``, ``shuffle``, ``batch``, ``map_batch``, ``pack_tokens``,
``pack_documents``, ``options``) returns a new pipeline and leaves the original unchanged, so one
definition can run with several option sets. ``iter(pipe)`` starts a run and
returns a :class:`~zephon.pipeline.iterator.PipelineIterator`, which owns it:
its position, statistics, checkpoint, restore and close.

Epochs advance, one rule: a new ``iter(pipe)`` continues after the last item
the previous run of this pipeline delivered. A run is one *pass*: with
``num_epochs=k`` pass ``q`` covers the epochs ``[q * k, (q + 1) * k)`` (with
None, one endless pass). So after a complete pass the next run is the next
pass (new permutations, new ``ctx.rng`` draws: the epoch is in every sample's
identity); after a ``break`` it is the rest of the pass. ``pipe.restore(state)``
sets where the next run starts (the state's position), ``pipe.set_epoch(e)``
makes it start at the beginning of epoch ``e`` (to run an epoch again, or to
skip ahead; the run then ends with ``e``'s pass). Each run is a stream of its
own: its batches are full except its very last, and ``lane_index`` counts from
0 in it. ``zephon.torch.loader`` follows the same rule.

The definition is a frozen :class:`~zephon.pipeline.spec.PipelineSpec`
(``pipe.spec``: source, ops, seed, epoch order, chunking, epochs), made once by
each pipeline; ``pipe.plan()`` resolves it under the pipeline's options once, and
the plan holds the fingerprint (``pipe.fingerprint()`` reads it). The plan, the
iterator and the checkpoint code are given the plan, never the pipeline.

Where the next run starts is the one piece of state a definition cannot do
without: it lives in the pipeline's :class:`~zephon.pipeline.progress.Progress`
(the latest run's record, the live runs held weakly, the checkpoint round
counter), the pipeline's only mutable member; everything else a run has is its
iterator's. The shortcuts act on the *latest* run:

- ``pipe.checkpoint()``: its delivered position (after ``restore``/``set_epoch``
  with no run going: that start);
- ``pipe.restore(state)``, ``pipe.set_epoch(e)``: restart it there if it is still
  going, else make the next run start there;
- ``pipe.stats()``, ``pipe.final_state``: its statistics and final state (none
  after ``restore``/``set_epoch`` placed the next start);
- ``pipe.close()``: closes every run of the pipeline still going.

When a pipeline runs several iterators at once, call the iterator's own methods.
Dropping an iterator (leaving a ``for`` loop with ``break``) closes its run at once.
"""

from __future__ import annotations

import functools
from typing import Mapping

from zephon.checkpoint import decode_state
from zephon.errors import ZephonConfigError
from zephon.options import RuntimeOptions
from zephon.options.resolve import OUT_OF_PROCESS_RUNNERS
from zephon.pipeline import ops as O
from zephon.pipeline.iterator import PipelineIterator
from zephon.pipeline.plan import Plan, upstream_aligned
from zephon.pipeline.progress import Progress
from zephon.pipeline.shards import resolve_order
from zephon.pipeline.sources import Source
from zephon.pipeline.spec import PipelineSpec
from zephon.pipeline.state import MAX_COUNT, Position, RunStart, check_run, position
from zephon.pipeline.validate import validate
from zephon.transport.spawn_guard import refuse_in_spawn_bootstrap

__all__ = ["Pipeline"]


@functools.lru_cache(maxsize=1)
def _default_runtime() -> RuntimeOptions:
    """The default options, made once: they are frozen, so every pipeline can share them
    (checking every field costs ~120 us, on every pipeline built, most of which are
    given options of their own next)."""
    return RuntimeOptions()


class Pipeline:
    """A pipeline definition: a source, then ops, then options; ``iter(pipe)`` runs it.

    The stream a pipeline produces is a pure function of its definition (source, ops,
    seed, chunking, epochs) and of the number of canonical lanes: runners, worker counts
    and prefetch depths never change it. Every builder method returns a new pipeline.

    Epochs advance: each ``iter(pipe)`` continues after the last item the previous run
    of this pipeline delivered. A run is a *pass* of ``num_epochs`` epochs (pass ``q``:
    epochs ``[q * num_epochs, (q + 1) * num_epochs)``), so three ``for b in pipe`` loops
    over a ``num_epochs=1`` pipeline see epochs 0, 1 and 2 (new permutations and
    ``ctx.rng`` draws), and a loop left with ``break`` is continued by the next one.
    :meth:`restore` and :meth:`set_epoch` say where the next run starts instead; a new
    pipeline (any builder method) starts at epoch 0.

    Args:
        source: a zephon source (``zephon.sources.*``).
        seed: the seed of the epoch permutations and of every op's randomness (a
            non-negative int).
        shuffle: visit each epoch in a seeded permutation (True), in source order (False),
            or ``"shards"``: the source's shards (:meth:`Source.shard_bounds`: row
            groups, tar shards, files; else blocks of 4096 indices) in a seeded order,
            the samples of each window of ``shuffle_window`` consecutive shards shuffled
            together, so that each shard is read in one stretch of the epoch (for data in
            object storage; the trade-off is in ``docs/architecture.md``). (The
            ``shuffle(n)`` method is a different thing: a shuffle-buffer op.)
        chunk_size: samples per chunk (an int >= 1): an epoch's order is cut into chunks
            and chunk ``j`` goes to lane ``j mod C``.
        num_epochs: epochs to run (an int >= 1), or None to run forever.
        shuffle_window: shards per window with ``shuffle="shards"`` (an int >= 1; None:
            8); only with that mode.

    Raises:
        ZephonConfigError: a value out of range or of the wrong type, naming it.

    Examples:
        >>> pipe = Pipeline(sources.from_sequence(list(range(10))), seed=0, chunk_size=4)
        >>> sorted(pipe) == list(range(10))
        True
        >>> list(Pipeline(sources.from_sequence([1, 2, 3]), shuffle=False))
        [1, 2, 3]
        >>> pipe = Pipeline(sources.from_sequence(list(range(6))), seed=1)
        >>> first, second = list(pipe), list(pipe)   # epochs 0 and 1
        >>> first != second and sorted(first) == sorted(second)
        True
        >>> pipe.set_epoch(0)                        # epoch 0 again
        >>> list(pipe) == first
        True
    """

    def __init__(self, source: Source, *, seed: int = 0, shuffle: bool | str = True,
                 chunk_size: int = 64, num_epochs: int | None = 1,
                 shuffle_window: int | None = None) -> None:
        if not isinstance(source, Source):
            raise ZephonConfigError(f"Pipeline: source must be a zephon source "
                                    f"(zephon.sources.*), got {type(source).__name__}")
        for name, value, low in (("seed", seed, 0), ("chunk_size", chunk_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ZephonConfigError(f"Pipeline: {name} must be an int >= {low}, "
                                        f"got {value!r}")
        if num_epochs is not None and (isinstance(num_epochs, bool) or
                                       not isinstance(num_epochs, int) or num_epochs < 1):
            raise ZephonConfigError(f"Pipeline: num_epochs must be None or an int >= 1, "
                                    f"got {num_epochs!r}")
        # ``shuffle`` (the flag) orders each epoch; ``shuffle(n)`` (the method) is the op.
        if source.orders_itself():  # a position-keyed mixture: read in its own order
            if not isinstance(shuffle, bool):
                raise ZephonConfigError(f"Pipeline: {type(source).__name__} orders itself (a "
                                        f"mixture with a position-keyed schedule): shuffle "
                                        f"must be True or False, got {shuffle!r}")
            source, shuffle = source.ordered(shuffle), False
        #: the definition (frozen): source, ops, seed, epoch order, chunking, epochs
        self.spec = PipelineSpec(source, (), seed, resolve_order(source, shuffle, shuffle_window),
                                 chunk_size, num_epochs)
        self.runtime = _default_runtime()
        self._progress = Progress()  # where the next run starts: the only mutable member
        self._plan: Plan | None = None  # the spec resolved under the options, made once

    # -- building ------------------------------------------------------------------------
    def _with(self, op: O.Op | None = None, runtime: RuntimeOptions | None = None) -> "Pipeline":
        new = Pipeline.__new__(Pipeline)
        new.spec = self.spec if op is None else self.spec.with_op(op)
        new.runtime = runtime if runtime is not None else self.runtime
        new._progress = Progress()  # a new definition starts at epoch 0
        new._plan = None  # and is resolved anew
        return new

    def _per_sample_ops(self) -> int:
        """How many per-sample (stateless) ops the chain has: the next one's ordinal."""
        return sum(isinstance(op, O.StatelessOp) for op in self.spec.ops)

    @property
    def ops(self) -> tuple[O.Op, ...]:
        """The pipeline's ops, in chain order (its spec's).

        Examples:
            >>> pipe = Pipeline(sources.from_sequence([1, 2])).map(abs).batch(2)
            >>> len(pipe.ops), pipe.ops[-1].describe()
            (2, 'batch(2, drop_last=False)')
        """
        return self.spec.ops

    # the definition's fields, read from the spec
    @property
    def source(self):
        """The pipeline's source (its spec's).

        Examples:
            >>> Pipeline(sources.from_sequence([1, 2])).source.name
            'sequence'
        """
        return self.spec.source

    @property
    def seed(self) -> int:
        """The seed of the epoch orders and of every op's randomness (its spec's).

        Examples:
            >>> Pipeline(sources.from_sequence([1, 2]), seed=7).seed
            7
        """
        return self.spec.seed

    @property
    def permute(self):
        """The epoch order (its spec's): True (a seeded permutation), False (source
        order), or the source's shard shuffle.

        Examples:
            >>> Pipeline(sources.from_sequence([1, 2]), shuffle=False).permute
            False
        """
        return self.spec.permute

    @property
    def chunk_size(self) -> int:
        """Samples per chunk (its spec's).

        Examples:
            >>> Pipeline(sources.from_sequence([1, 2]), chunk_size=64).chunk_size
            64
        """
        return self.spec.chunk_size

    @property
    def num_epochs(self):
        """Epochs in a pass, None for one endless pass (its spec's).

        Examples:
            >>> Pipeline(sources.from_sequence([1, 2]), num_epochs=3).num_epochs
            3
        """
        return self.spec.num_epochs

    def map(self, fn, parallelism: int = 1) -> "Pipeline":
        """Apply ``fn`` to every sample.

        Args:
            fn: ``fn(sample) -> sample``, or ``fn(sample, ctx) -> sample`` where ``ctx.rng``
                is a NumPy Generator seeded from the pipeline seed and the sample's identity
                (the same draw whatever runner or worker runs it). Must be picklable (module
                level) for the process runner.
            parallelism: the number of workers this op asks for (how it becomes a worker
                count: ``RuntimeOptions.worker_allocation``). A stage whose ops ask for
                more than one runs on the process runner unless ``RuntimeOptions.runner``
                or ``per_stage_runner`` says otherwise.

        Returns:
            A new pipeline with the op appended.

        Examples:
            >>> pipe = Pipeline(sources.from_sequence([1, 2, 3]), shuffle=False)
            >>> list(pipe.map(lambda x: x * 10))
            [10, 20, 30]
        """
        return self._with(O.MapOp(fn, parallelism, ordinal=self._per_sample_ops()))

    def filter(self, pred, parallelism: int = 1) -> "Pipeline":
        """Keep the samples for which ``pred`` is true.

        Args:
            pred: ``pred(sample) -> bool`` or ``pred(sample, ctx) -> bool`` (``ctx.rng`` as
                in :meth:`map`).
            parallelism: the number of workers this op asks for.

        Returns:
            A new pipeline with the op appended.

        Examples:
            >>> pipe = Pipeline(sources.from_sequence(list(range(6))), shuffle=False)
            >>> list(pipe.filter(lambda x: x % 2 == 0))
            [0, 2, 4]
        """
        return self._with(O.FilterOp(pred, parallelism, ordinal=self._per_sample_ops()))

    def map_batch(self, fn, parallelism: int = 1) -> "Pipeline":
        """Apply ``fn`` to every batch (place it after :meth:`batch`).

        Args:
            fn: ``fn(batch) -> batch``; a plain dict result becomes a
                :class:`~zephon.Batch` carrying the input batch's ``meta``.
            parallelism: the number of workers this op asks for.

        Returns:
            A new pipeline with the op appended.

        Examples:
            >>> src = sources.from_callable(4, lambda i: {"x": np.full(2, i)})
            >>> pipe = Pipeline(src, shuffle=False).batch(2).map_batch(lambda b: {"x": b["x"] * 2})
            >>> [b["x"].tolist() for b in pipe]
            [[[0, 0], [2, 2]], [[4, 4], [6, 6]]]
        """
        return self._with(O.MapBatchOp(fn, parallelism))

    def shuffle(self, buffer_size: int) -> "Pipeline":
        """A seeded shuffle buffer of ``buffer_size`` samples per lane.

        Deterministic: the buffer's seed comes from the pipeline seed, the lane and the
        flush boundary. It carries history across samples, so the pipeline resumes by
        replay: a restore re-reads from the last flush boundary
        (``RuntimeOptions.flush_every_k_chunks``) and drops what was already delivered.

        Args:
            buffer_size: samples held per lane before one is released (an int >= 1).

        Returns:
            A new pipeline with the op appended.

        Examples:
            >>> pipe = Pipeline(sources.from_sequence(list(range(8))), shuffle=False)
            >>> sorted(pipe.shuffle(4)) == list(range(8))
            True
        """
        return self._with(O.ShuffleOp(buffer_size))

    # ensure_mixture: a reorder buffer holding mixture shares (zephon.pipeline.ops.ensure_mixture)
    def ensure_mixture(self, weights: Mapping[str, float] | None = None, *,
                       by: str = "samples", field: str = "tokens", max_buffer: int = 4096,
                       leftover: str = "emit") -> "Pipeline":
        """Reorder samples so that the running share of each mixture component tracks its
        target, after a filter or a tokenizer made the delivered shares drift.

        Per lane it queues each component's samples and always emits from the component
        furthest below its target share, waiting for a scarce component while it holds
        at most ``max_buffer`` samples; at the end of each epoch it flushes what it holds
        (see :mod:`zephon.pipeline.ops.ensure_mixture` for the rule, what happens when a
        component runs dry, and what resumes). It reorders: over an epoch the output holds
        the same samples as its input (``leftover="emit"``), so it restores the target's
        shares only as far as its buffer can hold the surplus of the other components.
        Place it after the filters and the tokenizer, before ``batch`` and the packers.

        Args:
            weights: ``{component: weight}``; None (default): the mixture's own weights
                (the pipeline's source must be a mixture), of each epoch under a schedule.
            by: ``"samples"`` (each sample counts 1) or ``"tokens"`` (a sample counts the
                length of its flattened ``field``).
            field: the token field for ``by="tokens"``.
            max_buffer: the most samples one lane holds (an int >= 1; memory bound).
            leftover: ``"emit"`` (default: every sample is delivered; the surplus at the
                end of an epoch) or ``"drop"`` (the surplus is discarded: the epoch holds the
                target's shares when ``max_buffer`` held all of it; a full buffer lets
                it through by the rule before the epoch ends).

        Returns:
            A new pipeline with the op appended.

        Raises:
            ZephonConfigError: a bad argument, no weights for a source that is not a
                mixture, weights that do not name exactly the components the mixture's
                samples carry (a nested mixture's own components, not its name), or the op placed
                after ``batch`` or a packer.

        Examples:
            >>> a = sources.from_callable(40, lambda i: {"x": i})
            >>> b = sources.from_callable(40, lambda i: {"x": 100 + i})
            >>> mix = sources.mixture({"a": a, "b": b}, weights={"a": 0.5, "b": 0.5})
            >>> keep = lambda s: s["x"] >= 100 or s["x"] % 2 == 0  # half of "a" only
            >>> pipe = Pipeline(mix, shuffle=False).filter(keep)
            >>> def a_per_batch(p):
            ...     return [sum(sid[0].startswith("a") for sid in bt.meta["sample_ids"])
            ...             for bt in p.batch(8)]
            >>> a_per_batch(pipe)
            [3, 3, 2, 3, 3, 2, 3, 1]
            >>> a_per_batch(pipe.ensure_mixture(max_buffer=64))  # the surplus comes last
            [4, 4, 4, 4, 4, 0, 0, 0]
        """
        from zephon.pipeline.sources.mixture import MixtureSource

        source = self.spec.source
        mixture = source if isinstance(source, MixtureSource) else None
        if weights is None:
            if mixture is None:
                raise ZephonConfigError(
                    f"ensure_mixture: the pipeline's source {type(source).__name__} is "
                    "not a mixture: give weights={component: weight}")
            if mixture.stream is not None:
                raise ZephonConfigError(
                    f"ensure_mixture: the mixture's weights are a {mixture.schedule_unit}-keyed "
                    "schedule, exact in every block of 256 positions already; its targets "
                    "would be read per epoch: drop ensure_mixture() (after a filter, give "
                    "weights={component: weight} to hold fixed shares)")
            op = O.EnsureMixtureOp(mixture.schedule, by, field, max_buffer, leftover)
        else:
            op = O.EnsureMixtureOp(weights, by, field, max_buffer, leftover)
            if mixture is not None:
                op.check_components(mixture.record_names())
        for before in self.ops:
            if isinstance(before, (O.HoldsRecords, O.HoldsPieces, O.HoldsBins)):
                raise ZephonConfigError(
                    f"ensure_mixture reorders samples: place it before {before.kind}, whose "
                    "records hold several samples")
        return self._with(op)

    def batch(self, microbatch_size: int, drop_last: bool = False,
              collate_fn=None) -> "Pipeline":
        """Collate samples into batches of ``microbatch_size``, as torch's ``default_collate``.

        The rules are torch's with NumPy arrays in place of tensors
        (:mod:`zephon.pipeline.collate`): dict samples give a :class:`~zephon.Batch` of
        their keys, each stacked (arrays, numbers) or listed (strings); tuple or list
        samples give a :class:`~zephon.pipeline.ops.BatchList`, the list of their
        positions collated (``images, labels = batch``); a namedtuple, an array or a
        number gives a namedtuple, an array. Where torch would raise on values that do
        not stack (ragged arrays, None, lists of unequal length in a dict column) they
        stay a list; tuple or list samples of unequal length raise an
        :class:`~zephon.errors.OpError` of the batch op. A batch never mixes lanes.
        Every batch has exactly ``microbatch_size`` samples, across flush boundaries and
        epochs, except a lane's last batch of the run (its pass); after ``pack_tokens``
        the lane's short last row is a batch of its own after it, never stacked with
        full rows (``drop_last=True`` drops both: every batch is then
        ``(microbatch_size, seq_len)``). The ``meta`` of a Batch
        or BatchList holds ``sample_ids`` (``(source, index, epoch)`` per sample),
        ``lane`` and ``lane_index``.

        Args:
            microbatch_size: samples per batch (an int >= 1).
            drop_last: drop a lane's partial last batch (and a packer's short row)
                instead of emitting it.
            collate_fn: ``collate_fn(values) -> batch`` in place of the default
                collation, called with the list of the batch's sample values (as a
                DataLoader's ``collate_fn``), in the worker that read the samples when
                the batch is formed there; a plain dict it returns becomes a Batch, a
                plain list a BatchList. Part of the pipeline's fingerprint; it must
                pickle for the process runner (module level, as ops).

        Returns:
            A new pipeline with the op appended.

        Examples:
            >>> src = sources.from_callable(5, lambda i: {"x": np.arange(3) + i, "label": i})
            >>> batches = list(Pipeline(src, shuffle=False).batch(2))
            >>> batches[0]["x"].shape, batches[0]["label"].tolist(), len(batches)
            ((2, 3), [0, 1], 3)
            >>> len(list(Pipeline(src, shuffle=False).batch(2, drop_last=True)))
            2
        """
        return self._with(O.BatchOp(microbatch_size, drop_last, collate_fn))

    def pack_tokens(self, seq_len: int, field: str = "tokens",
                    drop_remainder: bool = False, *, aligned=None) -> "Pipeline":
        """Concatenate token arrays of consecutive samples and cut rows of ``seq_len``.

        Each output sample is ``{field: ndarray[seq_len], *aligned}``, across flush
        boundaries and epochs: no token is dropped; each ``aligned`` field (one value per
        token, e.g. ``tokenize_chat``'s ``loss_mask``) is cut as the tokens are. Only the lane's last row of the run (its pass) can be
        shorter: the tokens left at the end, or nothing with ``drop_remainder=True``; a
        ``batch()`` after it makes that row a batch of its own (see :meth:`batch`). Like
        :meth:`shuffle` it carries history, so the pipeline resumes by replay.

        Args:
            seq_len: tokens per output row (an int >= 1).
            field: the key of the token array in each input sample.
            drop_remainder: drop the lane's final short row instead of emitting it.
            aligned: fields packed like the tokens (e.g. ``("loss_mask",)``). None (the
                default): those the op that made ``field`` declares aligned with it
                (``tokenize_chat``: its ``mask_field``), else none.

        Returns:
            A new pipeline with the op appended.

        Raises:
            ZephonConfigError: a bad argument; or ``aligned`` not given while an op made
                fields aligned with ``field`` and an op since (a ``map``) may have changed
                them (give ``aligned=``: the fields to pack, or ``()``).

        Examples:
            >>> src = sources.from_callable(3, lambda i: {"tokens": np.arange(5) + 10 * i})
            >>> rows = list(Pipeline(src, shuffle=False).pack_tokens(4))
            >>> [r["tokens"].tolist() for r in rows]
            [[0, 1, 2, 3], [4, 10, 11, 12], [13, 14, 20, 21], [22, 23, 24]]
            >>> len(list(Pipeline(src, shuffle=False).pack_tokens(4, drop_remainder=True)))
            3
        """
        if aligned is None and isinstance(field, str):
            aligned = upstream_aligned(self.ops, "pack_tokens", field)
        return self._with(O.PackTokensOp(seq_len, field, drop_remainder, aligned))

    # pack_documents: document-aware packing (zephon.pipeline.ops.pack_documents)
    def pack_documents(self, seq_len: int, field: str = "tokens", *, algorithm: str = "greedy",
                       open_bins: int = 32, pad_id: int = 0, aligned=None,
                       drop_remainder: bool = False) -> "Pipeline":
        """Pack documents into rows of ``seq_len`` that keep their boundaries.

        Each output sample is ``{field: tokens, "positions", "cu_seqlens", *aligned}``
        (every array of a fixed length, so rows batch): the tokens padded with ``pad_id``,
        ``positions`` restarting at 0 in every document, ``cu_seqlens`` the documents'
        offsets in the row then -1 up to ``seq_len + 1`` entries
        (:mod:`zephon.pipeline.ops.pack_documents`). ``algorithm="greedy"`` (or ``"wrap"``) fills
        every row, splitting documents across rows; ``"first_fit"`` and ``"best_fit"``
        keep every document of at most ``seq_len`` tokens whole, placing it among
        ``open_bins`` open rows (longer ones are cut into whole rows and a rest). What is
        open stays across flush boundaries and epochs: nothing is dropped or padded
        mid-run except by the bin packing itself; only the run's end emits the open rows
        (``drop_remainder=True`` drops them). :func:`zephon.pipeline.training.to_training` makes training
        tensors of a batch of these rows.

        Args:
            seq_len: slots per row (an int >= 2).
            field: the key of the token array in each input sample.
            algorithm: ``"greedy"``, ``"wrap"``, ``"first_fit"`` or ``"best_fit"``.
            open_bins: rows a lane keeps open for bin packing (1 to 1024).
            pad_id: the token of the padding (an int >= 0).
            aligned: fields packed like the tokens (e.g. ``("loss_mask",)``), 0 on padding.
                None (the default): those the op that made ``field`` declares aligned with
                it (``tokenize_chat``: its ``mask_field``), else none.
            drop_remainder: drop what is open at the run's end instead of emitting it.

        Returns:
            A new pipeline with the op appended.

        Raises:
            ZephonConfigError: a bad argument; or ``aligned`` not given while an op made
                fields aligned with ``field`` and an op since (a ``map``) may have changed
                them (give ``aligned=``: the fields to pack, or ``()``).

        Examples:
            >>> src = sources.from_sequence([{"tokens": np.arange(n) + 10 * n} for n in (3, 5, 2)])
            >>> rows = list(Pipeline(src, shuffle=False).pack_documents(6, algorithm="best_fit"))
            >>> [r["tokens"].tolist() for r in rows]
            [[30, 31, 32, 20, 21, 0], [50, 51, 52, 53, 54, 0]]
            >>> rows[0]["positions"].tolist(), rows[0]["cu_seqlens"][:4].tolist()
            ([0, 1, 2, 0, 1, 0], [0, 3, 5, -1])
        """
        from zephon.pipeline.ops.pack_documents import PackDocumentsOp

        if aligned is None and isinstance(field, str):
            aligned = upstream_aligned(self.ops, "pack_documents", field)
        return self._with(PackDocumentsOp(seq_len, field, algorithm, open_bins, pad_id, aligned,
                                          drop_remainder))

    # -- text ops (zephon/pipeline/text/): registration only ------------------------------
    def tokenize(self, tokenizer, *, text_field: str = "text", output_field: str = "tokens",
                 add_bos: bool = False, add_eos: bool = False, bos=None, eos=None,
                 add_special_tokens: bool = False, max_length: int | None = None,
                 overflow: str = "truncate", dtype=None, keep_fields: bool = False,
                 parallelism: int = 1) -> "Pipeline":
        """Tokenize each sample's text with a Hugging Face fast tokenizer, a part at a time.

        Each output sample is ``{output_field: ndarray}``: ``[bos] + ids + [eos]``, with
        ``ids`` what ``tokenizer.encode(text, add_special_tokens=...).ids`` gives, the same
        on every runner. A worker tokenizes all the samples of a dispatch part in one
        ``encode_batch`` call (GIL released). See :mod:`zephon.pipeline.text.tokenize`.

        Args:
            tokenizer: a local ``tokenizer.json`` path or directory (never a hub name: it
                is refused), a ``tokenizers.Tokenizer`` or a ``transformers`` fast
                tokenizer; it travels to workers as its path or JSON, and the pipeline
                fingerprint holds the hash of its JSON.
            text_field: the key of the text in a dict sample (a str sample is the text).
            output_field: the key of the token array in the output.
            add_bos: put a BOS before the ids.
            add_eos: put an EOS after the ids.
            bos: the BOS id or token string (None: the tokenizer's own, declared by a
                ``transformers`` tokenizer or ``tokenizer_config.json``).
            eos: the EOS id or token string (None: the tokenizer's own).
            add_special_tokens: let the tokenizer add its own special tokens (its
                post-processor).
            max_length: with ``overflow="truncate"``, the most tokens of a row, BOS and
                EOS included (None: no limit).
            overflow: ``"truncate"`` (cut at ``max_length``) or ``"keep"``.
            dtype: the ids' dtype (None: uint16 when every id fits, else int32).
            keep_fields: keep the input's other fields beside the output.
            parallelism: the workers this op asks for (as for :meth:`map`).

        Returns:
            A new pipeline with the op appended.

        Raises:
            ZephonConfigError: a hub name or missing path, an unknown BOS/EOS, a dtype
                too small for the vocabulary, an option out of range.
            ImportError: ``tokenizers`` is missing (the ``text`` extra).

        Examples:
            >>> pipe = Pipeline(sources.from_sequence([{"text": "hi"}])).tokenize(
            ...     tok, add_eos=True, eos="<eos>")                      # doctest: +SKIP
        """
        from zephon.pipeline.text.tokenize import TokenizeOp

        return self._with(TokenizeOp(
            tokenizer, text_field=text_field, output_field=output_field, add_bos=add_bos,
            add_eos=add_eos, bos=bos, eos=eos, add_special_tokens=add_special_tokens,
            max_length=max_length, overflow=overflow, dtype=dtype, keep_fields=keep_fields,
            parallelism=parallelism))

    def tokenize_chat(self, tokenizer, *, template: str | None = None,
                      messages_field: str = "messages", output_field: str = "tokens",
                      mask_field: str = "loss_mask", add_bos: bool = False,
                      add_eos: bool = False, bos=None, eos=None,
                      add_special_tokens: bool = False, max_length: int | None = None,
                      dtype=None, keep_fields: bool = False,
                      parallelism: int = 1) -> "Pipeline":
        """Render chat samples with a template and tokenize them, with an assistant mask.

        Each sample ``{messages_field: [{"role", "content"}, ...]}`` becomes
        ``{output_field: ids, mask_field: uint8 mask}``: the rendered conversation
        tokenized whole, and 1 in the mask on the tokens with a character inside an
        assistant turn (its content and the template's end-of-turn text after it), 0
        elsewhere.
        See :mod:`zephon.pipeline.text.chat`.

        Args:
            tokenizer: as for :meth:`tokenize`.
            template: None (the tokenizer's own chat template, else the built-in
                ChatML), ``"chatml"``, or a Jinja template string.
            messages_field: the key of the list of messages in a sample.
            output_field: the key of the token ids in the output.
            mask_field: the key of the loss mask (uint8) in the output.
            add_bos: put a BOS before the ids (mask 0).
            add_eos: put an EOS after the ids (mask 0).
            bos: as for :meth:`tokenize`.
            eos: as for :meth:`tokenize`.
            add_special_tokens: as for :meth:`tokenize`.
            max_length: the most tokens of a row, BOS and EOS included (ids and mask
                are truncated alike; None: no limit).
            dtype: as for :meth:`tokenize`.
            keep_fields: as for :meth:`tokenize`.
            parallelism: as for :meth:`tokenize`.

        Returns:
            A new pipeline with the op appended.

        Examples:
            >>> chats = [{"messages": [{"role": "user", "content": "hi"},
            ...                        {"role": "assistant", "content": "hello"}]}]
            >>> rows = list(Pipeline(sources.from_sequence(chats)).tokenize_chat(tok))  # doctest: +SKIP
        """
        from zephon.pipeline.text.chat import TokenizeChatOp

        return self._with(TokenizeChatOp(
            tokenizer, template=template, messages_field=messages_field,
            output_field=output_field, mask_field=mask_field, add_bos=add_bos,
            add_eos=add_eos, bos=bos, eos=eos, add_special_tokens=add_special_tokens,
            max_length=max_length, dtype=dtype, keep_fields=keep_fields,
            parallelism=parallelism))

    def options(self, opts: RuntimeOptions) -> "Pipeline":
        """The same pipeline, run with ``opts``.

        Options say how the stream is produced (runners, workers, queues, transport, ranks,
        checkpoint exchange), not what it is: the same definition gives the same batches
        under any runner, worker count or queue depth. Three options do define the
        stream: ``canonical_replicas`` (the number of lanes), ``flush_every_k_chunks``
        (where a shuffle buffer drains and a replay can start) and ``deterministic=False``
        (completion order).

        Args:
            opts: a :class:`~zephon.RuntimeOptions`.

        Returns:
            A new pipeline carrying ``opts``.

        Raises:
            ZephonConfigError: ``opts`` is not a RuntimeOptions.

        Examples:
            >>> pipe = Pipeline(sources.from_sequence(list(range(6))), seed=1)
            >>> threaded = pipe.options(RuntimeOptions(runner="threads", max_workers=2))
            >>> list(threaded) == list(pipe)
            True
        """
        if not isinstance(opts, RuntimeOptions):
            raise ZephonConfigError(f"options() takes a RuntimeOptions, got {type(opts).__name__}")
        return self._with(runtime=opts)

    # -- plan ----------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """A hash of what defines the stream.

        It covers the source's description, the ops, the seed, the ``shuffle`` flag,
        ``chunk_size``, ``num_epochs`` and the flush cadence; a checkpoint restores only
        into a pipeline with the same fingerprint.

        Returns:
            A 64-character hex string (SHA-256).

        Examples:
            >>> a = Pipeline(sources.from_sequence([1, 2]), seed=0)
            >>> a.fingerprint() == Pipeline(sources.from_sequence([1, 2]), seed=0).fingerprint()
            True
            >>> a.fingerprint() == a.map(abs).fingerprint()
            False
        """
        return self.plan().fingerprint

    def plan(self) -> Plan:
        """The resolved plan, computed once per pipeline.

        A pipeline's definition never changes (every builder method returns a new
        pipeline), while resolving can be costly (a mixture under ``mixture_config``
        recomputes its schedule), so the plan is cached.

        Returns:
            The :class:`~zephon.pipeline.engine.Plan`: lanes, stages, runners, worker counts
            and queue depths (``plan().explain()`` prints it).

        Examples:
            >>> plan = Pipeline(sources.from_sequence([1, 2])).plan()
            >>> plan.runners
            {'inline'}
        """
        if self._plan is None:
            self._plan = Plan(self.spec, self.runtime)
        return self._plan

    def explain(self) -> str:
        """The resolved plan as text.

        Returns:
            Lines describing the lanes and which this rank owns, the order, how a restore
            resumes (cursor or replay), the flush cadence, and each stage's ops, runner,
            workers and queue depths.

        Examples:
            >>> text = Pipeline(sources.from_sequence([1, 2])).map(abs).explain()
            >>> "stage 0: read, map(abs)" in text
            True

        After a run with Ray stages (``runner="ray"``) it says where their actors were
        (nodes, units in flight, units re-run after lost actors); under
        ``worker_allocation="autotune"`` it ends with the latest run's worker counts and
        the controller's decisions (:mod:`zephon.pipeline.autotune`).
        """
        text = self.plan().explain()
        latest = self._progress.latest
        lines = [f"  ray {ex.name}: {ex.describe()}" for ex in latest.ray]
        if latest.autotune is not None:
            lines += latest.autotune.explain()
        return "\n".join([text, *lines])

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> PipelineIterator:
        """Start a run and return its iterator.

        The run continues after the last item the latest run of this pipeline delivered
        (after a complete pass: the next pass), or starts where :meth:`restore` or
        :meth:`set_epoch` said since. It becomes the latest run, the one the shortcuts
        act on; an earlier iterator still going goes on on its own (and is closed when it
        is dropped or exhausted). Worker processes start booting here while the ops are
        checked on the first sample (``RuntimeOptions.auto_validation``).

        Returns:
            A :class:`~zephon.pipeline.iterator.PipelineIterator` that owns the run.

        Raises:
            ValidationError: with ``auto_validation="strict"``, an op fails the checks run
                on the first sample: it cannot be pickled for a process stage (or MTP
                mode), it is not deterministic, or it mutates its input.

        Examples:
            >>> it = iter(Pipeline(sources.from_sequence([1, 2, 3]), shuffle=False))
            >>> next(it), next(it)
            (1, 2)
            >>> it.close()
        """
        refuse_in_spawn_bootstrap("iterating a zephon Pipeline")
        plan = self.plan()
        if plan.opts.mtp_mode or any(stage.mode in OUT_OF_PROCESS_RUNNERS
                                     for stage in plan.stages):
            # the pickle checks before any worker process exists; the behaviour checks
            # while the workers boot (the iterator runs them)
            seeded, checked = validate(plan, "pickle"), False
        else:  # nothing boots: both at once, under one keep of the generators' states
            seeded, checked = validate(plan, "all"), True
        return PipelineIterator(plan, self._progress.next_start(plan), self._progress,
                                seeded, checked=checked)

    def set_epoch(self, epoch: int) -> None:
        """Start the next run at the beginning of ``epoch``.

        The run then covers the rest of ``epoch``'s pass (with ``num_epochs=k``, up to
        the end of epoch ``(epoch // k + 1) * k - 1``), exactly as the first time it ran:
        use it to run an epoch again (validation on a fixed epoch, a re-run) or to skip
        ahead. If the latest run is still going, it restarts there at once.

        Args:
            epoch: an int >= 0.

        Raises:
            ZephonConfigError: ``epoch`` is not an int >= 0.

        Examples:
            >>> pipe = Pipeline(sources.from_sequence(list(range(4))), seed=0)
            >>> epoch0, epoch1 = list(pipe), list(pipe)
            >>> pipe.set_epoch(1)
            >>> list(pipe) == epoch1
            True
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < MAX_COUNT:
            raise ZephonConfigError(f"set_epoch: epoch must be an int >= 0, got {epoch!r}")
        self._progress.move_to(RunStart({}, epoch))

    def close(self) -> None:
        """Close every run of this pipeline that is still going (idempotent).

        Examples:
            >>> pipe = Pipeline(sources.from_sequence([1, 2, 3]))
            >>> it = iter(pipe)
            >>> pipe.close()
            >>> it.closed
            True
        """
        self._progress.close_runs()

    def stats(self, report: bool = False) -> dict:
        """Execution statistics of the latest run (a shortcut for ``it.stats()``).

        Args:
            report: return the report-grade snapshot instead (per-stage busy, idle and
                blocked fractions, time series, the consumer's wait, worker events; its
                schema is in :mod:`zephon.pipeline.stats`); ``zephon.profile`` renders it.

        Returns:
            A dict snapshot of the latest run's counters (see
            ``RuntimeOptions.execution_tracking``); empty when tracking is off, in MTP
            mode, where the statistics live in the subprocess, and before a run (also
            after :meth:`restore` or :meth:`set_epoch` placed the next start).

        Examples:
            >>> Pipeline(sources.from_sequence([1, 2])).stats()
            {}
        """
        return self._progress.latest.stats_snapshot(report)

    @property
    def final_state(self) -> bytes | None:
        """The checkpoint taken when the latest run reached the end of its stream.

        Set only with ``mtp_mode`` and ``mtp_auto_checkpoint``; None otherwise, and until
        a run ends (a :meth:`restore` or :meth:`set_epoch` with no run going places a
        new start, which has none).

        Examples:
            >>> Pipeline(sources.from_sequence([1, 2])).final_state is None
            True
        """
        return self._progress.latest.final_state

    # -- checkpoint ------------------------------------------------------------------------
    def position(self) -> Position:
        """Where the latest run stands (``it.position()``, also after the run ended, and
        right after a :meth:`restore`: where the restored run will start).

        Examples:
            >>> pipe = Pipeline(sources.from_sequence(list(range(8))), seed=1).batch(2)
            >>> for _, batch in zip(range(3), pipe):
            ...     pass
            >>> again = Pipeline(sources.from_sequence(list(range(8))), seed=1).batch(2)
            >>> again.restore(pipe.checkpoint())
            >>> again.position().batches, again.position().samples
            (3, 6)
        """
        latest = self._progress.latest
        return position(self.plan(), latest.states, latest.start_epoch)

    def checkpoint(self) -> bytes:
        """The latest run's delivered position as checkpoint bytes (a shortcut for
        ``it.checkpoint()``, also after the run ended).

        After a :meth:`restore` or :meth:`set_epoch` made with no run going, it saves that
        start. Only items handed to the consumer count. With several ranks every rank must call
        it at the same step: the ranks exchange their states and all return the same
        merged bytes. When a pipeline runs several iterators at once, call
        ``it.checkpoint()`` on the one you mean.

        Returns:
            The checkpoint as bytes (a versioned, checksummed envelope).

        Raises:
            ZephonConfigError: several ranks but neither ``aggregate_dir`` nor
                ``aggregate_store``.
            CheckpointError: the multi-rank exchange failed (states in disagreement, a
                medium failing mid-round).
            AggregationTimeoutError: a rank did not take part within
                ``aggregate_timeout_s`` (named).

        Examples:
            >>> pipe = Pipeline(sources.from_sequence(list(range(10))), seed=3, chunk_size=2)
            >>> for _, x in zip(range(4), pipe):
            ...     pass
            >>> state = pipe.checkpoint()
            >>> again = Pipeline(sources.from_sequence(list(range(10))), seed=3, chunk_size=2)
            >>> again.restore(state)
            >>> rest = list(again)
            >>> len(rest), rest == list(pipe)   # pipe's next run continues there too
            (6, True)
        """
        return self._progress.exchange(self.plan(), self._progress.latest)

    def restore(self, state: bytes) -> None:
        """Continue exactly after the last item delivered when ``state`` was taken.

        If the latest run is still going, it restarts from ``state``; otherwise the next
        ``iter(pipe)`` starts there. The state may come from any runner, worker
        count or number of ranks, as long as the definition (:meth:`fingerprint`) and the
        number of canonical lanes are the same.

        Args:
            state: bytes from :meth:`checkpoint` (or ``it.checkpoint()``).

        Raises:
            CheckpointError: the bytes are corrupt, of another format version, or do not
                fit this pipeline (another fingerprint, lane count, or positions out of
                range), naming what differs. Nothing is applied then.

        Examples:
            >>> pipe = Pipeline(sources.from_sequence(list(range(6))), shuffle=False)
            >>> it = iter(pipe)
            >>> next(it), next(it)
            (0, 1)
            >>> state = it.checkpoint()
            >>> it.close()
            >>> pipe.restore(state)
            >>> list(pipe)
            [2, 3, 4, 5]
        """
        self._progress.move_to(check_run(decode_state(state), self.plan()))

