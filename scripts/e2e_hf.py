"""The HF transformers side of the end-to-end benchmark, run in its own process (it owns the GPU while it runs).

Two configurations of `generate`, greedy, EOS never ending a sequence:
- best: `cache_implementation="static"`, which makes `generate` compile its decode step with `torch.compile`
  (mode "reduce-overhead": CUDA graphs). The cache is sized to each call exactly (`max_cache_len`), never to an earlier
  call's larger size, since a static cache's attention reads all of it every step;
- default: the dynamic cache, eager, with PyTorch's cuDNN attention backend turned off. That backend plans every new
  sequence length anew (on the H200, tens of ms per new shape with a 2-layer model, against 2-3 ms for a whole decode
  step without it), and a dynamic cache meets a new length at every step; left on, it would dominate HF's time with a
  cost a user avoids with one switch, so HF is measured without it (the flash / memory-efficient kernels). The
  compiled static-cache path keeps PyTorch's default: its shapes are fixed per call.
Decode step time on the fixed shapes: (median time of 128-token runs − median time of 8-token runs) ÷ 120, each run
synchronised, both with the same cache size, after a warm-up run that compiles; both runs pay generate's per-call
costs (such as recording CUDA graphs for a new cache), which so stay out of the step time. Mixed workload:
`e2e_workload`'s batching, every batch shape warmed up (compiled) first, then all batches timed back to back.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from e2e_roofline import HF_RESERVE_BYTES, LlamaShape, hf_bytes_per_sequence
from e2e_workload import HfBatch, hf_batches, left_pad
from gpu_bench_common import log

PAD_ID = 0
WARM_UP_TOKENS = 4  # a compiled step warms up, then CUDA graph trees record it


class HfRunner:
    """One loaded model and the two `generate` configurations."""

    def __init__(self, model_dir: str, gpu: bool) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.logging.set_verbosity_error()  # per-call notices would crowd the log the GPU call returns
        self.torch = torch
        self.device = "cuda" if gpu else "cpu"
        placement = {"device_map": "cuda"} if gpu else {}  # straight to the GPU (needs accelerate, there)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, **placement).eval()
        self.model.generation_config.eos_token_id = None  # EOS ignored: every sequence generates its length
        self.model.generation_config.pad_token_id = PAD_ID
        torch._dynamo.config.cache_size_limit = 64  # one graph per batch shape must never fall back to eager

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def free_bytes(self) -> int:
        if self.device == "cuda":
            return int(self.torch.cuda.mem_get_info()[0]) - HF_RESERVE_BYTES
        return 1 << 30

    def options(self, config: str) -> dict[str, Any]:
        if config == "default":
            return {}
        options: dict[str, Any] = {"cache_implementation": "static"}
        if self.device == "cpu":  # there generate compiles only when told to; the eager backend keeps it quick
            from transformers import CompileConfig

            compile_config = CompileConfig(backend="eager", mode=None)
            compile_config._compile_all_devices = True
            options["compile_config"] = compile_config
        return options

    def generate(self, prompts: list[list[int]], max_new_tokens: int, config: str,
                 cache_len: int) -> tuple[float, np.ndarray]:
        """Seconds for one synchronised `generate` call, and its new token ids."""
        ids, mask = left_pad(prompts, PAD_ID)
        ids_t = self.torch.as_tensor(ids, device=self.device)
        mask_t = self.torch.as_tensor(mask, device=self.device)
        options = self.options(config)
        if self.device == "cuda":
            self.torch.backends.cuda.enable_cudnn_sdp(config == "best")
        if config == "best":
            options["max_cache_len"] = cache_len
            self.model._previous_max_cache_length = -1  # size this call's cache exactly, not to an earlier call's
        self.sync()
        start = time.perf_counter()
        out = self.model.generate(input_ids=ids_t, attention_mask=mask_t, max_new_tokens=max_new_tokens,
                                  do_sample=False, **options)
        self.sync()
        elapsed = time.perf_counter() - start
        if out.shape[1] != ids.shape[1] + max_new_tokens:
            raise RuntimeError(f"HF generated {out.shape[1] - ids.shape[1]} tokens, not {max_new_tokens}")
        return elapsed, out[:, ids.shape[1]:].cpu().numpy()

    def compiled(self) -> bool:
        return hasattr(self.model, "_compiled_call")


def run_shapes(runner: HfRunner, prompt_sets: dict[int, dict[str, list]], new_tokens: int, short_tokens: int,
               config: str) -> dict[str, Any]:
    """Per batch size: the decode step time by the difference method, and the first greedy tokens."""
    metrics: dict[str, float] = {}
    first_tokens: dict[str, list[int]] = {}
    for batch, sets in sorted(prompt_sets.items()):
        cache_len = len(sets["warm"][0]) + new_tokens  # one cache size for the long and the short runs
        _, warm = runner.generate(sets["warm"], new_tokens, config, cache_len)
        first_tokens[f"{config}_b{batch}"] = warm[:, 0].tolist()
        long_s, short_s = [], []
        for long_prompts, short_prompts in zip(sets["long"], sets["short"], strict=True):
            long_s.append(runner.generate(long_prompts, new_tokens, config, cache_len)[0])
            short_s.append(runner.generate(short_prompts, short_tokens, config, cache_len)[0])
        step = (statistics.median(long_s) - statistics.median(short_s)) / (new_tokens - short_tokens)
        metrics[f"hf_{config}_decode_ms_b{batch}"] = step * 1e3
        metrics[f"hf_{config}_tokens_per_s_b{batch}"] = batch * new_tokens / statistics.median(long_s)
        log(f"  HF {config} batch {batch}: {step * 1e3:.2f} ms/step (runs {long_s}, {short_s})")
    if config == "best":  # generate compiled its decode step (a dynamic cache is never compiled)
        metrics["hf_best_compiled"] = float(runner.compiled())
    return {"metrics": metrics, "first_tokens": first_tokens}


def mixed_batch_size(runner: HfRunner, shape: LlamaShape, requests: list, cap: int) -> int:
    """The largest power of two ≤ cap at which every batch's cache and prefill activations fit (HF's throughput
    grows with the batch, so this is its best size)."""
    size = cap
    while size > 1:
        if all(size * hf_bytes_per_sequence(shape, b.prompt_len + b.max_new_tokens, b.prompt_len)
               <= runner.free_bytes() for b in hf_batches(requests, size)):
            return size
        size //= 2
    return 1


def run_mixed(runner: HfRunner, requests: list, batch_size: int, config: str,
              share: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """Output tokens per second over the whole mixed workload; a batch size that runs out of memory after all is
    halved (at most twice) and the workload run again from the start. `share` (k, n): only batches k, k + n, ...
    (HF's whole workload can outlast one GPU call; `e2e_figures.combine_hf_shares` adds the shares up)."""
    for attempt in range(3):
        try:
            return _run_mixed_at(runner, requests, batch_size, config, share)
        except runner.torch.cuda.OutOfMemoryError:
            if attempt == 2:
                raise
            log(f"  HF {config} mixed: out of memory at batch {batch_size}; trying {batch_size // 2}")
            runner.torch.cuda.empty_cache()
            batch_size //= 2
    raise AssertionError("unreachable")


def _run_mixed_at(runner: HfRunner, requests: list, batch_size: int, config: str,
                  share: tuple[int, int]) -> dict[str, Any]:
    k, n = share
    all_batches = hf_batches(requests, batch_size)
    batches = all_batches[k::n]
    counted = sum(b.counted_tokens for b in batches)
    warm_up(runner, batches, config)
    seconds = time_batches(runner, batches, config)
    elapsed = sum(seconds)
    log(f"  HF {config} mixed{f' (share {k} of {n})' if n > 1 else ''}: {counted} tokens in {elapsed:.1f} s = "
        f"{counted / elapsed:.1f} tok/s")
    if n > 1:
        tag = f"share{k}of{n}"
        return {"metrics": {f"hf_{config}_mixed_batch_size_{tag}": batch_size,
                            f"hf_{config}_mixed_seconds_{tag}": elapsed,
                            f"hf_{config}_mixed_counted_tokens_{tag}": counted},
                "samples": {f"hf_{config}_mixed_batch_seconds_{tag}": seconds}}
    metrics = {f"hf_{config}_mixed_batch_size": batch_size, f"hf_{config}_mixed_batches": len(all_batches),
               "hf_mixed_output_tokens": counted,  # what the requests asked for: the same for every batch size
               f"hf_{config}_mixed_generated_tokens": sum(batch_size * b.max_new_tokens for b in batches),
               f"hf_{config}_mixed_seconds": elapsed, f"hf_{config}_mixed_tokens_per_s": counted / elapsed}
    return {"metrics": metrics, "samples": {f"hf_{config}_mixed_batch_seconds": seconds}}


def warm_up(runner: HfRunner, batches: list[HfBatch], config: str) -> None:
    """Every batch shape with a few new tokens (the prefill, then decode steps that compile and record the graph),
    so no compilation is timed."""
    shapes = batches if config == "best" else batches[:1]
    for i, batch in enumerate(shapes):
        elapsed, _ = runner.generate(batch.prompts, WARM_UP_TOKENS, config, batch.prompt_len + batch.max_new_tokens)
        log(f"  HF {config} warm-up {i + 1}/{len(shapes)}: {elapsed:.1f} s")


def time_batches(runner: HfRunner, batches: list[HfBatch], config: str) -> list[float]:
    """Each batch's synchronised `generate` call, back to back (their sum is HF's time for the workload)."""
    return [runner.generate(b.prompts, b.max_new_tokens, config, b.prompt_len + b.max_new_tokens)[0]
            for b in batches]


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def work(task: dict[str, Any], sink: Any) -> None:
    """The worker's entry: load the model, then the part's sections, each saved to the sink as it ends."""
    import json
    from pathlib import Path

    from e2e_workload import load_requests, shape_prompt_sets

    runner = HfRunner(task["model_dir"], task["gpu"])
    sink.data["versions"] = versions()
    sink.data["device"] = device_name(runner)
    shape = LlamaShape.from_config(json.loads((Path(task["model_dir"]) / "config.json").read_text()))
    configs = task["hf_configs"]
    if task["part"] == "shapes":
        s = task["shapes"]
        vocab = np.asarray(task["vocab"])
        sets = {b: shape_prompt_sets(vocab, b, s["prompt_len"], s["runs"], s["seed"]) for b in s["batch_sizes"]}
        for config in configs:
            sink.section(f"HF {config} shapes",
                         lambda c=config: run_shapes(runner, sets, s["new_tokens"], s["short_tokens"], c))
    elif task["part"] == "mixed":
        requests = load_requests(Path(task["mixed"]["requests_file"]))
        size = mixed_batch_size(runner, shape, requests, task["mixed"]["cap"])
        for config in configs:
            share = tuple(task["mixed"].get("share", (0, 1)))
            sink.section(f"HF {config} mixed", lambda c=config: run_mixed(runner, requests, size, c, share))


def device_name(runner: HfRunner) -> str:
    if runner.device == "cuda":
        return f"{runner.torch.cuda.get_device_name()} (gpu)"
    return "cpu (cpu)"
