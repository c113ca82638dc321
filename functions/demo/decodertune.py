"""Fine-tuning the VAE decoder of an exported ``retouch:shapes-sd`` (``retouch train-demo
--tune-decoder``; the model itself is trained by ``train.py``), resumable, and writing the
model back with the tuned decoder in place of its own.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL
from tqdm.auto import tqdm

from retouch.functions.demo.shapes import make_sample
from retouch.functions.demo.train import (
    atomic_save,
    random_crop,
    recent,
    resolve_device,
    to_tensor,
)

log = logging.getLogger(__name__)


@dataclass
class DecoderTuning:
    """Fine-tuning the VAE decoder of an exported model, its encoder frozen.

    Why: the VAE of a short run renders some colours off (cyan reconstructs greenish, black
    greyish), and the UNet can only paint what the decoder draws. Freezing the encoder keeps
    the latent space, so the trained UNet stays valid and only the decoding improves.
    """

    steps: int = 2000
    batch: int = 16
    crop: int = 64
    lr: float = 3e-4
    seed: int = 0
    save_every: int = 100


def _decoder_crops(tuning: DecoderTuning, step: int) -> torch.Tensor:
    """Random crops of unmasked scenes (the decoder only ever decodes whole images)."""
    rng = np.random.default_rng([tuning.seed, 4, step])
    images = (
        to_tensor(make_sample(int(rng.integers(1 << 40))).image[None]) for _ in range(tuning.batch)
    )
    return torch.cat([random_crop(image, tuning.crop, rng) for image in images])


def finetune_decoder(
    folder: Path,
    out: Path,
    tuning: DecoderTuning,
    ckpt_dir: Path,
    device: str = "auto",
    progress: bool = True,
) -> dict[str, Any]:
    """Fine-tune ``folder``'s VAE decoder and write the model, otherwise unchanged, to ``out``.

    Resumable: the decoder, optimiser and step are checkpointed in ``ckpt_dir``.
    """
    where = resolve_device(device)
    vae = AutoencoderKL.from_pretrained(folder / "vae", torch_dtype=torch.float32).to(where)
    vae.requires_grad_(False)
    tuned = [*vae.decoder.parameters(), *vae.post_quant_conv.parameters()]
    for p in tuned:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(tuned, lr=tuning.lr, weight_decay=0.0)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    state_path = ckpt_dir / "decoder.pt"
    step, history = 0, []
    if state_path.exists():
        state = torch.load(state_path, map_location=where, weights_only=False)
        vae.load_state_dict(state["vae"])
        opt.load_state_dict(state["opt"])
        step, history = state["step"], state["history"]
    vae.decoder.train()
    bar = tqdm(total=tuning.steps, initial=step, desc="decoder", disable=not progress)
    while step < tuning.steps:
        images = _decoder_crops(tuning, step).to(where)
        with torch.no_grad():
            z = vae.encode(images).latent_dist.mode()
        recon = vae.decode(z).sample
        loss = F.l1_loss(recon, images) + 0.5 * F.mse_loss(recon, images)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tuned, 1.0)
        opt.step()
        step += 1
        history.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{recent(history):.4f}")
        if step % tuning.save_every == 0 or step == tuning.steps:
            state = {"vae": vae.state_dict(), "opt": opt.state_dict(), "step": step}
            atomic_save({**state, "history": history}, state_path)
    bar.close()
    summary = {
        "decoder_finetune": {
            **asdict(tuning),
            "loss_first100": recent(history[:100], 100),
            "loss_last100": recent(history, 100),
        }
    }
    _export_with_vae(folder, out, vae.eval(), summary)
    return summary


def _export_with_vae(folder: Path, out: Path, vae: AutoencoderKL, extra: dict[str, Any]) -> None:
    """Copy ``folder`` to ``out`` with ``vae`` (fp16) in place of its own, atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".export-", dir=out.parent) as tmp:
        staged = Path(tmp) / "model"
        shutil.copytree(folder, staged)
        shutil.rmtree(staged / "vae")
        copy.deepcopy(vae).half().cpu().save_pretrained(staged / "vae", safe_serialization=True)
        config_path = staged / "vae" / "config.json"
        config = json.loads(config_path.read_text())
        config.pop("_name_or_path", None)  # where it was loaded from: not part of the model
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        info_path = staged / "training.json"
        info = json.loads(info_path.read_text()) if info_path.exists() else {}
        info_path.write_text(json.dumps({**info, **extra}, indent=2) + "\n")
        if out.exists():
            os.rename(out, Path(tmp) / "old")
        os.rename(staged, out)
    log.info("exported %s with a fine-tuned decoder to %s", folder, out)
