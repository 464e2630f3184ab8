"""Speculative decoding on the H200: a Llama-3.1-8B-shaped target with random bf16 weights, speculation on vs off.
Writes `<date>-spec.json` (DESIGN.md's format) and prints a table.

Random weights make a draft's acceptance meaningless, so the mechanism is measured:
  ngram   a *copying* target (its layers add nothing and its LM head maps each token to the next of a cycle: the
          greedy continuation of a repeated 64-token cycle is the cycle again), k = 5, at batch 1 and 16
          → ratios.spec_ngram_itl_speedup_b1, spec_ngram_itl_speedup_b16 (ITL without ÷ with; higher is better)
          and ratios.spec_verify_step_vs_decode_b1 (a verification step's time ÷ a plain decode step's, at b1)
  worst   the same target on random-token prompts (no n-gram ever matches; its output follows one long cycle),
          batch 64, speculation on (no disable_by_batch_size) → ratios.spec_worst_case_b64 (step time with ÷
          without; lower is better)
  draft   the random target as its own draft (acceptance 1: the upper bound), and a 1B-shaped random draft with the
          same vocabulary (the cost of proposing), at batch 1 → ratios.spec_self_draft_speedup_b1 (ITL without ÷
          with), metrics.itl_b1_draft_1b_ms and the acceptance of each
  eagle   random EAGLE and EAGLE-3 heads in the published layouts over the random target at batch 1 (acceptance is
          meaningless: the cost of proposing with a head) → metrics.itl_b1_eagle_ms, itl_b1_eagle3_ms
ITL here is a request's decode time per later token, (e2e − TTFT) ÷ (output tokens − 1), averaged over the batch.
Correctness first: every speculative run's greedy tokens are compared with the plain run's (exactly for the copying
target; the random target in bf16 may differ after a near-tie, so agreement is reported).

Each side runs in its own process (one model in memory at a time); both sides of a ratio run in the same call.
  PYTHONPATH=. python scripts/bench_spec.py --git-sha <sha> [--part ngram|worst|draft|eagle] [--out DIR]
  PYTHONPATH=. python scripts/bench_spec.py --tiny      # a small Llama on the CPU, every path in a few minutes
Model directories (config and tokenizer; weights made on the device) go under --workdir; --merge-from merges earlier
calls' files into the results file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import e2e_checkpoint  # noqa: E402
from gpu_bench_common import (  # noqa: E402
    jax_device_name, log, merge_records, print_tables, read_record, result_record, versions, write_record)

PARTS = ("ngram", "worst", "draft", "eagle")
LLAMA_32_1B = {**e2e_checkpoint.LLAMA_31_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
               "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64}
TINY_DRAFT = {**e2e_checkpoint.TINY, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1}
CYCLE = 64  # tokens of the copying target's cycle


def sizes(tiny: bool) -> dict[str, Any]:
    if tiny:
        return dict(target=e2e_checkpoint.TINY, draft=TINY_DRAFT, prompt_len=128, output_len=32, b16=4, b64=8,
                    dtype="float32", k=5)
    return dict(target=e2e_checkpoint.LLAMA_31_8B, draft=LLAMA_32_1B, prompt_len=512, output_len=256, b16=16, b64=64,
                dtype="auto", k=5)


def successor_map(vocab: int, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    """The copying target's next-token map: one CYCLE-token cycle, and one long cycle through every other token."""
    order = np.random.default_rng(seed).permutation(np.arange(3, vocab))
    cycle, rest = order[:CYCLE], order[CYCLE:]
    successor = np.arange(vocab)
    successor[cycle] = np.roll(cycle, -1)
    successor[rest] = np.roll(rest, -1)
    return successor, cycle.tolist()


def make_copying(llm: Any, successor: np.ndarray) -> None:
    """Rewrites the loaded target in place (same shapes, dtypes and placements: no recompilation): layers add
    nothing, and the LM head row of successor[t] is token t's embedding."""
    import jax.numpy as jnp

    runner = llm._core.runner
    params = dict(runner.params)
    params["layers"] = tuple(layer | {"wo": jnp.zeros_like(layer["wo"]), "w_down": jnp.zeros_like(layer["w_down"])}
                             for layer in params["layers"])
    predecessor = np.argsort(successor)
    params["lm_head"] = params["embed"][jnp.asarray(predecessor)]
    runner.params = params


