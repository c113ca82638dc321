"""The shapes data set, the demo tokenizer's word tokens and the shapes-sd training step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from retouch.functions.demo.decodertune import DecoderTuning, finetune_decoder
from retouch.functions.demo.shapes import (
    COLOURS,
    WORDS,
    colour_matches,
    edit_succeeded,
    make_sample,
    make_scene,
    painted,
)
from retouch.functions.demo.train import TrainConfig, Trainer, make_tokenizer
from retouch.platform.cli.main import main
from retouch.platform.lab.bench.edits import most_visible, recolour_mask, replace_mask


def test_samples_are_deterministic_from_the_seed() -> None:
    for seed in (0, 7, 123456):
        a, b = make_sample(seed), make_sample(seed)
        assert np.array_equal(a.image, b.image)
        assert np.array_equal(a.mask, b.mask)
        assert a.captions == b.captions
    assert not np.array_equal(make_sample(1).image, make_sample(2).image)


def test_samples_have_masks_and_captions_in_the_vocabulary() -> None:
    for seed in range(40):
        sample = make_sample(seed)
        assert sample.image.shape == (128, 128, 3) and sample.image.dtype == np.uint8
        assert sample.mask.dtype == bool and 0 < sample.mask.mean() < 1
        for caption in sample.captions:
            assert set(caption.split()) <= set(WORDS), caption


def test_every_caption_word_is_one_token(tmp_path: Path) -> None:
    tokenizer = make_tokenizer(tmp_path)
    for word in WORDS:
        assert len(tokenizer.tokenize(word)) == 1, word
    ids = tokenizer("a red star on a blue striped background").input_ids
    assert len(ids) == 10  # 8 words + start + end
    assert len(tokenizer.tokenize("scarlet")) > 1  # other words still spell out


def test_colour_measure_recognises_the_drawn_colours() -> None:
    checked = 0
    for seed in range(60):
        scene = make_scene(seed)
        for (colour, _kind), sil in zip(scene.objects, scene.silhouettes, strict=True):
            if sil.sum() < 50:
                continue
            assert colour_matches(scene.image, sil, colour), (seed, colour)
            others = [c for c in COLOURS if c != colour and c not in ("white", "black")]
            assert not any(colour_matches(scene.image, sil, c) for c in others), (seed, colour)
            checked += 1
    assert checked > 50


def test_edit_judge_sees_the_drawn_object_in_box_and_dilated_masks() -> None:
    """The edit-success judge on the templates themselves: the masked object's own colour
    is recognised in both edit masks (the box holds much background), no other colour is,
    and the background alone (the object erased) is no success."""
    checked = 0
    for seed in range(40):
        scene = make_scene(900_000_000 + seed)
        index = most_visible(scene)
        colour = scene.objects[index][0]
        if [c for c, _kind in scene.objects].count(colour) > 1:
            continue  # an identical other object is "already there", by design
        unpainted = scene.unpainted(index)
        taken = {scene.background[0], *(c for c, _kind in scene.objects)}
        others = [c for c in COLOURS if c not in taken]
        for mask in (
            replace_mask(scene.silhouettes[index]),
            recolour_mask(scene.silhouettes[index]),
        ):
            assert edit_succeeded(scene.image, mask, colour, unpainted), (seed, colour)
            drawn = painted(scene.image, mask, unpainted)  # what every other colour is judged on
            assert not any(colour_matches(scene.image, drawn, c) for c in others), seed
            assert not edit_succeeded(scene.backdrop, mask, colour, unpainted), seed
            checked += 1
    assert checked > 60


def _trainer(tmp_path: Path) -> Trainer:
    torch.manual_seed(0)
    config = TrainConfig(vae_batch=2, samples=8, batch=2, lr=1e-3, warmup=1, save_every=1000)
    return Trainer(config, tmp_path / "ckpt", tmp_path / "out", torch.device("cpu"), progress=False)


def test_vae_step_lowers_the_loss(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    images, gen = trainer.vae_batch(0), trainer._generator
    first = trainer.vae_loss(images, gen(1, 0)).item()
    for _ in range(4):
        loss = trainer.vae_loss(images, gen(1, 0))
        trainer.vae_opt.zero_grad()
        loss.backward()
        trainer.vae_opt.step()
    assert trainer.vae_loss(images, gen(1, 0)).item() < first


def test_unet_step_lowers_the_loss_and_resumes(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    trainer.encode_samples()
    params = [*trainer.unet.parameters(), *trainer.text.parameters()]
    with torch.no_grad():
        first = trainer.unet_loss(0).item()
    for _ in range(4):  # the same batch, noise and timesteps each time: the loss must fall
        loss = trainer.unet_loss(0)
        trainer.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        trainer.opt.step()
    with torch.no_grad():
        assert trainer.unet_loss(0).item() < first
    trainer.unet_step = 4
    trainer.save()
    resumed = _trainer(tmp_path)
    assert resumed.unet_step == 4
    for a, b in zip(resumed.unet.parameters(), trainer.unet.parameters(), strict=True):
        assert torch.equal(a, b)


def test_export_loads_as_a_stock_inpainting_pipeline(tmp_path: Path) -> None:
    from diffusers import StableDiffusionInpaintPipeline

    trainer = _trainer(tmp_path)
    trainer.encode_samples()
    folder = trainer.export(tmp_path / "shapes-sd")
    weights = list(folder.rglob("*.safetensors"))
    assert len(weights) == 3
    for path in weights:  # shipped in fp16
        with safe_open(path, "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}  # noqa: SIM118
    pipe = StableDiffusionInpaintPipeline.from_pretrained(
        folder, safety_checker=None, requires_safety_checker=False
    )
    assert pipe.unet.config.in_channels == 9


@pytest.mark.parametrize(
    "argv",
    [
        ["train-demo", "--unet-steps", "-1"],
        ["train-demo", "--batch", "x"],
        ["train-demo", "--device", "tpu"],
        ["train-demo", "--cond-dropout", "1.5"],
        ["train-demo", "--tune-decoder", "/nonexistent"],
        ["train-demo", "--tune-decoder", "x", "--decoder-steps", "0"],
    ],
)
def test_train_demo_rejects_bad_values_with_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


def test_decoder_finetune_keeps_encoder_and_unet_and_resumes(tmp_path: Path) -> None:
    """Only the decoder learns (the UNet's latent space must not move), the rest of the
    model is copied unchanged, and a second call resumes at the checkpointed step."""
    from diffusers import AutoencoderKL, StableDiffusionInpaintPipeline

    trainer = _trainer(tmp_path)
    trainer.encode_samples()
    folder = trainer.export(tmp_path / "shapes-sd")
    tuning = DecoderTuning(steps=2, batch=2, save_every=1)
    out = tmp_path / "tuned"
    summary = finetune_decoder(folder, out, tuning, tmp_path / "dec", progress=False)
    assert summary["decoder_finetune"]["steps"] == 2
    before = AutoencoderKL.from_pretrained(folder / "vae")
    after = AutoencoderKL.from_pretrained(out / "vae")
    for a, b in zip(before.encoder.parameters(), after.encoder.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not all(
        torch.equal(a, b)
        for a, b in zip(before.decoder.parameters(), after.decoder.parameters(), strict=True)
    )
    assert (out / "unet" / "diffusion_pytorch_model.safetensors").read_bytes() == (
        folder / "unet" / "diffusion_pytorch_model.safetensors"
    ).read_bytes()
    pipe = StableDiffusionInpaintPipeline.from_pretrained(
        out, safety_checker=None, requires_safety_checker=False
    )
    assert pipe.unet.config.in_channels == 9
    with safe_open(out / "vae" / "diffusion_pytorch_model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}  # noqa: SIM118
    state = torch.load(tmp_path / "dec" / "decoder.pt", weights_only=False)
    assert state["step"] == 2
    more = DecoderTuning(steps=3, batch=2, save_every=1)
    finetune_decoder(folder, out, more, tmp_path / "dec", progress=False)
    state = torch.load(tmp_path / "dec" / "decoder.pt", weights_only=False)
    assert state["step"] == 3 and len(state["history"]) == 3


def test_warm_start_begins_from_an_exported_model(tmp_path: Path) -> None:
    """A warm start takes the folder's weights (not a fresh initialisation), skips the VAE
    phase, and a checkpoint, once written, wins over the folder when resuming."""
    trainer = _trainer(tmp_path)
    trainer.encode_samples()
    folder = trainer.export(tmp_path / "shapes-sd")
    config = TrainConfig(
        seed=1, vae_steps=5, vae_batch=2, samples=8, batch=2, warmup=1, mask_weight=3.0
    )
    warm = Trainer(
        config, tmp_path / "warm", tmp_path / "o", torch.device("cpu"), False, warm_start=folder
    )
    assert warm.vae_step == 5 and warm.warm_start["folder"] == str(folder)
    for a, b in zip(warm.unet.parameters(), trainer.ema_unet.parameters(), strict=True):
        assert torch.equal(a, b.half().float())
    warm.encode_samples()
    with torch.no_grad():
        weighted = warm.unet_loss(0).item()
        warm.cfg.mask_weight = 1.0
        assert warm.unet_loss(0).item() < weighted  # the masked pixels count three times
    warm.unet_step = 3
    warm.save()
    resumed = Trainer(
        config, tmp_path / "warm", tmp_path / "o", torch.device("cpu"), False, warm_start=None
    )
    assert resumed.unet_step == 3 and resumed.warm_start["folder"] == str(folder)
