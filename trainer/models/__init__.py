"""Small multimodal models (image/audio encoders, LLM backbone, diffusion generator); no distributed code."""
