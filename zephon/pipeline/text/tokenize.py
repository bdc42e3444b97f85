"""The ``tokenize`` op: a whole dispatch part through one ``encode_batch`` call.

What it owns: :class:`TokenizeOp` and the options every tokenize op shares
(:class:`TokenPolicy`: BOS/EOS, truncation, dtype).

- **Batched.** The op is *batched* (``batched = True``): a stage program hands it every
  record of a dispatch part at once (:meth:`TokenizeOp.apply_many`, see
  :meth:`~zephon.pipeline.program.StageProgram.run_ops`), and it tokenizes them in order
  with ``encode_batch_fast`` calls of :data:`ENCODE_SLICE` texts (a whole part in one call
  outgrew the CPU cache and cost up to 1.5x the CPU per text), which run in Rust with the
  GIL released (the
  threads runner gains from it) and, unless ``TOKENIZERS_PARALLELISM`` is off, on the
  tokenizer's own thread pool. It is still a per-sample op: sample ``i``'s output depends
  on sample ``i`` alone (the tokenizer's padding is switched off,
  :mod:`~zephon.pipeline.text.tokenizer`), so how the dispatch cuts parts, the runner and
  the worker count never change the stream, and it equals the tokenizer called sample by
  sample.
- **Output.** ``{output_field: ndarray}`` per sample (the input's other fields too with
  ``keep_fields=True``): ``[bos] + ids + [eos]`` with the ids of ``encode(text,
  add_special_tokens=...)``; with ``max_length`` and ``overflow="truncate"`` the ids are
  cut so that the whole row, BOS and EOS included, has at most ``max_length`` tokens.
  The dtype is ``uint16`` when every id fits, else ``int32``, or the one given.
- **Fields.** It makes ``output_field``, with no field aligned with it
  (:meth:`TokenizeOp.aligned_with`); with ``keep_fields=True`` the input's other fields
  go on as they came.
- **Errors.** A sample without the text field, or whose text is not a string, is an
  :class:`~zephon.errors.OpError` naming the op and the sample; the records before it go
  on first, as for any op.
- **Identity.** :meth:`TokenizeOp.describe` (the pipeline fingerprint) names the
  tokenizer by the hash of its JSON and every option, never an object id.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

from zephon.errors import OpError, ZephonConfigError
from zephon.pipeline.ops import StatelessOp, register
from zephon.pipeline.ops.base import PASSES_ON, Aligned
from zephon.pipeline.records import Record
from zephon.pipeline.text.tokenizer import TokenizerRef
from zephon.transport.failure import UnitFailure, Unwind

__all__ = ["ENCODE_SLICE", "TokenPolicy", "TokenizeOp", "sample_error"]

OVERFLOWS = ("keep", "truncate")
#: Texts per ``encode_batch`` call. A part of a process worker holds hundreds of texts
#: (dispatch parts aim at megabytes of output); encoded in one call, their ``Encoding``
#: objects (ids, offsets, token strings: tens of bytes per token) outgrow the core's cache
#: and every text cost more: on 4,000 documents of ~400 tokens, one CPU, 2.2-2.6 s in
#: calls of 32 texts against 2.5-3.7 s in calls of 512 (``bench/compare_lm.py``'s
#: corpus). 32 texts still give the tokenizer's own thread pool, when it is on, work to
#: share.
ENCODE_SLICE = 32


def sample_error(op: str, record: Record, what: str) -> OpError:
    """An OpError of ``op`` naming ``record``'s sample."""
    sid = record.ids[0]
    return OpError(f"op {op} failed on sample {sid}: {what}", op=op, sample_id=sid)


def prepared(records: list, prepare: Callable[[Record], Any]) -> tuple[list, OpError | None]:
    """``prepare`` of each record of a part, up to the first that fails: what was prepared
    and that failure (None when every record was). A batched op tokenizes what was
    prepared, then :func:`finished` raises the failure after the records made before it."""
    done: list = []
    for r in records:
        try:
            done.append(prepare(r))
        except OpError as exc:
            return done, exc
    return done, None


