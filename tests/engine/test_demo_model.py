"""The demo model from Python as from the shell: `LLM()` and `LLM("jengine-demo-tiny-random")` run it; its chat
template's end of turn is an end-of-sequence token, and a cached demo of another format is rebuilt."""

from __future__ import annotations

import json
from pathlib import Path

from jengine import LLM, SamplingParams
from jengine.models.demo import DEMO_SERVED_NAME, ensure_demo_model
from jengine.models.hub import resolve_model
from jengine.tokenizer import Tokenizer
from jengine.tokenizer.tiny import IM_END


def test_llm_with_no_model_runs_the_demo_model() -> None:
    assert resolve_model(DEMO_SERVED_NAME) == resolve_model(None)
    with LLM(max_model_len=64, max_num_seqs=2) as llm:
        out = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_demo_chat_turn_ends_at_an_end_of_sequence_token(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_pretrained(ensure_demo_model(tmp_path))
    turn = tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                         add_generation_prompt=False)
    ids = tokenizer.encode(turn, add_special_tokens=False)
    end_of_turn = tokenizer.encode(IM_END, add_special_tokens=False)
    assert len(end_of_turn) == 1 and end_of_turn[0] in ids and end_of_turn[0] in tokenizer.eos_token_ids


def test_a_cached_demo_of_an_older_format_is_rebuilt(tmp_path: Path) -> None:
    demo = ensure_demo_model(tmp_path)
    config = json.loads((demo / "config.json").read_text())
    config.pop("jengine_demo_format")  # what an older version left: chats that end with an EOS the model never ends
    (demo / "config.json").write_text(json.dumps(config))
    (demo / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    ensure_demo_model(tmp_path)
    eos = json.loads((demo / "generation_config.json").read_text())["eos_token_id"]
    assert isinstance(eos, list) and len(eos) == 2
