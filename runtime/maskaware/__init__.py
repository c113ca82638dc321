"""Mask-aware diffusion inference: bake a template once, then compute only the masked tokens."""
