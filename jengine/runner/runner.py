"""`ModelRunner.execute(SchedulerOutput) -> RunnerOutput`: the only owner of device arrays (weights, KV cache).

Host bookkeeping here (persistent batch, padded inputs, sampling metadata); the math in the jitted step. One
device→host copy per step brings the sampled tokens (and logprobs when asked) back.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from jengine.attention.backend import AttentionBackend
from jengine.config import EngineConfig
from jengine.models.spec import ModelSpec
from jengine.runner.buckets import StepBuckets, pick, powers_of_two
from jengine.runner.input_batch import InputBatch, StepInputs
from jengine.runner.kv_storage import KVPlan, allocate
from jengine.runner.compile import RecompileGuard, pinned_shapes, warm_up
from jengine.runner.step import build_step
from jengine.sampling.metadata import SamplingRowTable
from jengine.scheduler.output import RunnerOutput, SchedulerOutput, TokenLogprobs

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PromptLogprobRequest:
    """The flattened-token rows of one request whose prompt logprobs this step computes."""

    request_id: str
    first_position: int  # position of the first target token (≥ 1)
    count: int
    starts_prompt: bool  # the chunk begins at position 0: the list starts with None for the first prompt token


class ModelRunner:
    def __init__(self, spec: ModelSpec, params: dict, dtype, config: EngineConfig, plan: KVPlan,
                 backend: AttentionBackend) -> None:
        self.spec, self.params, self.dtype = spec, params, dtype
        self.config = config
        self.engine_seed = config.model.seed
        sched = config.scheduler
        max_blocks = -(-sched.max_model_len // plan.block_size)
        self.buckets = StepBuckets.build(sched.max_num_batched_tokens, sched.max_num_seqs, max_blocks)
        self.kv_cache = allocate(spec, plan, dtype)
        mode = config.runner.compile_buckets
        pin = mode == "all" or (mode == "auto" and backend.name != "reference")
        self.batch = InputBatch(sched.max_num_seqs, sched.max_model_len, plan.block_size,
                                plan.num_blocks * plan.block_size, self.buckets, pin_shapes=pin)
        self.backend = backend
        self.sampling_rows = SamplingRowTable(sched.max_num_seqs, engine_seed=config.model.seed)
        self._step = build_step(spec, backend)
        self.recompile_guard = RecompileGuard()
        if pin:
            warm_up(self, pinned_shapes(self.buckets))
            self.recompile_guard.arm()

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.batch.apply(sched)
        for new in sched.new_requests:
            self.sampling_rows.set_row(self.batch.rows[new.request_id].row, new.sampling_params, new.choice_index,
                                       new.request_counter, tuple(new.eos_token_ids))
        if sched.is_empty:
            return RunnerOutput([], [], [], {})
        inputs = self.batch.prepare(sched)
        sampling = self._sampling_metadata(inputs)
        prompt_plan, prompt_rows, prompt_targets, prompt_k = self._prompt_logprob_rows(inputs)
        sampled, prompt_out, self.kv_cache = self._step(
            self.params, self.kv_cache, inputs.token_ids, inputs.metadata, inputs.logits_rows, sampling,
            prompt_rows, prompt_targets, num_prompt_logprobs=prompt_k,
        )
        sampled, prompt_out = jax.device_get((sampled, prompt_out))
        self.recompile_guard.check(lambda: f"tokens={len(inputs.token_ids)} seqs={len(inputs.logits_rows)} "
                                           f"blocks={inputs.metadata.block_tables.shape[1]} "
                                           f"query_len={inputs.metadata.max_query_len}")
        return self._runner_output(inputs, sampled, prompt_plan, prompt_out)

    # ------------------------------------------------------------------ sampling inputs
    def _sampling_metadata(self, inputs: StepInputs):
        rows = inputs.rows
        num_prompt = self.batch.num_prompt[rows]
        steps = self.batch.num_tokens[rows] - num_prompt

        def histories(i: int):
            row, prompt = rows[i], num_prompt[i]
            return self.batch.token_ids[row, :prompt], self.batch.token_ids[row, prompt : prompt + steps[i]]

        return self.sampling_rows.build(rows, steps, histories, len(inputs.logits_rows))

    def _prompt_logprob_rows(self, inputs: StepInputs):
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
            plan.append(PromptLogprobRequest(inputs.request_ids[i], start + 1, n, start == 0))
            rows.extend(range(int(offsets[i]), int(offsets[i]) + n))
            targets.extend(self.batch.token_ids[inputs.rows[i], start + 1 : start + 1 + n].tolist())
        k = int(wanted[asking].max())
        padded = pick(max(len(rows), 1), powers_of_two(16, max(16, self.buckets.tokens[-1])))
        pad = padded - len(rows)
        return (plan, np.array(rows + [0] * pad, np.int32), np.array(targets + [0] * pad, np.int32),
                pick(max(k, 1), powers_of_two(1, max(self.config.model.max_logprobs, 1))))

    # ------------------------------------------------------------------ outputs
    def _runner_output(self, inputs: StepInputs, sampled, prompt_plan, prompt_out) -> RunnerOutput:
        """Appends the sampled tokens to the batch in one scatter; per request, only the output lists."""
        n = len(inputs.request_ids)
        token_ids = np.asarray(sampled.token_ids)[:n]
        samples = inputs.samples
        all_sample = bool(samples.all())
        self.batch.append_sampled(inputs.rows if all_sample else inputs.rows[samples],
                                  token_ids if all_sample else token_ids[samples])
        sampled_lists = [[token] for token in token_ids.tolist()]
        if not all_sample:  # prefill chunks that stop short of their last token sample nothing
            for i in np.flatnonzero(~samples).tolist():
                sampled_lists[i] = []
        return RunnerOutput(inputs.request_ids, sampled_lists, self._token_logprobs(inputs, sampled),
                            self._prompt_output(prompt_plan, prompt_out))

    def _token_logprobs(self, inputs: StepInputs, sampled) -> list[TokenLogprobs | None]:
        """Per row: the sampled token's raw logprobs and the top ones, for the requests that asked and sampled."""
        logprobs: list[TokenLogprobs | None] = [None] * len(inputs.request_ids)
        if sampled.logprobs is None:
            return logprobs
        wanted = self.sampling_rows.logprobs[inputs.rows]
        for i in np.flatnonzero((wanted >= 0) & inputs.samples).tolist():
            width = int(wanted[i]) + 1
            logprobs[i] = TokenLogprobs(sampled.logprob_token_ids[i, :width].tolist(),
                                        sampled.logprobs[i, :width].tolist(), int(sampled.sampled_rank[i]))
        return logprobs

    def _prompt_output(self, plan: list[PromptLogprobRequest], out) -> dict[str, list[TokenLogprobs | None]]:
        result, offset = {}, 0
        for item in plan:
            wanted = self.batch.rows[item.request_id].request.sampling_params.prompt_logprobs
            entries: list[TokenLogprobs | None] = [None] if item.starts_prompt else []
            for r in range(offset, offset + item.count):
                entries.append(TokenLogprobs(out.logprob_token_ids[r, : wanted + 1].tolist(),
                                             out.logprobs[r, : wanted + 1].tolist(), int(out.sampled_rank[r])))
            result[item.request_id] = entries
            offset += item.count
        return result