def finished(out: list, failure: OpError | None) -> list:
    """``out`` when every record was prepared; else the unit ends with ``failure`` and
    ``out`` (the records before the failing one, which go on ahead of the error), carried
    up to the stage program by :class:`~zephon.transport.failure.Unwind`."""
    if failure is not None:
        raise Unwind(UnitFailure(failure, out))
    return out


def _check_bool(op: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ZephonConfigError(f"{op}: {name} must be True or False, got {value!r}")
    return value


def _check_field(op: str, name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ZephonConfigError(f"{op}: {name} must be a non-empty string, got {value!r}")
    return value


class TokenPolicy:
    """BOS/EOS, truncation and dtype of a tokenize op, resolved against its tokenizer.

    ``bos``/``eos``: an id or a token string; None takes the tokenizer's own (declared by
    a ``transformers`` tokenizer or its ``tokenizer_config.json``); asked for
    (``add_bos``/``add_eos``) and known nowhere is a ZephonConfigError."""

    def __init__(self, op: str, ref: TokenizerRef, *, add_bos: bool, add_eos: bool,
                 bos: Any, eos: Any, max_length: int | None, overflow: str,
                 dtype: Any) -> None:
        _check_bool(op, "add_bos", add_bos)
        _check_bool(op, "add_eos", add_eos)
        self.bos = self._special(op, ref, "bos", bos) if add_bos else None
        self.eos = self._special(op, ref, "eos", eos) if add_eos else None
        specials = (self.bos is not None) + (self.eos is not None)
        if max_length is not None and (isinstance(max_length, bool) or
                                       not isinstance(max_length, int) or
                                       max_length <= specials):
            raise ZephonConfigError(f"{op}: max_length must be None or an int > {specials} "
                                    f"(the BOS/EOS it holds), got {max_length!r}")
        if overflow not in OVERFLOWS:
            raise ZephonConfigError(f"{op}: overflow must be one of {OVERFLOWS}, got "
                                    f"{overflow!r}")
        self.max_length, self.overflow = max_length, overflow
        #: content tokens a row keeps (None: all of them)
        self.limit = max_length - specials if max_length is not None and \
            overflow == "truncate" else None
        self.dtype = self._dtype(op, ref, dtype)

    @staticmethod
    def _special(op: str, ref: TokenizerRef, what: str, given: Any) -> int:
        value = given if given is not None else ref.declared.get(what)
        if value is None:
            raise ZephonConfigError(
                f"{op}: add_{what}=True but the tokenizer declares no {what.upper()} token: "
                f"pass {what}=ID or {what}='<token>'")
        return ref.token_id(op, what, value)

    @staticmethod
    def _dtype(op: str, ref: TokenizerRef, dtype: Any) -> np.dtype:
        top = ref.vocab_size() - 1
        if dtype is None:
            return np.dtype(np.uint16 if top <= np.iinfo(np.uint16).max else np.int32)
        try:
            chosen = np.dtype(dtype)
        except TypeError:
            chosen = None
        if chosen is None or chosen.kind not in "iu":
            raise ZephonConfigError(f"{op}: dtype must be a NumPy integer dtype, got "
                                    f"{dtype!r}")
        if np.iinfo(chosen).max < top:
            raise ZephonConfigError(f"{op}: dtype {chosen} cannot hold the tokenizer's ids "
                                    f"(up to {top})")
        return chosen

    def describe(self) -> str:
        return (f"bos={self.bos}, eos={self.eos}, max_length={self.max_length}, "
                f"overflow={self.overflow!r}, dtype={self.dtype.str}")

    def row(self, ids: list) -> np.ndarray:
        """``[bos] + ids + [eos]`` as an array, the ids cut to the row's limit."""
        if self.limit is not None and len(ids) > self.limit:
            ids = ids[:self.limit]
        bos, eos = self.bos, self.eos
        if bos is None and eos is None:
            return np.array(ids, dtype=self.dtype)
        start = 0 if bos is None else 1
        out = np.empty(len(ids) + start + (eos is not None), dtype=self.dtype)
        out[start:start + len(ids)] = ids
        if bos is not None:
            out[0] = bos
        if eos is not None:
            out[-1] = eos
        return out


@register
class TokenizeOp(StatelessOp):
    """``tokenize``: see the module docstring and ``Pipeline.tokenize``."""

    kind = "tokenize"
    #: a stage program hands the op a whole dispatch part (``apply_many``)
    batched = True

    def __init__(self, tokenizer: Any, *, text_field: str = "text",
                 output_field: str = "tokens", add_bos: bool = False, add_eos: bool = False,
                 bos: Any = None, eos: Any = None, add_special_tokens: bool = False,
                 max_length: int | None = None, overflow: str = "truncate",
                 dtype: Any = None, keep_fields: bool = False, parallelism: int = 1) -> None:
        op = self.kind
        self.tokenizer = tokenizer if isinstance(tokenizer, TokenizerRef) else \
            TokenizerRef(tokenizer, op)
        self.text_field = _check_field(op, "text_field", text_field)
        self.output_field = _check_field(op, "output_field", output_field)
        self.add_special_tokens = _check_bool(op, "add_special_tokens", add_special_tokens)
        self.keep_fields = _check_bool(op, "keep_fields", keep_fields)
        self.policy = TokenPolicy(op, self.tokenizer, add_bos=add_bos, add_eos=add_eos,
                                  bos=bos, eos=eos, max_length=max_length, overflow=overflow,
                                  dtype=dtype)
        if isinstance(parallelism, bool) or not isinstance(parallelism, int) or parallelism < 1:
            raise ZephonConfigError(f"{op}: parallelism must be an int >= 1, got "
                                    f"{parallelism!r}")
        self.parallelism = parallelism

    def describe(self) -> str:
        return (f"tokenize(sha256:{self.tokenizer.identity}, "
                f"text_field={self.text_field!r}, output_field={self.output_field!r}, "
                f"add_special_tokens={self.add_special_tokens}, {self.policy.describe()}, "
                f"keep_fields={self.keep_fields})")

    def aligned_with(self, field: str) -> Aligned:
        """No field is aligned with the tokens it makes; another field goes on as it came
        with ``keep_fields`` (else the op's output has none)."""
        if field == self.output_field:
            return ()
        return PASSES_ON if self.keep_fields else ()

    def _text(self, record: Record) -> str:
        value = record.value
        if isinstance(value, str):
            return value
        if not isinstance(value, Mapping):
            raise sample_error(self.kind, record, f"the sample is a {type(value).__name__}, "
                               f"not a dict with a {self.text_field!r} field or a string")
        if self.text_field not in value:
            raise sample_error(self.kind, record, f"no text field {self.text_field!r} "
                               f"(fields: {sorted(map(str, value))[:8]})")
        text = value[self.text_field]
        if not isinstance(text, str):
            raise sample_error(self.kind, record, f"field {self.text_field!r} is a "
                               f"{type(text).__name__}, not a string")
        return text

    def _value(self, value: Any, tokens: np.ndarray) -> dict:
        if self.keep_fields and isinstance(value, Mapping):
            return {**value, self.output_field: tokens}
        return {self.output_field: tokens}

    def apply_many(self, records: list, seed: int) -> list:
        """Every record of a part tokenized with ``encode_batch`` calls of at most
        :data:`ENCODE_SLICE` texts, in order; the first failing record raises after the
        records before it are made (they ride on the error)."""
        texts, failure = prepared(records, self._text)
        encode, special = self.tokenizer.get().encode_batch_fast, self.add_special_tokens
        row, make = self.policy.row, self._value
        out: list = []
        for a in range(0, len(texts), ENCODE_SLICE):
            # the slice's Encoding objects die before the next slice is encoded
            chunk = texts[a:a + ENCODE_SLICE]
            encoded = encode(chunk, add_special_tokens=special)
            out += [Record(make(r.value, row(e.ids)), r.ids, r.pos, r.lin)
                    for r, e in zip(records[a:a + len(chunk)], encoded, strict=True)]
        return finished(out, failure)

    def apply_one(self, r: Record, seed: int) -> Record | None:
        """One record (what :meth:`apply_many` gives it in a part of its own)."""
        return self.apply_many([r], seed)[0]
