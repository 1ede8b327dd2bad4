"""The decode batch's forward pass, compiled (`mx.compile`) per batch shape.

A small model's decode step is bound by the host, not the device: mlx-lm's
Python builds the step's graph op by op every token (on CUDA and on the CPU
the gated-delta recurrence runs as ops, not as one kernel), and the device
waits for it. A compiled step replays a traced graph instead, with its
elementwise chains fused into single kernels.

mlx-lm's caches cannot be traced as they are: attention caches write each
token at a Python-int offset, which a trace would freeze. Inside the
compiled function the model therefore sees stand-ins for its caches
(`_TracedKV`, `_TracedArrays`) whose every position is an array:

- an attention layer writes the new key and value at column `col` (a
  one-element array) of a buffer whose capacity is a multiple of
  `KVCache.step`, and attends over the whole buffer under a mask of each
  row's filled columns (left padding excluded, nothing past `col`);
- a linear-attention layer's conv and recurrent states are plain inputs and
  outputs.

So a trace depends only on the batch size and the buffers' capacity, and one
is made per (rows, capacity) pair met; capacities grow in 256-token steps,
before the call, outside the trace. Afterwards the new buffers and states go
back into mlx-lm's own cache objects, which every other path (joining,
leaving, prefix snapshots, prefill) keeps using unchanged.

Quantized attention caches (`kv_bits`, worker.engine.kv_quant) step the
same way (`_TracedQuantKV`): the new key and value are quantized inside the
trace and written at `col` into each of the three arrays (packed values,
scales, biases), and the model's attention takes the quantized path
(worker.engine.quant_attention) over the whole buffer under the same mask.

Only rows without a LoRA adapter step this way (an adapter's routing is
Python state a trace would freeze), and only over the cache types above:
anything else (rotating caches, padding still pending, a batch holding both
plain and quantized rows) takes the model's own forward.

On CUDA the generator's decode steps run traced or op by op, whichever its
timing of both found faster for that batch size (`choice`,
worker.engine.step_choice): mlx's fused attention kernels for a decode
step there (its vector kernel, and cuDNN's) refuse any array mask, and the
trace always masks its whole buffer, so under the trace every layer's
attention runs as separate matmul, mask and softmax kernels, against the
elementwise chains the trace fuses. Steps nobody times (a draft model's)
keep a fixed rule: a lone row of an attention-only model takes the
model's own forward, whose caches need no mask, as in mlx-lm's
`stream_generate`; a hybrid model keeps the trace, its fused gated-delta
steps gaining more than its few attention layers lose (measured on an
H200 with the 0.8b shape: 1.2x mlx-lm's decode). Blocks of several tokens
a row (a speculative verify, a draft model's read) keep the trace:
unmasked, several queries went to cuDNN, which builds a graph for every
new key length (mlx's attention graph cache is keyed by the key's shape,
except for one-query decoding), and such a block meets a new length every
step (on an H200 a lone row's draft model ran at 0.59x plain decoding that
way, against 3.3x at 8 rows). Blocks of up to 64 tokens now take two
matmuls there instead (worker.runtime.short_attention); whether they would
now run faster op by op has not been measured.
"""

from __future__ import annotations

import logging
from functools import partial

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from worker.engine.kv_quant import BatchLazyKV, BatchQuantKV, LazyKV, QuantKV
from worker.engine.step_choice import StepChoice
from worker.runtime.memory import processor

log = logging.getLogger("worker")

# Distinct traces kept before the compiled function is dropped and traced
# afresh (each holds its graph; a long-lived worker meets many capacities):
# at least this many, and CAPACITIES_KEPT per batch size, since the warm-up
# traces every batch size once and dropping them all at the next new shape
# makes the running batch trace again at each size it shrinks through
# (max_batch 64: a lone request that crossed 256 tokens left 1 trace of 64).
MAX_TRACES = 64
CAPACITIES_KEPT = 4


