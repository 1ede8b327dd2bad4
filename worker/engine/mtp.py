"""MTP drafting: a checkpoint's own multi-token-prediction head.

Qwen3.5 and Qwen3-Next checkpoints carry, beside the model, `mtp.*` weights
of one more decoder layer trained to look one token further ahead: at
position i it takes the target's last hidden state h_i (after the final
norm, the vector the LM head scores) and the embedding of the token that
follows, x_{i+1}, each RMS-normed (`pre_fc_norm_hidden`,
`pre_fc_norm_embedding`), concatenated (embedding first) and projected back
to the hidden size by `fc`; then one full-attention decoder layer with its
own small KV cache, a final norm (`norm`), and the target's own LM head: its
argmax is the guess for x_{i+2}. mlx-lm's loader drops these weights
(`sanitize`), so they are read here from the safetensors themselves.

How it drafts, per row (`MtpDrafter`): every verify forward of the target
(worker.engine.speculate) hands over its hidden states; the ones at the
row's kept positions pair with the tokens that followed them and are fed to
the head, the last pair with the row's new pending token, whose output is
the first draft token. Further tokens chain: the head's own output hidden
state and its last guess are fed back in. Those chained positions are not
the target's and are trimmed from the head's cache after the draft, so it
holds exactly one entry per position the target has computed and kept.

The head reads the row's prompt too (its last MAX_POSITIONS positions):
a prompt chunk's forward hands over its hidden states as a verify
forward does (worker.engine.speculate `read_prompt`; positions resumed
from the prefix cache have none, and the head starts after them). A plain step (speculation paused,
or before its first measurement) hands over no hidden state: the rows then
stop drafting for one step, run a verify forward without drafts to get one,
and the head continues from there, skipping the positions it missed. Both
only cost acceptance, never the tokens: every draft is checked by the
target.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from worker.engine.batch_cache import BatchCache
from worker.engine.compiled_step import CompiledDecode
from worker.engine.drafters import BatchRows
from worker.runtime.parts import model_parts

PREFIX = "mtp."
# The target's hidden states a row keeps until the head reads them: the
# latest MAX_POSITIONS positions (of its prompt, when it first drafts), in
# at most MAX_PIECES pieces (each holds a reference to its whole forward's
# output: a row that does not draft for a while keeps its latest ones).
MAX_POSITIONS = 512
MAX_PIECES = 32


class MtpError(ValueError):
    """The checkpoint has no MTP head this worker can run."""


class MtpHead(nn.Module):
    def __init__(self, layer: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = [layer]
        self.norm = nn.RMSNorm(hidden, eps=eps)

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: KVCache) -> mx.array:
        """(B, L, hidden) of the head, after its final norm."""
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1))
        x = self.layers[0](x, create_attention_mask(x, cache), cache)
        return self.norm(x)


def _decoder_layer(text) -> nn.Module:
    """A full-attention decoder layer of the target's own architecture."""
    module = sys.modules[type(text).__module__]
    args = text.args
    if hasattr(module, "DecoderLayer") and hasattr(args, "full_attention_interval"):
        # Qwen3.5: the layer type follows its index; the last of each
        # interval is full attention.
        return module.DecoderLayer(args, layer_idx=args.full_attention_interval - 1)
    if hasattr(module, "TransformerBlock"):  # Qwen3 and its kin: every layer is full attention
        return module.TransformerBlock(args)
    raise MtpError(f"an MTP head for model type {text.model_type!r} is not supported")


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files that hold `mtp.*` weights (by the index when
    there is one), and `mtp.safetensors`, where a head kept apart from the
    model's files lives."""
    files = []
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for k, f in weight_map.items() if k.startswith(PREFIX)})
    else:
        files = sorted(path.glob("model*.safetensors"))
    apart = path / "mtp.safetensors"
    return files + ([apart] if apart.is_file() else [])


def read_weights(path: Path) -> tuple[dict[str, mx.array], bool]:
    """The head's weights (names without `mtp.`), and whether they are in a
    Hugging Face checkpoint's layout (norm weights stored as weight - 1)."""
    weights: dict[str, mx.array] = {}
    hf_layout = False
    for file in _weight_files(path):
        # Lazy: only the head's arrays are ever read.
        arrays, metadata = mx.load(str(file), return_metadata=True)
        found = {k[len(PREFIX) :]: v for k, v in arrays.items() if k.startswith(PREFIX)}
        if found:
            weights.update(found)
            hf_layout = hf_layout or metadata.get("format") != "mlx"
    return weights, hf_layout


