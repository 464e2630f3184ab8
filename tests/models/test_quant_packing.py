"""The test writers' compressed-tensors modules are the `compressed-tensors` library's own (its compress gives the
same tensors from the same scales, its decompress the same dequantized weight), and jengine reads them back to that
weight."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.base import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402

from jengine.models.checkpoint import CheckpointReader  # noqa: E402
from jengine.models.quant_config import read_quant_config  # noqa: E402
from jengine.models.quant_load import dequantized_float  # noqa: E402
from tests.models import quant_checkpoints as qc  # noqa: E402

TOKEN = {"type": "float", "strategy": "token", "dynamic": True}
CASES = {  # name: (format, weight args, activation args, test writer)
    "float-channel": ("float-quantized", {"type": "float", "strategy": "channel"}, TOKEN, qc.channel("float")),
    "float-tensor": ("float-quantized", {"type": "float", "strategy": "tensor"}, TOKEN, qc.fp8_tensor()),
    "float-block": ("float-quantized", {"type": "float", "strategy": "block", "block_structure": [16, 32]}, TOKEN,
                    qc.fp8_block(16, 32, scale_name="weight_scale")),
    "int-channel": ("int-quantized", {"type": "int", "strategy": "channel"},
                    {"type": "int", "strategy": "token", "dynamic": True}, qc.channel("int")),
    "naive-int-group": ("naive-quantized", {"type": "int", "strategy": "group", "group_size": 16}, None,
                        qc.int_group(16)),
    "pack8-channel": ("pack-quantized", {"type": "int", "strategy": "channel"}, None, qc.packed(qc.channel("int"))),
    "pack8-group": ("pack-quantized", {"type": "int", "strategy": "group", "group_size": 32}, None,
                    qc.packed(qc.int_group(32))),
}


@pytest.mark.parametrize("name", CASES)
def test_writers_match_the_library_and_jengine_reads_them_back(name, tmp_path):
    fmt, weights, acts, writer = CASES[name]
    torch.manual_seed(0)
    ragged = weights["strategy"] in ("tensor", "channel")  # 70 columns: the last int32 word half full
    w = torch.randn(48, 70 if ragged else 64) * 0.1
    ours, dequantized = writer(w)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=8, symmetric=True, **weights),
                                input_activations=None if acts is None else QuantizationArgs(num_bits=8, **acts))
    compressor = BaseCompressor.get_value_from_registry(fmt)
    scale = ours["weight_scale"].reshape(-1, 1) if weights["strategy"] == "tensor" else ours["weight_scale"]
    library = compressor.compress({"weight": w, "weight_scale": scale}, scheme)
    stored = "weight_packed" if fmt == "pack-quantized" else "weight"
    assert torch.equal(library[stored].view(torch.uint8), ours[stored].view(torch.uint8))
    back = compressor.decompress(library, scheme)["weight"]
    torch.testing.assert_close(back.float(), dequantized, rtol=0, atol=1e-6)

    config = qc.ct_config(fmt, weights, acts)
    save_file({f"m.{k}": v.contiguous() for k, v in ours.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": config}))
    quant = read_quant_config(json.loads((tmp_path / "config.json").read_text()), None)
    with CheckpointReader(tmp_path) as reader:
        read = dequantized_float(reader, "m.weight", quant.module("m"))
    np.testing.assert_allclose(read, back.float().numpy(), rtol=0, atol=1e-6)