class _TracedKV:
    """An attention cache inside the trace: the whole buffer, written at `col`."""

    def __init__(self, keys: mx.array, values: mx.array, col: mx.array, offset: mx.array):
        self.keys, self.values, self.col = keys, values, col
        self.offset = offset  # (B,) each row's position: rope's offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.col, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.col, axes=(2,))
        self._moved(keys.shape[2])
        return self.keys, self.values

    def _moved(self, n: int) -> None:
        # As mlx-lm's caches do after a write: a block that chains forwards
        # (a drafter's) writes its next tokens after these.
        self.col = self.col + n
        self.offset = self.offset + n

    def _capacity(self) -> int:
        return self.keys.shape[2]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        columns = mx.arange(self._capacity())
        first = self.col - self.offset  # each row's left padding
        # Query i (of n written at col...) sees its row's columns up to its own.
        last = self.col + mx.arange(n)
        filled = (columns[None, None, :] >= first[:, None, None]) & (columns[None, None, :] <= last[None, :, None])
        return filled[:, None, :, :]


class _TracedQuantKV(_TracedKV):
    """A quantized attention cache inside the trace: `keys` and `values` are
    (packed, scales, biases); `bits` sends the model's attention down the
    quantized path."""

    def __init__(self, keys: tuple, values: tuple, col: mx.array, offset: mx.array, group_size: int, bits: int):
        self.keys, self.values, self.col, self.offset = keys, values, col, offset
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[tuple, tuple]:
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        self.keys = tuple(mx.slice_update(b, x, self.col, axes=(2,)) for b, x in zip(self.keys, qk))
        self.values = tuple(mx.slice_update(b, x, self.col, axes=(2,)) for b, x in zip(self.values, qv))
        self._moved(keys.shape[2])
        return self.keys, self.values

    def _capacity(self) -> int:
        return self.keys[0].shape[2]


class _TracedArrays:
    """A linear-attention cache inside the trace: its two states."""

    lengths = None

    def __init__(self, conv: mx.array, state: mx.array):
        self.cache = [conv, state]

    def __getitem__(self, i: int) -> mx.array:
        return self.cache[i]

    def __setitem__(self, i: int, value: mx.array) -> None:
        self.cache[i] = value

    def advance(self, n: int) -> None:
        pass

    def make_mask(self, n: int) -> None:
        return None


def _attention(c) -> bool:
    return type(c) in (KVCache, BatchKVCache, QuantKV, BatchQuantKV, LazyKV)


def _inner(c):
    """The cache the step writes: a batch under quantized_kv_start steps
    only while it holds rows of one kind, through that kind's batch cache."""
    return c.pure if type(c) is BatchLazyKV else c


def _steppable(c) -> bool:
    if _attention(c):
        return c.keys is not None
    if type(c) is ArraysCache:
        return c.left_padding is None and c.lengths is None and all(s is not None for s in c.cache)
    return False


def _column(c) -> int:
    return c._idx if isinstance(c, BatchKVCache) else c.offset


