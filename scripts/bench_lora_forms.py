"""Which form of the multi-LoRA addition costs least on the GPU: the projections of 32 Llama-3.1-8B layers alone
(fused q/k/v, o, fused gate/up, down; random bf16 weights, `--slots` adapters of rank `--rank` side by side), each
form timed at 1 and 64 rows beside the base projections in this one run.

- `dense` (today's `layers/lora.py`): y = x·W + (one-hot ⊙ x·A)·B, two extra GEMMs and the mask between them.
- `dense_bf16`: the same with the shrink written in bfloat16 (no float32 intermediate).
- `kcat`: the expand folded into the projection along K: [x | one-hot ⊙ x·A] · [W ; B] (W and B stacked at load).
- `ncat`: the shrink folded into the projection along N: [y | s] = x · [W | A], then y + (one-hot ⊙ s)·B.
Every form is checked against `dense` first (max rel. error ≤ 1e-2). Prints a table and writes `<out>/lora-forms.json`.

    PYTHONPATH=. python scripts/bench_lora_forms.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_bench_common as common  # noqa: E402

GROUPS = {"qkv": (4096, 6144, 3), "o": (4096, 4096, 1), "gate_up": (4096, 28672, 2), "down": (14336, 4096, 1)}


def make_layers(key, layers: int, slots: int, rank: int):
    import jax
    import jax.numpy as jnp

    out = []
    for layer in range(layers):
        weights = {}
        for g, (d, n, parts) in GROUPS.items():
            kw, ka, kb = jax.random.split(jax.random.fold_in(key, layer * 10 + len(weights)), 3)
            r = parts * rank
            weights[g] = dict(w=(jax.random.normal(kw, (d, n), jnp.float32) / d ** 0.5).astype(jnp.bfloat16),
                              a=(jax.random.normal(ka, (d, slots, r), jnp.float32) / d ** 0.5).astype(jnp.bfloat16),
                              b=(jax.random.normal(kb, (slots, r, n), jnp.float32) * 0.1).astype(jnp.bfloat16))
        out.append(weights)
    return out


def stacked(layers, form: str):
    """The load-time stacking the `kcat` and `ncat` forms need (outside the timed step)."""
    import jax.numpy as jnp

    def one(p):
        d, s, r = p["a"].shape
        if form == "kcat":
            return {**p, "wk": jnp.concatenate([p["w"], p["b"].reshape(s * r, -1)], axis=0)}
        if form == "ncat":
            return {**p, "wn": jnp.concatenate([p["w"], p["a"].reshape(d, s * r)], axis=1)}
        return p

    return [{g: one(p) for g, p in layer.items()} for layer in layers]


def project(form: str, x, p, one_hot):
    import jax.numpy as jnp

    f32 = jnp.float32
    d, s, r = p["a"].shape
    if form == "base":
        return jnp.dot(x, p["w"], preferred_element_type=f32).astype(x.dtype)
    if form == "ncat":
        ys = jnp.dot(x, p["wn"], preferred_element_type=f32)
        n = p["w"].shape[1]
        own = (ys[:, n:].reshape(-1, s, r) * one_hot[:, :, None]).astype(x.dtype).reshape(-1, s * r)
        return (ys[:, :n] + jnp.dot(own, p["b"].reshape(s * r, -1), preferred_element_type=f32)).astype(x.dtype)
    shrink_type = x.dtype if form == "dense_bf16" else f32
    shrunk = jnp.dot(x, p["a"].reshape(d, s * r), preferred_element_type=shrink_type)
    own = (shrunk.reshape(-1, s, r) * one_hot[:, :, None].astype(shrunk.dtype)).astype(x.dtype).reshape(-1, s * r)
    if form == "kcat":
        return jnp.dot(jnp.concatenate([x, own], axis=1), p["wk"], preferred_element_type=f32).astype(x.dtype)
    y = jnp.dot(x, p["w"], preferred_element_type=f32)
    return (y + jnp.dot(own, p["b"].reshape(s * r, -1), preferred_element_type=f32)).astype(x.dtype)


def step_fn(form: str):
    """All layers' projections: each o output feeds the next layer (a real chain), every output is read whole."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def step(layers, x, x_wide, one_hot):
        total = jnp.zeros((x.shape[0],), jnp.float32)
        for layer in layers:
            for g, (d, _, _) in GROUPS.items():
                y = project(form, x_wide if d != x.shape[1] else x, layer[g], one_hot)
                total = total + jnp.sum(y.astype(jnp.float32), axis=1)
                if g == "o":
                    x = y
        return total

    return step


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    forms = ("base", "dense", "dense_bf16", "kcat", "ncat")
    base_layers = make_layers(jax.random.key(0), args.layers, args.slots, args.rank)
    results: dict[str, float] = {}
    for rows in (1, 64):
        x = jax.random.normal(jax.random.key(rows), (rows, 4096), jnp.float32).astype(jnp.bfloat16)
        x_wide = jax.random.normal(jax.random.key(rows + 1), (rows, 14336), jnp.float32).astype(jnp.bfloat16)
        slot_of_row = np.arange(rows) % args.slots
        one_hot = jnp.asarray(np.eye(args.slots, dtype=np.float32)[slot_of_row])
        reference = None
        for form in forms:
            layers = stacked(base_layers, form)
            step = step_fn(form)
            got = np.asarray(step(layers, x, x_wide, one_hot), np.float32)
            if form == "dense":
                reference = got
            elif reference is not None:
                err = float(np.abs(got - reference).max() / np.abs(reference).max())
                results[f"{form}_t{rows}_max_rel_err"] = err
                if err > 1e-2:
                    common.log(f"{form} at {rows} rows differs from dense: {err:.3g}")
            results[f"{form}_t{rows}_ms"] = common.replay_seconds(lambda: step(layers, x, x_wide, one_hot), warmup=3,
                                                                  runs=5, calls=20) * 1e3
            common.log(f"{form} t{rows}: {results[f'{form}_t{rows}_ms']:.3f} ms")
            del layers
    ratios = {f"{form}_t{rows}_vs_base": results[f"{form}_t{rows}_ms"] / results[f"base_t{rows}_ms"]
              for form in forms[1:] for rows in (1, 64)}
    record = common.result_record("lora-forms", args.git_sha, common.jax_device_name(), common.versions(),
                                  " ".join(["python", *sys.argv]), results, ratios,
                                  notes=f"{args.layers} layers' projections alone, {args.slots} slots of rank "
                                        f"{args.rank}; ratios are form time ÷ base projections' time")
    common.write_record(Path(args.out) / "lora-forms.json", record)
    common.print_tables(record)


if __name__ == "__main__":
    main()
