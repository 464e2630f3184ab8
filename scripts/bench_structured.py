"""Structured-output benchmark: the engine's decode step with 64 rows constrained by a 20-property JSON schema ÷ the
same step unconstrained, and the schema's compile time.

Correctness first: 64 constrained requests (random weights, temperature 1, seeds 0..63) must all finish with output
that parses and validates against the schema. Then the timing, in one run: 64 requests decode `--max-tokens` tokens
through `LLM` (pipelined, the default), free and constrained, twice each, alternating; a mode's step time is the median
interval between the starts of consecutive engine steps that are pure decodes of all 64 requests: the engine's real
step period, host work included (for constrained rows the matchers advance on the core thread and each step's masks
are filled on the mask thread while the device runs that step's forward; the sampler is launched with them just
before the next forward). `metrics.mask_fill_ms_b64` is the median host time of one step's fill of 64 masks there;
`*_host_busy_ms_b64` the core thread's time per step not spent waiting for the device or for masks, and
`structured_mask_wait_ms_b64` its wait for masks not yet filled (both explain a ratio above 1: a busy host, or a fill
longer than the forward); `structured_advance_ms_b64` and `structured_fill_start_ms_b64` are two parts of that busy
time: the matchers consuming a step's tokens, and the start of the next fill (its hand-off to the mask thread).
`ratios.structured_step_vs_free_b64` = constrained ÷ free (lower is better; 1 = free). `metrics.schema_compile_ms` is
the median time to build and compile that schema's grammar for the model's tokenizer with an empty cache.

The model is a random-weight Llama (Llama-3-8B layers, `--layers` of them, weights made on the device by
`load_format="dummy"`) whose tokenizer is padded to 128,256 tokens, Llama-3's vocabulary size, so the per-token mask
work is a real model's. `--cpu` runs a tiny model instead
(32,000 tokens) to check the script. llguidance comes as a wheel (manylinux_2_31):

    pip install --no-deps llguidance-*.whl    # where PyPI cannot be reached
    PYTHONPATH=. python scripts/bench_structured.py --out benchmarks/results --git-sha SHA
    JAX_PLATFORMS=cpu PYTHONPATH=. python scripts/bench_structured.py --cpu --out benchmarks/results --git-sha SHA
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import llguidance.numpy  # noqa: E402
from gpu_bench_common import jax_device_name, log, print_tables, result_record, versions, write_record  # noqa: E402
from jengine import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from jengine.models.demo import build_random_llama  # noqa: E402
from jengine.structured.masks import MaskFiller, StepMasks  # noqa: E402

LLAMA3_8B_LAYER = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128)
TINY_LAYER = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
BATCH = 64
PROMPT = "Describe the item as JSON:"


def twenty_property_schema() -> dict[str, Any]:
    """Twenty required properties of every common kind: bounded strings and integers, enums, booleans, numbers,
    arrays with min/max items and one nested object."""
    kinds = [
        {"type": "string", "minLength": 2, "maxLength": 12},
        {"type": "integer", "minimum": 0, "maximum": 1000},
        {"enum": ["red", "green", "blue", "unknown"]},
        {"type": "boolean"},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 3},
    ]
    properties = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(19)}
    properties["owner"] = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                                            "name": {"type": "string", "maxLength": 6}},
                           "required": ["id", "name"], "additionalProperties": False}
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def is_valid(value: Any, schema: dict[str, Any]) -> bool:
    """A validator for the keywords the schema above uses (the GPU image has no jsonschema)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        return (isinstance(value, dict) and set(value) == set(schema["required"])
                and all(is_valid(value[k], s) for k, s in schema["properties"].items()))
    if kind == "array":
        return (isinstance(value, list) and schema["minItems"] <= len(value) <= schema["maxItems"]
                and all(is_valid(v, schema["items"]) for v in value))
    if kind == "integer":
        return type(value) is int and schema["minimum"] <= value <= schema["maximum"]
    if kind == "string":
        return isinstance(value, str) and schema.get("minLength", 0) <= len(value) <= schema["maxLength"]
    return type(value) is bool