def _grow(c, col: int, width: int) -> None:
    """Makes room for the `width` tokens written at `col`, in a buffer whose
    capacity is a multiple of KVCache.step, so that traces are shared across
    many positions (rows leaving a batch, a resumed snapshot or a merge
    leave other capacities)."""
    quantized = isinstance(c.keys, tuple)
    capacity = (c.keys[0] if quantized else c.keys).shape[2]
    if col + width <= capacity and capacity % KVCache.step == 0:
        return
    step = KVCache.step
    wanted = -(-(col + width) // step) * step

    def grown(x: mx.array) -> mx.array:
        B, H, _, d = x.shape
        return mx.concatenate([x[..., :col, :], mx.zeros((B, H, wanted - col, d), x.dtype)], axis=2)

    if quantized:
        c.keys, c.values = tuple(grown(x) for x in c.keys), tuple(grown(x) for x in c.values)
    else:
        c.keys, c.values = grown(c.keys), grown(c.values)


class CompiledDecode:
    """`forward(inputs, layers)` is the model's decode forward on (B,) inputs
    over the batch's caches, compiled; `steppable(layers)` says whether
    these caches can take it. `block(name, run, inputs, layers)` is a
    forward of several tokens per row (a speculative step's verify), traced
    the same way."""

    def __init__(self, model):
        self.model = model
        self._fn = mx.compile(self._step)
        # name -> the compiled block forward of that kind (see `block`)
        self._blocks: dict[str, object] = {}
        self._runs: dict[str, object] = {}
        self._shapes: set[tuple] = set()  # the decode step's traces
        # The blocks' traces, bounded apart: a speculative batch meets many
        # more shapes (widths times capacities), which must not drop the
        # decode step's.
        self._block_shapes: set[tuple] = set()
        self.max_traces = MAX_TRACES
        # Traces made so far: a step that made one is no measure of speed.
        self.traces = 0
        self.failed: str | None = None  # why the model could not be traced
        self.failed_blocks: dict[str, str] = {}  # why a kind of block could not
        self._quant: tuple[int, int] | None = None  # (group_size, bits) of quantized caches
        # Untimed steps: a lone row of plain attention caches decodes op by
        # op; timed ones (`way` with their rows): the faster way, by batch
        # size (see the module's docstring).
        self.lone_attention_eager = processor() == "cuda"
        self.choice = StepChoice() if processor() == "cuda" else None

    def keep_for(self, max_batch: int) -> None:
        """Keeps enough traces for batches of up to max_batch rows."""
        self.max_traces = max(MAX_TRACES, CAPACITIES_KEPT * max_batch)

    def steppable(self, layers: list) -> bool:
        for c in layers:
            if type(c) in (LazyKV, BatchLazyKV):
                # Conversions due before this step first: they decide the forms it runs with.
                c.settle()
        return self.failed is None and bool(layers) and all(_steppable(_inner(c)) for c in layers)

    def decodes(self, layers: list) -> bool:
        """Whether a decode step (one token a row) nobody times takes the
        trace: steppable, and not a lone row of plain attention caches on
        CUDA (see the module's docstring)."""
        return self.steppable(layers) and self._by_rule(layers)

    def _by_rule(self, layers: list) -> bool:
        return not (self.lone_attention_eager and all(type(c) is KVCache for c in layers))

    def way(self, layers: list, rows: int) -> tuple[bool | None, tuple[int, int] | None]:
        """For a decode step of `rows` the caller times: None when these
        caches cannot take the trace, else whether it does, the way `choice`
        keeps for `key(layers, rows)`, and that key, which the caller
        reports the step's time under (None without a choice: `decodes`'s
        rule decides)."""
        if not self.steppable(layers):
            return None, None
        if self.choice is None:
            return self._by_rule(layers), None
        key = self.key(layers, rows)
        return self.choice.traced(key), key

    @staticmethod
    def key(layers: list, rows: int) -> tuple[int, int]:
        """What a choice of way is kept for: the rows, and the capacity in
        tokens of their longest attention cache (0 for a model without one)."""
        tokens = 0
        for c in layers:
            c = _inner(c)
            if _attention(c) and c.keys is not None:
                tokens = max(tokens, (c.keys[0] if isinstance(c.keys, tuple) else c.keys).shape[2])
        return rows, tokens

    def _traced(self, states: list) -> list:
        layers = []
        for s in states:
            if len(s) == 2:
                layers.append(_TracedArrays(*s))
            elif isinstance(s[0], tuple):
                layers.append(_TracedQuantKV(*s, *self._quant))
            else:
                layers.append(_TracedKV(*s))
        return layers

    @staticmethod
    def _written(layers: list) -> list:
        return [(c.keys, c.values) if isinstance(c, _TracedKV) else tuple(c.cache) for c in layers]

    def _step(self, inputs: mx.array, states: list) -> tuple[mx.array, list]:
        layers = self._traced(states)
        logits = self.model(inputs[:, None], cache=layers)[:, -1, :]
        return logits, self._written(layers)

    def _block(self, name: str, inputs: mx.array, states: list) -> tuple[list, list]:
        layers = self._traced(states)
        outputs = self._runs[name](inputs, layers)
        return outputs, self._written(layers)

    def _states(self, layers: list, width: int) -> tuple[list, tuple]:
        """The traced function's cache inputs, and the shape key of its trace."""
        states = []
        columns: dict[int, mx.array] = {}
        for c in map(_inner, layers):
            if _attention(c):
                col = _column(c)
                _grow(c, col, width)
                if col not in columns:
                    columns[col] = mx.array([col], dtype=mx.int32)
                offset = c.offset if isinstance(c, BatchKVCache) else mx.array([c.offset], dtype=mx.int32)
                if isinstance(c.keys, tuple):
                    # One setting per model: the trace keeps it as a constant.
                    self._quant = (c.group_size, c.bits)
                states.append((c.keys, c.values, columns[col], offset))
            else:
                states.append((c[0], c[1]))
        capacities = tuple(s[0].shape[2] if not isinstance(s[0], tuple) else (s[0][0].shape[2], "quantized") for s in states if len(s) == 4)
        return states, capacities

    def _full(self, shapes: set[tuple], shape: tuple) -> bool:
        """Whether a new shape finds `shapes` at the bound (MAX_TRACES); they
        are then forgotten, and the caller compiles its functions afresh."""
        if shape in shapes or len(shapes) < self.max_traces:
            return False
        shapes.clear()
        return True

    def forward(self, inputs: mx.array, layers: list) -> mx.array:
        states, capacities = self._states(layers, 1)
        shape = (inputs.shape[0], capacities)
        if self._full(self._shapes, shape):
            self._fn = mx.compile(self._step)
        if shape in self._shapes:
            logits, out = self._fn(inputs, states)
        else:
            log.debug("compiled decode step: tracing %d rows, capacities %s", shape[0], shape[1])
            try:
                logits, out = self._fn(inputs, states)
            except Exception as exc:
                # A forward that evaluates while it builds (reads a value
                # back, say) cannot be traced; nothing was written yet.
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning("this model's decode step cannot be compiled; building it op by op (%s)", self.failed)
                return self.model(inputs[:, None], cache=layers)[:, -1, :]
            self._shapes.add(shape)
            self.traces += 1
        # The old buffers must not be referenced past this call, so that the
        # compiled slice updates write in place instead of copying them.
        del states
        self._advance(layers, out, 1)
        return logits

    def block(self, name: str, run, inputs: mx.array | tuple, layers: list, written: int | None = None) -> list | None:
        """`run(inputs, layers)` (a list of arrays: its outputs) over (B, W)
        inputs (or a tuple of arrays, the first (B, W) token ids, the others
        (B, W, ...) beside them) and the batch's caches, compiled; the caches advance by the
        tokens it writes per row (`written`, default W: one forward; more
        when `run` chains forwards). `name` is the kind of block; each
        name's first `run` is the one traced. None when this kind cannot be
        traced (the caller runs it op by op; nothing was written)."""
        if name in self.failed_blocks:
            return None
        if name not in self._blocks:
            self._runs[name] = run
            self._blocks[name] = mx.compile(partial(self._block, name))
        ids = inputs[0] if isinstance(inputs, tuple) else inputs
        written = ids.shape[1] if written is None else written
        states, capacities = self._states(layers, written)
        shape = (name, tuple(x.shape for x in inputs) if isinstance(inputs, tuple) else inputs.shape, capacities)
        if self._full(self._block_shapes, shape):
            self._blocks = {name: mx.compile(partial(self._block, name)) for name in self._blocks}
        if shape in self._block_shapes:
            outputs, out = self._blocks[name](inputs, states)
        else:
            log.debug("compiled %s: tracing %d rows of %d tokens, capacities %s", name, *ids.shape, capacities)
            try:
                outputs, out = self._blocks[name](inputs, states)
            except Exception as exc:
                self.failed_blocks[name] = f"{type(exc).__name__}: {exc}"
                log.warning("compiled %s: cannot be traced; building it op by op (%s)", name, self.failed_blocks[name])
                return None
            self._block_shapes.add(shape)
            self.traces += 1
        del states
        self._advance(layers, out, written)
        return outputs

    @staticmethod
    def _advance(layers: list, out: list, width: int) -> None:
        for lazy, new in zip(layers, out):
            c = _inner(lazy)
            if c is not lazy:
                lazy.advanced(width)
            if _attention(c):
                c.keys, c.values = new
                if not isinstance(c, BatchKVCache):
                    c.offset += width
                else:
                    c._idx += width
                    c.offset = c.offset + width
            else:
                c[0], c[1] = new
