"""`jengine bench throughput | latency | serve`: vLLM-shaped benchmarks over seeded synthetic datasets.

`datasets` draws prompts as token ids from the tokenizer's vocabulary (no downloads), `metrics` turns per-request
timings into the figures `vllm bench` reports, and one module per sub-command runs it (`cli.add_parser` wires them).
"""
