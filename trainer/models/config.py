"""Model sizes: small by default so the whole multimodal model trains on a CPU."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig:
    vocab_size: int = 262
    """Token ids of the service's tokenizer (ByteTokenizer: 262)."""
    dim: int = 64
    """Backbone width; encoders project to it."""
    layers: int = 4
    """Backbone decoder blocks (split over pipeline stages)."""
    heads: int = 4
    max_positions: int = 8192
    """Largest position id (the job's seq_len)."""
    # image encoder (ViT)
    patch_size: int = 14
    merge_size: int = 2
    """Patches merged per token along each axis: must match the job's image spec."""
    enc_dim: int = 48
    enc_layers: int = 2
    enc_heads: int = 4
    max_patches_per_side: int = 128
    # audio encoder
    n_mels: int = 128
    audio_token_stride: int = 4
    audio_layers: int = 1
    # image generator (diffusion)
    gen_resolution: int = 32
    """Generation targets are resized to this edge for the noise-prediction loss (the service sends
    them at the job's generation.image_size)."""
    gen_channels: int = 32
    diffusion_steps: int = 1000
    gen_loss_weight: float = 1.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "layers", "heads", "patch_size", "merge_size", "enc_dim", "enc_layers",
                     "gen_resolution", "gen_channels", "diffusion_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dim % self.heads or self.enc_dim % self.enc_heads:
            raise ValueError("widths must be divisible by their head counts")
        if self.gen_resolution % 4:
            raise ValueError(f"gen_resolution must be a multiple of 4, got {self.gen_resolution}")
