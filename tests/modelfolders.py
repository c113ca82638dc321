"""Model folders laid out exactly as users have them, built offline for the loading tests.

* :func:`build_sd_folder`: a hub-layout Stable Diffusion inpainting folder with real CLIP
  BPE tokenizer files (``vocab.json`` + ``merges.txt``, 77 tokens), fp16-variant weights, a
  sharded UNet with its index, a feature extractor, and a safety checker that is declared
  but not shipped (as in ``runwayml``-style repos whose users load without it).
* :func:`build_flux_folder`: a hub-layout Flux inpainting folder, its T5 tokenizer a
  sentencepiece model (``tokenizer_2/spiece.model``) trained offline, its transformer
  sharded.
* :func:`into_hub_cache`: a folder copied into a Hugging Face cache as ``huggingface_hub``
  lays it out (``models--org--name/blobs``, ``snapshots/<commit>`` of links, ``refs/main``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from diffusers import DiffusionPipeline, FluxInpaintPipeline, StableDiffusionInpaintPipeline
from transformers import (
    CLIPImageProcessor,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

from retouch.functions.demo.models import ensure_demo_model
from retouch.runtime.models import load_pipeline

CLIP_LENGTH = 77
SPECIAL = ("<|startoftext|>", "<|endoftext|>")
MERGES = ("a n", "t h", "th e</w>", "an d</w>", "r e", "o n</w>", "i n", "in g</w>")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _byte_chars() -> list[str]:
    """GPT-2 / CLIP ``bytes_to_unicode``: one printable character per byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def clip_tokenizer_files(folder: Path) -> int:
    """Write a CLIP BPE tokenizer as the hub ships one; its vocabulary size."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens = [*_byte_chars(), *(c + "</w>" for c in _byte_chars())]
    tokens += ["".join(m.split()) for m in MERGES] + list(SPECIAL)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    config = {
        "model_max_length": CLIP_LENGTH,
        "bos_token": SPECIAL[0],
        "eos_token": SPECIAL[1],
        "unk_token": SPECIAL[1],
        "pad_token": SPECIAL[1],
        "do_lower_case": True,
        "tokenizer_class": "CLIPTokenizer",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return len(tokens)


def t5_tokenizer(folder: Path, length: int = 512) -> int:
    """Train a small sentencepiece model offline into ``folder/spiece.model``; its size."""
    import sentencepiece

    folder.mkdir(parents=True, exist_ok=True)
    corpus = [
        "a red circle on a blue square",
        "the quick brown fox jumps over the lazy dog",
        "paint a yellow triangle in the masked region",
        "a photo of a cat sitting on a green sofa",
    ] * 20
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_prefix=str(folder / "spiece"),
        vocab_size=40,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        minloglevel=2,
    )
    (folder / "spiece.vocab").unlink()
    config = {"model_max_length": length, "tokenizer_class": "T5Tokenizer", "extra_ids": 0}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return 40


def _clip_encoder(vocab: int, hidden: int) -> CLIPTextModel:
    """A small CLIP text encoder over the real tokenizer's vocabulary and 77 positions."""
    with torch.random.fork_rng():
        torch.manual_seed(5)
        return CLIPTextModel(
            CLIPTextConfig(
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=CLIP_LENGTH,
                bos_token_id=vocab - 2,
                eos_token_id=vocab - 1,
                pad_token_id=vocab - 1,
            )
        ).eval()


def _save_hub_layout(
    pipe: DiffusionPipeline,
    target: Path,
    denoiser: str,
    tokenizers: dict[str, Path],
    shard_size: str = "300KB",
) -> None:
    """fp16-variant weights, the denoiser sharded with its index, and each tokenizer folder
    as written by hand (``tokenizers``: component name -> its files)."""
    pipe.to(torch.float16).save_pretrained(target, variant="fp16")
    (target / denoiser / "diffusion_pytorch_model.fp16.safetensors").unlink()
    getattr(pipe, denoiser).save_pretrained(
        target / denoiser, variant="fp16", max_shard_size=shard_size
    )
    for name, files in tokenizers.items():
        shutil.rmtree(target / name)
        shutil.copytree(files, target / name)
        shutil.rmtree(files)


def build_sd_folder(target: Path, models_dir: Path) -> Path:
    """The hub-layout SD inpainting folder (see the module docstring), from ``tiny-sd``'s
    UNet, VAE and scheduler with a 77-position CLIP text encoder over the real tokenizer."""
    tiny = load_pipeline(
        ensure_demo_model("retouch:tiny-sd", models_dir), "sd-inpaint", torch.device("cpu")
    )
    clip = target.parent / f".{target.name}-clip"
    vocab = clip_tokenizer_files(clip)
    pipe = StableDiffusionInpaintPipeline(
        vae=tiny.vae,
        text_encoder=_clip_encoder(vocab, tiny.text_encoder.config.hidden_size),
        tokenizer=CLIPTokenizer.from_pretrained(clip),
        unet=tiny.unet,
        scheduler=tiny.scheduler,
        safety_checker=None,
        feature_extractor=CLIPImageProcessor(),
        requires_safety_checker=False,
    )
    _save_hub_layout(pipe, target, "unet", {"tokenizer": clip})
    index = json.loads((target / "model_index.json").read_text())
    index["safety_checker"] = ["stable_diffusion", "StableDiffusionSafetyChecker"]
    (target / "model_index.json").write_text(json.dumps(index, indent=2))
    return target


def build_flux_folder(target: Path, models_dir: Path) -> Path:
    """A hub-layout Flux inpainting folder: ``tiny-flux``'s transformer (sharded) and VAE,
    a CLIP text encoder over the real BPE tokenizer (77 tokens) and a T5 encoder over a
    sentencepiece tokenizer (``tokenizer_2/spiece.model``, 512 tokens)."""
    tiny = load_pipeline(
        ensure_demo_model("retouch:tiny-flux", models_dir), "flux-inpaint", torch.device("cpu")
    )
    clip, t5 = target.parent / f".{target.name}-clip", target.parent / f".{target.name}-t5"
    vocab = clip_tokenizer_files(clip)
    t5_vocab = t5_tokenizer(t5)
    hidden = tiny.text_encoder_2.config.d_model
    with torch.random.fork_rng():
        torch.manual_seed(6)
        config = T5Config(
            vocab_size=t5_vocab,
            d_model=hidden,
            d_kv=hidden // 2,
            d_ff=2 * hidden,
            num_layers=2,
            num_heads=2,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
        encoder_2 = T5EncoderModel(config).eval()
    pipe = FluxInpaintPipeline(
        scheduler=tiny.scheduler,
        vae=tiny.vae,
        text_encoder=_clip_encoder(vocab, tiny.text_encoder.config.hidden_size),
        tokenizer=CLIPTokenizer.from_pretrained(clip),
        text_encoder_2=encoder_2,
        tokenizer_2=T5Tokenizer.from_pretrained(t5),
        transformer=tiny.transformer,
    )
    tokenizers = {"tokenizer": clip, "tokenizer_2": t5}
    _save_hub_layout(pipe, target, "transformer", tokenizers, shard_size="40KB")
    return target


def into_hub_cache(folder: Path, cache: Path, repo_id: str, commit: str = COMMIT) -> Path:
    """Copy ``folder`` into the hub cache ``cache`` as ``huggingface_hub`` stores a
    download: content-addressed blobs, a snapshot of relative links, ``refs/main``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / path.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
