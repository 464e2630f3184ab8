"""Model-level W4A16 figures for `scripts/bench_quant4.py`: the engine's decode and prefill step
(`models/decoder.forward` + the last row's logits, the platform's attention backend, a donated KV cache) on a
Llama-3.1-8B-shaped model with random weights, its projections bfloat16 or 4-bit (`layers/quant4.py:Int4Weight`
through `linear()`, group 128, float16 zero points and scales; the embedding and LM head stay bfloat16).

Correctness first: the 4-bit step's logits through the Pallas kernel against the same weights through the reference
implementation (unpack, then one matmul). The decode floor is what a batch-1 step must read (4-bit weights, scales
and zero points, the bfloat16 norms and LM head, and the KV cache) ÷ the measured device-to-device copy rate.
"""

from __future__ import annotations

import dataclasses
import time

from bench_quant8 import BLOCK, kv_bytes, model_spec, param_bytes_read, random_params, relative_error, time_step
from gpu_bench_common import log

GROUP = 128
PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")


def quantize4(w, impl: str):
    """A bfloat16 `[K, N]` weight → an `Int4Weight`: asymmetric round-to-nearest per (128-row group, column)."""
    import jax.numpy as jnp

    from jengine.layers.quant4 import Int4Weight

    k, n = w.shape
    wf = w.astype(jnp.float32).reshape(k // GROUP, GROUP, n)
    lo, hi = jnp.minimum(wf.min(axis=1), 0), jnp.maximum(wf.max(axis=1), 0)
    scale = jnp.maximum((hi - lo) / 15, 1e-8).astype(jnp.float16)
    zero = jnp.clip(jnp.round(-lo / scale.astype(jnp.float32)), 0, 15)
    q = jnp.clip(jnp.round(wf / scale.astype(jnp.float32)[:, None]) + zero[:, None], 0, 15).astype(jnp.int32)
    shifts = 4 * jnp.arange(8, dtype=jnp.int32)
    packed = jnp.sum(q.reshape(k // 8, 8, n) << shifts[None, :, None], axis=1, dtype=jnp.int32)  # disjoint bits
    return Int4Weight(packed, zero.astype(jnp.float16), scale, None, GROUP, impl)


def int4_params(params: dict, impl: str) -> dict:
    import functools

    import jax

    quant = jax.jit(functools.partial(quantize4, impl=impl))
    layers = tuple({k: (quant(v) if k in PROJECTIONS else v) for k, v in layer.items()} for layer in params["layers"])
    return {**params, "layers": layers}


def with_impl(params: dict, impl: str) -> dict:
    from jengine.layers.quant4 import Int4Weight

    layers = tuple({k: (dataclasses.replace(v, impl=impl) if isinstance(v, Int4Weight) else v)
                    for k, v in layer.items()} for layer in params["layers"])
    return {**params, "layers": layers}


def make_batch_case(spec, batch: int, query: int, context: int, dtype):
    """(jitted step, metadata, token ids, fresh KV) for `batch` sequences of `query` new tokens over `context`."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jengine.attention.backend import select_backend
    from jengine.attention.metadata import build_metadata
    from jengine.layers.attention import allocate_kv_cache
    from jengine.models.decoder import compute_logits, forward

    backend = select_backend(jax.devices()[0].platform, head_dim=spec.head_dim)
    blocks = -(-context // BLOCK)
    tables = [list(range(s * blocks, (s + 1) * blocks)) for s in range(batch)]
    md = build_metadata([query] * batch, [context] * batch, tables, block_size=BLOCK,
                        num_slots=(batch * blocks + 1) * BLOCK, max_query_len=query)
    tokens = jnp.asarray(np.arange(batch * query, dtype=np.int32) % spec.vocab_size)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, kv, tokens, md):
        hidden, kv = forward(spec, backend, params, kv, tokens, md)
        return compute_logits(spec, params, hidden[query - 1::query]), kv

    return step, md, tokens, lambda: allocate_kv_cache(spec, batch * blocks + 1, BLOCK, dtype)


def model_level(shape: dict, tiny: bool, context: int, prefill: int, copy_rate: float, runs: int = 5,
                calls: int = 20) -> tuple[dict, dict]:
    """(metrics, ratios) of the model step: bf16 and W4A16 at decode batch 1 and 64 and one prefill chunk."""
    import jax
    import jax.numpy as jnp

    spec = model_spec(shape)
    impl = "pallas" if jax.devices()[0].platform == "gpu" and not tiny else "pallas_interpret"
    base = random_params(spec)
    w4 = int4_params(base, impl)
    cases = {"decode_b1": (1, 1, context), "decode_b64": (4 if tiny else 64, 1, context),
             "prefill": (1, prefill, prefill)}
    metrics: dict = {"model_layers": spec.num_layers, "model_context_tokens": context,
                     "model_w4a16_weight_bytes_read": param_bytes_read(w4),
                     "model_bf16_weight_bytes_read": param_bytes_read(base)}
    for name, (batch, query, ctx) in cases.items():
        step, md, tokens, fresh_kv = make_batch_case(spec, batch, query, ctx, jnp.bfloat16)
        start = time.perf_counter()
        ours = step(w4, fresh_kv(), tokens, md)[0]
        ref = step(with_impl(w4, "reference"), fresh_kv(), tokens, md)[0]
        metrics[f"model_{name}_logits_max_rel_err"] = err = relative_error(ours, ref)
        if err > 2e-2:
            raise SystemExit(f"W4A16 model {name}: logits max rel. error {err:.3g} vs the reference path")
        for side, params in (("bf16", base), ("w4a16", w4)):
            metrics[f"model_{name}_{side}_s"] = time_step(step, params, md, tokens, fresh_kv, runs, calls)
        log(f"model {name}: bf16 {metrics[f'model_{name}_bf16_s'] * 1e3:.3f} ms, w4a16 "
            f"{metrics[f'model_{name}_w4a16_s'] * 1e3:.3f} ms (logits rel. err {err:.2g}; "
            f"{time.perf_counter() - start:.0f} s)")
    floor = (metrics["model_w4a16_weight_bytes_read"] + kv_bytes(spec, context)) / copy_rate
    metrics["model_decode_b1_floor_s"] = floor
    ratios = {f"w4a16_{name}_vs_bf16": metrics[f"model_{name}_bf16_s"] / metrics[f"model_{name}_w4a16_s"]
              for name in cases}
    ratios["w4a16_decode_b1_vs_floor"] = metrics["model_decode_b1_w4a16_s"] / floor
    return metrics, ratios