def compile_ms(llm: LLM, params: StructuredOutputsParams, runs: int = 7) -> dict[str, float]:
    """Median ms: to build and compile the grammar with an empty cache, to copy a cached matcher, and (host only)
    to fill the first mask of one fresh matcher and of BATCH fresh matchers at once (llguidance builds parts of
    the grammar lazily, on the first masks)."""
    source = llm._front.processor._grammars
    compiler = source.compiler  # the tokenizer's llguidance view is built here, once
    times: dict[str, list[float]] = {"schema_compile_ms": [], "schema_cached_matcher_ms": [],
                                     "first_mask_ms": [], "first_masks_b64_ms": []}

    def timed(name: str, fn: Any) -> None:
        start = time.perf_counter()
        fn()
        times[name].append((time.perf_counter() - start) * 1e3)

    filler = MaskFiller()
    for _ in range(runs):
        compiler._cache.clear()
        timed("schema_compile_ms", lambda: compiler.check(params))
        timed("schema_cached_matcher_ms", lambda: compiler.matcher(params))
        compiler._cache.clear()
        timed("first_mask_ms", lambda: filler.fill([SimpleNamespace(grammar=source.for_request(params))]))
        batch = [SimpleNamespace(grammar=source.for_request(params)) for _ in range(BATCH)]
        timed("first_masks_b64_ms", lambda: filler.fill(batch))
    return {name: statistics.median(values) for name, values in times.items()}


class StepClock:
    """Start time, shape and waits of every engine step (the core's `schedule` and `step`, wrapped), and the time of
    each fill of BATCH masks (llguidance's, wrapped: it runs on the core's mask thread). A step's waits: the core
    thread blocked for the device (`jax.device_get`) and for a step's masks (`StepMasks.__call__`); the rest of the
    step period is host work on the core thread, of it the matchers' advance (`MaskFiller.advance`) and the start of
    the next fill (`MaskFiller.fill_later`: its hand-off to the mask thread included)."""

    def __init__(self, llm: LLM) -> None:
        core = llm._core
        # start, tokens, rows, then seconds: device wait, mask wait, advance, fill start
        self.starts: list[tuple[float, int, int, float, float, float, float]] = []
        self.fills: list[float] = []
        self._shape, self._waits = (0, 0), [0.0] * 4
        schedule, step = core.scheduler.schedule, core.step
        self._originals = [(llguidance.numpy, "fill_next_token_bitmask_par"), (jax, "device_get"),
                           (StepMasks, "__call__"), (MaskFiller, "advance"), (MaskFiller, "fill_later")]
        self._originals = [(owner, name, getattr(owner, name)) for owner, name in self._originals]
        fill, device_get, masks_call, advance, fill_later = (original for _, _, original in self._originals)

        def timed_fill(executor, matchers, masks):
            start = time.perf_counter()
            fill(executor, matchers, masks)
            if len(matchers) == BATCH:
                self.fills.append(time.perf_counter() - start)

        def waiting(original, slot):
            def timed(*args, **kwargs):
                start = time.perf_counter()
                result = original(*args, **kwargs)
                self._waits[slot] += time.perf_counter() - start
                return result
            return timed

        def timed_schedule():
            out = schedule()
            self._shape = (out.total_num_scheduled_tokens, len(out.num_scheduled_tokens))
            return out

        def timed_step():
            start, self._waits = time.perf_counter(), [0.0] * 4
            result = step()
            self.starts.append((start, *self._shape, *self._waits))
            return result

        core.scheduler.schedule, core.step = timed_schedule, timed_step
        llguidance.numpy.fill_next_token_bitmask_par = timed_fill
        jax.device_get, StepMasks.__call__ = waiting(device_get, 0), waiting(masks_call, 1)
        MaskFiller.advance, MaskFiller.fill_later = waiting(advance, 2), waiting(fill_later, 3)

    def stop(self) -> None:
        for owner, name, original in self._originals:
            setattr(owner, name, original)

    def decode_period(self) -> dict[str, float]:
        """Medians over consecutive pure-decode steps of BATCH requests: seconds between their starts, of it the
        core thread's busy time (not waiting for the device or for masks) and its wait for masks; how many
        intervals; seconds of one fill of BATCH masks; of the busy time, the matchers' advance and the fill's start."""
        full = [s for s in self.starts if s[1] == s[2] == BATCH]
        pairs = [(a, b) for a, b in zip(self.starts, self.starts[1:]) if a in full and b in full]
        return {"period": statistics.median(b[0] - a[0] for a, b in pairs),
                "host_busy": statistics.median(b[0] - a[0] - a[3] - a[4] for a, b in pairs),
                "mask_wait": statistics.median(a[4] for a, _ in pairs),
                "advance": statistics.median(a[5] for a, _ in pairs),
                "fill_start": statistics.median(a[6] for a, _ in pairs), "intervals": len(pairs),
                "fill": statistics.median(self.fills) if self.fills else float("nan")}


