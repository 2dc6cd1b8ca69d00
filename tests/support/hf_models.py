"""Tiny transformers models built from configs, shared by the integration tests (float64, eval
mode, seeded weights)."""

from __future__ import annotations

from typing import Any

import torch


def seeded(cls: Any, config: Any) -> Any:
    """``cls(config)`` with weights drawn after ``torch.manual_seed(0)``, in float64, eval mode."""
    torch.manual_seed(0)
    return cls(config).double().eval()


def tiny_whisper(vocab: int) -> Any:
    """A 2 + 2 layer Whisper of width 32 on SDPA (its decoder: causal self-attention and
    cross-attention over the encoder)."""
    import transformers

    config = transformers.WhisperConfig(
        vocab_size=vocab, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, d_model=32, max_source_positions=24, max_target_positions=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, init_std=0.3,
        attn_implementation="sdpa", pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    return seeded(transformers.WhisperForConditionalGeneration, config)
