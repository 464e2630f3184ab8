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
        self.batch = InputBatch(sched.max_num_seqs, sched.max_model_len, plan.block_size,
                                plan.num_blocks * plan.block_size, self.buckets)
        self.backend = backend
        self.sampling_rows = SamplingRowTable(sched.max_num_seqs, engine_seed=config.model.seed)
        self._step = build_step(spec, backend)

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
        return self._runner_output(inputs, sampled, prompt_plan, prompt_out)

    # ------------------------------------------------------------------ sampling inputs
    def _sampling_metadata(self, inputs: StepInputs):
        rows = inputs.rows
        num_prompt = np.array([self.batch.rows[r].request.num_prompt_tokens for r in inputs.request_ids], np.int64)
        steps = self.batch.num_tokens[rows] - num_prompt

        def histories(i: int):
            row = rows[i]
            return self.batch.token_ids[row, : num_prompt[i]], self.batch.token_ids[row, num_prompt[i] : num_prompt[i]
                                                                                     + steps[i]]

        return self.sampling_rows.build(rows, steps, histories, len(inputs.logits_rows))

    def _prompt_logprob_rows(self, inputs: StepInputs):
        """Flattened rows whose logits give the next prompt token's logprob, for requests that asked."""
        plan, rows, targets, k = [], [], [], 0
        token_offset = 0
        for i, request_id in enumerate(inputs.request_ids):
            new = self.batch.rows[request_id].request
            start, count = int(inputs.positions_start[i]), int(inputs.num_scheduled[i])
            wanted = new.sampling_params.prompt_logprobs
            last_target = min(start + count, new.num_prompt_tokens - 1)  # targets are positions start+1 ..
            if wanted is not None and start < new.num_prompt_tokens:
                n = max(last_target - start, 0)
                plan.append(PromptLogprobRequest(request_id, start + 1, n, start == 0))
                rows.extend(range(token_offset, token_offset + n))
                row = inputs.rows[i]
                targets.extend(self.batch.token_ids[row, start + 1 : start + 1 + n].tolist())
                k = max(k, wanted)
            token_offset += count
        if not plan:
            return [], None, None, 0
        padded = pick(max(len(rows), 1), powers_of_two(16, max(16, self.buckets.tokens[-1])))
        pad = padded - len(rows)
        return (plan, np.array(rows + [0] * pad, np.int32), np.array(targets + [0] * pad, np.int32),
                pick(max(k, 1), powers_of_two(1, max(self.config.model.max_logprobs, 1))))

    # ------------------------------------------------------------------ outputs
    def _runner_output(self, inputs: StepInputs, sampled, prompt_plan, prompt_out) -> RunnerOutput:
        token_ids = np.asarray(sampled.token_ids)
        sampled_lists, logprobs = [], []
        for i, request_id in enumerate(inputs.request_ids):
            if not inputs.samples[i]:
                sampled_lists.append([])
                logprobs.append(None)
                continue
            token = int(token_ids[i])
            self.batch.append_tokens(request_id, [token])
            sampled_lists.append([token])
            logprobs.append(self._token_logprobs(sampled, i, request_id))
        return RunnerOutput(inputs.request_ids, sampled_lists, logprobs,
                            self._prompt_output(prompt_plan, prompt_out))

    def _token_logprobs(self, sampled, i: int, request_id: str) -> TokenLogprobs | None:
        wanted = self.batch.rows[request_id].request.sampling_params.logprobs
        if wanted is None or sampled.logprobs is None:
            return None
        return TokenLogprobs(sampled.logprob_token_ids[i, : wanted + 1].tolist(),
                             sampled.logprobs[i, : wanted + 1].tolist(), int(sampled.sampled_rank[i]))

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
