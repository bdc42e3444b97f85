"""Text ops: ``tokenize`` and ``tokenize_chat`` over Hugging Face fast tokenizers.

- :mod:`~zephon.pipeline.text.tokenizer`: :class:`TokenizerRef`, a tokenizer given by a
  local path or an instance, picklable through its JSON, loaded once per process;
- :mod:`~zephon.pipeline.text.tokenize`: the ``tokenize`` op (batched ``encode_batch``
  over a whole dispatch part, BOS/EOS, truncation, dtype);
- :mod:`~zephon.pipeline.text.chat`: chat templates and the ``tokenize_chat`` op
  (tokens plus an assistant-only ``loss_mask``).

The ``tokenizers`` package is optional (the ``text`` extra); nothing here imports it
before a tokenizer is given.
"""
