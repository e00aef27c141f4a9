"""Models: the flax.nnx decoder, named presets, checkpoint loading and tokenizers."""
from marljax.models.decoder import Decoder, ModelConfig
from marljax.models.loading import load_model, save_hf
from marljax.models.presets import PRESETS
from marljax.models.tokenizer import ChatCodec, load_tokenizer

__all__ = ["ChatCodec", "Decoder", "ModelConfig", "PRESETS", "load_model", "load_tokenizer", "save_hf"]
