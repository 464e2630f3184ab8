"""Model-level W4A16 figures for `scripts/bench_quant4.py`: the engine's decode and prefill step
(`models/decoder.forward` + the last row's logits, the platform's attention backend, a donated KV cache) on a
Llama-3.1-8B-shaped model with random weights, its projections bfloat16 or 4-bit (`layers/quant4.py:Int4Weight`
through `linear()`, group 128, float16 zero points and scales; the embedding and LM head stay bfloat16).

Correctness first: the 4-bit step's logits through the Pallas kernels against the same weights through the
reference implementation (unpack, then one matmul), both in bfloat16, and both against the reference run in float32
(matmuls at full precision). Over 32 random layers bfloat16 rounding alone moves the logits by a few percent (on the
CPU, the float32 and bfloat16 reference paths differ by 1.0–1.6 % at hidden sizes 256–1024, and the GPU's 8B shape
measured 3 % between kernel and reference), so a fixed tolerance on kernel vs reference either fails on rounding or
misses bugs; the check is relative to that rounding instead: the kernels' distance from float32 may be at most
twice the bfloat16 reference's own (or 2 %), where a wrong nibble, zero or scale gives errors of order one. The decode floor is what a batch-1 step must read (4-bit weights, scales
and zero points, the bfloat16 norms and LM head, and the KV cache) ÷ the measured device-to-device copy rate.
"""

from __future__ import annotations

import dataclasses
import time

from bench_quant8 import BLOCK, kv_bytes, model_spec, param_bytes_read, random_params, relative_error, time_step
from gpu_bench_common import log

GROUP = 128
PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")


