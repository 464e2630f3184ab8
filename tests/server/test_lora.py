"""LoRA adapters over the OpenAI API on a real server: `model` names an adapter, /v1/models lists it with its parent,
and adapters load and unload at run time under traffic (runtime updating switched on by vLLM's variable). Unloading
an adapter that requests use is refused (400 `lora_in_use`); nothing is lost either way."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.conftest import COMMON
from tests.server.conftest import MODEL_NAME, paused_core, scrape, wait_for

MODULES = {"q_proj": ("self_attn", 64, 64), "v_proj": ("self_attn", 64, 32), "down_proj": ("mlp", 96, 64)}


def _adapter(directory: Path, seed: int, rank: int = 4) -> str:
    """A PEFT directory with random q/v/down pairs on every layer (so outputs change)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(COMMON["num_hidden_layers"]):
        for module, (block, d_in, d_out) in MODULES.items():
            name = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.standard_normal((rank, d_in)).astype(np.float32) * 0.3
            tensors[f"{name}.lora_B.weight"] = rng.standard_normal((d_out, rank)).astype(np.float32) * 0.3
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8,
                                                               "target_modules": list(MODULES)}))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return str(directory)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: _adapter(root / name, seed) for seed, name in enumerate(("first", "second", "third"))}


@pytest.fixture(scope="module")
def lora_server(servers, chat_model_dir, adapters):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        handle = servers.start(chat_model_dir, enable_lora=True, max_loras=2, max_cpu_loras=2,
                               lora_modules=[f"first={adapters['first']}"])
    yield handle
    handle.wait_idle()


def _complete(server, model: str, prompt: str = "Once upon a time") -> list[int]:
    response = server.http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6,
                                                         "temperature": 0, "logprobs": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def test_models_lists_adapters_with_their_parent(lora_server, adapters):
    cards = {c["id"]: c for c in lora_server.http.get("/v1/models").json()["data"]}
    assert cards["first"]["parent"] == MODEL_NAME and cards["first"]["root"] == adapters["first"]
    assert cards[MODEL_NAME]["parent"] is None
    assert lora_server.http.get("/v1/models/first").json()["parent"] == MODEL_NAME
    assert _complete(lora_server, "first") != _complete(lora_server, MODEL_NAME)
    missing = lora_server.http.post("/v1/completions", json={"model": "second", "prompt": "hi", "max_tokens": 2})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    lora_server.wait_idle()


def test_load_and_unload_under_concurrent_traffic(lora_server, adapters):
    base_alone, first_alone = _complete(lora_server, MODEL_NAME), _complete(lora_server, "first")

    async def traffic(model: str, count: int) -> list[str]:
        async with lora_server.async_client() as client:  # one per event loop
            replies = await asyncio.gather(*(client.completions.create(model=model, prompt="Once upon a time",
                                                                       max_tokens=6, temperature=0)
                                             for _ in range(count)))
        return [r.choices[0].text for r in replies]

    async def load_during_traffic() -> tuple[list[str], list[str], int]:
        running = asyncio.gather(traffic(MODEL_NAME, 6), traffic("first", 6))
        loaded = await asyncio.to_thread(lora_server.http.post, "/v1/load_lora_adapter",
                                         json={"lora_name": "second", "lora_path": adapters["second"]})
        base, first = await running
        return base, first, loaded.status_code

    base, first, status = asyncio.run(load_during_traffic())
    assert status == 200 and len(set(base)) == 1 and len(set(first)) == 1 and base != first
    assert _complete(lora_server, "second") not in (base_alone, first_alone)

    engine = lora_server.engine
    with paused_core(engine) as release:  # a request under "first" is queued: unloading it is refused
        async def held() -> tuple[int, str, list[str]]:
            queued = asyncio.create_task(traffic("first", 1))  # admitted now: queued for the held core
            await asyncio.sleep(0.3)
            unloading = asyncio.create_task(asyncio.to_thread(
                lora_server.http.post, "/v1/unload_lora_adapter", json={"lora_name": "first"}))
            await asyncio.sleep(0.3)
            release()  # the core takes the request, then the unload
            refused = await unloading
            return refused.status_code, refused.json()["error"]["code"], await queued

        code, error, done = asyncio.run(held())
    assert (code, error) == (400, "lora_in_use") and len(done) == 1
    lora_server.wait_idle()
    assert lora_server.http.post("/v1/unload_lora_adapter", json={"lora_name": "first"}).status_code == 200
    gone = lora_server.http.post("/v1/completions", json={"model": "first", "prompt": "hi", "max_tokens": 2})
    assert gone.status_code == 404
    assert _complete(lora_server, MODEL_NAME) == base_alone  # the base model is untouched
    lora_server.wait_idle()


def test_bad_loads_are_clear_errors(lora_server, adapters, tmp_path):
    bad = lora_server.http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_lora_adapter"
    assert "adapter_config.json" in bad.json()["error"]["message"]
    assert lora_server.http.post("/v1/load_lora_adapter", json={"lora_name": "x"}).status_code == 400
    unknown = lora_server.http.post("/v1/unload_lora_adapter", json={"lora_name": "nobody"})
    assert unknown.status_code == 404


def test_lora_requests_info_metric(lora_server):
    wait_for(lambda: any(name == "jengine:lora_requests_info" for name, _ in scrape(lora_server)),
             what="lora_requests_info")
    labels = dict(next(l for name, l in scrape(lora_server) if name == "jengine:lora_requests_info"))
    assert labels["max_lora"] == "2" and labels["running_lora_adapters"] == ""


def test_runtime_updating_is_off_unless_switched_on(server):
    response = server.http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
    assert response.status_code == 404


def test_grpc_lora_name_runs_the_adapter(chat_model_dir, adapters):
    """A gRPC request's `lora_name` selects a loaded adapter: the same tokens as the in-process engine's."""
    import grpc

    from jengine.clients.async_engine import AsyncEngine
    from jengine.config import EngineConfig
    from jengine.sampling.params import SamplingParams
    from jengine.v1 import jengine_pb2 as pb
    from jengine.v1 import jengine_pb2_grpc as pb_grpc
    from server.grpc_service import start_grpc_server
    from tests.server.grpc_fixtures import LoopThread

    loops = LoopThread()
    config = EngineConfig.from_kwargs(str(chat_model_dir), dtype="float32", max_model_len=128, enable_lora=True,
                                      lora_modules=[f"first={adapters['first']}"])
    engine = AsyncEngine.from_config(config)
    server = loops.run(start_grpc_server(engine, "127.0.0.1", 0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.EngineStub(channel)

            def tokens(lora_name: str) -> list[int]:
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 8]), lora_name=lora_name,
                                             sampling=pb.SamplingParams(temperature=0, max_tokens=6))
                return [t for reply in stub.Generate(request) for out in reply.outputs for t in out.token_ids]

            async def in_process() -> list[int]:
                params = SamplingParams(temperature=0, max_tokens=6)
                outs = [o async for o in engine.generate({"prompt_token_ids": [5, 6, 7, 8]}, params,
                                                         lora_request=engine.list_loras()[0])]
                return [t for o in outs for t in o.outputs[0].token_ids]

            assert tokens("first") == loops.run(in_process()) != tokens("")
    finally:
        loops.run(server.stop(None))
        engine.shutdown()
        loops.close()

