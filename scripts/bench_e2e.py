"""End-to-end benchmark on the H200: jengine beside HF transformers `generate` on a Llama-3.1-8B-shaped model with
random bf16 weights, and beside the physical floor. Writes `<date>-e2e.json` (DESIGN.md's format) and prints a table.

Parts (one GPU call each; both sides of every ratio are measured in the same call, each side in its own process):
  shapes  HF best (static cache + torch.compile) and default (dynamic cache) and jengine at batch 1, 16, 64 and the
          largest batch that fits HF's cache and prefill in memory (capped at the engine's 256 running requests);
          512-token prompts, exactly 128 new tokens → ratios.decode_b1_vs_floor
  mixed   1000 ShareGPT-like requests (the engine bench's seeded generator; identical for both sides): jengine
          `LLM.generate` vs HF in fixed batches → ratios.throughput_vs_hf, throughput_vs_hf_default, kv_waste_fraction
  engine  cold and warm start to the first token, batch-256 decode at ~1024-token contexts against the roofline and
          its host critical path, TTFT with a 2k-token shared system prompt with prefix caching on and off
          → ratios.decode_b256_roofline_fraction, host_fraction_b256, prefix_cache_ttft_speedup;
          metrics.warm_start_seconds, cold_start_seconds, ttft_caching_on_device_ms (the start-up log lines
          in the details file)
  prefill TTFT at batch 1 of 1k, 4k, 16k and 32k fresh prompt tokens against the FLOP floor at the measured matmul
          rate → ratios.ttft_1k/4k/16k/32k_vs_flop_floor
  defaults `jengine bench throughput` at its defaults (400 ShareGPT-like requests) against `--compile-buckets all`,
          both with a warm compilation cache → ratios.default_vs_precompiled_throughput
Each part writes the random checkpoint (16 GB, seeded) under --workdir once per machine and merges its figures into
--out (default `$OUT/<date>-e2e.json`). `--merge-from FILE` merges earlier calls' files in first; with no --part
only the merge is done. A part too long for one call splits by side (`--sides jengine|hf`) or, for mixed, by HF
configuration (`--hf-configs best|default`); a ratio needs both its sides in one call. benchmarks/README.md has
the command lines, e.g.
  PYTHONPATH=. python scripts/bench_e2e.py --part shapes --git-sha <sha>
  python scripts/bench_e2e.py --merge-from a.json --merge-from b.json --out benchmarks/results/<date>-e2e.json
`--tiny`: a small Llama and a few requests, every code path in a minute or two: on a CPU (torch and JAX), or as a
quick check of the GPU paths before the full run where a GPU is present.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import e2e_checkpoint  # noqa: E402
import e2e_roofline as roof  # noqa: E402
from e2e_figures import (  # noqa: E402
    METHODS, combine_hf_shares, engine_figures, mixed_figures, prefill_figures, shapes_figures, worker_metrics)
from e2e_workload import mixed_requests, save_requests  # noqa: E402
from gpu_bench_common import (  # noqa: E402
    device_memory_bytes, log, merge_records, print_tables, read_record, result_record, write_record)

PARTS = ("shapes", "mixed", "engine", "prefill", "defaults")
HF_CONFIGS = ("best", "default")


def nothing(*errors: str) -> dict[str, Any]:
    """What a worker that did not run (yet) contributes."""
    return {"metrics": {}, "errors": list(errors)}


@dataclasses.dataclass(frozen=True)
class Scale:
    """Every size the benchmark uses; `FULL` is the GPU run, `TINY` checks the code paths on a CPU."""

    model: dict[str, Any]
    engine: dict[str, Any]  # the one engine configuration of every jengine process
    batch_sizes: tuple[int, ...]  # besides the largest that fits
    max_batch: int
    prompt_len: int
    new_tokens: int
    short_tokens: int  # the short runs of the difference method
    runs: int
    mixed: dict[str, int]  # num_prompts, input_len, output_len (medians), max_total_len
    engine_part: dict[str, int]
    prefill: dict[str, Any]  # lengths, runs, and the engine options it changes (longer requests, larger steps)
    defaults: dict[str, Any]  # `jengine bench throughput`'s dataset, and the flags it needs beyond its defaults


FULL = Scale(
    model=e2e_checkpoint.LLAMA_31_8B,
    # 32768 blocks of 16 (64 GiB of KV) hold 256 requests of 2048 tokens; pinned, so every process compiles the
    # same executables and the persistent compilation cache serves all but the first. A card under 100 GiB (an
    # 80 GiB H100 holds 15 GiB of weights) gets SMALL_CARD_BLOCKS instead (`pool_for_card`)
    engine=dict(max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=2048, num_gpu_blocks_override=32768),
    batch_sizes=(1, 16, 64), max_batch=256, prompt_len=512, new_tokens=128, short_tokens=8, runs=3,
    mixed=dict(num_prompts=1000, input_len=256, output_len=128, max_total_len=2048),
    # 896-token prompts: over the measured steps (all 256 decoding; the first admitted have ~128 tokens more than
    # the last, chunked prefill admitting ~2 per step) the mean attended context is ~1024
    engine_part=dict(batch=256, prompt_len=896, max_tokens=256, system_len=2048, suffix_len=64, ttft_requests=6),
    # 8192 batched tokens: a 32k prompt in four chunks; 4096 blocks (8 GiB) hold the longest request twice
    prefill=dict(lengths=[1024, 4096, 16384, 32768], runs=3,
                 engine=dict(max_model_len=32768 + 256, max_num_seqs=16, max_num_batched_tokens=8192,
                             num_gpu_blocks_override=4096)),
    defaults=dict(num_prompts=400, input_len=256, output_len=128, flags=[]),
)
TINY = Scale(
    model=e2e_checkpoint.TINY,
    engine=dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=512),
    batch_sizes=(1, 2), max_batch=4, prompt_len=32, new_tokens=8, short_tokens=2, runs=2,
    mixed=dict(num_prompts=12, input_len=16, output_len=8, max_total_len=128),
    engine_part=dict(batch=4, prompt_len=64, max_tokens=24, system_len=128, suffix_len=8, ttft_requests=3),
    prefill=dict(lengths=[64, 256], runs=2,
                 engine=dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128,
                             num_gpu_blocks_override=128)),
    defaults=dict(num_prompts=12, input_len=16, output_len=8, flags=["--max-model-len", "256"]),
)

class Sink:
    """A worker's results file, rewritten after every section so a call cut short keeps what it measured."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"metrics": {}, "samples": {}, "first_tokens": {}, "errors": []}

    def metric(self, key: str, value: float) -> None:
        self.data["metrics"][key] = value
        self.save()

    def section(self, name: str, fn) -> None:
        log(f"=== {name}")
        start = time.perf_counter()
        try:
            for key, values in fn().items():
                self.data.setdefault(key, {}).update(values)
        except Exception as exc:  # noqa: BLE001 - one failing section must not cost the GPU call
            log(traceback.format_exc())
            self.data["errors"].append(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
        log(f"--- {name} took {time.perf_counter() - start:.1f} s")
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data))


