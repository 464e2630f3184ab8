"""A restart loads the tokenizer class `AutoTokenizer` chose before, directly: the same tokenizer, without PyTorch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jengine.tokenizer import Tokenizer
from jengine.tokenizer.class_record import RECORD_DIR

TEXTS = ("Hello world, hello again!", "  spaces  and\ttabs\n", "<|im_start|>user\nhi<|im_end|>", "ünïcödé ✓ 123")
# (tokenizer_config.json's class, config.json's model_type): the names real checkpoints carry
DECLARED = [("PreTrainedTokenizerFast", "llama"), ("LlamaTokenizerFast", "llama"), ("Qwen2Tokenizer", "qwen2"),
            ("GPT2Tokenizer", "gpt2")]


def _declaring(source: Path, dest: Path, tokenizer_class: str, model_type: str) -> Path:
    shutil.copytree(source, dest)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | {"tokenizer_class": tokenizer_class}))
    (dest / "config.json").write_text(json.dumps({"model_type": model_type}))
    return dest


def _behaviour(tokenizer: Tokenizer) -> tuple:
    hf = tokenizer.hf_tokenizer
    encoded = [hf(text)["input_ids"] for text in TEXTS]
    return (type(hf), encoded, [hf.decode(ids) for ids in encoded], hf.all_special_tokens, len(hf),
            hf.get_added_vocab(), hf.eos_token_id, hf.bos_token_id)


@pytest.mark.parametrize(("tokenizer_class", "model_type"), DECLARED)
@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_recorded_class_loads_what_autotokenizer_loads(tiny_dirs, tmp_path, kind, tokenizer_class, model_type):
    model_dir = _declaring(tiny_dirs[kind], tmp_path / "model", tokenizer_class, model_type)
    reference = Tokenizer.from_pretrained(model_dir)  # AutoTokenizer alone
    first = Tokenizer.from_pretrained(model_dir, record_dir=tmp_path / "cache")  # AutoTokenizer, recorded
    assert len(list((tmp_path / "cache" / RECORD_DIR).glob("*.json"))) == 1
    again = Tokenizer.from_pretrained(model_dir, record_dir=tmp_path / "cache")  # the recorded class
    assert _behaviour(first) == _behaviour(reference)
    assert _behaviour(again) == _behaviour(reference)


def test_a_restart_with_the_record_imports_no_torch(tiny_dirs, tmp_path):
    pytest.importorskip("torch")  # without it installed nothing would be saved
    model_dir = _declaring(tiny_dirs["bytelevel"], tmp_path / "model", "PreTrainedTokenizerFast", "llama")
    Tokenizer.from_pretrained(model_dir, record_dir=tmp_path / "cache")
    code = ("import sys; from jengine.tokenizer import Tokenizer; "
            f"t = Tokenizer.from_pretrained({str(model_dir)!r}, record_dir={str(tmp_path / 'cache')!r}); "
            "print(t.hf_tokenizer('hi there')['input_ids'], 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ids, torch_imported = done.stdout.strip().rsplit(" ", 1)
    assert torch_imported == "False"
    assert ids == str(Tokenizer.from_pretrained(model_dir).hf_tokenizer("hi there")["input_ids"])


def test_an_edited_directory_is_decided_anew(tiny_dirs, tmp_path):
    """The record is keyed by the files: a changed tokenizer_config.json goes through AutoTokenizer again."""
    model_dir = _declaring(tiny_dirs["bytelevel"], tmp_path / "model", "PreTrainedTokenizerFast", "llama")
    cache = tmp_path / "cache"
    Tokenizer.from_pretrained(model_dir, record_dir=cache)
    shutil.rmtree(model_dir)
    _declaring(tiny_dirs["bytelevel"], model_dir, "Qwen2Tokenizer", "qwen2")
    reloaded = Tokenizer.from_pretrained(model_dir, record_dir=cache)
    assert type(reloaded.hf_tokenizer) is type(Tokenizer.from_pretrained(model_dir).hf_tokenizer)
    assert len(list((cache / RECORD_DIR).glob("*.json"))) == 2


def test_an_unusable_record_falls_back_to_autotokenizer(tiny_dirs, tmp_path):
    model_dir = _declaring(tiny_dirs["metaspace"], tmp_path / "model", "LlamaTokenizerFast", "llama")
    cache = tmp_path / "cache"
    Tokenizer.from_pretrained(model_dir, record_dir=cache)
    (record,) = (cache / RECORD_DIR).glob("*.json")
    for bad in ('{"module": "transformers.no_such_module", "name": "X"}', '{"module": "json", "name": "dumps"}',
                "not json"):
        record.write_text(bad)
        loaded = Tokenizer.from_pretrained(model_dir, record_dir=cache)
        assert _behaviour(loaded) == _behaviour(Tokenizer.from_pretrained(model_dir))
