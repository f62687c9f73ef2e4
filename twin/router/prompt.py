"""Prompts as token ids, without a tokenizer, and the router's block hashes.

**Text tokenization (the emulator's, and the router's estimate).** A text prompt is encoded as UTF-8
and cut into 4-byte chunks; each chunk is one token whose id is the chunk read as a little-endian
integer modulo the vocabulary size (no modulo when the vocabulary is unknown). It is trivial,
deterministic across processes and machines, and prefix-stable: two texts that share their first
``4 * k`` bytes share their first ``k`` tokens, so a shared system prompt is a shared token prefix.
A chat request is first rendered as ``"<|role|>content\\n"`` per message (text parts concatenated).

**Block hashes.** The router hashes full blocks of ``block_size`` token ids with a chained, stable
64-bit hash (:func:`twin.policies.prng.combine_hashes` over the parent hash and the block's ids). For a
text prompt that means blocks of ``4 * block_size`` bytes of text. These hashes only need to agree
with each other (they feed the router's own approximate prefix index); they are not vLLM's hashes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from twin.policies.prng import combine_hashes

BYTES_PER_TOKEN = 4


def text_token_ids(text: str, *, vocab_size: int | None = None) -> tuple[int, ...]:
    data = text.encode("utf-8", errors="surrogatepass")
    ids = (int.from_bytes(data[i : i + BYTES_PER_TOKEN], "little") for i in range(0, len(data), BYTES_PER_TOKEN))
    if vocab_size is None:
        return tuple(ids)
    return tuple(i % vocab_size for i in ids)


def chat_text(messages: Iterable[Any]) -> str:
    """Render chat messages (objects with ``role`` and ``content``) as one prompt string."""
    parts = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        parts.append(f"<|{m.role}|>{content}\n")
    return "".join(parts)


def block_hashes(ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the full blocks of ``ids`` (a last partial block is not cacheable)."""
    out: list[int] = []
    parent = 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = combine_hashes((parent, *ids[start : start + block_size]))
        out.append(parent)
    return tuple(out)