def check_outputs(llm: LLM, structured: StructuredOutputsParams, schema: dict[str, Any]) -> int:
    """How many of BATCH constrained outputs finished and validate (all must)."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=600, structured_outputs=structured)
              for i in range(BATCH)]
    valid = 0
    for output in llm.generate([PROMPT] * BATCH, params, use_tqdm=False):
        choice = output.outputs[0]
        try:
            valid += choice.finish_reason == "stop" and is_valid(json.loads(choice.text), schema)
        except ValueError:
            log("not JSON:", choice.text[:200])
    return valid


def timed_period(llm: LLM, structured: StructuredOutputsParams | None, max_tokens: int) -> dict[str, float]:
    """`StepClock.decode_period` of BATCH requests decoding `max_tokens` tokens (free ones ignore EOS)."""
    clock = StepClock(llm)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=structured is None,
                             structured_outputs=structured) for i in range(BATCH)]
    try:
        llm.generate([PROMPT] * BATCH, params, use_tqdm=False)
    finally:
        del llm._core.step, llm._core.scheduler.schedule  # the class's methods again
        clock.stop()
    return clock.decode_period()


def run(args: argparse.Namespace) -> dict[str, Any]:
    schema = twenty_property_schema()
    structured = StructuredOutputsParams(json=schema)
    with tempfile.TemporaryDirectory() as tmp:
        layer = TINY_LAYER if args.cpu else LLAMA3_8B_LAYER
        model_dir = build_random_llama(Path(tmp) / "model", **layer, num_hidden_layers=args.layers,
                                       vocab_size=args.vocab, max_position_embeddings=2048, write_weights=args.cpu)
        weights = dict(dtype="float32") if args.cpu else dict(dtype="bfloat16", load_format="dummy")
        llm = LLM(str(model_dir), max_num_seqs=BATCH, max_model_len=1024, max_num_batched_tokens=2048, **weights)
        host_ms = compile_ms(llm, structured)
        valid = check_outputs(llm, structured, schema)
        log(f"{valid}/{BATCH} constrained outputs validate; host times {host_ms}")
        if valid != BATCH:
            raise SystemExit("constrained outputs do not all validate: no timing")
        periods: dict[str, list[dict[str, float]]] = {"free": [], "structured": []}
        for _ in range(args.repeats):
            periods["free"].append(timed_period(llm, None, args.max_tokens))
            periods["structured"].append(timed_period(llm, structured, args.max_tokens))
        llm.shutdown()

    def median(mode: str, key: str) -> float:
        return statistics.median(p[key] for p in periods[mode])

    free, constrained = median("free", "period"), median("structured", "period")
    metrics = {**host_ms, "outputs_valid": valid,
               "free_step_ms_b64": free * 1e3, "structured_step_ms_b64": constrained * 1e3,
               "mask_fill_ms_b64": median("structured", "fill") * 1e3,
               "structured_mask_wait_ms_b64": median("structured", "mask_wait") * 1e3,
               "structured_advance_ms_b64": median("structured", "advance") * 1e3,
               "structured_fill_start_ms_b64": median("structured", "fill_start") * 1e3,
               **{f"{mode}_host_busy_ms_b64": median(mode, "host_busy") * 1e3 for mode in periods},
               "decode_intervals_counted": min(p["intervals"] for mode in periods.values() for p in mode),
               "vocab_size": args.vocab, "layers": args.layers}
    return {"metrics": metrics, "ratios": {"structured_step_vs_free_b64": constrained / free}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory of the results file")
    parser.add_argument("--git-sha", default="unknown")
    parser.add_argument("--cpu", action="store_true", help="a tiny model, to check the script without a GPU")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 8 on the GPU, 2 --cpu)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 128256, 32000 --cpu)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens decoded per timed run")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    args.layers = args.layers or (2 if args.cpu else 8)
    args.vocab = args.vocab or (32000 if args.cpu else 128256)
    args.max_tokens = args.max_tokens or (24 if args.cpu else 96)
    found = run(args)
    name = "structured-cpu" if args.cpu else "structured"
    record = result_record("structured", args.git_sha, jax_device_name(), versions(["llguidance"]),
                           "PYTHONPATH=. python " + " ".join(sys.argv), found["metrics"], found["ratios"])
    write_record(Path(args.out) / f"{datetime.date.today().isoformat()}-{name}.json", record)
    print_tables(record)


if __name__ == "__main__":
    main()
