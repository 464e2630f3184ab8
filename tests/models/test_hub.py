"""Hugging Face model ids in every entry point, from a hub-cache layout built on disk (no network): the cache found
through --download-dir, $HF_HUB_CACHE or $HF_HOME, `refs/<revision>` followed to its snapshot, HF_HUB_OFFLINE=1
reading only the cache, and online fetches limited to the files jengine reads."""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

import pytest

from jengine.cli import _serve_model, build_parser, main
from jengine.errors import CheckpointError
from jengine.models.demo import ensure_demo_model
from jengine.models.hub import resolve_model, resolve_tokenizer

SHA = "0123456789abcdef0123456789abcdef01234567"
REPO = "tiny-org/tiny-chat"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`models--tiny-org--tiny-chat/snapshots/<sha>/` holding the demo checkpoint, and `refs/main` naming it."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--tiny-org--tiny-chat"
    shutil.copytree(ensure_demo_model(tmp_path_factory.mktemp("demo")), repo / "snapshots" / SHA)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    return cache


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("HF_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return monkeypatch


def test_the_cache_is_found_by_download_dir_hf_hub_cache_or_hf_home(hub_cache: Path, offline) -> None:
    snapshot = hub_cache / "models--tiny-org--tiny-chat" / "snapshots" / SHA
    assert resolve_model(REPO, download_dir=hub_cache).path == snapshot
    assert resolve_model(REPO, revision=SHA, download_dir=hub_cache).path == snapshot
    offline.setenv("HF_HUB_CACHE", str(hub_cache))
    assert resolve_model(REPO).path == snapshot and resolve_model(REPO).name == REPO
    offline.delenv("HF_HUB_CACHE")
    home = hub_cache.parent / "hf-home"
    (home / "hub").mkdir(parents=True, exist_ok=True)
    if not (home / "hub" / "models--tiny-org--tiny-chat").exists():
        (home / "hub" / "models--tiny-org--tiny-chat").symlink_to(hub_cache / "models--tiny-org--tiny-chat")
    offline.setenv("HF_HOME", str(home))
    assert resolve_model(REPO).path.resolve() == snapshot.resolve()


def test_offline_a_missing_model_or_revision_is_refused_in_words(hub_cache: Path, offline) -> None:
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE=1"):
        resolve_model("tiny-org/absent", download_dir=hub_cache)
    with pytest.raises(CheckpointError, match="at revision v9"):
        resolve_model(REPO, revision="v9", download_dir=hub_cache)
    with pytest.raises(CheckpointError, match="model directory not found"):
        resolve_model("/no/such/dir")
    single_file = hub_cache / "model.gguf"
    single_file.write_bytes(b"GGUF")
    assert resolve_model(single_file).path == single_file  # a single-file checkpoint is a local path too
    assert resolve_tokenizer(REPO, download_dir=hub_cache).endswith(SHA) and resolve_tokenizer(None) is None


def test_online_only_safetensors_config_and_tokenizer_files_are_fetched(tmp_path: Path, offline) -> None:
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id: str, **kwargs) -> str:
        calls.append((repo_id, kwargs))
        return str(tmp_path)

    offline.setenv("HF_HUB_OFFLINE", "0")
    offline.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model("Qwen/Qwen3-8B", revision="v1", download_dir=tmp_path / "cache").path == tmp_path
    (repo_id, kwargs), = calls
    assert repo_id == "Qwen/Qwen3-8B" and kwargs["revision"] == "v1" and kwargs["cache_dir"] == tmp_path / "cache"
    patterns = kwargs["allow_patterns"]

    def fetched(name: str) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in patterns)

    wanted = ("model-00001-of-00004.safetensors", "model.safetensors.index.json", "config.json",
              "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "tokenizer.model", "quantize_config.json", "quant_config.json",
              "hf_quant_config.json")
    assert all(fetched(name) for name in wanted)
    assert not any(fetched(name) for name in ("pytorch_model.bin", "model.pt", "consolidated.pth", "README.md"))


def test_serve_and_generate_take_a_hub_id(hub_cache: Path, offline, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", REPO, "--download-dir", str(hub_cache)])
    assert _serve_model(args) == (str(hub_cache / "models--tiny-org--tiny-chat" / "snapshots" / SHA), REPO)
    offline.setenv("HF_HUB_CACHE", str(hub_cache))
    for command in ("throughput", "latency"):  # bench builds its engine through the same LLM(...) call
        bench = build_parser().parse_args(["bench", command, "--model", REPO, "--revision", SHA])
        assert (bench.model, bench.revision) == (REPO, SHA)
    assert main(["generate", "--model", REPO, "--revision", SHA, "--prompt", "Hello", "--max-tokens", "3",
                 "--max-model-len", "64", "--max-num-seqs", "2", "--ignore-eos"]) == 0
    assert capsys.readouterr().out.strip()
