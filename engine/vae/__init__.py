"""Autoencoders: the tiny TAESD / TAEHV family (fast previews, realtime decode) and the full FLUX.1 AE."""

from .tiny import TINY_VARIANTS, StreamDecoder, TinyVAE, TinyVariant, load_tiny_vae

__all__ = ["TINY_VARIANTS", "StreamDecoder", "TinyVAE", "TinyVariant", "load_tiny_vae"]
