"""The runner's side of a verification step: the target scores each request's last token and its k drafts in one
forward (the ragged attention takes k + 1 query tokens per request), then `rejection.verify` decides per position.

Rows: a request with k drafts contributes k + 1 logits rows (its last k + 1 flattened tokens), one sampling row
each; requests without drafts contribute one, so a step mixing prefill chunks, plain decodes and verifications is
one program. Host work is vectorised numpy over those rows.
"""

from __future__ import annotations

import dataclasses
import numpy as np

from jengine.runner.buckets import pick, powers_of_two
from jengine.runner.input_batch import StepInputs
from jengine.sampling.sampler import SamplerOutput
from jengine.spec_decode.rejection import VerifyOutput


@dataclasses.dataclass(frozen=True)
class VerifyPlan:
    num_drafts: np.ndarray  # drafts verified per scheduled request [seqs]
    first_rows: np.ndarray  # first verification row of each request [seqs]
    request_of_row: np.ndarray  # scheduled request of each verification row [rows]
    offset_in_request: np.ndarray  # 0..k of each row [rows]
    draft_ids: np.ndarray  # the draft each row checks, -1 on bonus and padding rows [rows_padded]
    logits_rows: np.ndarray  # flattened token whose logits each row reads [rows_padded]


def plan_verification(inputs: StepInputs, spec_tokens: dict[str, list[int]], max_rows: int) -> VerifyPlan:
    """Rows of a step whose requests in `spec_tokens` have drafts after their last token."""
    num_drafts = np.array([len(spec_tokens.get(r, ())) for r in inputs.request_ids], np.int64)
    counts = num_drafts + 1
    total = int(counts.sum())
    first = np.cumsum(counts) - counts
    request_of_row = np.repeat(np.arange(len(counts)), counts)
    offset = np.arange(total) - first[request_of_row]
    ends = np.cumsum(inputs.num_scheduled)
    padded = pick(total, powers_of_two(8, max(max_rows, 8)))
    logits_rows = np.zeros(padded, np.int32)
    logits_rows[:total] = ends[request_of_row] - 1 - num_drafts[request_of_row] + offset
    draft_ids = np.full(padded, -1, np.int32)
    has_draft = offset < num_drafts[request_of_row]
    if has_draft.any():
        draft_ids[:total][has_draft] = np.concatenate([spec_tokens[r] for r, k in zip(inputs.request_ids,
                                                                                       num_drafts) if k])
    return VerifyPlan(num_drafts, first, request_of_row, offset, draft_ids, logits_rows)


def accepted_tokens(plan: VerifyPlan, candidates: np.ndarray, accepted: np.ndarray) -> tuple[list[list[int]],
                                                                                              np.ndarray]:
    """Per request, its emitted tokens (the accepted drafts, then the token at the first rejection or the bonus)
    and how many drafts were accepted."""
    total = len(plan.request_of_row)
    stops = np.where(accepted[:total], np.iinfo(np.int64).max, plan.offset_in_request)
    num_accepted = np.minimum.reduceat(stops, plan.first_rows)  # the bonus row never accepts: a stop exists
    emitted = np.where(accepted[:total], plan.draft_ids[:total], candidates[:total])
    ends = plan.first_rows + num_accepted + 1
    return [emitted[s:e].tolist() for s, e in zip(plan.first_rows.tolist(), ends.tolist())], num_accepted


def first_row_outputs(plan: VerifyPlan, out: VerifyOutput) -> SamplerOutput:
    """The logprobs of each request's first row (the one sample of a request without drafts)."""
    lp = out.logprobs
    rows = plan.first_rows
    return SamplerOutput(out.candidates[rows], None if lp is None else lp.logprobs[rows],
                         None if lp is None else lp.logprob_token_ids[rows],
                         None if lp is None else lp.sampled_rank[rows])
