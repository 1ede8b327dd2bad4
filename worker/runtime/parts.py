"""A loaded mlx-lm model's parts: the text model (a multimodal checkpoint
keeps it as `language_model`), its body, which gives the final hidden
states (layers and final norm: mlx-lm keeps it as `model`), and its LM head
over them (the tied embedding where there is no `lm_head`)."""

from __future__ import annotations

from contextlib import contextmanager

import mlx.nn as nn


def text_model(model) -> nn.Module:
    return getattr(model, "language_model", model)


def head_module(model) -> nn.Module:
    """The module that holds the LM head's weights: `lm_head`, or the
    embedding it is tied to."""
    text = text_model(model)
    return text.lm_head if "lm_head" in text else text.model.embed_tokens


def model_parts(model) -> tuple[nn.Module, object, object]:
    """(text model, body, LM head as a function of the body's output)."""
    text = text_model(model)
    head = head_module(text)
    return text, text.model, head if "lm_head" in text else head.as_linear


class _LastPositionOnly:
    """A decoder layer that computes its output at its input's last position
    only, the cache still taking every position's keys and values (or
    recurrent state): two calls, the positions before the last and then the
    last. Nothing reads the first call's output, and mlx computes lazily, so
    that call's queries, attention and MLP are never run, as mlx-lm's
    prefill never runs them for a forward whose output it does not read.
    Other attributes are the layer's (a hybrid body asks `is_linear`)."""

    def __init__(self, layer):
        self._layer = layer

    def __getattr__(self, name: str):
        return getattr(self._layer, name)

    def __call__(self, x, mask=None, cache=None):
        # Only an unpadded forward's masks ("causal", or none) say the same
        # for any split; an array mask would have to be cut to each call.
        if x.shape[1] == 1 or not (mask is None or isinstance(mask, str)):
            return self._layer(x, mask, cache)
        self._layer(x[:, :-1], mask, cache)
        return self._layer(x[:, -1:], None, cache)


@contextmanager
def last_position_only(body):
    """While it lasts, the body's last layer is a _LastPositionOnly: for a
    forward whose output is read at the last position only, which spares
    that layer's work at every other position (on a model of N layers, 1/N
    of the forward's)."""
    layers = body.layers
    last = layers[-1]
    layers[-1] = _LastPositionOnly(last)
    try:
        yield
    finally:
        layers[-1] = last
