"""Train a tiny BPE tokenizer for tests and demo models.

Tests need a real tokenizer whose vocabulary splits multi-byte characters across tokens, and CI has no network to fetch
one. Training a few hundred merges on a built-in multilingual corpus with the `tokenizers` library takes milliseconds,
is deterministic, and needs neither torch nor transformers: the HF directory layout (tokenizer.json,
tokenizer_config.json, special_tokens_map.json) is written by hand so `AutoTokenizer.from_pretrained` loads it.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

logger = logging.getLogger(__name__)

TokenizerKind = Literal["bytelevel", "metaspace"]

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
NUM_BYTE_TOKENS = 256
SPECIALS = (UNK, BOS, EOS, IM_START, IM_END)
"""Ids 0, 1, 2 are <unk>, <s>, </s> in both kinds (Llama's layout), so tiny model configs can use bos=1, eos=2."""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML (Qwen style) without a default system prompt; offered to tiny tokenizers and as a `--chat-template` value."""

TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog. A tokenizer turns text into numbers and back again.
Hello, world! How are you today? I am fine, thank you. The weather is nice and the sun is shining.
Large language models generate one token at a time; the engine streams each piece of text as it arrives.
你好，世界。今天天气很好。我们正在测试一个小型的分词器，它需要处理中文、日文和韩文。
日本語のテキスト。東京は日本の首都です。ひらがなとカタカナと漢字を使います。
한국어 텍스트입니다. 안녕하세요, 세계! 서울은 한국의 수도입니다.
Emoji: 🙂🚀👍🏽🎉❤️ and flags 🇫🇷🇯🇵; skin tones 👋🏻👋🏿 and families 👨‍👩‍👧.
Café, naïve, façade, résumé, jalapeño, Zürich, Ångström, Łódź, Dvořák, São Paulo, smørrebrød.
Ελληνικά: Καλημέρα κόσμε. Русский: Привет, мир! Ещё немного текста. עברית: שלום עולם. العربية: مرحبا بالعالم.
Numbers 0123456789, symbols ~!@#$%^&*()_+-={}[]|\\:;"'<>,.?/ and tabs\tand  double  spaces.
def main(argv: list[str]) -> int:
    return len(argv) * 2 + 1  # code also appears in chats
"""
"""Mixed scripts so the merges cover ASCII words while CJK, emoji and accents stay split across several tokens."""


def train_tiny_tokenizer(
    out_dir: str | Path,
    vocab_size: int = 512,
    kind: TokenizerKind = "bytelevel",
    chat_template: str | None = None,
) -> Path:
    """Train a tiny BPE tokenizer and save it as a HF tokenizer directory; returns the directory.

    `kind="bytelevel"` mimics GPT-2/Llama-3 (byte-level BPE, BOS added by the post-processor); `kind="metaspace"`
    mimics Llama-2/Mistral (SentencePiece-style "▁" spaces with `<0xNN>` byte fallback, so rare characters decode from
    byte tokens). The vocabulary holds at most `vocab_size` tokens, specials included.
    """
    if kind == "bytelevel":
        tokenizer = _train_bytelevel(vocab_size)
    elif kind == "metaspace":
        tokenizer = _train_metaspace(vocab_size)
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'bytelevel' or 'metaspace'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _save(tokenizer, out, chat_template)
    logger.debug("trained %s tokenizer with %d tokens in %s", kind, tokenizer.get_vocab_size(), out)
    return out


def pad_vocabulary(out_dir: str | Path, vocab_size: int, seed: int = 0) -> int:
    """Grow a saved byte-level tokenizer's BPE vocabulary to `vocab_size` tokens with random distinct words (never
    produced by encoding: they have no merges), so vocabulary-wide work (logits, grammar token masks) costs what it
    costs at a real model's size. Returns the new size."""
    path = Path(out_dir) / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab: dict[str, int] = data["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in data.get("added_tokens", [])}
    next_id = 1 + max([*vocab.values(), *(t["id"] for t in data.get("added_tokens", []))])
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.,:\"{}[]"
    while next_id < vocab_size:
        word = ("Ġ" if rng.random() < 0.5 else "") + "".join(rng.choices(letters, k=rng.randint(2, 9)))
        if word not in taken:
            taken.add(word)
            vocab[word] = next_id
            next_id += 1
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return next_id


def _corpus() -> list[str]:
    """The corpus as lines, so the trainer sees many short sequences (more pair statistics, same result each run)."""
    return TINY_CORPUS.splitlines()


def _common_chars_corpus() -> list[str]:
    """The corpus without the characters it holds only once, which then encode as byte-fallback tokens.

    Chosen here rather than with the trainer's `limit_alphabet`, whose choice among equally frequent characters
    changes from run to run.
    """
    counts = Counter(TINY_CORPUS)
    return ["".join(c for c in line if counts[c] > 1) for line in _corpus()]


def _bos_post_processor(bos_id: int) -> processors.TemplateProcessing:
    """Prepend BOS to every encoding, as Llama-2 and Llama-3 do."""
    return processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])