def workload(kind: str, batch: int, size: dict, vocab: int) -> list[list[int]]:
    successor, cycle = successor_map(vocab)
    if kind == "copy":
        return [(cycle * (size["prompt_len"] // CYCLE + 1))[: size["prompt_len"]] for _ in range(batch)]
    rng = np.random.default_rng(1)
    others = np.setdiff1d(np.arange(3, vocab), cycle)
    return [rng.choice(others, size["prompt_len"], replace=False).tolist() for _ in range(batch)]


def run_side(task: dict[str, Any]) -> dict[str, Any]:
    """One engine, one workload: warm-up, then a timed generate; ITL, engine steps and the tokens."""
    from jengine import LLM, SamplingParams

    engine_args = dict(dtype=task["dtype"], max_model_len=task["prompt_len"] + task["output_len"] + 16,
                       max_num_seqs=max(task["batch"], 8), max_num_batched_tokens=4096, seed=0, compile_buckets="lazy",
                       compilation_cache_dir=task.get("cache_dir"), load_format="dummy")
    if task.get("speculative"):
        engine_args["speculative_config"] = task["speculative"]
    llm = LLM(task["model"], **engine_args)
    if task["copying"]:
        make_copying(llm, successor_map(task["vocab"])[0])
    prompts = [{"prompt_token_ids": p} for p in workload(task["workload"], task["batch"], task, task["vocab"])]
    params = SamplingParams(temperature=0, max_tokens=task["output_len"], ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # the same run first: every step shape it uses is compiled
    core = llm._core
    steps_before = core.num_steps
    counts = getattr(core.scheduler, "spec_counts", None)
    drafted_before = (counts.num_draft_tokens, counts.num_accepted_tokens) if counts else (0, 0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    itls = [(o.metrics.e2e - o.metrics.ttft) / (len(o.outputs[0].token_ids) - 1) for o in outputs]
    decode_s = max(o.metrics.e2e - o.metrics.ttft for o in outputs)
    drafted = counts.num_draft_tokens - drafted_before[0] if counts else 0
    accepted = counts.num_accepted_tokens - drafted_before[1] if counts else 0
    result = {"itl_ms": 1000 * float(np.mean(itls)), "decode_s": decode_s,
              "steps": core.num_steps - steps_before, "draft_tokens": drafted, "accepted_tokens": accepted,
              "tokens": [o.outputs[0].token_ids for o in outputs], "device": jax_device_name()}
    llm.shutdown()
    return result


def side(task: dict[str, Any], workdir: Path, metrics: dict[str, Any]) -> dict[str, Any]:
    """`run_side` in a fresh process (its device memory is freed when it ends); records the device it ran on."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=workdir, delete=False) as f:
        json.dump(task, f)
    out = Path(f.name).with_suffix(".out.json")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    subprocess.run([sys.executable, __file__, "--worker", f.name, "--worker-out", str(out)], check=True, env=env)
    result = json.loads(out.read_text())
    metrics["device"] = result.pop("device")
    return result


def ngram_config(k: int) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": k, "prompt_lookup_min": 2}


def acceptance(result: dict[str, Any]) -> float:
    return result["accepted_tokens"] / result["draft_tokens"] if result["draft_tokens"] else 0.0


def agreement(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Fraction of positions where two runs' greedy tokens agree (up to each request's first difference)."""
    same = total = 0
    for x, y in zip(a["tokens"], b["tokens"], strict=True):
        first = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x))
        same, total = same + first, total + len(x)
    return same / total


def part_ngram(base: dict, metrics: dict, ratios: dict, workdir: Path) -> None:
    successor, cycle = successor_map(base["vocab"])
    start = base["prompt_len"] % CYCLE
    expected = [(cycle * (base["output_len"] // CYCLE + 3))[start : start + base["output_len"]]]
    for name, batch in (("b1", 1), ("b16", base["b16"])):
        task = dict(base, workload="copy", batch=batch, copying=True)
        plain = side(task, workdir, metrics)
        spec = side(dict(task, speculative=ngram_config(base["k"])), workdir, metrics)
        assert plain["tokens"] == expected * batch, "the copying target does not continue its cycle"
        assert spec["tokens"] == plain["tokens"], f"ngram changed greedy output at {name}"
        ratios[f"spec_ngram_itl_speedup_{name}"] = plain["itl_ms"] / spec["itl_ms"]
        metrics |= {f"itl_{name}_plain_ms": plain["itl_ms"], f"itl_{name}_ngram_ms": spec["itl_ms"],
                    f"ngram_acceptance_rate_{name}": acceptance(spec)}
        if batch == 1:  # one prefill step, then decode steps only
            verify_step = spec["decode_s"] / max(spec["steps"] - 1, 1)
            decode_step = plain["decode_s"] / max(plain["steps"] - 1, 1)
            ratios["spec_verify_step_vs_decode_b1"] = verify_step / decode_step
            metrics |= {"verify_step_b1_ms": 1000 * verify_step, "decode_step_b1_ms": 1000 * decode_step}
        log(f"ngram {name}: plain {plain['itl_ms']:.2f} ms, ngram {spec['itl_ms']:.2f} ms, "
            f"acceptance {acceptance(spec):.3f}")


def part_worst(base: dict, metrics: dict, ratios: dict, workdir: Path) -> None:
    task = dict(base, workload="random", batch=base["b64"], copying=True)
    plain = side(task, workdir, metrics)
    spec = side(dict(task, speculative=ngram_config(base["k"])), workdir, metrics)
    assert spec["tokens"] == plain["tokens"], "ngram changed greedy output on the random workload"
    ratios["spec_worst_case_b64"] = spec["itl_ms"] / plain["itl_ms"]
    metrics |= {"step_b64_plain_ms": plain["itl_ms"], "step_b64_ngram_ms": spec["itl_ms"],
                "worst_case_draft_tokens": spec["draft_tokens"]}
    log(f"worst b64: plain {plain['itl_ms']:.2f} ms, ngram {spec['itl_ms']:.2f} ms, drafts {spec['draft_tokens']}")


def part_draft(base: dict, metrics: dict, ratios: dict, workdir: Path) -> None:
    task = dict(base, workload="random", batch=1, copying=False)
    plain = side(task, workdir, metrics)
    k = base["k"]
    self_draft = side(dict(task, speculative={"method": "draft_model", "model": base["model"],
                                              "num_speculative_tokens": k}), workdir, metrics)
    small = side(dict(task, speculative={"method": "draft_model", "model": base["draft_model"],
                                         "num_speculative_tokens": k}), workdir, metrics)
    for name, run in (("self_draft", self_draft), ("draft_1b", small)):
        # reported, not asserted: a random bf16 target's logits are near-ties everywhere, and the verification
        # step (k + 1 query rows) reduces in another order than a one-row decode step (the CPU float32 tests
        # hold exact identity)
        agree = agreement(plain, run)
        metrics |= {f"{name}_agreement": agree, f"{name}_acceptance_rate": acceptance(run),
                    f"itl_b1_{name}_ms": run["itl_ms"]}
    ratios["spec_self_draft_speedup_b1"] = plain["itl_ms"] / self_draft["itl_ms"]
    metrics["itl_b1_plain_random_ms"] = plain["itl_ms"]
    log(f"draft b1: plain {plain['itl_ms']:.2f} ms, self-draft {self_draft['itl_ms']:.2f} ms "
        f"(acceptance {acceptance(self_draft):.3f}), 1B draft {small['itl_ms']:.2f} ms")


def eagle_head_shapes(kind: str, shape: dict, num_aux: int) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of an EAGLE (`layers.0.*`, no input norm) or EAGLE-3 (`midlayer.*`, q/k/v over
    2·d, fc over `num_aux` target layers, own norm and full-vocabulary lm_head, so no d2t) head for a target of
    `shape`."""
    d, inter, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    width, p = (d, "layers.0.") if kind == "eagle" else (2 * d, "midlayer.")
    shapes = {"fc.weight": (d, (2 if kind == "eagle" else num_aux) * d), p + "self_attn.q_proj.weight": (q, width),
              p + "self_attn.k_proj.weight": (kv, width), p + "self_attn.v_proj.weight": (kv, width),
              p + "self_attn.o_proj.weight": (d, q), p + "post_attention_layernorm.weight": (d,),
              p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
              p + "mlp.down_proj.weight": (d, inter)}
    if kind == "eagle3":
        shapes |= {p + "input_layernorm.weight": (d,), p + "hidden_norm.weight": (d,), "norm.weight": (d,),
                   "lm_head.weight": (shape["vocab_size"], d)}
    return shapes


def part_eagle(base: dict, metrics: dict, ratios: dict, workdir: Path) -> None:
    task = dict(base, workload="random", batch=1, copying=False)
    plain = side(task, workdir, metrics)
    for kind in ("eagle", "eagle3"):
        head = workdir / f"{kind}-head-{base['shape']['hidden_size']}"
        layers = base["shape"]["num_hidden_layers"]
        aux = [2, layers // 2, layers - 3] if layers >= 6 else list(range(min(layers, 3)))  # tiny: its layers
        if not (head / "config.json").exists():
            config = {**e2e_checkpoint.llama_config({**base["shape"], "num_hidden_layers": 1}),
                      "architectures": ["LlamaForCausalLM" if kind == "eagle" else "LlamaForCausalLMEagle3"],
                      "eagle_aux_hidden_state_layer_ids": aux}
            e2e_checkpoint.write_checkpoint(head, config, eagle_head_shapes(kind, base["shape"], len(aux)), seed=5)
        run = side(dict(task, speculative={"method": kind, "model": str(head), "num_speculative_tokens": base["k"]}),
                   workdir, metrics)
        agree = agreement(plain, run)
        assert agree >= 0.9, f"{kind}: greedy tokens agree with the plain run at only {agree:.3f} of positions"
        metrics |= {f"itl_b1_{kind}_ms": run["itl_ms"], f"{kind}_acceptance_rate": acceptance(run),
                    f"{kind}_agreement": agree}
        log(f"{kind} b1: plain {plain['itl_ms']:.2f} ms, {kind} {run['itl_ms']:.2f} ms "
            f"(random head, acceptance {acceptance(run):.3f})")
    metrics["itl_b1_plain_random_ms"] = plain["itl_ms"]


def model_dirs(workdir: Path, size: dict) -> tuple[Path, Path]:
    """config.json and a tokenizer per model: the weights are random ones made on the device (load_format dummy,
    seeded alike, so the target loaded as its own draft has the target's weights)."""
    paths = []
    for name, shape in (("target", size["target"]), ("draft", size["draft"])):
        path = workdir / f"{name}-{shape['hidden_size']}x{shape['num_hidden_layers']}"
        if not (path / "tokenizer.json").exists():
            path.mkdir(parents=True, exist_ok=True)
            (path / "config.json").write_text(json.dumps(e2e_checkpoint.llama_config(shape)))
            (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
            e2e_checkpoint.write_tokenizer(path, shape["vocab_size"])
        paths.append(path)
    return paths[0], paths[1]


def run_parts(parts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    size = sizes(args.tiny)
    args.workdir.mkdir(parents=True, exist_ok=True)
    target, draft = model_dirs(args.workdir, size)
    base = dict(model=str(target), draft_model=str(draft), vocab=size["target"]["vocab_size"], shape=size["target"],
                cache_dir=str(args.workdir / "jax-cache"), **{k: v for k, v in size.items()
                                                             if k not in ("target", "draft")})
    metrics: dict[str, Any] = {"tiny": args.tiny}
    ratios: dict[str, float] = {}
    for part in parts:
        parts_by_name = {"ngram": part_ngram, "worst": part_worst, "draft": part_draft, "eagle": part_eagle}
        parts_by_name[part](base, metrics, ratios, args.workdir)
    device = metrics.pop("device", "unknown")  # the workers' device: this process never initialises one
    return result_record("spec", args.git_sha, device, versions(), " ".join(sys.argv), metrics, ratios)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=PARTS, action="append", help="default: all four")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")))
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "jengine-bench-spec")
    parser.add_argument("--merge-from", type=Path, action="append", default=[])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.worker_out.write_text(json.dumps(run_side(json.loads(args.worker.read_text()))))
        return 0
    out = args.out / f"{datetime.date.today().isoformat()}-spec.json"
    parts = args.part or ([] if args.merge_from else list(PARTS))  # --merge-from alone: only merge
    record: dict[str, Any] = {}
    if parts:
        record = run_parts(parts, args)
    for path in [*args.merge_from, *([out] if out.exists() else [])]:
        record = merge_records(read_record(path), record) if record else read_record(path)
    write_record(out, record)
    print_tables(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
