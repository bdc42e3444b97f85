"""A tokenizer as ops hold it: by local path or by its JSON, loaded once per process.

What it owns: :class:`TokenizerRef` and :func:`tokenizers_module`.

- **What may be given.** A ``tokenizer.json`` file, a local directory holding one
  (a ``transformers`` save: its ``tokenizer_config.json`` gives ``bos_token``,
  ``eos_token`` and ``chat_template`` when present), a ``tokenizers.Tokenizer``, or a
  ``transformers`` fast tokenizer (anything with a ``backend_tokenizer``; its
  ``bos_token_id``, ``eos_token_id`` and ``chat_template`` are read). A string that is
  not an existing local path (a hub name such as ``"gpt2"``, a URL) is refused with a
  :class:`~zephon.errors.ZephonConfigError`: zephon never downloads at run time.
- **Identity.** ``identity`` is the SHA-256 of the tokenizer's JSON
  (``Tokenizer.to_str()``), so a path and an instance of the same tokenizer are the same
  tokenizer to the pipeline fingerprint, and a changed vocabulary is another.
- **Pickling.** A ref given a path pickles as the path (a worker loads the file itself
  and checks that it still has the identity it had when the pipeline was built); a ref
  given an instance pickles as its JSON. Neither pickles a Rust object, so a tokenizer
  that does not pickle (a ``transformers`` tokenizer holding a lock, say) still runs in
  process workers.
- **Lifecycle.** :meth:`TokenizerRef.get` loads the tokenizer on first use in a process,
  once per identity (a process-wide cache under a lock), with its own padding and
  truncation switched off (zephon's ops truncate and never pad, so ``encode_batch``
  gives each text what ``encode`` gives it alone). The loaded instance is never changed
  after that.
- **Threads.** One loaded instance serves every thread of the process. The Rust
  ``Tokenizer`` behind it is ``Sync`` and ``encode_batch`` takes it by shared reference
  with the GIL released; what fails under threads ("RuntimeError: Already borrowed",
  huggingface/tokenizers#537, transformers#47085) is a *mutation* (``enable_truncation``,
  ``enable_padding``, which ``transformers``' ``__call__`` makes on every call) while an
  encode is in flight. zephon calls only ``encode_batch`` on an instance it loaded itself
  and never mutates it, so threads share it safely (tested).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from typing import Any

from zephon.errors import ZephonConfigError

__all__ = ["TokenizerRef", "tokenizers_module"]

EXTRA_HINT = 'python -m pip install -e ".[text]" (in the zephon checkout)'

_LOADED: dict[str, Any] = {}
_LOAD_LOCK = threading.Lock()


def tokenizers_module():
    """The ``tokenizers`` package, or an ImportError naming the ``text`` extra."""
    try:
        import tokenizers
    except ImportError:
        raise ImportError(f"zephon's tokenize ops need the tokenizers package: "
                          f"{EXTRA_HINT}") from None
    return tokenizers


def _identity(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _config_token(config: dict, key: str) -> str | None:
    """A special token of a ``tokenizer_config.json``: a string or ``{"content": ...}``."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _resolve_path(op: str, path: str) -> tuple[str, dict]:
    """The tokenizer.json file of ``path`` and the config beside it (may be empty)."""
    if "://" in path or not os.path.exists(path):
        raise ZephonConfigError(
            f"{op}: tokenizer {path!r} is not a local file or directory; zephon never "
            "downloads a tokenizer at run time (a hub name?): download it once (for "
            "example `huggingface-cli download NAME --local-dir DIR`) and pass the local "
            "path, or pass a tokenizers.Tokenizer")
    config: dict = {}
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ZephonConfigError(f"{op}: directory {path!r} holds no tokenizer.json (only "
                                "fast tokenizers are supported)")
    cfg_file = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file, encoding="utf-8") as f:
            try:
                config = json.load(f)
            except ValueError as exc:
                raise ZephonConfigError(f"{op}: {cfg_file!r} is not JSON: {exc}") from None
    return file, config