def run_worker(name: str, args: argparse.Namespace) -> int:
    task = json.loads(Path(args.task).read_text())
    sink = Sink(Path(args.result))
    if name == "hf":
        import e2e_hf as worker
    else:
        import e2e_jengine as worker
    try:
        worker.work(task, sink)
    except Exception as exc:  # noqa: BLE001 - reported to the orchestrator through the results file
        log(traceback.format_exc())
        sink.data["errors"].append(f"{name} worker: {type(exc).__name__}: {str(exc)[:300]}")
        sink.save()
        return 1
    return 0


SMALL_CARD_BLOCKS = 20480  # 40 GiB: JAX takes 75 % of 80 GiB (59.4), the weights 15 GiB, the step needs the rest


def pool_for_card(engine: dict[str, Any]) -> dict[str, Any]:
    """`engine` with its pinned KV pool cut to SMALL_CARD_BLOCKS on a GPU of under 100 GiB (nvidia-smi's figure,
    read without starting JAX in this process, whose workers take the GPU)."""
    total = device_memory_bytes()
    if engine.get("num_gpu_blocks_override", 0) > SMALL_CARD_BLOCKS and total < 100 << 30:
        log(f"{total >> 20} MiB GPU: KV pool pinned at {SMALL_CARD_BLOCKS} blocks")
        return engine | {"num_gpu_blocks_override": SMALL_CARD_BLOCKS}
    return engine


