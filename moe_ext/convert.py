"""Convert a model folder's bf16 expert weights into kernel-ready 4-bit tensors (issue 6).

    python -m moe_ext.convert INPUT_DIR OUTPUT_DIR [--quant-mode w4a4|w4a8|w4a16] [--activation swiglu|relu2]

Reads every *.safetensors file of INPUT_DIR, finds the per-expert projections of each MoE layer (Hugging Face
names: `<layer>.experts.<e>.{gate_proj,up_proj,down_proj}.weight` or Mixtral's `{w1,w3,w2}`), quantizes each layer
with `prepare_moe_weights` and writes OUTPUT_DIR/moe_experts.safetensors: for layer prefix P the tensors
`P.w1_weight`, `P.w1_weight_sf` (flat swizzled scale bytes), `P.w1_alpha`, `P.w2_weight`, `P.w2_weight_sf`,
`P.w2_alpha` (and `P.fc2_input_scale` for w4a4), with the quant mode, activation and shapes in the file metadata.
`load_converted` reads it back bit for bit. The input folder is never written to.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict

import torch

from .activation import ActivationType
from .quant.block import sf_block
from .quant.prepare import PreparedWeights, prepare_moe_weights
from .quant.swizzle import mma_view, sf_bytes

OUTPUT_FILE = "moe_experts.safetensors"
_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)"
                     r"\.weight$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)(_bias)?$")


class ConversionError(ValueError):
    """A model folder that cannot be converted: the message says which file or tensor and why."""


def _safe_open(path: str):
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt")
    except Exception as exc:  # safetensors raises its own error types for truncated or corrupt headers
        raise ConversionError(f"{path}: not a readable safetensors file ({exc})") from exc


def find_expert_layers(input_dir: str) -> dict[str, dict[int, dict[str, tuple[str, str]]]]:
    """{layer prefix: {expert: {role: (file, tensor name)}}} for every per-expert projection in the folder."""
    files = sorted(f for f in os.listdir(input_dir) if f.endswith(".safetensors"))
    if not files:
        raise ConversionError(f"{input_dir}: no .safetensors files")
    layers: dict = defaultdict(lambda: defaultdict(dict))
    for name in files:
        path = os.path.join(input_dir, name)
        with _safe_open(path) as f:
            for key in f.keys():
                if _FUSED.search(key):
                    raise ConversionError(f"{path}: {key} is a fused expert tensor (GPT-OSS style, with biases); "
                                          "expert biases cannot be expressed in this API")
                match = _EXPERT.match(key)
                if match:
                    layers[match["layer"]][int(match["expert"])][_ROLE[match["proj"]]] = (path, key)
    if not layers:
        raise ConversionError(f"{input_dir}: no per-expert projections (<layer>.experts.<e>.<proj>.weight) found")
    return layers


def _load_layer(layer: str, experts: dict, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w1 [E, 2I (up; gate) or I, H] and w2 [E, H, I] in fp32, checked for completeness and shape."""
    count = max(experts) + 1
    roles = ("up", "gate", "down") if gated else ("up", "down")
    w1, w2 = [], []
    for e in range(count):
        missing = [r for r in roles if r not in experts.get(e, {})]
        if missing:
            raise ConversionError(f"{layer}: expert {e} lacks its {', '.join(missing)} projection")
        tensors = {}
        for role in roles:
            path, key = experts[e][role]
            with _safe_open(path) as f:
                tensors[role] = f.get_tensor(key).float()
        up, down = tensors["up"], tensors["down"]
        if up.dim() != 2 or down.dim() != 2 or down.shape != (up.shape[1], up.shape[0]):
            raise ConversionError(f"{layer}: expert {e} has up {tuple(up.shape)} and down {tuple(down.shape)}; "
                                  "expected [I, H] and [H, I]")
        if gated and tensors["gate"].shape != up.shape:
            raise ConversionError(f"{layer}: expert {e} gate {tuple(tensors['gate'].shape)} != up {tuple(up.shape)}")
        w1.append(torch.cat((up, tensors["gate"])) if gated else up)
        w2.append(down)
    shapes = {tuple(t.shape) for t in w1}
    if len(shapes) != 1:
        raise ConversionError(f"{layer}: experts have different shapes {sorted(shapes)}")
    return torch.stack(w1), torch.stack(w2)


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // total
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:50]:<50}", end="", file=sys.stderr,
          flush=True)
    if done == total:
        print(file=sys.stderr)