def load_head(model, path: Path, config: dict) -> MtpHead:
    """The MTP head of the checkpoint at `path`, for `model` (its target)."""
    weights, hf_layout = read_weights(path)
    if not weights:
        raise MtpError(f'draft = "mtp": {path} carries no mtp.* weights (a multi-token-prediction head); use "ngram" or a draft model')
    text, body, _ = model_parts(model)
    args = text.args
    hidden = args.hidden_size
    head = MtpHead(_decoder_layer(text), hidden, args.rms_norm_eps)
    quant = config.get("quantization") or {}
    if any(k.endswith(".scales") for k in weights):
        nn.quantize(
            head,
            group_size=quant.get("group_size", 64),
            bits=quant.get("bits", 4),
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
    if hf_layout and getattr(args, "full_attention_interval", None) is not None:
        # Qwen3.5's norms are (1 + weight), stored as the weight (mlx-lm's
        # sanitize adds the one to the model's own).
        weights = {k: v + 1.0 if k.endswith("norm.weight") and v.ndim == 1 else v for k, v in weights.items()}
    dtype = body.norm.weight.dtype  # the target's activations (float32 on a CPU)
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise MtpError(f'draft = "mtp": the mtp.* weights of {path} do not fit this model: {exc}') from exc
    mx.eval(head.parameters())
    return head


class MtpState:
    """One row's tokens, and the target's hidden states at its positions
    not yet fed to the head: (first position, (n, hidden) array) pieces."""

    __slots__ = ("tokens", "hidden", "end")

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)
        self.hidden: list[tuple[int, mx.array]] = []
        self.end = -1  # the position after the last hidden state handed over

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    @property
    def current(self) -> bool:
        """The target's hidden state before the pending token is known (the
        head's input for the first draft token)."""
        return self.end == len(self.tokens)


