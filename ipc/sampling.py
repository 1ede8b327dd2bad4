"""The sampling settings of a request, each field with its bounds and its
default, declared here once.

`Sampling` holds the values a worker draws with (a `Generate` is one), with
chat_metal's defaults. `SamplingFields` is the same fields, each of them
optional (None: not given), as a request line, an HTTP body, the CLI's
flags, the chat's `/set` and the pool's `[defaults]` table give them. All of
these are validated with the bounds below, so a pool default can never put
into a request a value the request itself could not carry.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

# The bounds: wide enough for any use, narrow enough that no value can hurt
# a worker. Ten million tokens is beyond every model's context; a
# temperature of 100 already draws almost uniformly.
MAX_COUNT = 10_000_000
MaxTokens = Annotated[int, Meta(ge=1, le=MAX_COUNT)]
Temperature = Annotated[float, Meta(ge=0.0, le=100.0)]
TopK = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(gt=0.0, le=100.0)]
Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Budget = Annotated[int, Meta(ge=0, le=MAX_COUNT)]


class Sampling(msgspec.Struct, kw_only=True):
    """How a reply is drawn, in Hugging Face's order (penalty, temperature,
    top-k, top-p); the defaults are chat_metal's."""

    temperature: Temperature = 0.7  # 0: greedy
    top_k: TopK = 50  # 0: every token
    top_p: TopP = 0.9
    repetition_penalty: Penalty = 1.1  # 1: none
    max_tokens: MaxTokens = 512
    seed: Seed | None = None  # None: a fresh draw each time
    reasoning_budget: Budget | None = None  # tokens of thinking before </think> is forced; None: no limit


NAMES: tuple[str, ...] = Sampling.__struct_fields__
DEFAULTS: dict[str, Any] = msgspec.structs.asdict(Sampling())

# The same fields, each optional: what a client (or the pool's defaults) gives.
SamplingFields = msgspec.defstruct(
    "SamplingFields",
    [(f.name, f.type | None, None) for f in msgspec.structs.fields(Sampling)],
    kw_only=True,
    module=__name__,
)


def given(*layers: object) -> dict[str, Any]:
    """Each field's value in the first layer that gives it (a request, then
    the pool's defaults); fields none gives are left out, for Sampling's
    own defaults."""
    fields = {}
    for name in NAMES:
        for layer in layers:
            value = getattr(layer, name)
            if value is not None:
                fields[name] = value
                break
    return fields


def check(name: str, value: object) -> Any:
    """`value` for the field `name`, validated with its bounds (as a float
    field takes an int, the value as the field holds it). Raises ValueError
    that names the field."""
    try:
        return getattr(msgspec.convert({name: value}, SamplingFields), name)
    except msgspec.ValidationError as exc:
        what, _, _ = str(exc).partition(" - at `$")
        raise ValueError(f"invalid field {name!r}: {what}") from None