def convert(input_dir: str, output_dir: str, quant_mode: str = "w4a4", activation: str = "swiglu",
            overwrite: bool = False, x_global_scale: float = 1.0, fc2_input_scale: float = 1.0) -> str:
    """Convert every MoE layer of a folder; w4a4 alphas fold in x_global_scale and fc2_input_scale (the encode
    scales activations will be quantized with, semantics §1.6). Returns the written file."""
    from safetensors.torch import save_file

    input_dir, output_dir = os.path.realpath(input_dir), os.path.realpath(output_dir)
    if not os.path.isdir(input_dir):
        raise ConversionError(f"{input_dir}: not a directory")
    if output_dir == input_dir:
        raise ConversionError("OUTPUT_DIR must differ from INPUT_DIR: the input is never overwritten")
    out_path = os.path.join(output_dir, OUTPUT_FILE)
    if os.path.exists(out_path) and not overwrite:
        raise ConversionError(f"{out_path} exists; pass --overwrite to replace it")
    if activation not in ("swiglu", "relu2"):
        raise ConversionError(f"--activation must be swiglu (gated) or relu2, got {activation!r}")
    activation_type = ActivationType.Relu2 if activation == "relu2" else ActivationType.Swiglu
    layers = find_expert_layers(input_dir)
    tensors, shapes = {}, {}
    for i, (layer, experts) in enumerate(sorted(layers.items())):
        _progress(i, len(layers), layer)
        w1, w2 = _load_layer(layer, experts, activation_type != ActivationType.Relu2)
        prepared = prepare_moe_weights(w1, w2, quant_mode, activation_type, x_global_scale=x_global_scale,
                                       fc2_input_scale=fc2_input_scale)
        for name in ("w1_weight", "w1_alpha", "w2_weight", "w2_alpha", "fc2_input_scale"):
            value = getattr(prepared, name)
            if value is not None:
                tensors[f"{layer}.{name}"] = value.contiguous()
        for name in ("w1_weight_sf", "w2_weight_sf"):
            view = getattr(prepared, name)
            tensors[f"{layer}.{name}"] = sf_bytes(view, view.numel()).clone()
        shapes[layer] = [w1.shape[0], w2.shape[1], w2.shape[2]]
    _progress(len(layers), len(layers), "done")
    os.makedirs(output_dir, exist_ok=True)
    metadata = {"format": "moe_ext.experts.v1", "quant_mode": prepared.quant_mode, "activation": activation,
                "layers": json.dumps(shapes), "x_global_scale": repr(float(x_global_scale))}
    save_file(tensors, out_path, metadata=metadata)
    return out_path


def load_converted(path: str, device="cpu") -> dict[str, PreparedWeights]:
    """{layer prefix: PreparedWeights} from a converted file, scales as 6-D MMA views, bit for bit as written."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device=str(device)) as f:
        meta = f.metadata() or {}
        if meta.get("format") != "moe_ext.experts.v1":
            raise ConversionError(f"{path}: not a moe_ext expert file (format {meta.get('format')!r})")
        quant_mode = meta["quant_mode"]
        activation_type = int(ActivationType.Relu2 if meta["activation"] == "relu2" else ActivationType.Swiglu)
        block = sf_block(quant_mode)
        keys = set(f.keys())
        out = {}
        for layer, (experts, hidden, inter) in json.loads(meta["layers"]).items():
            get = lambda name: f.get_tensor(f"{layer}.{name}")  # noqa: E731
            n1 = inter if activation_type == ActivationType.Relu2 else 2 * inter
            out[layer] = PreparedWeights(
                quant_mode=quant_mode, w1_weight=get("w1_weight"),
                w1_weight_sf=mma_view(get("w1_weight_sf"), experts, n1, hidden // block), w1_alpha=get("w1_alpha"),
                w2_weight=get("w2_weight"), w2_weight_sf=mma_view(get("w2_weight_sf"), experts, hidden, inter // block),
                w2_alpha=get("w2_alpha"),
                fc2_input_scale=get("fc2_input_scale") if f"{layer}.fc2_input_scale" in keys else None,
                x_global_scale=float(meta["x_global_scale"]) if quant_mode == "w4a4" else None,
                per_token_activation=False,
                activation_type=activation_type)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_ext.convert", description=__doc__.splitlines()[0])
    parser.add_argument("input_dir")
    parser.add_argument("output_dir")
    parser.add_argument("--quant-mode", default="w4a4", choices=["w4a4", "w4a8", "w4a16"])
    parser.add_argument("--activation", default="swiglu", choices=["swiglu", "relu2"])
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    parser.add_argument("--x-global-scale", type=float, default=1.0,
                        help="w4a4: NVFP4 encode scale of the activations (2688 / calibrated amax)")
    parser.add_argument("--fc2-input-scale", type=float, default=1.0, help="w4a4: encode scale of the FC2 input")
    args = parser.parse_args(argv)
    try:
        path = convert(args.input_dir, args.output_dir, args.quant_mode, args.activation, args.overwrite,
                       args.x_global_scale, args.fc2_input_scale)
    except ConversionError as exc:
        print(f"moe_ext.convert: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