class MtpDrafter(BatchRows):
    name = "mtp"
    # worker.engine.speculate hands this drafter the target's hidden states.
    wants_hidden = True

    def __init__(self, model, head: MtpHead):
        super().__init__()
        self.text, self.body, self.lm_head = model_parts(model)
        self.head = head
        # The head's chained steps, compiled as the draft model's are: on a
        # CPU, op by op, they were about a third of a small model's
        # speculative step.
        self.compiled = CompiledDecode(head)

    def state(self, tokens: list[int]) -> MtpState:
        return MtpState(tokens)

    def forward(self, inputs: mx.array, cache: list) -> tuple[mx.array, mx.array]:
        """The target's verify forward: (logits, final hidden states)."""
        hidden = self.body(inputs, cache=cache)
        return self.lm_head(hidden), hidden

    def verified(self, states: list[MtpState], starts: list[int], hidden: mx.array, kept: list[int]) -> None:
        """A verify forward's hidden states (rows, width, hidden): row i's
        first kept[i] + 1 columns are positions starts[i]... (its pending
        token and kept drafts); None entries in `states` are rows that do
        not speculate."""
        for i, (s, start, a) in enumerate(zip(states, starts, kept)):
            if s is not None:
                self.add(s, start, hidden[i, : a + 1])

    def add(self, s: MtpState, start: int, hidden: mx.array) -> None:
        """The target's hidden states (n, hidden) at a row's positions
        start... (from a verify forward or its prompt's prefill)."""
        if s.end != start:  # positions were missed (plain steps): the head skips them
            s.hidden.clear()
        s.hidden.append((start, hidden))
        s.end = start + hidden.shape[0]
        held = sum(h.shape[0] for _, h in s.hidden)
        while len(s.hidden) > MAX_PIECES or held > MAX_POSITIONS:
            first, h = s.hidden[0]
            cut = min(h.shape[0], max(1, held - MAX_POSITIONS)) if len(s.hidden) <= MAX_PIECES else h.shape[0]
            if cut == h.shape[0]:
                del s.hidden[0]
            else:
                s.hidden[0] = (first + cut, h[cut:])
            held -= cut

    def waiting(self, states: list[MtpState]) -> bool:
        """Some row needs a verify forward to hand over its hidden state."""
        return any(not s.current for s in states)

    def propose(self, states: list[MtpState], pendings: list[int | None], limits: list[int]) -> list[list[int]]:
        k = max(limits, default=0)
        ready = [s.current and p is not None and n > 0 for s, p, n in zip(states, pendings, limits)]
        if not any(ready):
            return [[] for _ in states]
        pending = {id(s): p for s, p, r in zip(states, pendings, ready) if r}
        # Rows in the head's cache that do not draft now leave it (they start
        # again when they do: a paused row's context is not worth its
        # cache), so that every row here reads at least one position.
        self._drop({id(s) for s in self._rows if id(s) not in pending})
        known = {id(s) for s in self._rows}
        fresh = [s for s, r in zip(states, ready) if r and id(s) not in known]
        if fresh or not self._rows:
            per_row = self._drafted(fresh, pending, k)
        else:
            per_row = self._drafted_compiled(self._pieces(self._rows, pending), k)
        if k > 1:
            for c in self._cache.layers:
                c.trim(k - 1)
        where = {id(s): i for i, s in enumerate(self._rows)}
        return [per_row[where[id(s)]][:n] if r else [] for s, n, r in zip(states, limits, ready)]

    def _drafted(self, fresh: list[MtpState], pending: dict, k: int, pieces=None) -> list[list[int]]:
        """Each row's k drafted tokens, op by op: the rows already in the
        head's cache (`pieces`: their inputs, when already taken) and those
        `fresh` to it read their waiting positions, then the head chains."""
        outs = []
        if self._rows:
            outs.append(self._feed(pieces or self._pieces(self._rows, pending), self._cache))
        for s in fresh:
            cache = BatchCache.lone([KVCache()])
            outs.append(self._feed(self._pieces([s], pending), cache))
            self._cache = cache if self._cache is None else self._cache.extend(cache)
            self._rows.append(s)
        h = mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
        return self._chain(h, self._cache.layers, k).tolist()

    def _drafted_compiled(self, pieces: tuple, k: int) -> list[list[int]]:
        """`_drafted` for the rows in the head's cache as one compiled block
        (their waiting positions read, then k - 1 chained steps), when every
        row reads the same number of positions, no more than a step keeps
        (adapters never wrap the head or the LM head: nothing here is routed
        per row); else `_drafted` on the same pieces."""
        tokens, hidden = pieces
        widths = {len(t) for t in tokens}
        layers = self._cache.layers
        if len(widths) != 1 or not 0 < (width := widths.pop()) <= k + 1 or not self.compiled.steppable(layers):
            return self._drafted([], {}, k, pieces)
        x = mx.array(tokens, dtype=mx.uint32)
        outputs = self.compiled.block(f"mtp-{k}", self._chained(k), (x, mx.stack(hidden)), layers, written=width + k - 1)
        if outputs is None:
            return self._drafted([], {}, k, pieces)
        return outputs[0].tolist()

    def _chained(self, k: int):
        def run(inputs: tuple, layers: list) -> list:
            x, hidden = inputs
            return [self._chain(self.head(self.body.embed_tokens(x), hidden, layers[0])[:, -1], layers, k)]

        return run

    def _chain(self, h: mx.array, layers: list, k: int) -> mx.array:
        """(rows, k) drafted tokens: the LM head's pick from the head's
        output `h` (rows, hidden) after each row's last read position, then
        k - 1 steps of the head fed its own output and pick."""
        tokens = mx.argmax(self.lm_head(h), axis=-1)
        drafted = [tokens]
        for _ in range(k - 1):
            h = self.head(self.body.embed_tokens(tokens[:, None]), h[:, None], layers[0])[:, -1]
            tokens = mx.argmax(self.lm_head(h), axis=-1)
            drafted.append(tokens)
        return mx.stack(drafted, axis=1)

    def _pieces(self, rows: list[MtpState], pending: dict) -> tuple[list[list[int]], list[mx.array]]:
        """Each row's waiting hidden states (n, hidden) and the tokens that
        followed them (the last: its pending token); taken from the rows."""
        hs, ts = [], []
        for s in rows:
            h = mx.concatenate([a for _, a in s.hidden], axis=0) if len(s.hidden) > 1 else s.hidden[0][1]
            start = s.hidden[0][0]
            hs.append(h)
            ts.append(s.tokens[start + 1 : start + h.shape[0]] + [pending[id(s)]])
            s.hidden.clear()
        return ts, hs

    def _feed(self, pieces: tuple, cache: BatchCache) -> mx.array:
        """Feeds each row's waiting hidden states with the tokens that
        followed them (`_pieces`); returns (rows, hidden) of the head after
        each row's last one."""
        ts, hs = pieces
        lengths = [len(t) for t in ts]
        width = max(lengths)
        x = mx.array([t + [0] * (width - len(t)) for t in ts], dtype=mx.uint32)
        h = mx.stack([mx.pad(a, ((0, width - a.shape[0]), (0, 0))) if a.shape[0] < width else a for a in hs])
        if cache.merged and width * len(ts) > sum(lengths):
            cache.pad(lengths, width)
        out = self.head(self.body.embed_tokens(x), h, cache.layers[0])
        if cache.merged:
            cache.unpad()
        return out[mx.arange(len(ts)), mx.array([n - 1 for n in lengths])]
