"""A loaded mlx-lm model's parts: the text model (a multimodal checkpoint
keeps it as `language_model`), its body, which gives the final hidden
states (layers and final norm: mlx-lm keeps it as `model`), and its LM head
over them (the tied embedding where there is no `lm_head`)."""

from __future__ import annotations

import mlx.nn as nn


def text_model(model) -> nn.Module:
    return getattr(model, "language_model", model)


def model_parts(model) -> tuple[nn.Module, object, object]:
    """(text model, body, LM head as a function of the body's output)."""
    text = text_model(model)
    body = text.model
    head = text.lm_head if "lm_head" in text else body.embed_tokens.as_linear
    return text, body, head
