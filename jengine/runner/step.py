"""The jitted step: model forward over the ragged batch, logits at the sampling rows, prompt logprobs, the sampler.

The runner calls `step(params, state, batch)`: `params` the weights, `state` the device state a step replaces
(`StepState`: the KV cache, updated in place, and the token feed), `batch` everything about this step (`StepBatch`,
one typed pytree built on the host). What selects a compiled variant is a static field of the batch (the attention
query bound, the sampler's flags, the prompt-logprob width) or a shape; a new per-row input (a LoRA slot, a grammar
bitmask, draft tokens) is a new field there, never another argument. The model, the backend and the expert mesh are
one static, hashable `StepModel`, so engines built one after another in one process share compiled steps. The
per-step pytrees are not frozen: several are built per step, and a frozen dataclass's __init__ (object.__setattr__
per field) costs several times more; nothing changes them after they are built.

The token feed: `row_tokens` holds, per persistent-batch row, the token that row sampled last. The sampler writes it
and the next step's forward reads it wherever the host passed a pending placeholder (`input_batch.pending_token_id`),
so step N+1 can be dispatched before step N's tokens reach the host.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jengine.attention.backend import AttentionBackend
from jengine.attention.kv_cache import KVCache
from jengine.attention.metadata import AttentionMetadata
from jengine.layers.invariant import row_reduction_for
from jengine.layers.lora import LoraRows
from jengine.models.decoder import compute_logits, forward_capturing
from jengine.models.spec import ModelSpec
from jengine.runner.host_pack import Packed, pack, unpack
from jengine.runner.input_batch import PENDING_BASE
from jengine.runner.launch import EAGER_OPTIONS, LaunchPolicy
from jengine.runner.program_store import ProgramStore, device_assignment, program_key
from jengine.sampling.metadata import SamplingMetadata
from jengine.sampling.sampler import SamplerOutput, raw_logprobs, sample
from jengine.structured.device import apply_token_mask


@dataclasses.dataclass(frozen=True)
class StepModel:
    """What the step's programs are specialised to (a static argument): equal values share compiled programs."""

    spec: ModelSpec
    backend: AttentionBackend
    expert_mesh: jax.sharding.Mesh | None = None  # the mesh experts are split over (expert parallelism), else None
    # Hidden states the forward also returns for a proposer (EAGLE heads): None, none (the plain step's program);
    # () the final-normed hidden states; (i, j, ...) the inputs of those layers side by side (EAGLE-3)
    capture: tuple[int, ...] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(slots=True)
class StepState:
    """The device state each step takes and replaces (the forward donates it: the cache is updated in place)."""

    kv_cache: KVCache  # [layers, blocks, block_size, 2, kv_heads, head_dim] (or its fp8 QuantizedKV)
    row_tokens: Int[Array, " rows"] | None  # per persistent-batch row, its last sampled token; None: no feed


@jax.tree_util.register_dataclass
@dataclasses.dataclass(slots=True)
class ModelInputs:
    """The forward's part of a step: ragged tokens, their attention metadata and the rows whose logits count."""

    token_ids: Int[Array, " tokens"]  # pending placeholders (≤ PENDING_BASE) are read from `row_tokens`
    attention: AttentionMetadata
    logits_rows: Int[Array, " seqs"]  # flattened row of each request's last new token
    prompt_rows: Int[Array, " prompt_rows"] | None  # rows whose logits score the next prompt token; None: none asked
    prompt_targets: Int[Array, " prompt_rows"] | None  # the prompt token each of those rows scores
    num_prompt_logprobs: int = dataclasses.field(default=0, metadata=dict(static=True))  # top-K width of those
    lora: LoraRows | None = None  # each token row's adapter slot (params["lora"] holds the slots); None: no LoRA


@jax.tree_util.register_dataclass
@dataclasses.dataclass(slots=True)
class StepBatch:
    """One step's inputs. The forward and the sampler are separate programs and each sees only its part, so model
    shapes and sampling options compile independently (their counts add instead of multiplying)."""

    model: ModelInputs
    sampling: SamplingMetadata  # one row per request bucket row
    sample_rows: Int[Array, " seqs"]  # batch row that records each sample; out of range where it does not count
    # Packed allowed-token bits of each row (structured output; free rows all ones); None: no row is constrained,
    # and the sampler compiles without it.
    token_mask: Int[Array, "seqs words"] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(slots=True)
class StepOutput:
    sampled: SamplerOutput
    prompt_logprobs: SamplerOutput | None  # at `ModelInputs.prompt_rows`, when asked


