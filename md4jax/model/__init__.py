"""The denoiser network: a Transformer from (z_t, conditioning) to logits, with no diffusion math."""
