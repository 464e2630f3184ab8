"""`ModelRunner.execute(SchedulerOutput) -> RunnerOutput`: the only owner of device arrays (weights, KV cache).

Host bookkeeping here (persistent batch, padded inputs, sampling metadata); the math in the jitted step. One
device→host copy per step brings the sampled tokens (and logprobs when asked) back. `execute` is `dispatch` (launch
the step, wait for nothing) then `fetch` (that copy); a pipelined engine dispatches the next step in between, whose
inputs take the pending tokens from the device (see `step.py`). Each dispatch builds one `StepBatch` and calls
`step(params, state, batch)`; start-up compilation (`warm_up`) runs the same call on padding-only batches.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import numpy as np

from jengine.attention.backend import AttentionBackend
from jengine.attention.kv_cache import KVCache
from jengine.config import EngineConfig
from jengine.layers.invariant import RowReduction, row_reduction_for
from jengine.layers.lora import LoraRows
from jengine.lora.runner_slots import RunnerLora
from jengine.lora.rows import build_rows
from jengine.models.spec import ModelSpec
from jengine.parallel.sharding import ParallelLayout
from jengine.runner.buckets import StepBuckets, pick, powers_of_two
from jengine.runner.input_batch import InputBatch, StepInputs
from jengine.runner.kv_storage import KVPlan, allocate
from jengine.runner import compile as compiling
from jengine.runner.compile import RecompileGuard, StepShape, padding_inputs, pinned_shapes
from jengine.runner.launch import launch_policy
from jengine.runner.protocol import TokenMaskSource
from jengine.runner.token_masks import WaitingSampler, padded_masks
from jengine.runner.program_store import ProgramStore
from jengine.runner.step import (ModelInputs, StepBatch, StepModel, StepOutput, StepPrograms, StepState, build_step,
                                 sample_phase)
from jengine.sampling.metadata import SamplingMetadata, SamplingRowTable
from jengine.sampling.params import SamplingParams
from jengine.scheduler.output import RunnerOutput, SchedulerOutput, TokenLogprobs
from jengine.spec_decode.proposer import Proposer, build_proposer, fallback_reason
from jengine.spec_decode.rejection import VerifyOutput, verify
from jengine.spec_decode.verify_step import VerifyPlan, accepted_tokens, first_row_outputs, plan_verification

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PromptLogprobRequest:
    """The flattened-token rows of one request whose prompt logprobs this step computes."""

    request_id: str
    first_position: int  # position of the first target token (≥ 1)
    count: int
    starts_prompt: bool  # the chunk begins at position 0: the list starts with None for the first prompt token
    num_logprobs: int  # top logprobs asked per position


@dataclasses.dataclass(slots=True)
class InFlightStep:
    """A dispatched step: its device outputs (being copied to the host) and what turns them into a RunnerOutput.
    Holds no reference to the rows' requests, which may leave the batch before it is fetched. Not frozen: a step
    whose sampler waits for token masks gets its `out` when that sampler is launched."""

    inputs: StepInputs
    out: StepOutput | None
    prompt_plan: list[PromptLogprobRequest]
    logprobs_wanted: np.ndarray | None  # per scheduled request (-1: none) when the step returns logprobs
    verification: tuple[VerifyPlan, VerifyOutput] | None = None  # a step verifying drafts: its rows and verdicts


class ModelRunner:
    """A `StepRunner` over this process's devices; the jitted step is `step(params, state, batch)`."""

    def __init__(self, spec: ModelSpec, params: dict, dtype, config: EngineConfig, plan: KVPlan,
                 backend: AttentionBackend, layout: ParallelLayout, lora: RunnerLora | None = None,
                 proposer: Proposer | None = None, store: ProgramStore | None = None) -> None:
        """`params` are already placed as `layout` says; the KV cache is allocated here with its sharding.
        `lora`: the adapters' device slots and the host cache they load from (LoRA enabled). `proposer`:
        speculation's, when it holds device state of its own (a draft model); else built here. `store`: where
        compiled programs are saved and loaded (`ProgramStore.beside` the compilation cache; None: nowhere)."""
        self.spec, self.params, self.dtype = spec, params, dtype
        self.lora = lora
        self.config = config
        self.engine_seed = config.model.seed
        sched = config.scheduler
        max_blocks = -(-sched.max_model_len // plan.block_size)
        one_split = backend.one_split_positions(np.dtype(plan.kv_dtype).itemsize == 1)
        self.buckets = StepBuckets.build(sched.max_num_batched_tokens, sched.max_num_seqs, max_blocks,
                                         one_split // plan.block_size if one_split else None)
        self.layout = layout
        mode = config.runner.compile_buckets
        pin = mode == "all" or (mode == "auto" and backend.name != "reference")
        self.batch = InputBatch(sched.max_num_seqs, sched.max_model_len, plan.block_size,
                                plan.num_blocks * plan.block_size, self.buckets, pin_shapes=pin)
        self.backend = backend
        self.sampling_rows = SamplingRowTable(sched.max_num_seqs, engine_seed=config.model.seed,
                                              row_reduction=row_reduction_for(params))
        self.state = StepState(allocate(spec, plan, layout.kv_cache_sharding),
                               jax.device_put(np.zeros(sched.max_num_seqs, np.int32), layout.replicated))
        speculative = config.speculative
        self.proposer = proposer or (build_proposer(speculative) if speculative else None)
        capture = None if self.proposer is None else self.proposer.hidden_capture
        model = StepModel(spec, backend, layout.mesh if layout.expert_parallel else None, capture)
        self._model = model
        self.mask_words = -(-spec.vocab_size // 32)  # the sampler's token mask covers the model's whole vocabulary
        launch = launch_policy(layout.mesh.devices.flat[0].platform, config.runner.enforce_eager)
        self._programs = StepPrograms(model, store, launch)
        self._step = build_step(self._programs)
        self._speculates = np.zeros(sched.max_num_seqs, bool)  # per row: its request may speculate
        self.recompile_guard = RecompileGuard()
        self._waiting: WaitingSampler | None = None  # the last dispatched step, while its sampler waits for masks
        if pin:
            self.warm_up(pinned_shapes(self.buckets))
            if speculative is None:  # verification steps add shapes (k + 1 rows per request) compiled on first use
                self.recompile_guard.arm()

    @property
    def kv_cache(self) -> KVCache:
        """The paged KV cache (or its fp8 `QuantizedKV`), as the last dispatched step left it."""
        return self.state.kv_cache

    def execute(self, sched: SchedulerOutput, token_masks: TokenMaskSource | None = None) -> RunnerOutput:
        """One step, serially: launch it and wait for its tokens."""
        step = self.dispatch(sched) if token_masks is None else self.dispatch(sched, token_masks)
        return RunnerOutput([], [], [], {}) if step is None else self.fetch(step)

    def dispatch(self, sched: SchedulerOutput, token_masks: TokenMaskSource | None = None) -> InFlightStep | None:
        """Applies the diff and launches the step without waiting for the device (None when nothing is scheduled).
        Tokens of steps not fetched yet are pending: the step reads them on the device.

        With `token_masks` (structured output) only the forward is launched; the sampler waits for the masks,
        which the source is asked for as late as it can be: when the next step has been prepared on the host, just
        before its forward is launched (or when this step is fetched). The host fills them meanwhile, while the
        device runs the forward, and the device gets the sampler and the next forward back to back."""
        self.batch.apply(sched)
        if self.lora is not None:
            self.params = self.lora.apply(sched.lora_loads, self.params)
        for new in sched.new_requests:
            row = self.batch.rows[new.request_id].row
            self.sampling_rows.set_row(row, new.sampling_params, new.choice_index, new.request_counter,
                                       tuple(new.eos_token_ids))
            self._speculates[row] = fallback_reason(new.sampling_params) is None
        if sched.is_empty:
            return None
        inputs = self.batch.prepare(sched)
        if sched.scheduled_spec_tokens:
            return self._dispatch_verification(sched, inputs, token_masks)
        sampling = self._sampling_metadata(inputs)
        prompt_plan, prompt_rows, prompt_targets, prompt_k = self._prompt_logprob_rows(inputs)
        model = ModelInputs(inputs.token_ids, inputs.metadata, inputs.logits_rows, prompt_rows, prompt_targets,
                            prompt_k, self._lora_rows(self.batch.lora_slot[inputs.rows], inputs.num_scheduled,
                                                          len(inputs.token_ids)))
        batch = StepBatch(model, sampling, self._sample_rows(inputs))
        self.launch_waiting_sampler()  # the previous step's tokens are this forward's inputs
        logits = prompt = out = hidden = None
        if token_masks is None and self._model.capture is None:
            self.state, out = self._step(self.step_params, self.state, batch)
            _start_copy_to_host(out)
        else:  # the forward alone: its sampler waits for the masks, or it returns a proposer's hidden states
            logits, prompt, self.state, hidden = self._programs.forward(self.step_params, self.state, batch.model)
            if token_masks is None:
                self.state, out = sample_phase(logits, prompt, self.state, batch, self._programs)
                _start_copy_to_host(out)
        if self.proposer is not None:
            self.proposer.observe(model, inputs, hidden)
        self.recompile_guard.check(lambda: f"tokens={len(inputs.token_ids)} seqs={len(inputs.logits_rows)} "
                                           f"blocks={inputs.metadata.block_tables.shape[1]} "
                                           f"query_len={inputs.metadata.max_query_len}")
        self.batch.reserve_sampled(inputs.rows[inputs.samples])
        wanted = self.sampling_rows.logprobs[inputs.rows] if sampling.max_num_logprobs else None
        step = InFlightStep(inputs, out, prompt_plan, wanted)
        if token_masks is not None:
            self._waiting = WaitingSampler(step, logits, prompt, batch, token_masks)
        return step

    def launch_waiting_sampler(self) -> None:
        """Launches the sampler of the step that waits for its token masks (if one does), with the masks (rows in
        scheduled order; without them when no scheduled row turns out constrained)."""
        waiting, self._waiting = self._waiting, None
        if waiting is None:
            return
        masks = waiting.token_masks()
        batch = waiting.batch
        if masks is not None:
            batch.token_mask = padded_masks(*masks, len(batch.sample_rows), self.mask_words)
        self.state, waiting.step.out = sample_phase(waiting.logits, waiting.prompt, self.state, batch, self._programs)
        _start_copy_to_host(waiting.step.out)

    def fetch(self, step: InFlightStep) -> RunnerOutput:
        """Waits for a dispatched step's outputs (one device→host copy) and records its tokens in the batch; with
        speculation, the proposer's drafts for the next step come with them."""
        if self._waiting is not None and self._waiting.step is step:
            self.launch_waiting_sampler()
        if step.verification is not None:
            result = self._fetch_verification(step)
        else:
            out = jax.device_get(step.out)
            result = self._runner_output(step, out.sampled, out.prompt_logprobs)
        if self.proposer is not None:
            result = dataclasses.replace(result, draft_token_ids=self._propose(step.inputs))
        return result

    # ------------------------------------------------------------------ speculative decoding
    def _dispatch_verification(self, sched: SchedulerOutput, inputs: StepInputs,
                               token_masks: TokenMaskSource | None) -> InFlightStep:
        """A step whose requests with drafts are scored at their last k + 1 tokens and verified. Constrained
        requests never have drafts: each one's mask goes to its one row."""
        self.launch_waiting_sampler()
        plan = plan_verification(inputs, sched.scheduled_spec_tokens, self.buckets.tokens[-1])
        sampling = self._verify_sampling(inputs, plan)
        prompt_plan, prompt_rows, prompt_targets, prompt_k = self._prompt_logprob_rows(inputs)
        model = ModelInputs(inputs.token_ids, inputs.metadata, plan.logits_rows, prompt_rows, prompt_targets,
                            prompt_k, self._lora_rows(self.batch.lora_slot[inputs.rows], inputs.num_scheduled,
                                                          len(inputs.token_ids)))
        logits, prompt, self.state, hidden = self._programs.forward(self.step_params, self.state, model,
                                                                    verification=True)
        masks = token_masks() if token_masks is not None else None
        mask = None if masks is None else padded_masks(plan.first_rows[masks[0]], masks[1], len(plan.draft_ids),
                                                       self.mask_words)
        verdict = verify(logits, sampling, plan.draft_ids, mask)
        self.proposer.observe(model, inputs, hidden)
        _start_copy_to_host((verdict, prompt))
        self.batch.reserve_sampled(inputs.rows[inputs.samples])
        wanted = self.sampling_rows.logprobs[inputs.rows] if sampling.max_num_logprobs else None
        return InFlightStep(inputs, StepOutput(None, prompt), prompt_plan, wanted, (plan, verdict))

    def _verify_sampling(self, inputs: StepInputs, plan: VerifyPlan) -> SamplingMetadata:
        """One sampling row per verified position: position j samples generation step s + j, its penalty history
        holding the drafts before it (they sit in the batch after the known tokens)."""
        rows = inputs.rows[plan.request_of_row]
        num_prompt = self.batch.num_prompt[rows]
        steps = self.batch.num_tokens[rows] - num_prompt + plan.offset_in_request
        token_ids = self.batch.token_ids

        def histories(i: int):
            row, prompt = rows[i], num_prompt[i]
            return token_ids[row, :prompt], token_ids[row, prompt : prompt + steps[i]]

        return self.sampling_rows.build(rows, steps, histories, len(plan.draft_ids))

    def _fetch_verification(self, step: InFlightStep) -> RunnerOutput:
        plan, verdict = step.verification
        verdict, prompt = jax.device_get((verdict, step.out.prompt_logprobs))
        tokens, num_accepted = accepted_tokens(plan, np.asarray(verdict.candidates), np.asarray(verdict.accepted))
        inputs = step.inputs
        samples = inputs.samples
        sampling = np.flatnonzero(samples)
        self.batch.fill_verified(inputs.rows[sampling], inputs.owners[sampling], [tokens[i] for i in sampling],
                                 (plan.num_drafts - num_accepted)[sampling])
        sampled_lists = [emitted if sampled else [] for emitted, sampled in zip(tokens, samples.tolist())]
        return RunnerOutput(inputs.request_ids, sampled_lists,
                            self._token_logprobs(step, first_row_outputs(plan, verdict)),
                            self._prompt_output(step.prompt_plan, prompt))

    def _propose(self, inputs: StepInputs) -> dict[str, list[int]]:
        """Drafts for the requests of this step that sampled and may speculate, unless the batch is larger than
        `disable_by_batch_size`."""
        limit = self.config.speculative.disable_by_batch_size
        if limit is not None and len(self.batch.rows) > limit:
            return {}
        rows = inputs.rows
        chosen = np.flatnonzero(inputs.samples & self._speculates[rows] & (self.batch.owners[rows] == inputs.owners))
        if not chosen.size:
            return {}
        drafts = self.proposer.propose(self.batch, rows[chosen])
        return {inputs.request_ids[i]: d for i, d in zip(chosen.tolist(), drafts) if d}

    def shutdown(self) -> None:
        """Nothing runs beside this process's steps: the device arrays go with the runner."""

    # ------------------------------------------------------------------ start-up compilation
    def warm_up(self, shapes: list[StepShape], progress: bool = True) -> int:
        """Compiles the step for `shapes` (greedy and sampling variants of the sampler) by running padding-only
        steps; returns the compile count."""
        variants = [(shape, self.padding_batch(shape, sampled, masked))
                    for shape in shapes for masked in (False, True) for sampled in (0, 1)]
        batches = [batch for _, batch in variants]
        shape_of = {id(batch): shape for shape, batch in variants}
        last_forward: dict[StepShape, tuple] = {}  # the current shape's logits: its sampler variants share them

        def compile_one(batch: StepBatch) -> tuple[float, float]:
            return self._programs.compile(self.step_params, self.state, batch)

        def run_one(batch: StepBatch) -> StepState:
            # A shape's four variants differ in the sampler only: its forward (a whole padding step of the
            # bucket's rows on the device) runs once, and each variant's sampler on its logits.
            shape = shape_of[id(batch)]
            if shape not in last_forward:
                logits, prompt, self.state, _ = self._programs.forward(self.step_params, self.state, batch.model)
                last_forward.clear()
                last_forward[shape] = (logits, prompt)
            self.state, _ = sample_phase(*last_forward[shape], self.state, batch, self._programs)
            return self.state

        # The threads take one variant of every shape first: a shape's variants share its forward program, so in
        # shape order most threads waited on the thread building that forward (two forwards built at a time on 8)
        per_shape = len(variants) // max(len(shapes), 1)
        forwards_first = [batch for k in range(per_shape) for batch in batches[k::per_shape]]
        return compiling.warm_up(compile_one, run_one, batches, len(shapes), progress, forwards_first)

    def padding_batch(self, shape: StepShape, num_sampled: int, masked: bool = False) -> StepBatch:
        """A padding-only step of `shape` that samples `num_sampled` rows (0: the greedy variant) and records
        nothing in any row; `masked`: the sampler's structured-output variant (an all-ones token mask)."""
        token_ids, md, logits_rows = padding_inputs(shape, self.batch.num_slots)
        nowhere = np.full(shape.seqs, len(self.batch.num_tokens), np.int32)
        mask = np.full((shape.seqs, self.mask_words), -1, np.int32) if masked else None
        lora = self._lora_rows(np.zeros(0, np.int32), np.zeros(0, np.int32), len(token_ids))
        return StepBatch(ModelInputs(token_ids, md, logits_rows, None, None, lora=lora),
                         _padding_sampling(shape, num_sampled, self.sampling_rows.row_reduction), nowhere,
                         mask)

    @property
    def step_params(self) -> dict:
        """The weights the step reads: the model's, and the adapters' slot arrays under "lora" (LoRA enabled)."""
        return self.params if self.lora is None else {**self.params, "lora": self.lora.slots.arrays}

    def _lora_rows(self, row_slots: np.ndarray, num_scheduled: np.ndarray, num_tokens: int
                       ) -> LoraRows | None:
        if self.lora is None:
            return None
        return build_rows(row_slots, num_scheduled, num_tokens, self.lora.slots.num_slots)

    def _sample_rows(self, inputs: StepInputs) -> np.ndarray:
        """The batch row that records each padded row's sample; out of range (dropped) where it does not count."""
        nowhere = len(self.batch.num_tokens)
        out = np.full(len(inputs.logits_rows), nowhere, np.int32)
        out[: len(inputs.rows)] = np.where(inputs.samples, inputs.rows, nowhere)
        return out

    # ------------------------------------------------------------------ sampling inputs
    def _sampling_metadata(self, inputs: StepInputs) -> SamplingMetadata:
        rows = inputs.rows
        num_prompt = self.batch.num_prompt[rows]
        steps = self.batch.num_tokens[rows] - num_prompt

        def histories(i: int):
            row, prompt = rows[i], num_prompt[i]
            return self.batch.token_ids[row, :prompt], self.batch.output_history(row, prompt, prompt + steps[i])

        return self.sampling_rows.build(rows, steps, histories, len(inputs.logits_rows))

    def _prompt_logprob_rows(self, inputs: StepInputs
                             ) -> tuple[list[PromptLogprobRequest], np.ndarray | None, np.ndarray | None, int]:
        """Flattened rows whose logits give the next prompt token's logprob, for requests that asked."""
        wanted = self.batch.num_prompt_logprobs[inputs.rows]
        num_prompt = self.batch.num_prompt[inputs.rows]
        asking = np.flatnonzero((wanted >= 0) & (inputs.positions_start < num_prompt))
        if not asking.size:  # the common step: nobody asked, no Python loop over requests
            return [], None, None, 0
        offsets = np.cumsum(inputs.num_scheduled) - inputs.num_scheduled
        plan, rows, targets = [], [], []
        for i in asking.tolist():
            start, count = int(inputs.positions_start[i]), int(inputs.num_scheduled[i])
            n = max(min(start + count, int(num_prompt[i]) - 1) - start, 0)  # targets are positions start+1 ..
            plan.append(PromptLogprobRequest(inputs.request_ids[i], start + 1, n, start == 0, int(wanted[i])))
            rows.extend(range(int(offsets[i]), int(offsets[i]) + n))
            targets.extend(self.batch.token_ids[inputs.rows[i], start + 1 : start + 1 + n].tolist())
        k = int(wanted[asking].max())
        padded = pick(max(len(rows), 1), powers_of_two(16, max(16, self.buckets.tokens[-1])))
        pad = padded - len(rows)
        return (plan, np.array(rows + [0] * pad, np.int32), np.array(targets + [0] * pad, np.int32),
                pick(max(k, 1), powers_of_two(1, max(self.config.model.max_logprobs, 1))))

    # ------------------------------------------------------------------ outputs
    def _runner_output(self, step: InFlightStep, sampled, prompt_out) -> RunnerOutput:
        """Records the sampled tokens in the batch in one scatter; per request, only the output lists."""
        inputs = step.inputs
        n = len(inputs.request_ids)
        token_ids = np.asarray(sampled.token_ids)[:n]
        samples = inputs.samples
        all_sample = bool(samples.all())
        if all_sample:
            self.batch.fill_sampled(inputs.rows, token_ids, inputs.owners)
        else:
            self.batch.fill_sampled(inputs.rows[samples], token_ids[samples], inputs.owners[samples])
        sampled_lists = [[token] for token in token_ids.tolist()]
        if not all_sample:  # prefill chunks that stop short of their last token sample nothing
            for i in np.flatnonzero(~samples).tolist():
                sampled_lists[i] = []
        return RunnerOutput(inputs.request_ids, sampled_lists, self._token_logprobs(step, sampled),
                            self._prompt_output(step.prompt_plan, prompt_out))

    def _token_logprobs(self, step: InFlightStep, sampled) -> list[TokenLogprobs | None]:
        """Per row: the sampled token's raw logprobs and the top ones, for the requests that asked and sampled."""
        logprobs: list[TokenLogprobs | None] = [None] * len(step.inputs.request_ids)
        wanted = step.logprobs_wanted
        if sampled.logprobs is None or wanted is None:
            return logprobs
        for i in np.flatnonzero((wanted >= 0) & step.inputs.samples).tolist():
            width = int(wanted[i]) + 1
            logprobs[i] = TokenLogprobs(sampled.logprob_token_ids[i, :width].tolist(),
                                        sampled.logprobs[i, :width].tolist(), int(sampled.sampled_rank[i]))
        return logprobs

    def _prompt_output(self, plan: list[PromptLogprobRequest], out) -> dict[str, list[TokenLogprobs | None]]:
        result, offset = {}, 0
        for item in plan:
            wanted = item.num_logprobs
            entries: list[TokenLogprobs | None] = [None] if item.starts_prompt else []
            for r in range(offset, offset + item.count):
                entries.append(TokenLogprobs(out.logprob_token_ids[r, : wanted + 1].tolist(),
                                             out.logprobs[r, : wanted + 1].tolist(), int(out.sampled_rank[r])))
            result[item.request_id] = entries
            offset += item.count
        return result


def _padding_sampling(shape: StepShape, num_sampled: int, row_reduction: RowReduction) -> SamplingMetadata:
    """Sampling metadata of `shape.seqs` rows, the first `num_sampled` of them at temperature 1."""
    table = SamplingRowTable(1, row_reduction=row_reduction)
    table.set_row(0, SamplingParams(temperature=1.0), 0, 0, ())
    sampled_rows = np.zeros(num_sampled, np.int64)
    return table.build(sampled_rows, np.zeros(num_sampled, np.int64), None, shape.seqs)


def _start_copy_to_host(tree: Any) -> None:
    """Starts the device→host copy of every array in `tree` now, so that the later `device_get` only waits."""
    for leaf in jax.tree_util.tree_leaves(tree):
        leaf.copy_to_host_async()
