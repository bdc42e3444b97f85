"""Chat templates and the ``tokenize_chat`` op: tokens plus an assistant-only loss mask.

What it owns: :class:`ChatTemplate` (a conversation rendered to text, with the character
spans of the assistant's turns) and :class:`TokenizeChatOp`.

- **Samples** are ``{messages_field: [{"role": str, "content": str}, ...]}``; anything
  else is an :class:`~zephon.errors.OpError` naming the sample.
- **Templates.** ``template=None`` takes the tokenizer's own ``chat_template`` (a
  ``transformers`` tokenizer's, or its directory's ``tokenizer_config.json``), else the
  built-in ChatML (:data:`CHATML`); ``"chatml"`` asks for the built-in; any other string
  is a Jinja template, rendered as ``transformers``' ``apply_chat_template`` renders one
  (a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``; variables
  ``messages``, ``bos_token``, ``eos_token``, ``add_generation_prompt=False`` and a
  ``raise_exception`` function). Jinja comes with the ``text`` extra. The built-in
  ChatML renders each message as ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` (the
  tokenizer should have ``<|im_start|>`` and ``<|im_end|>`` as added tokens).
- **Where the assistant is.** A Jinja template is rendered on every prefix of the
  conversation: what ``messages[:i + 1]`` adds to ``messages[:i]`` is message ``i``'s
  segment (no messages render as "" when the template cannot render them; a template
  whose prefix renderings do not extend each other is refused, naming the message).
  Rendering every prefix costs time quadratic in the number of messages (long
  multi-turn traces are slow with a Jinja template); the built-in ChatML renders each
  message once. An assistant span runs from the start of the message's content in its
  segment (where a marker rendered in place of the content lands, so that text of the
  template equal to the content, the ``a`` of ``assistant``, is never taken for it) to
  the end of the segment: the content and the end-of-turn text the template puts after
  it (``<|im_end|>\\n`` in ChatML), so the model learns to stop. An
  assistant message with empty content has no span; a template that changes the content
  (so that it is not found in its segment) is refused.
- **Tokens and mask.** The rendered conversation is tokenized whole (one
  ``encode_batch`` call per dispatch part), so ``tokens`` is what the tokenizer gives the
  rendered text; ``loss_mask[t]`` is 1 when token ``t`` has a character inside an
  assistant span (by its character offsets), else 0: a token that joins the text before
  a turn to its first characters (a byte-level BPE's ``" ju"`` of ``": jumps"``) is the
  assistant's. BOS/EOS added by the op have mask 0; ``max_length`` truncates both
  arrays alike. The op declares the mask aligned with the tokens
  (:meth:`TokenizeChatOp.aligned_with`), so a packer after it (``pack_tokens``,
  ``pack_documents`` without ``aligned=``) packs the mask with the tokens.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from zephon.errors import ZephonConfigError
from zephon.pipeline.ops import StatelessOp, register
from zephon.pipeline.ops.base import PASSES_ON, Aligned
from zephon.pipeline.records import Record
from zephon.pipeline.text.tokenize import (
    TokenPolicy,
    _check_bool,
    _check_field,
    finished,
    prepared,
    sample_error,
)
from zephon.pipeline.text.tokenizer import EXTRA_HINT, TokenizerRef

__all__ = ["CHATML", "ChatTemplate", "TokenizeChatOp"]

#: The built-in template, as Jinja (what :class:`ChatTemplate` renders for ``"chatml"``,
#: without Jinja).
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n{% endfor %}")

#: What stands for an assistant's content in the rendering that locates it (private-use
#: characters no template writes).
_MARKER = "\ue000zephon:content\ue001"

_COMPILED: dict[str, Any] = {}
_COMPILE_LOCK = threading.Lock()


def _jinja(source: str):
    """``source`` compiled once per process, as ``transformers`` compiles chat templates."""
    found = _COMPILED.get(source)
    if found is not None:
        return found
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError(f"a Jinja chat template needs jinja2: {EXTRA_HINT}") from None

    def raise_exception(message):
        raise ValueError(message)

    with _COMPILE_LOCK:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        compiled = _COMPILED[source] = env.from_string(source)
    return compiled


class ChatTemplate:
    """A conversation as text plus the character spans of its assistant turns.

    Args:
        source: ``"chatml"`` (built in) or a Jinja template.
        bos_token, eos_token: the strings the template sees as ``bos_token`` and
            ``eos_token`` ("" when the tokenizer has none).
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self.builtin = source == "chatml"
        if not self.builtin:
            _jinja(source)  # a syntax error shows at construction

    @property
    def identity(self) -> str:
        text = "\0".join((self.source, self.bos_token, self.eos_token))
        return hashlib.sha256(text.encode()).hexdigest()

    def _render(self, messages: list) -> str:
        return _jinja(self.source).render(messages=messages, bos_token=self.bos_token,
                                          eos_token=self.eos_token,
                                          add_generation_prompt=False)

    def render(self, messages: list) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and its assistant spans ``[a, b)`` (characters).

        Raises:
            ValueError: the template is not prefix-stable, or changes an assistant's
                content (naming the message).
        """
        if self.builtin:
            return self._render_chatml(messages)
        spans: list[tuple[int, int]] = []
        prev = self._render_none()
        for i, message in enumerate(messages):
            cur = self._render(messages[:i + 1])
            if not cur.startswith(prev):
                raise ValueError(f"the chat template is not prefix-stable: rendering "
                                 f"messages[:{i + 1}] does not extend messages[:{i}]")
            if message["role"] == "assistant" and message["content"]:
                spans.append((self._content_at(messages, i, prev, cur), len(cur)))
            prev = cur
        return prev, spans

    def _render_none(self) -> str:
        """The rendering of no messages: "" when the template cannot render it (Qwen's
        reads ``messages[0]`` unguarded)."""
        try:
            return self._render([])
        except Exception:  # noqa: BLE001 - whatever the template raises on no messages
            return ""

    def _content_at(self, messages: list, i: int, prev: str, cur: str) -> int:
        """Where message ``i``'s content starts in ``cur`` (its prefix rendering): where
        a marker rendered in its place is (a search for the content itself could land
        on the template's text, the ``a`` of ``<|im_start|>assistant``)."""
        content = messages[i]["content"]
        marked = self._render([*messages[:i], {**messages[i], "content": _MARKER}])
        k = marked.find(_MARKER, len(prev))
        if k < 0 or marked[:k] != cur[:k] or cur[k:k + len(content)] != content:
            raise ValueError(f"the chat template changes the content of message {i} (an "
                             "assistant turn): its loss mask cannot be placed")
        return k

    @staticmethod
    def _render_chatml(messages: list) -> tuple[str, list[tuple[int, int]]]:
        parts, spans, at = [], [], 0
        for message in messages:
            head = f"<|im_start|>{message['role']}\n"
            segment = f"{head}{message['content']}<|im_end|>\n"
            if message["role"] == "assistant" and message["content"]:
                spans.append((at + len(head), at + len(segment)))
            parts.append(segment)
            at += len(segment)
        return "".join(parts), spans


def _messages(record: Record, field: str) -> list:
    """The sample's messages, checked: a list of ``{"role": str, "content": str}``."""
    value = record.value
    messages = value.get(field) if isinstance(value, Mapping) else None
    if not isinstance(messages, list):
        raise sample_error("tokenize_chat", record, f"no list of messages under {field!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or \
                not isinstance(m.get("content"), str):
            raise sample_error("tokenize_chat", record, f"message {i} is not a dict with "
                               "string 'role' and 'content'")
    return messages


def _token_string(ref: TokenizerRef, value: Any) -> str:
    """A declared special token as the string a template sees ("" when none)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return ref.token(value) or ""
    return value if isinstance(value, str) else ""


@register
class TokenizeChatOp(StatelessOp):
    """``tokenize_chat``: see the module docstring and ``Pipeline.tokenize_chat``."""

    kind = "tokenize_chat"
    batched = True

    def __init__(self, tokenizer: Any, *, template: str | None = None,
                 messages_field: str = "messages", output_field: str = "tokens",
                 mask_field: str = "loss_mask", add_bos: bool = False, add_eos: bool = False,
                 bos: Any = None, eos: Any = None, add_special_tokens: bool = False,
                 max_length: int | None = None, dtype: Any = None,
                 keep_fields: bool = False, parallelism: int = 1) -> None:
        op = self.kind
        self.tokenizer = tokenizer if isinstance(tokenizer, TokenizerRef) else \
            TokenizerRef(tokenizer, op)
        self.messages_field = _check_field(op, "messages_field", messages_field)
        self.output_field = _check_field(op, "output_field", output_field)
        self.mask_field = _check_field(op, "mask_field", mask_field)
        if self.mask_field == self.output_field:
            raise ZephonConfigError(f"{op}: mask_field and output_field are both "
                                    f"{mask_field!r}")
        self.add_special_tokens = _check_bool(op, "add_special_tokens", add_special_tokens)
        self.keep_fields = _check_bool(op, "keep_fields", keep_fields)
        self.policy = TokenPolicy(op, self.tokenizer, add_bos=add_bos, add_eos=add_eos,
                                  bos=bos, eos=eos, max_length=max_length,
                                  overflow="truncate", dtype=dtype)
        self.template = self._template(template)
        if isinstance(parallelism, bool) or not isinstance(parallelism, int) or parallelism < 1:
            raise ZephonConfigError(f"{op}: parallelism must be an int >= 1, got "
                                    f"{parallelism!r}")
        self.parallelism = parallelism

    def _template(self, template: str | None) -> ChatTemplate:
        ref = self.tokenizer
        source = template if template is not None else ref.declared.get("chat_template")
        if source is None:
            source = "chatml"
        if not isinstance(source, str) or not source:
            whose = "template" if template is not None else "the tokenizer's chat_template"
            raise ZephonConfigError(f"{self.kind}: {whose} must be 'chatml' or a Jinja "
                                    f"template string, got {source!r:.80} (pass template=)")
        try:
            return ChatTemplate(source, _token_string(ref, ref.declared.get("bos")),
                                _token_string(ref, ref.declared.get("eos")))
        except ImportError:
            raise
        except Exception as exc:  # noqa: BLE001 - Jinja's syntax errors, named
            raise ZephonConfigError(f"{self.kind}: the chat template does not compile: "
                                    f"{type(exc).__name__}: {exc}") from None

    def describe(self) -> str:
        return (f"tokenize_chat(sha256:{self.tokenizer.identity}, "
                f"template=sha256:{self.template.identity}, "
                f"messages_field={self.messages_field!r}, output_field={self.output_field!r}, "
                f"mask_field={self.mask_field!r}, add_special_tokens={self.add_special_tokens}, "
                f"{self.policy.describe()}, keep_fields={self.keep_fields})")

    def aligned_with(self, field: str) -> Aligned:
        """The mask is aligned with the tokens it makes (one value per token); another field
        goes on as it came with ``keep_fields``."""
        if field == self.output_field:
            return (self.mask_field,)
        return PASSES_ON if self.keep_fields and field != self.mask_field else ()

    def _rendered(self, record: Record) -> tuple[str, list]:
        messages = _messages(record, self.messages_field)
        try:
            return self.template.render(messages)
        except Exception as exc:
            raise sample_error(self.kind, record, f"rendering the chat template raised "
                               f"{type(exc).__name__}: {exc}") from exc

    def _row(self, encoding, spans: list) -> tuple[np.ndarray, np.ndarray]:
        ids = encoding.ids
        offsets = np.array(encoding.offsets, dtype=np.int64).reshape(len(ids), 2)
        starts, ends = offsets[:, 0], offsets[:, 1]
        inside = np.zeros(len(ids), dtype=bool)
        for a, b in spans:
            inside |= (ends > a) & (starts < b)  # a character of the token in [a, b)
        tokens = self.policy.row(ids)
        mask = np.zeros(tokens.size, dtype=np.uint8)
        start = 0 if self.policy.bos is None else 1
        kept = tokens.size - start - (self.policy.eos is not None)
        mask[start:start + kept] = inside[:kept]
        return tokens, mask

    def apply_many(self, records: list, seed: int) -> list:
        """Every conversation of a part rendered, then tokenized in one call; the first
        failing record raises after the records before it are made."""
        rendered, failure = prepared(records, self._rendered)
        encoded = self.tokenizer.get().encode_batch(
            [text for text, _ in rendered],
            add_special_tokens=self.add_special_tokens) if rendered else []
        out = []
        for r, e, (_, spans) in zip(records, encoded, rendered, strict=False):
            tokens, mask = self._row(e, spans)
            value = {self.output_field: tokens, self.mask_field: mask}
            if self.keep_fields:
                value = {**r.value, **value}
            out.append(Record(value, r.ids, r.pos, r.lin))
        return finished(out, failure)

    def apply_one(self, r: Record, seed: int) -> Record | None:
        """One record (what :meth:`apply_many` gives it in a part of its own)."""
        return self.apply_many([r], seed)[0]
