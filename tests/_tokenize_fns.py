"""A tiny BPE trained in the test (seconds, never a download) and its corpus.

Module level so process workers import it (tests/ is on their path).
"""

from __future__ import annotations

import json
import os

import numpy as np

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
         "boxing matches under pale moonlight and nobody asks why").split()


def corpus(n: int, seed: int = 0) -> list[str]:
    """``n`` documents of 3 to 120 words (some long enough to truncate)."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(3, 120)))) for _ in range(n)]


def train_tokenizer(directory: str, vocab_size: int = 300, config: bool = True) -> str:
    """A byte-level BPE saved as ``directory/tokenizer.json`` (and, with ``config``, a
    ``tokenizer_config.json`` naming ``<s>``/``</s>``); returns the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(400, seed=99), trainer=trainer)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    if config:
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": "<s>", "eos_token": {"content": "</s>"}}, f)
    return directory


def text_sample(i: int) -> dict:
    return {"id": i, "text": corpus(1, seed=i)[0]}


def upper(sample: dict) -> dict:
    return {**sample, "text": sample["text"].upper()}


def fail_on_seven(sample: dict) -> dict:
    if sample["id"] == 7:
        raise ValueError("seven")
    return sample


def text_or_missing(i: int) -> dict:
    """Sample 3 has no text field."""
    return {"id": i} if i == 3 else text_sample(i)


def text_or_missing_at_40(i: int) -> dict:
    """Sample 40 (in the second encode slice of a part) has no text field."""
    return {"id": i} if i == 40 else text_sample(i)


class LockedFastTokenizer:
    """Shaped as a ``transformers`` fast tokenizer (``backend_tokenizer``, special ids,
    ``chat_template``) and, like one holding a lock, not picklable."""

    def __init__(self, path: str, chat_template: str | None = None) -> None:
        import threading

        from tokenizers import Tokenizer

        self.backend_tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        self.bos_token_id = self.backend_tokenizer.token_to_id("<s>")
        self.eos_token_id = self.backend_tokenizer.token_to_id("</s>")
        self.chat_template = chat_template
        self._lock = threading.Lock()


def rayon_threads(sample: dict) -> dict:
    return {**sample, "rayon": os.environ.get("RAYON_NUM_THREADS")}