def _train_bytelevel(vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every byte is in the alphabet, so any text encodes and <unk> only holds id 0 (see SPECIALS)."""
    specials = list(SPECIALS)
    if vocab_size < NUM_BYTE_TOKENS + len(specials):
        raise ValueError(f"a byte-level vocabulary needs at least {NUM_BYTE_TOKENS + len(specials)} tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    tokenizer.post_processor = _bos_post_processor(tokenizer.token_to_id(BOS))
    return tokenizer


def _metaspace_parts() -> tuple[Any, Any]:
    """Pre-tokenizer and decoder as in Llama-2's conversion: "▁" for spaces, byte fallback, one leading space cut."""
    pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    dec = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return pre, dec


def _train_metaspace(vocab_size: int) -> Tokenizer:
    """Metaspace BPE with byte fallback: train on common characters, then add 256 `<0xNN>` tokens after the specials.

    Characters seen once in the corpus (rare CJK characters, emoji) stay out of the vocabulary and encode as byte
    tokens: the case where streaming must hold back half a character.
    """
    specials = list(SPECIALS)
    budget = vocab_size - NUM_BYTE_TOKENS
    if budget < 64:
        raise ValueError(f"a metaspace vocabulary needs at least {NUM_BYTE_TOKENS + 64} tokens")
    pre, dec = _metaspace_parts()
    trained = Tokenizer(models.BPE(unk_token=UNK))
    trained.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(
        vocab_size=budget,
        special_tokens=specials,
        show_progress=False,
    )
    trained.train_from_iterator(_common_chars_corpus(), trainer)
    return _with_byte_fallback(trained, specials, pre, dec)


def _with_byte_fallback(trained: Tokenizer, specials: list[str], pre: Any, dec: Any) -> Tokenizer:
    """Rebuild the trained model with Llama-2's id layout: <unk>, <s>, </s>, <0x00>..<0xFF>, then the rest."""
    old = sorted(trained.get_vocab().items(), key=lambda kv: kv[1])
    ordered = [UNK, BOS, EOS] + [f"<0x{b:02X}>" for b in range(NUM_BYTE_TOKENS)]
    ordered += [tok for tok, _ in old if tok not in (UNK, BOS, EOS)]
    vocab = {tok: i for i, tok in enumerate(ordered)}
    merges = [tuple(m) for m in json.loads(trained.to_str())["model"]["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK, byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre
    tokenizer.decoder = dec
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.post_processor = _bos_post_processor(vocab[BOS])
    return tokenizer


def _save(tokenizer: Tokenizer, out: Path, chat_template: str | None) -> None:
    """Write the three files `AutoTokenizer` reads, by hand so neither transformers nor torch is needed."""
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    specials = _special_tokens_map()
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": True,
        "add_eos_token": False,
        **specials,
        "extra_special_tokens": [IM_START, IM_END],
        "added_tokens_decoder": _added_tokens_decoder(tokenizer),
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", {**specials, "additional_special_tokens": [IM_START, IM_END]})


def _special_tokens_map() -> dict[str, str]:
    """Named special tokens; no pad token, as Llama."""
    return {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}


def _added_tokens_decoder(tokenizer: Tokenizer) -> dict[str, dict[str, Any]]:
    """The `added_tokens_decoder` entry transformers writes: id → token properties."""
    return {
        str(tid): {
            "content": tok.content,
            "lstrip": tok.lstrip,
            "normalized": tok.normalized,
            "rstrip": tok.rstrip,
            "single_word": tok.single_word,
            "special": tok.special,
        }
        for tid, tok in sorted(tokenizer.get_added_tokens_decoder().items())
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Pretty, UTF-8, stable key order: the files are diffable and byte-identical across runs."""
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
