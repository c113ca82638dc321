"""``retouch train-demo``: train the ``retouch:shapes-sd`` demo model (resumable)."""

from __future__ import annotations

import argparse
from pathlib import Path

from retouch.platform.cli.common import one_line_error, report


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train-demo",
        help="train the retouch:shapes-sd demo model on procedural shapes (resumable)",
        description="Train a small SD-style inpainting model (VAE, CLIP text encoder, 9-channel "
        "UNet) on the procedural shapes data set and export it as a diffusers folder in fp16. "
        "Checkpoints in --ckpt-dir let an interrupted run resume where it stopped.",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("shapes-sd"),
        help="diffusers folder to export to (default ./shapes-sd)",
    )
    p.add_argument(
        "--ckpt-dir",
        type=Path,
        default=Path("train-demo-ckpt"),
        help="checkpoints and encoded latents; rerun with the same folder to resume",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of data, initialisation and noise")
    p.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when available, else CPU), cpu, cuda or cuda:N",
    )
    p.add_argument(
        "--threads", type=int, default=0, help="CPU threads for torch (default: torch's choice)"
    )
    p.add_argument("--vae-steps", type=int, default=1500, help="VAE training steps")
    p.add_argument("--vae-batch", type=int, default=16, help="VAE batch of 64 px crops")
    p.add_argument(
        "--samples",
        type=int,
        default=12000,
        help="(scene, mask) pairs encoded once for the UNet phase",
    )
    p.add_argument("--unet-steps", type=int, default=8000, help="UNet training steps")
    p.add_argument("--batch", type=int, default=32, help="UNet batch size")
    p.add_argument("--lr", type=float, default=4e-4, help="UNet and text encoder learning rate")
    p.add_argument(
        "--cond-dropout",
        type=float,
        default=0.1,
        help="fraction of captions replaced by the empty prompt (classifier-free guidance)",
    )
    p.add_argument(
        "--save-every", type=int, default=100, help="checkpoint every N steps of a phase"
    )
    p.add_argument(
        "--export-every",
        type=int,
        default=500,
        help="also export the EMA weights every N UNet steps (0: only at the end)",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="end the UNet phase after this much wall time, then export (0: no limit)",
    )
    p.add_argument(
        "--export-only",
        action="store_true",
        help="export the latest checkpoint without training further",
    )
    p.add_argument(
        "--warm-start",
        type=Path,
        metavar="FOLDER",
        help="start the UNet phase from the exported model in FOLDER (its VAE, text encoder "
        "and UNet) instead of training from scratch; ignored when --ckpt-dir has a checkpoint",
    )
    p.add_argument(
        "--mask-weight",
        type=float,
        default=1.0,
        help="loss weight of the latent pixels under the inpainting mask (default 1: uniform)",
    )
    p.add_argument(
        "--tune-decoder",
        type=Path,
        metavar="FOLDER",
        help="instead of training: fine-tune the VAE decoder of the exported model in FOLDER "
        "(encoder and UNet unchanged) and write the model to --out",
    )
    p.add_argument(
        "--decoder-steps", type=int, default=6000, help="steps of --tune-decoder (default 6000)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(run=_train_demo)


def _train_demo(args: argparse.Namespace) -> None:
    checks = (
        (args.vae_steps >= 0, "--vae-steps must be >= 0"),
        (args.unet_steps >= 0, "--unet-steps must be >= 0"),
        (args.vae_batch >= 1, "--vae-batch must be >= 1"),
        (args.batch >= 1, "--batch must be >= 1"),
        (args.samples >= 1, "--samples must be >= 1"),
        (args.threads >= 0, "--threads must be >= 0"),
        (args.lr > 0, "--lr must be > 0"),
        (0.0 <= args.cond_dropout < 1.0, "--cond-dropout must be in [0, 1)"),
        (args.save_every >= 1, "--save-every must be >= 1"),
        (args.export_every >= 0, "--export-every must be >= 0"),
        (args.max_minutes >= 0, "--max-minutes must be >= 0"),
        (args.decoder_steps >= 1, "--decoder-steps must be >= 1"),
        (args.mask_weight > 0, "--mask-weight must be > 0"),
        (
            args.warm_start is None or (args.warm_start / "unet" / "config.json").exists(),
            f"--warm-start: {args.warm_start} is not an exported model folder",
        ),
        (
            args.device == "auto" or args.device == "cpu" or args.device.startswith("cuda"),
            f"--device must be auto, cpu or cuda[:N], not {args.device!r}",
        ),
    )
    for ok, message in checks:
        if not ok:
            one_line_error(message)
    if args.device.startswith("cuda"):
        from retouch.platform.lab.torchsettings import cuda_available

        if not cuda_available():
            one_line_error("--device cuda: no CUDA device is available")

    if args.tune_decoder is not None:
        _tune_decoder(args)
        return
    from retouch.functions.demo.train import TrainConfig, Trainer, train_demo

    config = TrainConfig(
        seed=args.seed,
        vae_steps=args.vae_steps,
        vae_batch=args.vae_batch,
        samples=args.samples,
        unet_steps=args.unet_steps,
        batch=args.batch,
        lr=args.lr,
        cond_dropout=args.cond_dropout,
        save_every=args.save_every,
        export_every=args.export_every,
        max_minutes=args.max_minutes,
        mask_weight=args.mask_weight,
    )
    if args.export_only:
        if not (args.ckpt_dir / "state.pt").exists():
            one_line_error(f"--export-only: no checkpoint in {args.ckpt_dir}")
        from retouch.platform.lab.torchsettings import use_threads

        use_threads(args.threads)
        trainer = Trainer(config, args.ckpt_dir, args.out, "cpu", progress=False)
        trainer.export()
        report(trainer.summary(), False)
        return
    summary = train_demo(
        config,
        args.ckpt_dir,
        args.out,
        device=args.device,
        threads=args.threads,
        progress=not args.no_progress,
        warm_start=args.warm_start,
    )
    report(summary, False)


def _tune_decoder(args: argparse.Namespace) -> None:
    if not (args.tune_decoder / "vae" / "config.json").exists():
        one_line_error(f"--tune-decoder: {args.tune_decoder} is not an exported model folder")
    if args.tune_decoder.resolve() == args.out.resolve():
        one_line_error("--tune-decoder: --out must be another folder than the input")
    from retouch.functions.demo.decodertune import DecoderTuning, finetune_decoder
    from retouch.platform.lab.torchsettings import use_threads

    use_threads(args.threads)
    tuning = DecoderTuning(
        steps=args.decoder_steps,
        batch=args.vae_batch,
        seed=args.seed,
        save_every=args.save_every,
    )
    summary = finetune_decoder(
        args.tune_decoder,
        args.out,
        tuning,
        args.ckpt_dir,
        device=args.device,
        progress=not args.no_progress,
    )
    report(summary, False)
