"""What narrow wgmma widths could save on the wgmma GEMMs (session 34's prediction, no GPU): on the benchmark's
routing draws (moe_ext.bench.random_routing), each expert's rows split into routing tiles; a tile's stage costs
max(MMA, decode) issue cycles, the MMA proportional to the token rows a wgmma multiplies (MMA_CYCLES for 128
weight rows x 128 tokens x 64 K, at the H200's dense bf16 rate) and the decode DECODE_CYCLES a 128-row weight half
(115 SASS a consumer thread, 8 warps on 4 schedulers). Prints, per shape and T, the ratio of each form's cost
today to its cost with narrow widths:

  128 / 64 weight rows x 128-token tiles (128, WGMMA, WGMMA): n32 / n64 / n128 for a tile's live rows
  256 weight rows x 128-token tiles (128, WGMMA_WIDE, WGMMA_WIDE): the second 64-row block skipped at <= 64 rows
  128 / 256 weight rows x 64-token tiles (64, WGMMA, ...): n32 at <= 32 rows

    python3 benchmarks/padding_model.py [--draws 3]

A model, not a measurement: it ignores the copier, the epilogue, the raster's imbalance and the power cap, and it
does not rank the forms against each other (by it 64-token tiles would never lose to 128-token ones, which the
tuner's choices at T >= 4096 contradict): which form wins is the device's to say.
"""
import argparse

import torch

from moe_ext.bench import SHAPES, random_routing

MMA_CYCLES = 553  # 128 x 128 x 64 MACs
DECODE_CYCLES = 230  # a 128-row weight half's decode


def stage_cost(weight_rows: int, tokens: int) -> float:
    halves = weight_rows // 128
    return max(MMA_CYCLES * halves * tokens / 128, DECODE_CYCLES * halves)


def tile_costs(rows: int, tile: int, weight_rows: int, narrow: bool) -> float:
    full, rest = divmod(rows, tile)
    cost = full * stage_cost(weight_rows, tile)
    if rest:
        if not narrow:
            width = tile
        elif tile == 128 and weight_rows == 256:
            width = 64 if rest <= 64 else 128
        else:
            width = next(w for w in (32, 64, tile) if rest <= w and w <= tile)
        cost += stage_cost(weight_rows, width)
    return cost


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--tokens", default="1024,4096,16384")
    args = parser.parse_args()
    forms = [(128, 128), (128, 256), (64, 128), (64, 256)]
    print("shape T | each form's (routing tile x weight rows) cost today / with narrow widths")
    for shape in SHAPES.values():
        for T in (int(t) for t in args.tokens.split(",")):
            rows = [torch.bincount(random_routing(T, shape, seed, "cpu").ids.flatten().long(),
                                   minlength=shape.num_experts)[shape.local_offset:][:shape.num_local].tolist()
                    for seed in range(args.draws)]
            ratios = [sum(tile_costs(r, *form, False) for draw in rows for r in draw)
                      / sum(tile_costs(r, *form, True) for draw in rows for r in draw) for form in forms]
            print(f"{shape.name} {T} | " + " ".join(f"t{t}xn{w} {x:.3f}" for (t, w), x in zip(forms, ratios)))


if __name__ == "__main__":
    main()
