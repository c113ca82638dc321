"""Hand-written tokenizers for the built-in demo models.

Nothing can be downloaded, so the demo models get a character-level CLIP BPE vocabulary
written here (no merges): every word becomes its characters, the last one marked ``</w>``.
It is a real ``CLIPTokenizer`` saved with ``save_pretrained``, so the pipelines load it
exactly as they load a downloaded tokenizer.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from transformers import CLIPTokenizer

SPECIALS = ("<|startoftext|>", "<|endoftext|>")
CHARS = string.ascii_lowercase + string.digits + string.punctuation


def vocabulary() -> dict[str, int]:
    """Token → id: the specials, then each character alone and as a word end."""
    tokens = list(SPECIALS)
    for ch in CHARS:
        tokens += [ch, ch + "</w>"]
    return {tok: i for i, tok in enumerate(tokens)}


def save_tokenizer(folder: Path, max_length: int) -> CLIPTokenizer:
    """Write vocab/merges files, build the tokenizer from them and ``save_pretrained`` it."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab_file = folder / "vocab.json"
    merges_file = folder / "merges.txt"
    vocab_file.write_text(json.dumps(vocabulary()))
    merges_file.write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(
        vocab=str(vocab_file), merges=str(merges_file), model_max_length=max_length
    )
    tokenizer.save_pretrained(folder)
    return tokenizer
