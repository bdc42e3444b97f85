"""``TorchLoader``: a pipeline as an iterable of tensor batches with the Stateful protocol.

Lifecycle: ``iter(loader)`` goes on with the run in progress, if any; else it
starts a new run of the pipeline, which continues after the last batch this
loader handed out, as ``iter(pipe)`` does (after a complete pass: the next
epoch; see :class:`~zephon.pipeline.Pipeline`), or after a loaded state;
``next`` hands out the next batch as tensors; ``close()`` (also at the end of
the stream, on ``load_state_dict`` and at garbage collection) stops the
pinning thread and closes the pipeline's run.

Delivery: only batches handed to the caller count for ``state_dict()``. With
``pin_memory=False`` the loader pulls a batch from the pipeline when the
caller asks, and ``state_dict()`` is ``pipe.checkpoint()``. With
``pin_memory=True`` a background thread pulls up to ``prefetch`` batches
ahead and pins them; each carries the lane position the pipeline recorded for
it, the loader records that position when it hands the batch out, and
``state_dict()`` exchanges exactly those positions: prefetched batches are
produced again after a restore, and when the loader closes a run its
consumer left early it rewinds the run to them (``PipelineIterator.rewind``),
so the pipeline's next run continues after the last batch handed out, not
after the prefetched ones.

Placement (:mod:`zephon.torch._device`): with ``device=`` every tensor of a batch is
moved there, and ``normalize=`` turns the named ``uint8`` image columns into
normalised ``(N, C, H, W)`` float32 tensors after the move. With ``pin_memory=True``
the background thread does it too (on CUDA: on a side stream, the consumer's stream
made to wait on an event when the batch is handed out); else the consumer's thread
does it when it takes the batch. Placement never changes which batches count: the
hand-off carries each batch's delivered positions as before.

``state_dict()`` is collective across ranks, like ``pipe.checkpoint()``: every
rank calls it at the same step. Its value is ``{"zephon_checkpoint": bytes}``:
``torch.save`` stores it (and ``torch.load(weights_only=True)`` reads it
back), and ``torch.distributed.checkpoint`` stores it as a replicated object
(every rank holds the same bytes).
"""

from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING

from zephon.errors import CheckpointError, ZephonConfigError
from zephon.pipeline.iterator import Handoff, HandoffClosed
from zephon.torch import STATE_KEY, _require_torch
from zephon.torch._convert import map_leaves, to_torch
from zephon.torch._device import Placement, placement

if TYPE_CHECKING:
    from zephon.pipeline.iterator import PipelineIterator

__all__ = ["TorchLoader"]

_JOIN_TIMEOUT_S = 30.0


# -- the seam to the pipeline's run state --------------------------------------------------
# The pinning thread takes batches from the pipeline's iterator ahead of the training loop:
# with each batch it keeps the iterator's delivered positions at that moment, and the loader
# checkpoints the positions of the last batch it handed on (PipelineIterator.delivered() /
# checkpoint(delivered)).


def _pin_fn(torch):
    available = getattr(getattr(torch, "accelerator", None), "is_available", None)
    has_accelerator = available() if available is not None else torch.cuda.is_available()
    if not has_accelerator:
        warnings.warn("zephon.torch: pin_memory=True but no accelerator is available; "
                      "batches are prefetched on the background thread but not pinned",
                      RuntimeWarning, stacklevel=4)
        return lambda batch: batch

    def pin(batch):  # every tensor of the batch, through its structure (tuple batches too)
        return map_leaves(batch, lambda v: v.pin_memory() if isinstance(v, torch.Tensor)
                          else v)

    return pin


def _converter(keep_dtypes: bool, training: dict | None):
    """What turns a pipeline batch into the loader's (``training``: to_training's keyword
    arguments, or None for tensors of the batch as it is)."""
    if training is None:
        return lambda batch: to_torch(batch, keep_dtypes=keep_dtypes)
    from zephon.pipeline.training import to_training

    return lambda batch: to_torch(to_training(batch, **training), keep_dtypes=keep_dtypes)


def _prefetch(items, pin, out: Handoff, convert, place: Placement | None) -> None:
    try:
        for batch in items:
            ready, event = (pin(convert(batch)), None) if place is None else \
                place.move(pin(convert(batch)))
            if not out.put((ready, event, items.delivered())):
                return
        out.finish()
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer
        out.fail(exc)


