"""Train ``retouch:shapes-sd``: a small SD-style inpainting model on the procedural shapes set.

No diffusion weights can be downloaded here, so the trained demo model is trained from
scratch with diffusers' and transformers' own classes, in three resumable phases:

1. ``vae``: a small ``AutoencoderKL`` (8x down, 4 latent channels) on 64 px crops of the
   scenes and of masked scenes (the pipeline encodes masked images too); L1 + a tiny KL.
2. ``encode``: a fixed set of samples (scene, mask, captions) is encoded once with the frozen
   VAE, image and masked-image latents, so the UNet phase never runs the VAE.
3. ``unet``: a 9-channel ``UNet2DConditionModel`` and a small ``CLIPTextModel`` (on the demo
   tokenizer with the data set's words as tokens) trained jointly with the epsilon objective
   on a DDPM schedule (min-SNR weighting), captions dropped for classifier-free guidance,
   with an EMA of both; the EMA weights are exported.

Every random draw is a function of the seed and the step, so a run resumed from its
checkpoint continues exactly as an uninterrupted run would. ``export`` writes the
``StableDiffusionInpaintPipeline`` folder in fp16 safetensors with ``save_pretrained``.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DDPMScheduler,
    StableDiffusionInpaintPipeline,
    UNet2DConditionModel,
)
from tqdm.auto import tqdm
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from retouch.functions.demo.shapes import SIZE, WORDS, make_sample
from retouch.functions.demo.tokenizer import save_tokenizer

log = logging.getLogger(__name__)

TEXT_LEN = 16  # "a red star and a green ring on a blue striped background" is 14 tokens
TEXT_HIDDEN = 64
VAE_CHANNELS = (16, 32, 64, 64)  # 3 downsamplings: 128 px -> 16x16 latents
UNET_CHANNELS = (64, 128, 128)
UNET_HEADS = 4
# The SD noise schedule; the exported DDIM scheduler has the same betas.
SCHEDULE = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
MIN_SNR_GAMMA = 5.0


@dataclass
class TrainConfig:
    """Every knob of a run; stored in the checkpoint and in the exported folder."""

    seed: int = 0
    vae_steps: int = 600
    vae_batch: int = 16
    vae_crop: int = 64
    vae_lr: float = 1e-3
    samples: int = 8000  # pre-encoded (scene, mask) pairs the UNet trains on
    unet_steps: int = 4000
    batch: int = 32
    lr: float = 5e-4
    warmup: int = 200
    cond_dropout: float = 0.1
    ema_decay: float = 0.999
    save_every: int = 100
    export_every: int = 0  # also export the EMA weights every N UNet steps (0: at the end)
    max_minutes: float = 0.0  # stop the UNet phase after this much wall time (0: no limit)
    # Loss weight of the latent pixels under the inpainting mask (1: uniform). Outside the
    # mask the masked-image input gives the answer away; inside, the caption must.
    mask_weight: float = 1.0


def make_tokenizer(folder: Path) -> CLIPTokenizer:
    """The demo character tokenizer with every data-set word as one token."""
    return save_tokenizer(folder, TEXT_LEN, WORDS)


def build_vae() -> AutoencoderKL:
    """The VAE, started nearly deterministic: posterior log-variance -12 (std 0.0025).

    From the usual start (log-variance 0, std 1) the decoder first sees latents drowned in
    unit noise, and with the tiny KL weight of SD-style VAEs the encoder needs thousands of
    steps to shrink it (measured: L1+MSE stuck at ~0.45 after 400 steps). Zeroing the
    log-variance rows of ``quant_conv`` removes that wait; the pipeline still samples the
    posterior, now with negligible noise.
    """
    n = len(VAE_CHANNELS)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=VAE_CHANNELS,
        layers_per_block=1,
        latent_channels=4,
        # Groups of several channels: with one channel a group (GroupNorm = instance norm)
        # every flat region's absolute colour is normalised away (measured: hues lost).
        norm_num_groups=4,
        sample_size=SIZE,
    )
    with torch.no_grad():
        logvar = slice(4, 8)
        vae.quant_conv.weight[logvar] = 0.0
        vae.quant_conv.bias[logvar] = -12.0
    return vae


def build_text_encoder(vocab_size: int) -> CLIPTextModel:
    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=TEXT_HIDDEN,
        intermediate_size=TEXT_HIDDEN * 2,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=TEXT_LEN,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        projection_dim=TEXT_HIDDEN,
    )
    return CLIPTextModel(config)


def build_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=SIZE // 8,
        in_channels=9,  # noisy latents + mask + masked-image latents
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=UNET_CHANNELS,
        layers_per_block=1,
        cross_attention_dim=TEXT_HIDDEN,
        attention_head_dim=UNET_HEADS,  # diffusers' legacy name: the number of heads
        norm_num_groups=8,  # 8-16 channels a group, so colour survives (see build_vae)
    )


def inference_scheduler() -> DDIMScheduler:
    """The scheduler shipped with the model (as the random-weight demo models use)."""
    return DDIMScheduler(
        **SCHEDULE,
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        num_train_timesteps=1000,
    )


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float [B, 3, H, W] in [-1, 1], as the pipeline's preprocessing."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def random_crop(image: torch.Tensor, size: int, rng: np.random.Generator) -> torch.Tensor:
    """A ``size`` px crop at a random position on the 8 px latent grid (convolutions don't
    care about the image size, and 64 px crops train the VAE ~4x faster)."""
    y, x = (int(v) for v in rng.integers(0, SIZE - size + 1, 2) // 8 * 8)
    return image[:, :, y : y + size, x : x + size]


def _masked(images: torch.Tensor, masks: np.ndarray) -> torch.Tensor:
    """The pipeline's masked image: repainted pixels set to 0 (mid grey)."""
    keep = torch.from_numpy(~masks)[:, None].float()
    return images * keep


def atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class Trainer:
    """Runs the phases, checkpointing to ``ckpt_dir`` so any phase can be resumed."""

    def __init__(
        self,
        config: TrainConfig,
        ckpt_dir: Path,
        out: Path,
        device: torch.device | str,
        progress: bool = True,
        warm_start: Path | None = None,
    ) -> None:
        self.cfg = config
        self.ckpt_dir = ckpt_dir
        self.out = out
        self.device = torch.device(device)
        self.progress = progress
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer = make_tokenizer(ckpt_dir / "tokenizer")
        self.vae = build_vae().to(device)
        self.text = build_text_encoder(len(self.tokenizer)).to(device)
        self.unet = build_unet().to(device)
        self.ema_text = copy.deepcopy(self.text).requires_grad_(False)
        self.ema_unet = copy.deepcopy(self.unet).requires_grad_(False)
        self.vae_step = 0
        self.unet_step = 0
        self.history: dict[str, list[float]] = {"vae": [], "unet": []}
        self.warm_start: dict[str, Any] | None = None  # what the UNet phase started from
        self.noise = DDPMScheduler(**SCHEDULE, num_train_timesteps=1000)
        self.vae_opt = torch.optim.AdamW(self.vae.parameters(), lr=config.vae_lr, weight_decay=0.0)
        self.opt = torch.optim.AdamW(
            [*self.unet.parameters(), *self.text.parameters()], lr=config.lr, weight_decay=1e-2
        )
        self.latents: dict[str, Any] | None = None
        if warm_start is not None and not self.state_path.exists():
            self._warm_start(warm_start)
        self._load()

    def _warm_start(self, folder: Path) -> None:
        """Start from an exported model (its EMA weights, fp16 widened to fp32) instead of a
        fresh initialisation; the VAE phase counts as done (its weights are the folder's)."""
        fp32 = {"torch_dtype": torch.float32}
        self.vae.load_state_dict(AutoencoderKL.from_pretrained(folder / "vae", **fp32).state_dict())
        self.vae.register_to_config(
            scaling_factor=AutoencoderKL.load_config(folder / "vae")["scaling_factor"]
        )
        text = CLIPTextModel.from_pretrained(folder / "text_encoder", **fp32).state_dict()
        unet = UNet2DConditionModel.from_pretrained(folder / "unet", **fp32).state_dict()
        for live, ema, weights in (
            (self.text, self.ema_text, text),
            (self.unet, self.ema_unet, unet),
        ):
            live.load_state_dict(weights)
            ema.load_state_dict(weights)
        self.vae_step = self.cfg.vae_steps
        self.vae.eval()
        info = folder / "training.json"
        self.warm_start = {
            "folder": str(folder),
            "training": json.loads(info.read_text()) if info.exists() else None,
        }
        log.info("warm start from %s", folder)

    # ---- checkpoints -------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return self.ckpt_dir / "state.pt"

    def save(self) -> None:
        atomic_save(
            {
                "config": asdict(self.cfg),
                "vae": self.vae.state_dict(),
                "vae_opt": self.vae_opt.state_dict(),
                "vae_step": self.vae_step,
                "text": self.text.state_dict(),
                "unet": self.unet.state_dict(),
                "ema_text": self.ema_text.state_dict(),
                "ema_unet": self.ema_unet.state_dict(),
                "opt": self.opt.state_dict(),
                "unet_step": self.unet_step,
                "history": self.history,
                "scaling_factor": self.vae.config.scaling_factor,
                "warm_start": self.warm_start,
            },
            self.state_path,
        )

    def _load(self) -> None:
        if not self.state_path.exists():
            return
        state = torch.load(self.state_path, map_location=self.device, weights_only=False)
        if state["config"]["seed"] != self.cfg.seed:
            raise ValueError(
                f"checkpoint {self.state_path} was trained with seed {state['config']['seed']}, "
                f"not {self.cfg.seed}: use another --ckpt-dir"
            )
        self.vae.load_state_dict(state["vae"])
        self.vae_opt.load_state_dict(state["vae_opt"])
        self.text.load_state_dict(state["text"])
        self.unet.load_state_dict(state["unet"])
        self.ema_text.load_state_dict(state["ema_text"])
        self.ema_unet.load_state_dict(state["ema_unet"])
        self.opt.load_state_dict(state["opt"])
        self.vae_step, self.unet_step = state["vae_step"], state["unet_step"]
        self.history = state["history"]
        self.warm_start = state.get("warm_start")
        self.vae.register_to_config(scaling_factor=state["scaling_factor"])
        log.info("resumed %s: vae step %d, unet step %d", self.state_path, *self.steps())

    def steps(self) -> tuple[int, int]:
        return self.vae_step, self.unet_step

    def _generator(self, phase: int, step: int) -> torch.Generator:
        """Noise of one step: a function of seed, phase and step, so resuming is exact."""
        return torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + phase * 10_000_019 + step)

    # ---- phase 1: VAE ------------------------------------------------------------------
    def vae_batch(self, step: int) -> torch.Tensor:
        """Random 64 px crops of scenes, a third of them masked like the pipeline does."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, 1, step])
        c = cfg.vae_crop
        crops = []
        for i in range(cfg.vae_batch):
            sample = make_sample(int(rng.integers(1 << 40)))
            image = to_tensor(sample.image[None])
            if i % 3 == 0:
                image = _masked(image, sample.mask[None])
            crops.append(random_crop(image, c, rng))
        return torch.cat(crops).to(self.device)

    def vae_loss(self, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        posterior = self.vae.encode(images).latent_dist
        eps = torch.randn(posterior.mean.shape, generator=generator).to(self.device)
        z = posterior.mean + posterior.std * eps
        recon = self.vae.decode(z).sample
        kl = posterior.kl().mean() / images[0].numel()
        return F.l1_loss(recon, images) + 0.5 * F.mse_loss(recon, images) + 1e-5 * kl

    def train_vae(self) -> None:
        cfg = self.cfg
        if self.vae_step >= cfg.vae_steps:
            return
        self.vae.train()
        bar = tqdm(
            total=cfg.vae_steps, initial=self.vae_step, desc="vae", disable=not self.progress
        )
        while self.vae_step < cfg.vae_steps:
            loss = self.vae_loss(self.vae_batch(self.vae_step), self._generator(1, self.vae_step))
            self.vae_opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.vae.parameters(), 1.0)
            self.vae_opt.step()
            self.vae_step += 1
            self.history["vae"].append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{recent(self.history['vae']):.4f}")
            if self.vae_step % cfg.save_every == 0 or self.vae_step == cfg.vae_steps:
                self.save()
        bar.close()
        self.vae.eval()

    # ---- phase 2: latents --------------------------------------------------------------
    @torch.no_grad()
    def encode_samples(self) -> None:
        """Encode ``samples`` (image, masked image) pairs once; cached next to the checkpoint."""
        cfg = self.cfg
        path = self.ckpt_dir / "latents.pt"
        key = {"seed": cfg.seed, "samples": cfg.samples, "vae_step": self.vae_step}
        if path.exists():
            cached = torch.load(path, weights_only=False)
            if cached["key"] == key:
                self.latents = cached
                self.vae.register_to_config(scaling_factor=cached["scaling_factor"])
                return
        self.vae.eval()
        means, stds, mmeans, mstds, masks, captions = [], [], [], [], [], []
        chunk = 32
        bar = tqdm(total=cfg.samples, desc="encode", disable=not self.progress)
        for start in range(0, cfg.samples, chunk):
            batch = [
                make_sample(_sample_seed(cfg.seed, i))
                for i in range(start, min(start + chunk, cfg.samples))
            ]
            images = to_tensor(np.stack([s.image for s in batch])).to(self.device)
            mask = np.stack([s.mask for s in batch])
            for src, m_out, s_out in (
                (images, means, stds),
                (_masked(images, mask), mmeans, mstds),
            ):
                dist = self.vae.encode(src).latent_dist
                m_out.append(dist.mean.half().cpu())
                s_out.append(dist.std.half().cpu())
            small = F.interpolate(
                torch.from_numpy(mask)[:, None].float(), size=(SIZE // 8, SIZE // 8)
            )  # as the pipeline resizes the mask (nearest)
            masks.append(small.bool())
            captions += [s.captions for s in batch]
            bar.update(len(batch))
        bar.close()
        mean = torch.cat(means)
        scaling = float(1.0 / mean.float().std())
        self.latents = {
            "key": key,
            "mean": mean,
            "std": torch.cat(stds),
            "masked_mean": torch.cat(mmeans),
            "masked_std": torch.cat(mstds),
            "mask": torch.cat(masks),
            "captions": captions,
            "scaling_factor": scaling,
        }
        self.vae.register_to_config(scaling_factor=scaling)
        atomic_save(self.latents, path)
        log.info("encoded %d samples; latent scaling factor %.4f", cfg.samples, scaling)

    # ---- phase 3: UNet + text encoder --------------------------------------------------
    def tokenize(self, captions: list[str]) -> torch.Tensor:
        return self.tokenizer(
            captions,
            padding="max_length",
            max_length=TEXT_LEN,
            truncation=True,
            return_tensors="pt",
        ).input_ids.to(self.device)

    def unet_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        """(UNet conditioning input without the noisy latents, clean latents, captions)."""
        assert self.latents is not None
        cfg, lat = self.cfg, self.latents
        rng = np.random.default_rng([cfg.seed, 3, step])
        idx = torch.from_numpy(rng.integers(0, cfg.samples, cfg.batch))
        gen = self._generator(2, step)
        sf = self.vae.config.scaling_factor

        def draw(mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
            m, s = mean[idx].float(), std[idx].float()
            return (m + s * torch.randn(m.shape, generator=gen)) * sf

        clean = draw(lat["mean"], lat["std"])
        masked = draw(lat["masked_mean"], lat["masked_std"])
        mask = lat["mask"][idx].float()
        captions = []
        for i in idx.tolist():
            options = lat["captions"][i]
            pick = options[int(rng.integers(len(options)))]
            captions.append("" if rng.random() < cfg.cond_dropout else pick)
        cond = torch.cat([mask, masked], dim=1).to(self.device)
        return cond, clean.to(self.device), captions

    def unet_loss(self, step: int) -> torch.Tensor:
        cond, clean, captions = self.unet_batch(step)
        gen = self._generator(3, step)
        noise = torch.randn(clean.shape, generator=gen).to(self.device)
        t = torch.randint(0, self.noise.config.num_train_timesteps, (len(clean),), generator=gen)
        t = t.to(self.device)
        noisy = self.noise.add_noise(clean, noise, t)
        text = self.text(self.tokenize(captions))[0]
        pred = self.unet(torch.cat([noisy, cond], dim=1), t, encoder_hidden_states=text).sample
        alphas = self.noise.alphas_cumprod.to(self.device)[t]
        snr = alphas / (1 - alphas)
        weight = torch.clamp(snr, max=MIN_SNR_GAMMA) / snr  # min-SNR-gamma, epsilon target
        error = F.mse_loss(pred, noise, reduction="none")
        if self.cfg.mask_weight != 1.0:
            mask = cond[:, :1]  # the latent-resolution inpainting mask, 1 = repaint
            error = error * (1.0 + (self.cfg.mask_weight - 1.0) * mask)
        per_sample = error.mean(dim=(1, 2, 3))
        return (per_sample * weight).mean()

    @torch.no_grad()
    def _ema_update(self) -> None:
        decay = min(self.cfg.ema_decay, (1 + self.unet_step) / (10 + self.unet_step))
        for ema, live in ((self.ema_unet, self.unet), (self.ema_text, self.text)):
            for e, p in zip(ema.parameters(), live.parameters(), strict=True):
                e.lerp_(p, 1 - decay)

    def train_unet(self) -> None:
        cfg = self.cfg
        if self.unet_step >= cfg.unet_steps:
            return
        self.encode_samples()
        self.unet.train()
        self.text.train()
        started = time.monotonic()
        params = [*self.unet.parameters(), *self.text.parameters()]
        bar = tqdm(
            total=cfg.unet_steps, initial=self.unet_step, desc="unet", disable=not self.progress
        )
        while self.unet_step < cfg.unet_steps:
            lr = cfg.lr * min(1.0, (self.unet_step + 1) / max(cfg.warmup, 1))
            for group in self.opt.param_groups:
                group["lr"] = lr
            loss = self.unet_loss(self.unet_step)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            self.opt.step()
            self.unet_step += 1
            self._ema_update()
            self.history["unet"].append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{recent(self.history['unet']):.4f}")
            out_of_time = cfg.max_minutes > 0 and time.monotonic() - started > cfg.max_minutes * 60
            if self.unet_step % cfg.save_every == 0 or out_of_time:
                self.save()
            if cfg.export_every and self.unet_step % cfg.export_every == 0:
                self.export()
            if out_of_time:
                log.info(
                    "stopping after %.1f minutes at unet step %d", cfg.max_minutes, self.unet_step
                )
                break
        bar.close()
        self.save()

    # ---- export ------------------------------------------------------------------------
    def export(self, out: Path | None = None) -> Path:
        """Write the EMA weights as a ``StableDiffusionInpaintPipeline`` folder, fp16."""
        out = out or self.out
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".export-", dir=out.parent) as tmp:
            folder = Path(tmp) / "model"
            tokenizer = make_tokenizer(Path(tmp) / "tokenizer")
            vae = copy.deepcopy(self.vae).eval().half().cpu()
            pipe = StableDiffusionInpaintPipeline(
                vae=vae,
                text_encoder=copy.deepcopy(self.ema_text).eval().half().cpu(),
                tokenizer=tokenizer,
                unet=copy.deepcopy(self.ema_unet).eval().half().cpu(),
                scheduler=inference_scheduler(),
                safety_checker=None,
                feature_extractor=None,
                requires_safety_checker=False,
            )
            pipe.save_pretrained(folder, safe_serialization=True)
            (folder / "training.json").write_text(json.dumps(self.summary(), indent=2) + "\n")
            old = Path(tmp) / "old"
            if out.exists():
                os.rename(out, old)
            os.rename(folder, out)
        log.info("exported unet step %d to %s", self.unet_step, out)
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "config": asdict(self.cfg),
            "vae_step": self.vae_step,
            "unet_step": self.unet_step,
            "vae_loss_last100": recent(self.history["vae"], 100),
            "unet_loss_last100": recent(self.history["unet"], 100),
            "scaling_factor": self.vae.config.scaling_factor,
            "warm_start": self.warm_start,
            "params": {
                "vae": _count(self.vae),
                "text_encoder": _count(self.text),
                "unet": _count(self.unet),
            },
        }

    def run(self) -> dict[str, Any]:
        self.train_vae()
        self.train_unet()
        self.export()
        return self.summary()


def _sample_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of the UNet set; evaluation scenes use other seeds."""
    return seed * 1_000_000 + index


def recent(values: list[float], n: int = 50) -> float:
    tail = values[-n:]
    return float(sum(tail) / len(tail)) if tail else math.nan


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def train_demo(
    config: TrainConfig,
    ckpt_dir: Path,
    out: Path,
    device: str = "auto",
    threads: int = 0,
    progress: bool = True,
    on_trainer: Callable[[Trainer], None] | None = None,
    warm_start: Path | None = None,
) -> dict[str, Any]:
    """The ``retouch train-demo`` entry point: seed, build or resume, train, export."""
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(config.seed)
    trainer = Trainer(
        config, ckpt_dir, out, resolve_device(device), progress=progress, warm_start=warm_start
    )
    if on_trainer is not None:
        on_trainer(trainer)
    return trainer.run()


def resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA when there is one, else the CPU; anything else is taken as given."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def remove_checkpoints(ckpt_dir: Path) -> None:
    shutil.rmtree(ckpt_dir, ignore_errors=True)
