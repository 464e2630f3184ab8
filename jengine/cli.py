"""The `jengine` command: `generate` runs one prompt to a completion on stdout.

`serve`, `openai` and `bench` are named here so that users meet a clear message instead of an unknown command until
they exist.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

_NOT_BUILT = {
    "serve": "the gRPC + OpenAI server",
    "openai": "the stand-alone OpenAI front",
    "bench": "the benchmark driver",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jengine", description="LLM inference and serving in JAX.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("--model", type=Path, default=None,
                     help="HF model directory (safetensors); default: a tiny random-weight demo model built offline")
    gen.add_argument("--prompt", default="Hello, world!", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    gen.add_argument("--chat-template", default=None, help="chat template file or text, overriding the model's")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (greedy)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    gen.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    gen.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache page")
    gen.add_argument("--compilation-cache-dir", type=Path, default=Path.home() / ".cache" / "jengine" / "jax-cache",
                     help="JAX persistent compilation cache")
    for name, what in _NOT_BUILT.items():
        commands.add_parser(name, help=f"{what} (not available in this version)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _NOT_BUILT:
        print(f"jengine {argv[0]}: {_NOT_BUILT[argv[0]]} is not available in this version yet.", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)  # platform probing notes are not for users
    from jengine.errors import JengineError

    try:
        return _generate(args)
    except JengineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


def _generate(args: argparse.Namespace) -> int:
    import jax

    jax.config.update("jax_compilation_cache_dir", str(args.compilation_cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

    from jengine.models.demo import ensure_demo_model
    from jengine.models.loader import load_model
    from jengine.runner.simple import SimpleGenerator
    from jengine.tokenizer import IncrementalDetokenizer, Tokenizer

    model_dir = args.model or ensure_demo_model()
    tokenizer = Tokenizer.from_pretrained(model_dir, chat_template=args.chat_template)
    if args.chat:
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    spec, params, dtype = load_model(model_dir, dtype=args.dtype)
    stop_ids = () if args.ignore_eos else tuple(tokenizer.eos_token_ids | set(spec.eos_token_ids))
    generator = SimpleGenerator(spec, params, dtype, block_size=args.block_size)
    result = generator.generate([prompt_ids], args.max_tokens, stop_token_ids=stop_ids)
    tokens = [t for t in result.token_ids[0] if t not in stop_ids]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt_ids)
    sys.stdout.write(detokenizer.push(tokens) + detokenizer.finish() + "\n")
    logger.info("prompt %d tokens, generated %d tokens", len(prompt_ids), len(result.token_ids[0]))
    return 0