class TorchLoader:
    """Batches of ``pipe`` as torch tensors, with the Stateful protocol.

    Build it with :func:`zephon.torch.loader`. Iterating yields zephon Batches
    (dicts with ``.meta``) whose numeric columns are tensors sharing the arena's
    memory. ``iter(loader)`` goes on with the run in progress, if any (a loop left
    early continues where it stopped), else starts a new run of the pipeline: after a
    complete pass the next epoch, after a loaded state where it says (the pipeline's
    rule, :class:`~zephon.pipeline.Pipeline`). Only batches handed to the caller count
    for :meth:`state_dict`.

    Args:
        pipe: the zephon Pipeline, options included.
        pin_memory: pin numeric columns on a background thread (see
            :func:`zephon.torch.loader`).
        prefetch: batches the pinning thread may prepare ahead (an int >= 1).
        keep_dtypes: keep unsigned integer arrays in their dtype (see
            :func:`zephon.torch.to_torch`).
        to_training: hand out :func:`zephon.torch.to_training` of each batch instead
            (True, or a dict of its keyword arguments).
        device: move every tensor of a batch to this device (see
            :func:`zephon.torch.loader`); None: leave them on the host.
        non_blocking: copy to the device with ``non_blocking`` (asynchronous from pinned
            memory).
        normalize: column -> ``(mean, std)`` in 0-1 units: those ``uint8`` image columns
            become normalised ``(N, C, H, W)`` float32 tensors (after the move).
        layout: the layout of each image, ``"HWC"`` or ``"CHW"``.
        channels_last: give normalised images ``torch.channels_last`` memory format.

    Raises:
        ImportError: torch is missing.
        ZephonConfigError: ``pipe`` is not a Pipeline, or a bad ``pin_memory``,
            ``prefetch``, ``device``, ``non_blocking``, ``normalize``, ``layout`` or
            ``channels_last``.

    Examples:
        >>> src = sources.from_sequence([{"x": np.float32(i)} for i in range(6)])
        >>> loader = zephon.torch.loader(Pipeline(src, shuffle=False).batch(2))
        >>> first = next(iter(loader))
        >>> ckpt = {"data": loader.state_dict()}
        >>> rest = [b["x"].tolist() for b in loader]
        >>> loader.load_state_dict(ckpt["data"])
        >>> [b["x"].tolist() for b in loader] == rest
        True
    """

    def __init__(self, pipe, *, pin_memory: bool = False, prefetch: int = 2,
                 keep_dtypes: bool = False, to_training: bool | dict = False,
                 device=None, non_blocking: bool = True, normalize=None,
                 layout: str = "HWC", channels_last: bool = False) -> None:
        from zephon.pipeline import Pipeline
        from zephon.pipeline.training import check_options

        if not isinstance(pipe, Pipeline):
            raise ZephonConfigError(f"zephon.torch.loader takes a zephon Pipeline, got "
                                    f"{type(pipe).__name__}")
        if not isinstance(pin_memory, bool):
            raise ZephonConfigError(f"pin_memory must be True or False, got {pin_memory!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ZephonConfigError(f"prefetch must be an int >= 1, got {prefetch!r}")
        if not isinstance(keep_dtypes, bool):
            raise ZephonConfigError(f"keep_dtypes must be True or False, got {keep_dtypes!r}")
        self.keep_dtypes = keep_dtypes
        training = None if to_training is False else check_options(to_training)
        self._convert = _converter(keep_dtypes, training)
        self._torch = _require_torch()
        self._place = placement(self._torch, device, non_blocking, normalize, layout,
                                channels_last)
        self.device = None if self._place is None else self._place.device
        self.pipe, self.pin_memory, self.prefetch = pipe, pin_memory, prefetch
        self._it: PipelineIterator | None = None
        self._last_it: PipelineIterator | None = None  # the run that just ended or was closed
        self._pinned_run = False
        self._thread: threading.Thread | None = None
        self._handoff: Handoff | None = None
        self._delivered: dict = {}
        self._ended = False  # the caller got the end of the pinned run
        self._pin = None

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> "TorchLoader":
        if self._it is not None and not self._it.closed:
            return self  # a run in progress goes on (a loop left early continues here)
        self.close()
        self._attach(iter(self.pipe))
        return self

    def _attach(self, it: PipelineIterator) -> None:
        """Make ``it`` (a run going on) this loader's, with its pinning thread."""
        self._it = it
        self._pinned_run = self.pin_memory
        self._ended = False
        if self.pin_memory:
            if self._pin is None:
                self._pin = _pin_fn(self._torch)
            self._delivered = it.delivered()
            self._handoff = Handoff(self.prefetch)
            self._thread = thread = threading.Thread(
                target=_prefetch,
                args=(it, self._pin, self._handoff, self._convert, self._place),
                name="zephon-pin-memory", daemon=True)
            thread.start()

    def set_mixture_weights(self, weights: dict) -> int:
        """Set new weights of the pipeline's mixture from the next sample no batch handed
        out holds on (:meth:`~zephon.pipeline.iterator.PipelineIterator.set_mixture_weights`:
        a mixture with ``schedule_unit="samples"`` or ``"tokens"``; every rank calls it at
        the same step). Batches the pinning thread took ahead are made again under the new
        weights; the change is part of :meth:`state_dict` from then on.

        Args:
            weights: component name -> weight, every component named.

        Returns:
            The stream position (in samples) from which the weights hold.

        Raises:
            ZephonConfigError: the source is no mixture with a position-keyed schedule,
                or the weights do not name exactly its components.

        Examples:
            >>> mix = sources.mixture(
            ...     {"a": sources.from_sequence(list(range(1000)), name="a"),
            ...      "b": sources.from_sequence(list(range(1000, 2000)), name="b")},
            ...     {"a": 1, "b": 1}, schedule_unit="samples")
            >>> loader = zephon.torch.loader(Pipeline(mix, num_epochs=None).batch(64))
            >>> _ = [next(iter(loader)) for _ in range(4)]  # 256 samples handed out
            >>> loader.set_mixture_weights({"a": 1, "b": 0})
            256
            >>> bool((next(iter(loader)) < 1000).all())
            True
            >>> loader.close()
        """
        it = self._it
        if it is None:
            self.__iter__()
            it = self._it
        assert it is not None, "__iter__ starts a run"
        thread, pinned = self._thread, self._handoff
        if thread is None or pinned is None:
            return it.set_mixture_weights(weights)
        pinned.close()  # the pinning thread stops; the run goes back to what was handed out
        thread.join(timeout=_JOIN_TIMEOUT_S)
        self._thread = None
        it.rewind(self._delivered)
        try:
            return it.set_mixture_weights(weights)
        finally:
            if not it.closed:
                self._attach(it)  # the run (restarted, or as it was) with a new thread

    def __next__(self):
        if self._it is None:
            self.__iter__()
        it, pinned = self._it, self._handoff
        assert it is not None, "__iter__ starts a run"
        if self._thread is None or pinned is None:
            try:
                batch = self._convert(next(it))
            except StopIteration:
                self._last_it, self._it = it, None
                raise
            return batch if self._place is None else self._place.now(batch)
        try:
            batch, event, self._delivered = pinned.get()
        except HandoffClosed:  # closed from another thread while waiting
            self.close()
            raise StopIteration from None
        except StopIteration:  # the end of the run: every batch was handed out
            self._ended = True
            self.close()
            raise
        except BaseException:  # the run's error
            self.close()
            raise
        if event is None or self._place is None:  # an event comes only from a placement
            return batch
        return self._place.ready(batch, event)

    def close(self) -> None:
        """Stop the pinning thread and close the pipeline's run (idempotent).

        The thread is stopped first, while the run still produces, so a thread waiting
        for the pipeline's next batch gets it, finds the hand-off closed and ends; then the run
        closes (its workers are reaped). :meth:`state_dict` still answers afterwards.

        Examples:
            >>> loader = zephon.torch.loader(Pipeline(sources.from_sequence([1, 2])))
            >>> next(iter(loader))
            2
            >>> loader.close()
            >>> loader.close()
        """
        thread, pinned = self._thread, self._handoff
        if thread is not None and pinned is not None:  # set together
            pinned.close()  # the thread's next put() answers False: it ends
            thread.join(timeout=_JOIN_TIMEOUT_S)  # a stalled op: give up, close the run
            self._thread = None
        if self._it is not None:
            self._it.close()
            if self._pinned_run and not self._ended:
                # the thread took batches the caller never got: the next run goes on after
                # the last one handed out
                self._it.rewind(self._delivered)
            self._last_it = self._it
        self._it = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # -- where it is ------------------------------------------------------------------------
    def position(self):
        """Where the stream stands after the last batch handed to the caller: batches and
        samples delivered on this rank and over every lane
        (:class:`~zephon.pipeline.state.Position`; after a restore on another number of
        ranks, ``batches`` is the whole stream's count as the checkpoint had it).

        Examples:
            >>> loader = zephon.torch.loader(Pipeline(sources.from_sequence(list(range(8))),
            ...                                       seed=0).batch(2))
            >>> _ = next(iter(loader)), next(iter(loader))
            >>> loader.position().batches
            2
            >>> loader.close()
        """
        it = self._it if self._it is not None else self._last_it
        if it is None:
            return self.pipe.position()
        return it.position(self._delivered if self._pinned_run else None)

    def steps(self, total: int, *, micro_batches: int = 1, start: int | None = None):
        """Run a fixed number of optimizer steps, across epochs, from where the stream is.

        Yields ``(step, batches)`` for ``step`` in ``[start, total)``: ``batches`` is a list
        of ``micro_batches`` batches (gradient accumulation). When a pass ends mid-step the
        next pass goes on (the next epoch). ``start`` defaults to the step the stream is
        at: ``position().batches // (micro_batches * dp_degree)``, the optimizer steps
        already taken with a global batch of ``micro_batches`` per dp group, so after a
        restore on any world size the loop goes on at the checkpoint's step.

        Args:
            total: the step to stop before (an int >= 0).
            micro_batches: batches per rank and step (an int >= 1).
            start: the first step's number; None: from the position (only in the first
                pass of a ``num_epochs=k`` pipeline, whose counts start again with each
                pass; ``num_epochs=None`` is one pass for ever).

        Raises:
            ZephonConfigError: a bad ``total``/``micro_batches``/``start``; a position
                that is not at a step boundary of ``micro_batches * dp_degree`` batches
                (the checkpoint was taken mid-step, or with another global batch); a
                position in a later pass without ``start``; a pass that delivers no batch.

        Examples:
            >>> pipe = Pipeline(sources.from_sequence(list(range(6))), seed=0).batch(2)
            >>> loader = zephon.torch.loader(pipe)
            >>> [(step, len(b)) for step, b in loader.steps(4, micro_batches=2)]
            [(0, 2), (1, 2), (2, 2), (3, 2)]
            >>> loader.close()
        """
        for name, value, low in (("total", total, 0), ("micro_batches", micro_batches, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ZephonConfigError(f"steps(): {name} must be an int >= {low}, got "
                                        f"{value!r}")
        if start is None:
            start = self._start_step(micro_batches)
        elif isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ZephonConfigError(f"steps(): start must be an int >= 0, got {start!r}")
        return self._steps(start, total, micro_batches)

    def _start_step(self, micro_batches: int) -> int:
        plan = self.pipe.plan()
        pos = self.position()
        epochs = plan.spec.num_epochs
        if epochs is not None and pos.start_epoch >= epochs and pos.batches:
            raise ZephonConfigError(
                f"steps(): the stream is in pass {pos.start_epoch // epochs} (epoch "
                f"{pos.start_epoch}); its counts start again with each pass of "
                f"num_epochs={epochs}: give start= (your trainer's step), or build the "
                "pipeline with num_epochs=None")
        per_step = micro_batches * plan.dp
        if pos.batches % per_step:
            raise ZephonConfigError(
                f"steps(): {pos.batches} batches were delivered, not a whole number of steps "
                f"of {micro_batches} micro-batch(es) x {plan.dp} dp group(s): the checkpoint "
                "was taken mid-step or with another global batch; give start=")
        return pos.batches // per_step

    def _steps(self, start: int, total: int, micro_batches: int):
        empty = 0  # passes in a row that ended without a batch (a run restored at its end
        step = start  # is one: the next is the next pass)
        while step < total:
            batches: list = []
            while len(batches) < micro_batches:
                try:
                    batches.append(next(self))
                    empty = 0
                except StopIteration:  # the next next() starts the next pass
                    empty += 1
                    if empty > 1:
                        raise ZephonConfigError(
                            f"steps(): a pass of the pipeline delivered no batch (step {step} "
                            f"of {total})") from None
            yield step, batches
            step += 1

    # -- Stateful ----------------------------------------------------------------------------
    def delivered(self) -> dict:
        """The lane positions after the last batch handed to the caller (a copy): what
        :meth:`state_dict` saves now. A framework that takes batches ahead of the step that
        trains on them keeps the copy of each batch and passes the one of the batch last
        trained on to ``state_dict(delivered=...)``.

        Examples:
            >>> loader = zephon.torch.loader(Pipeline(sources.from_sequence([1, 2]), shuffle=False))
            >>> loader.delivered()
            {}
            >>> _ = next(iter(loader))
            >>> loader.delivered()
            {0: (0, 1, 1)}
            >>> loader.close()
        """
        if self._pinned_run:
            return dict(self._delivered)
        it = self._it if self._it is not None else self._last_it
        return {} if it is None else it.delivered()

    def state_dict(self, delivered: dict | None = None) -> dict:
        """The position after the last batch this loader handed out (or at ``delivered``,
        a copy :meth:`delivered` returned earlier in the same run).

        Collective across ranks, like ``Pipeline.checkpoint()``: every rank calls it at
        the same step. Batches prefetched by the pinning thread but not handed out are not
        counted (they come again after a restore).

        Args:
            delivered: positions :meth:`delivered` returned earlier in this run, to save
                instead of the current ones (None: the current ones).

        Returns:
            ``{"zephon_checkpoint": bytes}``: ``torch.save`` stores it (and
            ``torch.load(weights_only=True)`` reads it back); ``torch.distributed.checkpoint``
            stores it as a replicated object.

        Raises:
            CheckpointError: the multi-rank exchange failed.
            AggregationTimeoutError: the exchange exceeded ``aggregate_timeout_s``.

        Examples:
            >>> pipe = Pipeline(sources.from_sequence([1, 2, 3]), shuffle=False)
            >>> loader = zephon.torch.loader(pipe)
            >>> next(iter(loader))
            1
            >>> sorted(loader.state_dict())
            ['zephon_checkpoint']
            >>> loader.close()
        """
        it = self._it if self._it is not None else self._last_it
        if it is not None and delivered is not None:
            state = it.checkpoint(delivered)
        elif it is not None and self._pinned_run:
            state = it.checkpoint(self._delivered)  # what the loop got, not the prefetch
        elif it is not None:
            state = it.checkpoint()
        else:
            state = self.pipe.checkpoint()
        return {STATE_KEY: state}

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue after the batches recorded in ``state_dict``.

        The state may come from another number of ranks or another runner. It is checked
        before anything changes: a refused state leaves the loader as it was. Otherwise the
        current run closes and the next iteration starts from the state.

        Args:
            state_dict: the dict :meth:`state_dict` returned (its bytes may have become a
                uint8 tensor through ``torch.distributed.checkpoint``).

        Raises:
            CheckpointError: not such a dict, a tensor of another dtype, or a checkpoint
                that is corrupt or does not fit this pipeline.

        Examples:
            >>> pipe = Pipeline(sources.from_sequence([1, 2, 3]), shuffle=False)
            >>> loader = zephon.torch.loader(pipe)
            >>> state = loader.state_dict()             # before any batch: the start
            >>> next(iter(loader)), next(iter(loader))
            (1, 2)
            >>> loader.load_state_dict(state)
            >>> list(loader)
            [1, 2, 3]
        """
        if not isinstance(state_dict, dict) or STATE_KEY not in state_dict:
            raise CheckpointError(
                f"load_state_dict expects the dict state_dict() returned (with key "
                f"{STATE_KEY!r}), got {type(state_dict).__name__}"
                + (f" with keys {sorted(state_dict)}" if isinstance(state_dict, dict) else ""))
        state = state_dict[STATE_KEY]
        if isinstance(state, self._torch.Tensor):
            if state.dtype != self._torch.uint8:
                raise CheckpointError(f"load_state_dict: the {STATE_KEY!r} tensor must hold the "
                                      f"checkpoint bytes as uint8, got {state.dtype}")
            state = state.numpy().tobytes()
        # Check it all before anything changes: a refused state leaves the loader as it was.
        from zephon.checkpoint import decode_state
        from zephon.pipeline.proof import ResumeMismatchWarning
        from zephon.pipeline.state import check_state

        check_state(decode_state(state), self.pipe.plan())  # warns of an accepted difference
        self.close()
        self._last_it = None
        with warnings.catch_warnings():  # checked just above: say it once, not twice
            warnings.simplefilter("ignore", ResumeMismatchWarning)
            self.pipe.restore(state)
