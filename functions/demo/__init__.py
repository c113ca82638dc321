"""Built-in demo models, tokenizers and template images (all built offline)."""