def quantize4(w, impl: str, configs: tuple | None = None, group: int = GROUP):
    """A bfloat16 `[K, N]` weight → an `Int4Weight`: asymmetric round-to-nearest per (`group`-row group, column)."""
    import jax.numpy as jnp

    from jengine.layers.quant4 import Int4Weight

    k, n = w.shape
    wf = w.astype(jnp.float32).reshape(k // group, group, n)
    lo, hi = jnp.minimum(wf.min(axis=1), 0), jnp.maximum(wf.max(axis=1), 0)
    scale = jnp.maximum((hi - lo) / 15, 1e-8).astype(jnp.float16)
    zero = jnp.clip(jnp.round(-lo / scale.astype(jnp.float32)), 0, 15)
    q = jnp.clip(jnp.round(wf / scale.astype(jnp.float32)[:, None]) + zero[:, None], 0, 15).astype(jnp.int32)
    shifts = 4 * jnp.arange(8, dtype=jnp.int32)
    packed = jnp.sum(q.reshape(k // 8, 8, n) << shifts[None, :, None], axis=1, dtype=jnp.int32)  # disjoint bits
    return Int4Weight(packed, zero.astype(jnp.float16), scale, None, group, impl, configs)


def int4_params(params: dict, impl: str, configs: tuple | None = None, group: int = GROUP) -> dict:
    import functools

    import jax

    quant = jax.jit(functools.partial(quantize4, impl=impl, configs=configs, group=group))
    layers = tuple({k: (quant(v) if k in PROJECTIONS else v) for k, v in layer.items()} for layer in params["layers"])
    return {**params, "layers": layers}


def with_impl(params: dict, impl: str, configs: tuple | None = None) -> dict:
    """The words-layout weights of `params` with implementation `impl`; `mosaic`/`mosaic_interpret` convert them
    to that kernel's layout (`models/quant4_place.py:in_kernel_layout`), with `configs` (by row count) for it."""
    from jengine.layers.quant4 import Int4Weight
    from jengine.models.quant4_place import in_kernel_layout, words_impl

    def swap(v):
        w = in_kernel_layout(dataclasses.replace(v, impl=words_impl(impl)), impl)
        return dataclasses.replace(w, configs=configs) if w.nk else w

    layers = tuple({k: (swap(v) if isinstance(v, Int4Weight) else v)
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


def check_logits(spec, name: str, w4: dict, ours, case: tuple, known_noise: float | None = None) -> dict:
    """Kernel logits vs the bfloat16 reference path and vs the float32 one; SystemExit past the rounding bound.
    With `known_noise` (bfloat16's distance from float32 measured on an earlier case) the float32 run is skipped and
    the kernel is held to twice that from the bfloat16 reference."""
    import jax
    import jax.numpy as jnp

    ref_params = with_impl(w4, "reference")
    step, md, tokens, fresh_kv = make_batch_case(spec, *case, jnp.bfloat16)
    ref = step(ref_params, fresh_kv(), tokens, md)[0]
    out = {f"model_{name}_logits_max_rel_err": relative_error(ours, ref)}
    exact = None
    if known_noise is None:
        params32 = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, ref_params)
        try:
            step32, md32, tokens32, fresh_kv32 = make_batch_case(spec, *case, jnp.float32)
            with jax.default_matmul_precision("highest"):
                exact = step32(params32, fresh_kv32(), tokens32, md32)[0]
        except Exception as exc:  # noqa: BLE001 - e.g. a float32 attention tile beyond shared memory
            log(f"model {name}: no float32 reference ({type(exc).__name__}: {str(exc)[:200]})")
    if exact is None:
        err, bound, against = out[f"model_{name}_logits_max_rel_err"], max(2 * (known_noise or 2e-2), 2e-2), "bf16"
    else:
        out[f"model_{name}_logits_rel_err_vs_f32"] = err = relative_error(ours, exact)
        out[f"model_{name}_reference_bf16_rel_err_vs_f32"] = noise = relative_error(ref, exact)
        bound, against = max(2 * noise, 2e-2), "float32"
    log(f"model {name}: logits vs bf16 reference {out[f'model_{name}_logits_max_rel_err']:.3g}, vs the {against} "
        f"reference {err:.3g} (bound {bound:.3g})")
    if err > bound:
        raise SystemExit(f"W4A16 model {name}: logits {err:.3g} from the {against} reference, beyond twice "
                         f"bfloat16's rounding ({bound:.3g})")
    return out


def model_level(shape: dict, tiny: bool, context: int, prefill: int, copy_rate: float, runs: int = 5,
                calls: int = 20, configs: tuple | None = None, group: int = GROUP,
                kernel: str = "pallas", mosaic_configs: tuple | None = None) -> tuple[dict, dict]:
    """(metrics, ratios) of the model step: bf16 and W4A16 (groups of `group` rows) at decode batch 1 and 64 and one
    prefill chunk, the kernels at `configs` (`Int4Weight.configs`; None: their defaults). Keys of a group other than
    128 carry it (`w4a16_g32_decode_b1_vs_bf16`). `kernel`: `pallas` (the Triton kernels) or `mosaic` (the
    weight-only Mosaic kernel; its keys carry `_mosaic`)."""
    import jax
    import jax.numpy as jnp

    spec = model_spec(shape)
    impl = "pallas" if jax.devices()[0].platform == "gpu" and not tiny else "pallas_interpret"
    base = random_params(spec)
    w4 = words = int4_params(base, impl, configs, group)  # `words`: the reference path's input
    if kernel == "mosaic":
        w4 = with_impl(w4, "mosaic" if impl == "pallas" else "mosaic_interpret", mosaic_configs)
    cases = {"decode_b1": (1, 1, context), "decode_b64": (4 if tiny else 64, 1, context),
             "prefill": (1, prefill, prefill)}
    metrics: dict = {"model_layers": spec.num_layers, "model_context_tokens": context,
                     "model_w4a16_weight_bytes_read": param_bytes_read(w4),
                     "model_bf16_weight_bytes_read": param_bytes_read(base)}
    for name, (batch, query, ctx) in cases.items():
        step, md, tokens, fresh_kv = make_batch_case(spec, batch, query, ctx, jnp.bfloat16)
        start = time.perf_counter()
        noise = max((v for k, v in metrics.items() if k.endswith("reference_bf16_rel_err_vs_f32")), default=None)
        metrics.update(check_logits(spec, name, words, step(w4, fresh_kv(), tokens, md)[0], (batch, query, ctx),
                                    None if query == 1 else noise))  # a float32 prefill chunk: minutes of the run
        err = metrics[f"model_{name}_logits_max_rel_err"]
        for side, params in (("bf16", base), ("w4a16", w4)):
            metrics[f"model_{name}_{side}_s"] = time_step(step, params, md, tokens, fresh_kv, runs,
                                                          calls if query == 1 else 5)
        log(f"model {name}: bf16 {metrics[f'model_{name}_bf16_s'] * 1e3:.3f} ms, w4a16 "
            f"{metrics[f'model_{name}_w4a16_s'] * 1e3:.3f} ms (logits rel. err {err:.2g}; "
            f"{time.perf_counter() - start:.0f} s)")
    floor = (metrics["model_w4a16_weight_bytes_read"] + kv_bytes(spec, context)) / copy_rate
    metrics["model_decode_b1_floor_s"] = floor
    ratios = {f"w4a16_{name}_vs_bf16": metrics[f"model_{name}_bf16_s"] / metrics[f"model_{name}_w4a16_s"]
              for name in cases}
    ratios["w4a16_decode_b1_vs_floor"] = metrics["model_decode_b1_w4a16_s"] / floor
    if group != GROUP or kernel != "pallas":
        tag = (f"_g{group}" if group != GROUP else "") + ("_mosaic" if kernel != "pallas" else "")
        metrics = {k.replace("model_", f"model{tag}_", 1): v for k, v in metrics.items()}
        ratios = {k.replace("w4a16_", f"w4a16{tag}_", 1): v for k, v in ratios.items()}
    return metrics, ratios
