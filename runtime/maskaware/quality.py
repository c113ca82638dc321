"""Image agreement measures that hold a mask-aware edit against the stock output."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def psnr(a: np.ndarray, b: np.ndarray, region: np.ndarray | None = None) -> float:
    """PSNR in dB of two float images in [0, 1] (``[H, W, C]``), optionally over a boolean
    ``[H, W]`` region only; identical inputs give ``inf``."""
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if region is not None:
        diff = diff[np.asarray(region, dtype=bool)]
    mse = float(np.mean(diff**2))
    return float("inf") if mse == 0 else float(10.0 * np.log10(1.0 / mse))


def ssim(
    a: np.ndarray,
    b: np.ndarray,
    sigma: float = 1.5,
    size: int = 11,
    region: np.ndarray | None = None,
) -> float:
    """Mean SSIM (Wang et al. 2004: Gaussian window, K1 0.01, K2 0.03, data range 1) of two
    ``[H, W, C]`` float images, averaged over channels; with a boolean ``[H, W]`` region,
    over the windows centred in it."""
    x = torch.as_tensor(np.asarray(a, dtype=np.float64)).permute(2, 0, 1)[:, None]
    y = torch.as_tensor(np.asarray(b, dtype=np.float64)).permute(2, 0, 1)[:, None]
    coords = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    g = g / g.sum()
    window = (g[:, None] * g[None, :])[None, None]

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, window)  # valid region only, as skimage crops its borders

    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x**2
    var_y = blur(y * y) - mu_y**2
    cov = blur(x * y) - mu_x * mu_y
    c1, c2 = 0.01**2, 0.03**2
    num = (2 * mu_x * mu_y + c1) * (2 * cov + c2)
    den = (mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2)
    ssim_map = num / den
    if region is None:
        return float(ssim_map.mean())
    pad = (size - 1) // 2
    inside = torch.as_tensor(np.asarray(region, dtype=bool)[pad:-pad, pad:-pad])
    return float(ssim_map[:, 0][:, inside].mean())
