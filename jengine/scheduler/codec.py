"""A JSON codec of `SchedulerOutput` (the step contract of `output.py`): plain data in, the same data out.

A multi-process engine sends each step's plan from process 0 to the others as text; anything that must cross a
process boundary as text can use it. Pure Python: no jax.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jengine.sampling.params import SamplingParams, StructuredOutputsParams
from jengine.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput


def encode_step(sched: SchedulerOutput) -> str:
    return json.dumps(step_to_json(sched))


def decode_step(message: str) -> SchedulerOutput:
    return step_from_json(json.loads(message))


def step_to_json(sched: SchedulerOutput) -> dict[str, Any]:
    """`sched` as JSON-ready values (lists and dicts of numbers and strings)."""
    return {
        "new": [_new_to_json(n) for n in sched.new_requests],
        "cached": [[c.request_id, c.new_block_ids, c.num_computed_tokens] for c in sched.cached_requests],
        "scheduled": list(sched.num_scheduled_tokens.items()),
        "total": sched.total_num_scheduled_tokens,
        "finished": sorted(sched.finished_request_ids),
        "preempted": sorted(sched.preempted_request_ids),
    }


def step_from_json(data: dict[str, Any]) -> SchedulerOutput:
    return SchedulerOutput(
        new_requests=[_new_from_json(n) for n in data["new"]],
        cached_requests=[CachedRequestData(r, blocks, computed) for r, blocks, computed in data["cached"]],
        num_scheduled_tokens=dict((r, n) for r, n in data["scheduled"]),
        total_num_scheduled_tokens=data["total"],
        finished_request_ids=set(data["finished"]),
        preempted_request_ids=set(data["preempted"]),
    )


def _new_to_json(new: NewRequestData) -> dict[str, Any]:
    fields = dataclasses.asdict(new)
    params = fields["sampling_params"]
    if params["logit_bias"] is not None:  # JSON keys are strings
        params["logit_bias"] = [[k, v] for k, v in params["logit_bias"].items()]
    return fields | {"eos_token_ids": sorted(new.eos_token_ids)}


def _new_from_json(data: dict[str, Any]) -> NewRequestData:
    params = dict(data["sampling_params"])
    if params["logit_bias"] is not None:
        params["logit_bias"] = {int(k): v for k, v in params["logit_bias"]}
    if params.get("structured_outputs") is not None:
        params["structured_outputs"] = StructuredOutputsParams(**params["structured_outputs"])
    return NewRequestData(**data | {"sampling_params": SamplingParams(**params),
                                    "eos_token_ids": frozenset(data["eos_token_ids"])})
