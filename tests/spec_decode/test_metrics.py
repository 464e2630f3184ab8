"""The speculation counters reach /metrics under vLLM's names, summed across replicas by the router."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from jengine.clients.router import sum_stats
from jengine.engine.stats import EngineStats
from server.metrics import EngineSources, _EngineStatsCollector


def test_spec_decode_series_use_vllm_names():
    stats = EngineStats(spec_decode_num_drafts=3, spec_decode_num_draft_tokens=12, spec_decode_num_accepted_tokens=7,
                        spec_decode_num_accepted_tokens_per_pos=(3, 2, 1, 1))
    registry = CollectorRegistry()
    registry.register(_EngineStatsCollector(EngineSources(1, lambda: [stats], lambda _r: 0), "m"))
    text = generate_latest(registry).decode()
    assert 'jengine:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0' in text
    assert 'jengine:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 12.0' in text
    assert 'jengine:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 7.0' in text
    assert 'jengine:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0' in text


def test_router_sums_per_position_counts_of_unequal_length():
    total = sum_stats([EngineStats(spec_decode_num_accepted_tokens_per_pos=(2, 1)),
                       EngineStats(spec_decode_num_accepted_tokens_per_pos=(1, 1, 1))])
    assert total.spec_decode_num_accepted_tokens_per_pos == (3, 2, 1)