class TokenizerRef:
    """A tokenizer by path or JSON: picklable, identified by its JSON, loaded lazily.

    Args:
        tokenizer: a local ``tokenizer.json`` path or directory, a
            ``tokenizers.Tokenizer`` or a ``transformers`` fast tokenizer.
        op: the op's name, for error messages.

    Raises:
        ZephonConfigError: not a local path (a hub name), no tokenizer.json, a file that
            does not load, or an object that is not a fast tokenizer.
        ImportError: ``tokenizers`` is missing (the ``text`` extra).
    """

    def __init__(self, tokenizer: Any, op: str = "tokenize") -> None:
        tk = tokenizers_module()
        self.path: str | None = None
        self._json: str | None = None
        #: special tokens and a chat template the tokenizer's owner declared (by name)
        self.declared: dict[str, Any] = {}
        if isinstance(tokenizer, (str, os.PathLike)):
            file, config = _resolve_path(op, os.fspath(tokenizer))
            try:
                loaded = tk.Tokenizer.from_file(file)
            except Exception as exc:  # noqa: BLE001 - the library raises plain Exceptions
                raise ZephonConfigError(f"{op}: {file!r} does not load as a tokenizer: "
                                        f"{exc}") from None
            self.path = os.path.abspath(file)
            self.declared = {k: v for k, v in (
                ("bos", _config_token(config, "bos_token")),
                ("eos", _config_token(config, "eos_token")),
                ("chat_template", config.get("chat_template"))) if v is not None}
        elif isinstance(tokenizer, tk.Tokenizer):
            loaded = tk.Tokenizer.from_str(tokenizer.to_str())
        elif isinstance(getattr(tokenizer, "backend_tokenizer", None), tk.Tokenizer):
            loaded = tk.Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
            self.declared = {k: v for k, v in (
                ("bos", getattr(tokenizer, "bos_token_id", None)),
                ("eos", getattr(tokenizer, "eos_token_id", None)),
                ("chat_template", getattr(tokenizer, "chat_template", None)))
                if v is not None}
        else:
            raise ZephonConfigError(
                f"{op}: tokenizer must be a local tokenizer.json path or directory, a "
                "tokenizers.Tokenizer or a transformers fast tokenizer, got "
                f"{type(tokenizer).__name__}")
        _normalise(loaded)
        text = loaded.to_str()
        self.identity = _identity(text)
        if self.path is None:
            self._json = text
        with _LOAD_LOCK:
            _LOADED.setdefault(self.identity, loaded)

    def __reduce__(self):
        return (_rebuild, (self.path, self._json, self.identity, self.declared))

    def get(self):
        """The loaded ``tokenizers.Tokenizer`` of this process (loaded on first use; the
        same instance for every thread; never to be changed)."""
        tok = _LOADED.get(self.identity)
        if tok is not None:
            return tok
        with _LOAD_LOCK:
            tok = _LOADED.get(self.identity)
            if tok is None:
                tok = _LOADED[self.identity] = self._load()
        return tok

    def _load(self):
        tk = tokenizers_module()
        tok = tk.Tokenizer.from_file(self.path) if self.path is not None else \
            tk.Tokenizer.from_str(self._json)
        _normalise(tok)
        if _identity(tok.to_str()) != self.identity:
            raise ZephonConfigError(f"tokenizer file {self.path!r} changed since the "
                                    "pipeline was built (its JSON has another hash)")
        return tok

    def token_id(self, op: str, what: str, value: Any) -> int:
        """``value`` (an id or a token string) as an id of this tokenizer."""
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ZephonConfigError(f"{op}: {what} must be a token id or a token string, "
                                    f"got {value!r}")
        tok = self.get()
        if isinstance(value, str):
            found = tok.token_to_id(value)
            if found is None:
                raise ZephonConfigError(f"{op}: {what} token {value!r} is not in the "
                                        "tokenizer's vocabulary")
            return int(found)
        if not 0 <= value < self.vocab_size():
            raise ZephonConfigError(f"{op}: {what} id {value} is outside the vocabulary "
                                    f"[0, {self.vocab_size()})")
        return value

    def vocab_size(self) -> int:
        """Ids the tokenizer can produce: its vocabulary with the added tokens."""
        return int(self.get().get_vocab_size(with_added_tokens=True))

    def token(self, token_id: int | None) -> str | None:
        """The token string of an id (None for None)."""
        return None if token_id is None else self.get().id_to_token(token_id)


def _normalise(tok) -> None:
    """Switch off a tokenizer's own padding and truncation (ops truncate, never pad)."""
    if tok.padding is not None:
        tok.no_padding()
    if tok.truncation is not None:
        tok.no_truncation()


def _rebuild(path, text, identity, declared) -> TokenizerRef:
    ref = TokenizerRef.__new__(TokenizerRef)
    ref.path, ref._json, ref.identity, ref.declared = path, text, identity, declared
    return ref