def resolve_pending(ids: Int[Array, "*shape"], row_tokens: Int[Array, " rows"]) -> Int[Array, "*shape"]:
    """`ids` with each pending placeholder (PENDING_BASE - r) replaced by the token row r sampled last."""
    rows = jnp.clip(PENDING_BASE - ids, 0, row_tokens.shape[0] - 1)
    return jnp.where(ids <= PENDING_BASE, row_tokens[rows], ids)


def _forward_step(model: StepModel, params: dict, state: StepState, inputs: ModelInputs | Packed
                  ) -> tuple[Float[Array, "seqs vocab"], SamplerOutput | None, StepState,
                             Float[Array, "tokens features"] | None]:
    """Model forward over the ragged batch; float32 logits at the sampling rows; prompt logprobs when asked; the
    hidden states `model.capture` names (None when it names none). With a token feed, pending placeholders take
    the rows' last sampled tokens. `inputs` may come packed (`host_pack.pack`: one host→device copy)."""
    inputs = unpack(inputs)
    token_ids = inputs.token_ids
    if state.row_tokens is not None:
        token_ids = resolve_pending(token_ids, state.row_tokens)
    layers = model.capture or ()
    hidden, kv_cache, captured = forward_capturing(model.spec, model.backend, params, state.kv_cache, token_ids,
                                                   inputs.attention, layers, model.expert_mesh, inputs.lora)
    features = None
    if model.capture is not None:
        features = jnp.concatenate(captured, axis=-1) if layers else hidden
    logits = compute_logits(model.spec, params, hidden[inputs.logits_rows])
    prompt = None
    if inputs.prompt_rows is not None:
        prompt_logits = compute_logits(model.spec, params, hidden[inputs.prompt_rows])
        prompt = raw_logprobs(inputs.prompt_targets, prompt_logits, inputs.num_prompt_logprobs,
                              row_reduction_for(params))
    return logits, prompt, StepState(kv_cache, state.row_tokens), features


def sampler_inputs(batch: StepBatch) -> Packed:
    """The sampler's host-built inputs (`sample_step`'s `host`) as one packed buffer: one host→device copy."""
    return pack((batch.sampling, batch.sample_rows, batch.token_mask))


def _sample_step(logits: Float[Array, "seqs vocab"], host: Packed, row_tokens: Int[Array, " rows"]
                 ) -> tuple[SamplerOutput, Int[Array, " rows"]]:
    """Samples one token per row and records it as the last token of its persistent-batch row (`sample_rows`;
    out of range for rows whose sample does not count); pending ids in the penalties' histories are resolved.
    A token mask bans the tokens each constrained row's grammar does not allow, before anything else. `host`:
    `sampler_inputs`, the packed (sampling metadata, sample_rows, token_mask or None)."""
    sampling, sample_rows, token_mask = unpack(host)
    if token_mask is not None:
        logits = apply_token_mask(logits.astype(jnp.float32), token_mask)
    if sampling.output_token_ids.shape[1]:
        sampling = dataclasses.replace(sampling,
                                       output_token_ids=resolve_pending(sampling.output_token_ids, row_tokens))
    out = sample(logits, sampling)
    return out, row_tokens.at[sample_rows].set(out.token_ids, mode="drop")


# The step's two programs as jits, in two launch modes (`runner/launch.py`): XLA's command buffers, or every kernel
# launched on its own (`EAGER_OPTIONS`). The whole state is donated: the cache is written in place, and `row_tokens`
# (read, not written, here) comes back as the same buffer. The sampler does not donate it: the forward may still be
# reading it when the sampler is called.
_jit_forward = functools.partial(jax.jit, _forward_step, static_argnames=("model",), donate_argnames=("state",))
STEP_JITS = {False: (_jit_forward(), jax.jit(_sample_step)),
             True: (_jit_forward(compiler_options=EAGER_OPTIONS),
                    jax.jit(_sample_step, compiler_options=EAGER_OPTIONS))}
forward_step, sample_step = STEP_JITS[False]


StepFn = Callable[[dict, StepState, StepBatch], tuple[StepState, StepOutput]]