class Call:
    """One invocation: the checkpoint, the workers of the asked parts, and the merged results file."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.scale = TINY if args.tiny else FULL
        self.workdir = Path(args.workdir)
        self.out = Path(args.out)
        self.deadline = time.monotonic() + args.deadline_s
        self.base = self._earlier_records()
        self.ours = result_record("e2e", args.git_sha, "", {}, shlex.join(["python"] + sys.argv), {}, {},
                                  methods={}, errors={})
        self.shape = roof.LlamaShape.from_config(e2e_checkpoint.llama_config(self.scale.model))
        self.gpu = shutil.which("nvidia-smi") is not None
        if args.part and not self.gpu and not args.tiny:
            raise SystemExit("no GPU here (nvidia-smi not found): the full benchmark needs one; --tiny runs anywhere")
        self.engine_kwargs = pool_for_card(self.scale.engine) if self.gpu and not args.tiny else self.scale.engine
        self.model_dir: Path | None = None
        self.vocab: list[int] = []

    def _earlier_records(self) -> dict[str, Any] | None:
        paths = [Path(p) for p in self.args.merge_from] + ([self.out] if self.out.exists() else [])
        record = None
        for path in paths:
            record = read_record(path) if record is None else merge_records(record, read_record(path))
        return record

    # ---------------------------------------------------------------- set-up
    def prepare(self) -> None:
        """The checkpoint (once per machine: a complete one from an earlier call is reused) and the prompt vocab."""
        from jengine.bench.datasets import vocab_ids
        from jengine.tokenizer import Tokenizer

        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model_dir = self.workdir / ("llama-tiny-random" if self.args.tiny else "llama-3.1-8b-random")
        marker = self.model_dir / "complete.json"
        if not (marker.exists() and json.loads(marker.read_text()) == self.scale.model):
            start = time.perf_counter()
            e2e_checkpoint.write_random_llama(self.model_dir, self.scale.model, seed=0)
            marker.write_text(json.dumps(self.scale.model))
            self.ours["metrics"]["checkpoint_write_seconds"] = time.perf_counter() - start
            log(f"checkpoint written in {time.perf_counter() - start:.1f} s: {self.model_dir}")
        self.vocab = vocab_ids(Tokenizer.from_pretrained(self.model_dir)).tolist()

    def task(self, **fields: Any) -> dict[str, Any]:
        return {"tiny": self.args.tiny, "gpu": self.gpu, "model_dir": str(self.model_dir), "vocab": self.vocab,
                "engine": {**self.engine_kwargs, **dict(self.args.engine_option)},
                "cache_dir": str(self.workdir / "jax-cache"), "invariant_segment": self.args.invariant_segment,
                "segments_apart": self.args.segments_apart, "mosaic_decode": self.args.mosaic_decode,
                "hf_configs": self.args.hf_configs, **fields}

    def worker(self, kind: str, task: dict[str, Any], label: str) -> dict[str, Any]:
        """Runs one worker process to completion (or to the call's deadline) and returns what it saved."""
        task_path, result_path = self.workdir / f"task-{label}.json", self.workdir / f"result-{label}.json"
        result_path.unlink(missing_ok=True)
        task_path.write_text(json.dumps(task | {"spawned_at": time.time()}))
        command = [sys.executable, __file__, "--worker", kind, "--task", str(task_path), "--result", str(result_path)]
        error = self.run_before_deadline(label, command)
        data = json.loads(result_path.read_text()) if result_path.exists() else {"metrics": {}, "errors": []}
        data["errors"] = data.get("errors", []) + ([error] if error else [])
        return data

    def run_before_deadline(self, label: str, command: list[str]) -> str | None:
        """Runs `command` (a worker or a jengine command) until it ends or the call's deadline nears; the error
        that says it did not run or was stopped, else None."""
        remaining = self.deadline - time.monotonic() - 15
        if remaining < 20:
            return f"{label}: not run, the call's deadline is near"
        env = os.environ | {"PYTHONUNBUFFERED": "1"} | ({} if self.gpu else {"JAX_PLATFORMS": "cpu"})
        log(f"\n##### {label}")
        try:
            subprocess.run(command, env=env, timeout=remaining, check=False)
        except subprocess.TimeoutExpired:
            return f"{label}: stopped at the call's deadline"
        return None

    def hf_worker(self, task: dict[str, Any], label: str) -> dict[str, Any]:
        if "hf" not in self.args.sides or not self.args.hf_configs:
            return nothing()
        return self.worker("hf", task, label)

    def jengine_worker(self, task: dict[str, Any], label: str) -> dict[str, Any]:
        return self.worker("jengine", task, label) if "jengine" in self.args.sides else nothing()

    # ---------------------------------------------------------------- parts
    def shapes(self) -> None:
        """jengine first: its ratio (against the floor) is then safe even if HF's compiles take the call's time."""
        s = self.scale
        sizes = sorted({*(self.args.batch_sizes or s.batch_sizes), self.largest_batch()})
        spec = dict(batch_sizes=sizes, prompt_len=s.prompt_len, new_tokens=s.new_tokens, short_tokens=s.short_tokens,
                    runs=self.args.runs or s.runs, seed=0)
        method = METHODS["shapes"].format(runs=spec["runs"], new=s.new_tokens, short=s.short_tokens)

        def figures(hf: dict[str, Any], ours: dict[str, Any]) -> tuple[dict, dict]:
            first_tokens = hf.get("first_tokens", {}) | ours.get("first_tokens", {})
            return shapes_figures(self.shape, hf["metrics"], ours["metrics"], sizes, first_tokens)

        ours = self.jengine_worker(self.task(role="shapes", shapes=spec), "jengine-shapes")
        self.publish("shapes", [ours], figures(nothing(), ours), method)
        hf = self.hf_worker(self.task(part="shapes", shapes=spec), "hf-shapes")
        self.publish("shapes", [hf, ours], figures(hf, ours), method)

    def largest_batch(self) -> int:
        """The largest power of two whose HF static cache and prefill activations fit beside the weights in the
        GPU's memory, capped at the engine's running requests."""
        s = self.scale
        total = device_memory_bytes() if self.gpu else 1 << 31
        free = (total - 2 * self.shape.num_params - roof.HF_RESERVE_BYTES) if self.gpu else 1 << 30
        largest = roof.largest_hf_batch(self.shape, free, s.prompt_len + s.new_tokens, s.prompt_len, 1 << 20)
        self.ours["metrics"] |= {"largest_batch_that_fits": largest, "largest_batch_used": min(largest, s.max_batch)}
        log(f"largest batch that fits HF's cache and prefill: {largest}; used: {min(largest, s.max_batch)}")
        return min(largest, s.max_batch)

    def mixed(self) -> None:
        m = dict(self.scale.mixed, num_prompts=self.args.num_prompts or self.scale.mixed["num_prompts"])
        if self.args.mixed_lengths:
            m["input_len"], m["output_len"] = self.args.mixed_lengths
        requests = mixed_requests(np.asarray(self.vocab), m["num_prompts"], m["input_len"], m["output_len"],
                                  m["max_total_len"], seed=0)
        path = self.workdir / "mixed-requests.json"
        save_requests(path, requests)
        spec = {"requests_file": str(path), "cap": self.scale.max_batch, "share": list(self.args.hf_share)}
        method = METHODS["mixed"].format(**m)
        ours = self.jengine_worker(self.task(role="mixed", mixed=spec), "jengine-mixed")
        k, n = self.args.hf_share
        if n > 1 and "jengine_mixed_tokens_per_s" in ours["metrics"]:  # each share's call measures jengine whole
            ours["metrics"][f"jengine_mixed_tokens_per_s_share{k}of{n}"] = \
                ours["metrics"]["jengine_mixed_tokens_per_s"]
        self.publish("mixed", [ours], mixed_figures({}, ours["metrics"]), method)
        hf = self.hf_worker(self.task(part="mixed", mixed=spec), "hf-mixed")
        self.publish("mixed", [hf, ours], mixed_figures(hf["metrics"], ours["metrics"]), method)

    def engine(self) -> None:
        """Cold start into a fresh compilation cache, then two warm starts from it (prefix caching on, then off).
        The filled cache then serves the later parts of calls on this machine, if none was kept yet."""
        e = self.scale.engine_part
        method = METHODS["engine"].format(n=e["ttft_requests"] - 1, **e)
        fresh = self.workdir / f"jax-cache-cold-{time.time_ns()}"
        runs: list[dict[str, Any]] = []
        for role in ("cold", "warm_on", "warm_off"):
            runs.append(self.jengine_worker(self.task(role=role, cache_dir=str(fresh), engine_part=e),
                                            f"jengine-{role}"))
            on, off = (runs[1:] + [nothing(), nothing()])[:2]
            figures = engine_figures(self.shape, on["metrics"], on.get("samples", {}).get("ttft_caching_on_s"),
                                     off.get("samples", {}).get("ttft_caching_off_s"))
            self.publish("engine", runs, figures, method)
        shared = Path(self.task()["cache_dir"])
        if fresh.exists() and not shared.exists():
            fresh.rename(shared)

    def prefill(self) -> None:
        """TTFT by prompt length at batch 1 against the FLOP floor, in an engine sized for 32k-token prompts."""
        p = self.scale.prefill
        engine = {**self.task()["engine"], **p["engine"]}
        method = METHODS["prefill"].format(lengths="/".join(map(str, p["lengths"])), runs=p["runs"],
                                           max_model_len=engine["max_model_len"],
                                           budget=engine["max_num_batched_tokens"])
        ours = self.jengine_worker(self.task(role="prefill", prefill=p, engine=engine), "jengine-prefill")
        self.publish("prefill", [ours], prefill_figures(self.shape, ours["metrics"], p["lengths"]), method)

    def defaults(self) -> None:
        """`jengine bench throughput` as a user runs it, at its defaults, against `--compile-buckets all`: three
        processes on one fresh compilation cache (all, filling it; the defaults, warm; all, warm)."""
        d = self.scale.defaults
        cache = self.workdir / f"jax-cache-defaults-{time.time_ns()}"
        method = METHODS["defaults"].format(**d)
        metrics: dict[str, float] = {}
        errors: list[str] = []
        for label, flags in (("all_cold", ["--compile-buckets", "all"]), ("default", []),
                             ("all", ["--compile-buckets", "all"])):
            report = self.bench_throughput(label, cache, d, flags)
            if "error" in report:
                errors.append(report["error"])
                break
            metrics[f"bench_throughput_{label}_tokens_per_s"] = report["output_throughput"]
        ratios = {}
        if {"bench_throughput_default_tokens_per_s", "bench_throughput_all_tokens_per_s"} <= metrics.keys():
            ratios["default_vs_precompiled_throughput"] = (metrics["bench_throughput_default_tokens_per_s"]
                                                           / metrics["bench_throughput_all_tokens_per_s"])
        self.publish("defaults", [{"metrics": metrics, "errors": errors}], ({}, ratios), method)

    def bench_throughput(self, label: str, cache: Path, d: dict[str, Any], flags: list[str]) -> dict[str, Any]:
        """One `jengine bench throughput` process; its JSON report, or {"error": ...}."""
        out = self.workdir / f"bench-throughput-{label}.json"
        out.unlink(missing_ok=True)
        command = [sys.executable, "-m", "jengine", "bench", "throughput", "--model", str(self.model_dir),
                   "--dataset-name", "sharegpt-like", "--num-prompts", str(d["num_prompts"]),
                   "--input-len", str(d["input_len"]), "--output-len", str(d["output_len"]),
                   "--compilation-cache-dir", str(cache), "--output-json", str(out), *d["flags"], *flags]
        error = self.run_before_deadline(f"bench throughput ({label}): {shlex.join(command[1:])}", command)
        if error:
            return {"error": error}
        return json.loads(out.read_text()) if out.exists() else {"error": f"{label}: no report (see the log)"}

    # ---------------------------------------------------------------- results
    def publish(self, part: str, workers: list[dict[str, Any]], figures: tuple[dict, dict], method: str) -> None:
        """This part's figures into the results file (merged over the earlier ones) and its raw samples beside."""
        metrics, ratios = figures
        self.ours["metrics"] |= worker_metrics(*workers) | metrics
        self.ours["ratios"] |= ratios
        self.ours["methods"][part] = method
        self.ours["errors"][part] = [e for w in workers for e in w.get("errors", [])]
        for data in workers:
            self.ours["versions"] |= data.get("versions", {})
            self.ours["device"] = self.ours["device"] or data.get("device", "")
        self.write()
        details = self.out.parent / f"endtoend_{part}_details.json"
        details.write_text(json.dumps(workers, indent=1))

    def write(self, show: bool = False) -> None:
        record = with_hf_shares_combined(self.ours if self.base is None else merge_records(self.base, self.ours))
        write_record(self.out, record)
        if show:
            print_tables(record)
            for part, errors in record.get("errors", {}).items():
                for error in errors:
                    log(f"error ({part}): {error}")
            log(f"\nwritten: {self.out}")


def with_hf_shares_combined(record: dict[str, Any]) -> dict[str, Any]:
    metrics, ratios = combine_hf_shares(record["metrics"])
    return {**record, "metrics": record["metrics"] | metrics, "ratios": record["ratios"] | ratios}


def default_out() -> str:
    folder = os.environ.get("OUT") or str(Path(__file__).resolve().parents[1] / "benchmarks" / "results")
    return str(Path(folder) / f"{datetime.date.today().isoformat()}-e2e.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--part", choices=PARTS, action="append", default=[],
                        help="what to run (repeatable); none: only merge the --merge-from files into --out")
    parser.add_argument("--out", default=None,
                        help="results file (default: $OUT/<date>-e2e.json); one that exists is merged into")
    parser.add_argument("--merge-from", action="append", default=[], metavar="FILE",
                        help="earlier results files merged in first (repeatable)")
    parser.add_argument("--git-sha", default="unknown", help="the commit measured (the GPU machine has no .git)")
    parser.add_argument("--tiny", action="store_true",
                        help="a small model and a few requests: checks every code path (on the GPU, if there is one)")
    parser.add_argument("--hf-configs", default=",".join(HF_CONFIGS),
                        type=lambda v: [c for c in v.split(",") if c],
                        help="HF configurations to run: best,default (empty: jengine's side only)")
    parser.add_argument("--sides", default="jengine,hf", type=lambda v: [x for x in v.split(",") if x],
                        help="which sides to run: jengine,hf (a ratio needs both of its sides in one call)")
    parser.add_argument("--batch-sizes", default=None, type=lambda v: [int(b) for b in v.split(",")],
                        help="shapes: batch sizes besides the largest that fits (default 1,16,64)")
    parser.add_argument("--hf-share", default=(0, 1), type=_share, metavar="K/N",
                        help="mixed: HF runs only its batches K, K+N, ... (HF's whole workload can outlast one call; "
                             "run K = 0..N-1 in N calls at one commit and merge them)")
    parser.add_argument("--num-prompts", type=int, default=None, help="mixed: requests (default 1000)")
    parser.add_argument("--mixed-lengths", default=None, type=lambda v: [int(x) for x in v.split(",")],
                        metavar="IN,OUT", help="mixed: median prompt and output lengths (default 256,128)")
    parser.add_argument("--runs", type=int, default=None, help="shapes: timed runs per size and length (default 3)")
    parser.add_argument("--workdir", default="/tmp/jengine-e2e", help="checkpoint, caches and worker files")
    parser.add_argument("--engine-option", action="append", default=[], type=_engine_option, metavar="KEY=VALUE",
                        help="an extra jengine engine argument (JSON value), e.g. async_scheduling=false; repeatable")
    parser.add_argument("--invariant-segment", type=int, default=None,
                        help="the deterministic attention's smallest long-context segment in positions, for the A/B "
                             "(0: one split, no merge launch; default: the engine's)")
    parser.add_argument("--segments-apart", action="store_true",
                        help="the deterministic attention's short steps walk their segments on programs of their own")
    parser.add_argument("--mosaic-decode", default=None, type=lambda v: [int(x) for x in v.split(",")],
                        metavar="BLOCK_KV,SLOTS,SPLIT[,PREFETCH]", help="decode-only steps outside the "
                        "deterministic mode on the Mosaic GPU decode with this MosaicDecodeConfig (Hopper; with "
                        "--engine-option deterministic=false), for the A/B")
    parser.add_argument("--deadline-s", type=float, default=570.0,
                        help="stop starting workers, and stop a running one, so the call ends within this")
    parser.add_argument("--worker", choices=("hf", "jengine"), help=argparse.SUPPRESS)
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    bad = [c for c in args.hf_configs if c not in HF_CONFIGS]
    if bad:
        parser.error(f"--hf-configs takes {', '.join(HF_CONFIGS)}; got {', '.join(bad)}")
    if args.mixed_lengths and (len(args.mixed_lengths) != 2 or min(args.mixed_lengths) < 1):
        parser.error(f"--mixed-lengths takes two positive lengths IN,OUT; got {args.mixed_lengths}")
    bad = [side for side in args.sides if side not in ("jengine", "hf")]
    if bad or not args.sides:
        parser.error(f"--sides takes jengine and/or hf; got {args.sides}")
    if not args.part and not args.merge_from and not args.worker:
        parser.error("give --part (what to run) or --merge-from (files to merge)")
    args.out = args.out or default_out()
    return args


def _share(value: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--hf-share takes K/N, e.g. 0/2; got {value!r}") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"--hf-share K/N needs 0 <= K < N; got {value!r}")
    return k, n


def _engine_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args.worker, args)
    call = Call(args)
    if not args.part:  # merge only
        if call.base is None:
            raise SystemExit("nothing to merge: no --merge-from file exists")
        record = with_hf_shares_combined(call.base)
        write_record(call.out, record)
        print_tables(record)
        return 0
    call.prepare()
    runs = {"shapes": call.shapes, "mixed": call.mixed, "engine": call.engine, "prefill": call.prefill,
            "defaults": call.defaults}
    for part in PARTS:
        if part in args.part:
            runs[part]()
    call.write(show=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
