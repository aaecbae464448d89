"""python -m moe_ext.convert: a model folder's bf16 experts -> kernel-ready tensors, read back bit for bit."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("safetensors")
from safetensors.torch import save_file  # noqa: E402

import moe_ext  # noqa: E402
from moe_ext.convert import ConversionError, convert, load_converted  # noqa: E402

E, H, I = 4, 128, 128


def write_model(folder, naming="qwen", layers=(0, 1), drop=None):
    """A tiny model folder: two shards, per-expert projections under Hugging Face names, plus non-expert tensors."""
    g = torch.Generator().manual_seed(0)
    names = {"qwen": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}[naming]
    block = "mlp" if naming == "qwen" else "block_sparse_moe"
    weights = {}
    for layer in layers:
        shard = {f"model.layers.{layer}.self_attn.q_proj.weight": torch.randn(H, H, generator=g).bfloat16()}
        for e in range(E):
            prefix = f"model.layers.{layer}.{block}.experts.{e}"
            gate, up = (torch.randn(I, H, generator=g) * 0.1).bfloat16(), (torch.randn(I, H, generator=g) * 0.1).bfloat16()
            down = (torch.randn(H, I, generator=g) * 0.1).bfloat16()
            for proj, t in zip(names, (gate, up, down)):
                if drop != (layer, e, proj):
                    shard[f"{prefix}.{proj}.weight"] = t
            weights[(layer, e)] = (gate, up, down)
        save_file(shard, os.path.join(folder, f"model-{layer:05d}.safetensors"))
    return weights, block


@pytest.mark.parametrize("naming", ["qwen", "mixtral"])
@pytest.mark.parametrize("mode", ["w4a4", "w4a8", "w4a16"])
def test_convert_round_trip_and_forward(tmp_path, naming, mode):
    src, dst = tmp_path / "model", tmp_path / "out"
    src.mkdir()
    weights, block = write_model(str(src), naming)
    before = {p: p.read_bytes() for p in src.iterdir()}
    result = subprocess.run([sys.executable, "-m", "moe_ext.convert", str(src), str(dst), "--quant-mode", mode],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert {p: p.read_bytes() for p in src.iterdir()} == before, "the input folder must be untouched"
    loaded = load_converted(result.stdout.strip())
    assert sorted(loaded) == [f"model.layers.{layer}.{block}.experts" for layer in (0, 1)]
    for layer in (0, 1):
        w1 = torch.stack([torch.cat((weights[(layer, e)][1], weights[(layer, e)][0])).float() for e in range(E)])
        w2 = torch.stack([weights[(layer, e)][2].float() for e in range(E)])
        direct = moe_ext.prepare_moe_weights(w1, w2, mode)
        got = loaded[f"model.layers.{layer}.{block}.experts"]
        for name in ("w1_weight", "w2_weight", "w1_alpha", "w2_alpha", "w1_weight_sf", "w2_weight_sf"):
            assert torch.equal(getattr(got, name), getattr(direct, name)), name
        # The loaded layer runs: same output as the directly prepared one.
        x = torch.randn(6, H)
        act = moe_ext.quantize_activation(x, mode)
        ids = torch.randint(0, E, (6, 2), dtype=torch.int32)
        scales = torch.full((6, 2), 0.5)
        run = lambda p: moe_ext.cute_dsl_fused_moe(**act.kwargs(), token_selected_experts=ids,  # noqa: E731
                                                   token_final_scales=scales, num_experts=E, top_k=2, **p.kwargs())
        assert torch.equal(run(got), run(direct))


def test_convert_refuses_bad_inputs(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    write_model(str(src), drop=(1, 2, "up_proj"))
    with pytest.raises(ConversionError, match="expert 2 lacks its up projection"):
        convert(str(src), str(tmp_path / "out"))
    with pytest.raises(ConversionError, match="must differ from INPUT_DIR"):
        convert(str(src), str(src))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    result = subprocess.run([sys.executable, "-m", "moe_ext.convert", str(corrupt), str(tmp_path / "o2")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "not a readable safetensors file" in result.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConversionError, match="no .safetensors files"):
        convert(str(empty), str(tmp_path / "o3"))


def test_convert_does_not_overwrite_without_flag(tmp_path):
    src, dst = tmp_path / "model", tmp_path / "out"
    src.mkdir()
    write_model(str(src), layers=(0,))
    convert(str(src), str(dst))
    with pytest.raises(ConversionError, match="exists; pass --overwrite"):
        convert(str(src), str(dst))
    convert(str(src), str(dst), overwrite=True)


def test_fused_expert_tensors_with_biases_are_refused(tmp_path):
    src = tmp_path / "gptoss"
    src.mkdir()
    save_file({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(2, H, 2 * I),
               "model.layers.0.mlp.experts.gate_up_proj_bias": torch.zeros(2, 2 * I)},
              str(src / "model.safetensors"))
    with pytest.raises(ConversionError, match="biases cannot be expressed"):
        convert(str(src), str(tmp_path / "out"))
