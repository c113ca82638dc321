"""Hand-written tokenizers for the built-in demo models.

Nothing can be downloaded, so the demo models get a character-level CLIP BPE vocabulary
written here (no merges): every word becomes its characters, the last one marked ``</w>``.
It is a real ``CLIPTokenizer`` saved with ``save_pretrained``, so the pipelines load it
exactly as they load a downloaded tokenizer.

A trained model may also name whole ``words``: BPE merges are added so each of those words
becomes one token (a small text encoder then learns words instead of spelling), while any
other word still falls back to its characters.
"""

from __future__ import annotations

import itertools
import json
import string
from pathlib import Path

from transformers import CLIPTokenizer, PreTrainedTokenizerBase

SPECIALS = ("<|startoftext|>", "<|endoftext|>")
CHARS = string.ascii_lowercase + string.digits + string.punctuation


def vocabulary() -> dict[str, int]:
    """Token → id: the specials, then each character alone and as a word end."""
    tokens = list(SPECIALS)
    for ch in CHARS:
        tokens += [ch, ch + "</w>"]
    return {tok: i for i, tok in enumerate(tokens)}


def _bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """CLIP's BPE on one word: repeatedly merge every occurrence of the best-ranked pair."""
    while len(symbols) > 1:
        pairs = [(ranks.get(p, 1 << 30), p) for p in itertools.pairwise(symbols)]
        rank, best = min(pairs)
        if rank == 1 << 30:
            break
        merged: list[str] = []
        i = 0
        while i < len(symbols):
            if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                merged.append(symbols[i] + symbols[i + 1])
                i += 2
            else:
                merged.append(symbols[i])
                i += 1
        symbols = merged
    return symbols


def word_merges(words: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """Merges that make each of ``words`` a single token.

    Each word gets the merge of its first two remaining symbols until it is one token. A
    merge appended later ranks after every earlier one, so it never changes how an already
    finished word is split: words are added one at a time without disturbing each other.
    """
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for word in words:
        while len(symbols := _bpe([*word[:-1], word[-1] + "</w>"], ranks)) > 1:
            pair = (symbols[0], symbols[1])
            ranks[pair] = len(merges)
            merges.append(pair)
    return merges


def save_tokenizer(folder: Path, max_length: int, words: tuple[str, ...] = ()) -> CLIPTokenizer:
    """Write vocab/merges files, build the tokenizer from them and ``save_pretrained`` it.

    With ``words`` (lowercase letters only), each of them is one token (see ``word_merges``).
    """
    folder.mkdir(parents=True, exist_ok=True)
    vocab_file = folder / "vocab.json"
    merges_file = folder / "merges.txt"
    vocab = vocabulary()
    merges = word_merges(words)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    vocab_file.write_text(json.dumps(vocab))
    merges_file.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    tokenizer = CLIPTokenizer(
        vocab=str(vocab_file), merges=str(merges_file), model_max_length=max_length
    )
    tokenizer.save_pretrained(folder)
    return tokenizer


# Qwen's chat markers and end of text; Z-Image's pipeline wraps every prompt in the chat
# template before tokenizing it.
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_tokenizer(max_length: int) -> PreTrainedTokenizerBase:
    """A byte-level ``Qwen2Tokenizer`` built in memory (no merges: every byte is a token),
    with Qwen's specials and the chat template Qwen3's renders for one user turn (what
    ``enable_thinking=True`` gives). Saved with its pipeline, it loads as a downloaded one."""
    from tokenizers import AddedToken
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([*alphabet, *QWEN_SPECIALS])}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=max_length)
    tokenizer.add_tokens([AddedToken(t, special=True) for t in QWEN_SPECIALS[1:]])
    tokenizer.padding_side = "right"
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer
