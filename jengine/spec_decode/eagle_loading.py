"""Start-up of the EAGLE proposers: the head's config and weights in the published layouts, its KV over the
target's block ids, and which target hidden states the step returns for it.

Tensor names as the published heads spell them (an optional `model.` prefix is dropped):
- EAGLE(-2) (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): `fc.weight [d, 2·d]` (`fc.bias` where the head has one), one
  decoder layer `layers.0.*` of the family its config.json names (no `input_layernorm`: the head skips it),
  and, where the head directory has them, its own `embed_tokens.weight` / `lm_head.weight`; else the target's.
- EAGLE-3: `fc.weight [d, 3·d]`, the layer as `midlayer.*` (or `layers.0.*`) with `q/k/v_proj [·, 2·d]`,
  `input_layernorm`, `hidden_norm` and `post_attention_layernorm`; `norm.weight`; `lm_head.weight
  [draft_vocab_size, d]`; `d2t [draft_vocab_size]` (target id = draft id + d2t[draft id]; absent: the
  vocabularies are equal) and `t2d` (the target ids the draft covers; not needed to propose).
The target layers an EAGLE-3 head reads: `eagle_aux_hidden_state_layer_ids` of the speculative config, else of the
head's config.json (top level or under `eagle_config`), else vLLM's default (2, L // 2, L − 3). Layer i's feature
is the residual stream entering layer i.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jengine.config import EngineConfig
from jengine.errors import CheckpointError, ConfigError
from jengine.models.checkpoint import CheckpointReader, read_config
from jengine.models.registry import spec_from_hf_config
from jengine.models.spec import ModelSpec
from jengine.models.weights import FusedSource, LeafSource, parameter_sources
from jengine.parallel.sharding import ParallelLayout
from jengine.runner.kv_storage import KVPlan
from jengine.spec_decode.draft_loading import proposer_cache
from jengine.spec_decode.eagle import EagleProposer
from jengine.spec_decode.eagle_head import HeadModel

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoadedHead:
    kind: str  # eagle | eagle3
    spec: ModelSpec  # the head's decoder layer (one layer)
    params: dict
    capture: tuple[int, ...]  # StepModel.capture: () the final hidden states, else the layers read
    norm_before_residual: bool


def head_spec(config: dict) -> ModelSpec:
    """The head's one layer, from its config.json (EAGLE architectures read as their base family's)."""
    names = [name.replace("Eagle3", "").replace("Eagle", "") for name in config.get("architectures") or []]
    spec = spec_from_hf_config({**config, "architectures": names or ["LlamaForCausalLM"]})
    if spec.num_layers != 1:
        raise ConfigError(f"an EAGLE head has one decoder layer; its config.json says {spec.num_layers}")
    return spec


def aux_layers(override: list[int] | None, config: dict, target: ModelSpec) -> tuple[int, ...]:
    nested = config.get("eagle_config") or {}
    ids = override or config.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids")
    layers = target.num_layers
    ids = tuple(ids) if ids else (2, layers // 2, layers - 3)
    if len(set(ids)) != len(ids) or not all(isinstance(i, int) and 0 <= i < layers for i in ids):
        raise ConfigError(f"eagle_aux_hidden_state_layer_ids {list(ids)} must be distinct layers of the target's "
                          f"{layers}")
    return tuple(sorted(ids))  # the step captures them in layer order, as the heads were trained


def load_eagle_head(config: EngineConfig, target: ModelSpec, target_params: dict, layout: ParallelLayout,
                    dtype) -> LoadedHead:
    """The head's parameters, placed replicated, the target's embedding and LM head shared where it has none."""
    if config.parallel.tensor_parallel_size != 1:
        raise ConfigError(f"{config.speculative.method} speculation runs with tensor_parallel_size=1")
    kind, head_dir = config.speculative.method, config.speculative.model
    hf = read_config(head_dir)
    spec = head_spec(hf)
    if spec.hidden_size != target.hidden_size:
        raise ConfigError(f"the EAGLE head {head_dir} has hidden_size {spec.hidden_size}, the target "
                          f"{target.hidden_size}: it must read the target's embedding and hidden states")
    capture = aux_layers(config.speculative.eagle_aux_hidden_state_layer_ids, hf, target) if kind == "eagle3" else ()
    with CheckpointReader(head_dir) as reader:
        tensors = _HeadTensors(reader)
        params = _head_params(kind, spec, target, tensors, len(capture))
        params = jax.tree.map(lambda value: jnp.asarray(value, dtype), params)
        mapping = _draft_to_target(tensors, target.vocab_size) if kind == "eagle3" else None
    params = jax.device_put(params, layout.replicated)
    params.setdefault("embed", target_params["embed"])
    if "lm_head" not in params:
        params["lm_head"] = target_params["embed"] if target.tie_word_embeddings else target_params["lm_head"]
    if mapping is not None:
        params["draft_to_target"] = jax.device_put(mapping, layout.replicated)
    logger.info("%s head %s: reads the target's %s", kind, head_dir,
                f"layers {list(capture)}" if capture else "final hidden states")
    return LoadedHead(kind, spec, params, capture, bool(hf.get("norm_before_residual", False)))


class _HeadTensors:
    """A head checkpoint's tensors under their canonical names (no `model.` prefix; `midlayer.` as `layers.0.`)."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader, self.names = reader, {}
        for name in reader:
            short = name.removeprefix("model.")
            self.names["layers.0." + short.removeprefix("midlayer.") if short.startswith("midlayer.") else short] = name

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.names:
            raise CheckpointError(f"the EAGLE head {self.reader.model_dir} has no tensor {name!r}")
        tensor = self.reader.read(self.names[name])
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"the EAGLE head's {name} has shape {list(tensor.shape)}, expected {list(shape)}")
        return tensor


def _head_params(kind: str, spec: ModelSpec, target: ModelSpec, tensors: _HeadTensors, num_aux: int) -> dict:
    d = spec.hidden_size
    fc_in = 2 * d if kind == "eagle" else num_aux * target.hidden_size
    params = {"fc": np.asarray(tensors.read("fc.weight", (d, fc_in))).T,
              "layer": _layer(kind, spec, tensors)}
    if "fc.bias" in tensors:
        params["fc_bias"] = tensors.read("fc.bias", (d,))
    if "embed_tokens.weight" in tensors:
        params["embed"] = tensors.read("embed_tokens.weight", (target.vocab_size, d))
    if kind == "eagle3":
        draft_vocab = _draft_vocab(tensors)
        params["norm"] = tensors.read("norm.weight", (d,))
        params["lm_head"] = tensors.read("lm_head.weight", (draft_vocab, d))
    elif "lm_head.weight" in tensors:
        params["lm_head"] = tensors.read("lm_head.weight", (target.vocab_size, d))
    return params


def _layer(kind: str, spec: ModelSpec, tensors: _HeadTensors) -> dict:
    """The decoder layer in the target's layout (`models/weights.py`); EAGLE-3's q/k/v read 2·d inputs."""
    sources = dict(parameter_sources(spec)["layers"][0])
    if kind == "eagle":
        sources.pop("attn_norm")  # the head skips its input norm (a checkpoint holding one is read without it)
    else:
        sources["hidden_norm"] = dataclasses.replace(sources["attn_norm"], names=np.array(
            "model.layers.0.hidden_norm.weight", dtype=object))
        qkv = sources["wqkv"]
        sources["wqkv"] = dataclasses.replace(qkv, parts=tuple(
            dataclasses.replace(p, tensor_shape=(2 * spec.hidden_size,) + p.tensor_shape[1:]) for p in qkv.parts))
    return {name: _read_source(tensors, source) for name, source in sources.items()}


def _read_source(tensors: _HeadTensors, source: LeafSource | FusedSource) -> np.ndarray:
    if isinstance(source, FusedSource):
        return source.fuse([_read_source(tensors, part) for part in source.parts])
    pieces = [source.from_checkpoint(tensors.read(name.removeprefix("model."), source.checkpoint_shape))
              for name in source.names.flat]
    return np.stack(pieces).reshape(source.shape) if source.names.ndim else pieces[0]


def _draft_vocab(tensors: _HeadTensors) -> int:
    if "lm_head.weight" not in tensors:
        raise CheckpointError(f"the EAGLE-3 head {tensors.reader.model_dir} has no lm_head.weight")
    return int(tensors.reader.shape(tensors.names["lm_head.weight"])[0])


def _draft_to_target(tensors: _HeadTensors, target_vocab: int) -> np.ndarray | None:
    """Target id of each draft id (None: the same vocabulary), checked to lie in the target's."""
    draft_vocab = _draft_vocab(tensors)
    if "d2t" not in tensors:
        if draft_vocab != target_vocab:
            raise CheckpointError(f"the EAGLE-3 head's vocabulary has {draft_vocab} tokens, the target's "
                                  f"{target_vocab}, and no d2t maps them")
        return None
    ids = np.arange(draft_vocab) + np.asarray(tensors.read("d2t", (draft_vocab,)), np.int64)
    if ids.min() < 0 or ids.max() >= target_vocab:
        raise CheckpointError(f"the EAGLE-3 head's d2t maps draft ids outside the target's {target_vocab} tokens")
    return ids.astype(np.int32)


def build_eagle_proposer(config: EngineConfig, head: LoadedHead, plan: KVPlan, layout: ParallelLayout,
                         platform: str) -> EagleProposer:
    kv, backend = proposer_cache(config, head.spec, plan, layout, platform)
    model = HeadModel(head.spec, backend, head.kind, head.norm_before_residual)
    return EagleProposer(model, head.params, kv, head.capture, config.speculative.num_speculative_tokens,
                         plan.block_size, plan.num_blocks, config.scheduler.max_model_len,
                         config.scheduler.max_num_seqs)