class StepPrograms:
    """The step's two programs, compiled ahead for the runner's shapes and called directly at dispatch (keyed by the
    shapes of the inputs that vary; the weights and state keep theirs). `compile` builds one batch's programs, or
    loads them from the `ProgramStore` without tracing; a shape never compiled goes through the jits."""

    def __init__(self, model: StepModel, store: ProgramStore | None = None,
                 launch: LaunchPolicy = LaunchPolicy()) -> None:
        self.model, self.store, self.launch = model, store, launch
        self._forward: dict[Hashable, Any] = {}
        self._sample: dict[Hashable, Any] = {}
        self._building: dict[Hashable, threading.Lock] = {}  # one per program: start-up's threads build each once

    def forward(self, params: dict, state: StepState, inputs: ModelInputs, verification: bool = False):
        """The forward of a step of `inputs` (packed here: one host→device copy). `verification`: a speculative
        step's (drafts scored at k + 1 rows a request), which runs every decode iteration: launched as a decode step
        is, whatever its query bound."""
        packed = pack(inputs)
        program = self._forward.get(_shapes_of(packed))
        if program is None:
            return self._forward_jit(inputs, verification)(self.model, params, state, packed)
        return program(params, state, packed)

    def sample(self, logits: Float[Array, "seqs vocab"], host: Packed, row_tokens: Int[Array, " rows"]):
        program = self._sample.get((logits.shape, _shapes_of(host)))
        if program is None:
            return self._sample_jit(logits, host, row_tokens)
        return program(logits, host, row_tokens)

    def compile(self, params: dict, state: StepState, batch: StepBatch) -> tuple[float, float]:
        """Compiles (or loads) the programs a step of `batch` calls, without running them (nothing is donated or
        written): start-up runs it from several threads. Returns the seconds spent (tracing and lowering, XLA
        compiling or loading)."""
        packed = pack(batch.model)
        forward, lower_f, compile_f = self._build(self._forward, _shapes_of(packed), self._forward_jit(batch.model),
                                                  (params, state, packed))
        logits = forward.out_info[0]
        logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=logits.sharding)
        host = sampler_inputs(batch)
        _, lower_s, compile_s = self._build(self._sample, (logits.shape, _shapes_of(host)), self._sample_jit,
                                            (logits, host, state.row_tokens))
        return lower_f + lower_s, compile_f + compile_s

    def _forward_jit(self, inputs: ModelInputs, verification: bool = False):
        """The forward jit of the launch mode of a step of `inputs` (by its static `max_query_len`; a verification
        step's as a decode's)."""
        return STEP_JITS[self.launch.eager_for(1 if verification else inputs.attention.max_query_len)][0]

    @property
    def _sample_jit(self):
        return STEP_JITS[self.launch.eager_sampler][1]

    def _build(self, table: dict, shapes: Hashable, jitted, args: tuple):
        """(program, seconds tracing and lowering, seconds compiling or loading), the program put in `table` (found
        there where another batch of the same shapes built it: the sampler's variants share their forward; a thread
        that finds it being built waits for it)."""
        with self._building.setdefault((jitted.__name__, shapes), threading.Lock()):
            if shapes in table:
                return table[shapes], 0.0, 0.0
            return self._build_new(table, shapes, jitted, args)

    def _build_new(self, table: dict, shapes: Hashable, jitted, args: tuple):
        start = time.perf_counter()
        static = (self.model,) if jitted.__name__ == _forward_step.__name__ else ()
        mode = "eager" if jitted in STEP_JITS[True] else "graphs"
        key = program_key(f"{jitted.__name__}-{mode}", static, args) if self.store is not None else None
        compiled = self.store.load(key, device_assignment(args)) if key is not None else None
        if compiled is not None:
            table[shapes] = compiled
            return compiled, 0.0, time.perf_counter() - start
        lowered = jitted.lower(*static, *args)
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        if key is not None:
            self.store.save(key, compiled)
        table[shapes] = compiled
        return compiled, lowered_at - start, time.perf_counter() - lowered_at


def _shapes_of(tree: Any) -> Hashable:
    """What selects a compiled program for `tree` (a `Packed`): its structure and its leaves' shapes."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple(leaf.shape for leaf in leaves)


def build_step(programs: StepPrograms) -> StepFn:
    """One engine step for one model: forward, then sampling. Returns the new state and the step's outputs;
    nothing waits for the device."""

    def step(params: dict, state: StepState, batch: StepBatch) -> tuple[StepState, StepOutput]:
        logits, prompt, state, _ = programs.forward(params, state, batch.model)
        return sample_phase(logits, prompt, state, batch, programs)

    return step


def sample_phase(logits: Float[Array, "seqs vocab"], prompt: SamplerOutput | None, state: StepState,
                 batch: StepBatch, programs: StepPrograms) -> tuple[StepState, StepOutput]:
    """The step's second program, on the forward's outputs: a runner that must fill `batch.token_mask` on the host
    launches the forward (`StepPrograms.forward`) first and this once the mask is ready."""
    sampled, row_tokens = programs.sample(logits, sampler_inputs(batch), state.row_tokens)
    return StepState(state.kv_cache, row_tokens), StepOutput(sampled, prompt)


def num_compiled_shapes() -> int:
    """How many step variants are compiled in this process (the recompilation guard watches it grow)."""
    return sum(jitted._cache_size() for jits in STEP_JITS.values() for jitted in jits)
