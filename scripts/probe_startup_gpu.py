"""Probe: what a fresh process pays before the engine's first step — imports (jax, jengine, torch, transformers)
and the tokenizer load through `AutoTokenizer` beside a named class — each in its own fresh process, twice (the
first may meet a cold page cache). Writes one JSON of wall seconds.

    PYTHONPATH=. python scripts/probe_startup_gpu.py --out $OUT/startup-probe.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SNIPPETS = {
    "import_torch": "import torch",
    "import_jax_devices": "import jax; jax.devices()",
    "import_jengine_llm": "import jengine.llm",
    "import_transformers": "import transformers",
    "autotokenizer": "import transformers; transformers.AutoTokenizer.from_pretrained(DIR)",
    "autotokenizer_torch_first": "import torch, transformers; transformers.AutoTokenizer.from_pretrained(DIR)",
    "tokenizers_backend": "import transformers; transformers.PreTrainedTokenizerFast.from_pretrained(DIR)",
    "jengine_tokenizer": "from jengine.tokenizer import Tokenizer; Tokenizer.from_pretrained(DIR)",
}
EPILOGUE = "; import sys; print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)"


def wall(code: str) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code + EPILOGUE], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    return seconds, (done.stderr.strip().splitlines() or [""])[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    from e2e_checkpoint import write_tokenizer

    tok = Path(tempfile.mkdtemp()) / "tok"
    tok.mkdir()
    write_tokenizer(tok, args.vocab)
    results = {"python_bare": [wall("pass")[0] for _ in range(2)]}
    for name, code in SNIPPETS.items():
        runs = [wall(code.replace("DIR", repr(str(tok)))) for _ in range(2)]
        results[name] = [round(s, 3) for s, _ in runs] + [runs[-1][1]]
        print(name, results[name], flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
