"""Backends that execute a validated MoEProblem, and the choice between them.

The reference backend runs `moe_ext.reference` on any device. The Hopper backend runs the CuTe-DSL kernels
linked into `moe_ext._C` on sm_90 devices, for every quant mode, full width or as two localized shards.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import torch

from .problem import MoEProblem
from .reference import reference_moe
from .routing import compute_routing
from .tuning import AutoTuner, ProfilingRun, Tactic, device_signature, token_bucket
from .workspace import MoEWorkspace


@dataclasses.dataclass(frozen=True)
class ReferenceBackend:
    """PyTorch reference. Its only tactic is (routing tile,): the problem's tile size."""

    name: str = "reference"

    def tactics(self, problem: MoEProblem) -> list[Tactic]:
        return [(problem.tile_size,)]

    def default_tactic(self, problem: MoEProblem) -> Tactic:
        return (problem.tile_size,)

    def run(self, problem: MoEProblem, tactic: Tactic, out: torch.Tensor,
            workspace: MoEWorkspace | None = None) -> torch.Tensor:
        (tile,) = tactic
        routing = compute_routing(problem.token_selected_experts, problem.num_local_experts,
                                  problem.local_expert_offset, tile)
        if workspace is not None and tile in workspace.tile_sizes:
            routing = workspace.store_routing(routing)
        return reference_moe(problem, routing, out)


REFERENCE = ReferenceBackend()


@dataclasses.dataclass(frozen=True)
class HopperBackend:
    """CuTe-DSL kernels for sm_90a: routing, GEMM1 (+ activation + FC2-input quantization), the per-token FC2
    quantizer (w4a4 with per_token_scale), GEMM2, finalize. A tactic is (routing tile, GEMM1 K split, GEMM2 K
    split): tokens per CTA of the streaming GEMMs (a tile the kernels were compiled for) and how many CTAs of a
    cluster share each GEMM tile's K steps; split launcher.WGMMA (0) runs that GEMM's warp-specialised wgmma kernel
    instead (128-token tile; in the quantized modes both GEMMs or neither), launcher.WGMMA_WIDE (-1) its 256-row
    weight tiles, launcher.THREE_CTAS (-2) its streaming kernel's three-CTAs-an-SM form (8- and 32-token tiles),
    GEMM2's launcher.PERSISTENT (-4) its persistent 16-token streaming form (w4a4 per-token);
    (8, launcher.FUSED_DECODE, launcher.FUSED_DECODE) (-3) runs the whole small-T forward as one launch."""

    name: str = "sm90"

    def supports(self, problem: MoEProblem) -> bool:
        from . import launcher

        if not (problem.num_tokens > 0 and problem.num_local_experts <= 2048
                and launcher.hopper_device(problem.device) and self._tiles(problem)):
            return False
        if problem.hidden_size % 128 or problem.intermediate_size % 128:
            warnings.warn(f"the sm_90a kernels need H % 128 == 0 and I % 128 == 0 (H={problem.hidden_size}, "
                          f"I={problem.intermediate_size}); this layer runs on the PyTorch reference path",
                          stacklevel=3)
            return False
        if problem.shards is not None and (problem.n1 // len(problem.shards)) % 128:
            # The GEMMs take whole 128-row weight tiles: a Relu2 shard holds I / 2 rows of W1.
            warnings.warn(f"the sm_90a kernels need each localized shard's {problem.n1 // len(problem.shards)} W1 "
                          f"rows to be a multiple of 128 (Relu2 shards: I % 256 == 0, I={problem.intermediate_size}); "
                          "this layer runs on the PyTorch reference path", stacklevel=3)
            return False
        return True

    @staticmethod
    def _tiles(problem: MoEProblem) -> tuple:
        from . import launcher

        return launcher.token_tiles(problem.kernel_mode, problem.activation.kind)

    @staticmethod
    def _slabs_fit(problem: MoEProblem, tactic: tuple) -> bool:
        """Whether a forward on `tactic` fits the token slabs a workspace holds: its GEMM1 reads none, or T is at
        most launcher.SLAB_MAX_TOKENS."""
        from . import launcher

        return (problem.num_tokens <= launcher.SLAB_MAX_TOKENS
                or not launcher.reads_slabs(problem.kernel_mode, tactic[0], tactic[1]))

    @staticmethod
    def _forms(problem: MoEProblem) -> dict:
        """launcher.kernel_forms for this problem: a localized shard's launches hold 1 / parts of the weight rows
        (that decides where 256-row weight tiles fit)."""
        from . import launcher

        parts = 1 if problem.shards is None else len(problem.shards)
        return launcher.kernel_forms(problem.kernel_mode, problem.activation.kind, problem.n1 // parts,
                                     problem.hidden_size // parts)

    @classmethod
    def _default_forms(cls, problem: MoEProblem) -> dict:
        """_forms less the ones only the tuner takes (launcher.PERSISTENT: it won and lost by shape)."""
        forms = cls._forms(problem)
        del forms["persistent"]
        return forms

    @staticmethod
    def _both_widths(problem: MoEProblem) -> bool:
        """Localized shards with localized_allow_nonlocalized: the full-width path is a candidate too, and a fourth
        tactic element says which runs (1: the shards, 0: full width)."""
        return problem.shards is not None and problem.localized_allow_nonlocalized

    def tactics(self, problem: MoEProblem) -> list[Tactic]:
        from . import launcher

        base = [t for t in launcher.tactics(self._tiles(problem), **self._forms(problem))
                if self._slabs_fit(problem, t)]
        if launcher.fits_fused_decode(problem):
            base.append((launcher.DECODE_TILE, launcher.FUSED_DECODE, launcher.FUSED_DECODE))
        if self._both_widths(problem):
            return [t + (1,) for t in base] + [t + (0,) for t in base]
        return base

    def default_tactic(self, problem: MoEProblem) -> Tactic:
        from . import launcher

        # A localized shard runs on its domain's SMs, with half the weight rows of each GEMM.
        parts = 1 if problem.shards is None else len(problem.shards)
        sms = launcher.num_sms(problem.device)
        if problem.shards is not None:
            sms = problem.localized_sm_count or sms // parts
        def heuristic(tiles: tuple) -> tuple:
            return launcher.default_tactic(problem.num_tokens, problem.top_k, problem.num_experts,
                                           problem.num_local_experts, problem.n1 // parts,
                                           problem.hidden_size // parts, tiles, sms,
                                           fused_decode=launcher.DEFAULT_FUSED_DECODE
                                           and launcher.fits_fused_decode(problem),
                                           decode_gemm2_idle=launcher.decode_gemm2_idle(problem),
                                           **self._default_forms(problem))

        tactic = heuristic(self._tiles(problem))
        if not self._slabs_fit(problem, tactic):  # (it takes them below ~12 rows an expert: T < ~400 measured)
            tactic = heuristic(tuple(t for t in self._tiles(problem)
                                     if not launcher.reads_slabs(problem.kernel_mode, t, 1)))
        return tactic + (1,) if self._both_widths(problem) else tactic

    def run(self, problem: MoEProblem, tactic: Tactic, out: torch.Tensor,
            workspace: MoEWorkspace | None = None) -> torch.Tensor:
        from . import launcher, streams

        tile, split1, split2, *width = tactic
        if width == [0]:  # the full-width path of a localized problem (localized_allow_nonlocalized)
            problem = dataclasses.replace(problem, shards=None, localized_streams=None,
                                          aux_stream=problem.localized_memset_stream or problem.aux_stream)
        T, K = problem.num_tokens, problem.top_k
        wgmma = launcher.is_wgmma(split1)
        pooled = workspace is not None and tile in workspace.tile_sizes
        routing = (workspace.routing_buffers(T, tile) if pooled
                   else launcher.allocate_routing(T, K, problem.num_local_experts, tile, problem.device))
        rows = routing.permuted_to_expanded.numel()
        sizes = (problem.quant_mode, rows, problem.intermediate_size, T, K, problem.hidden_size)
        slab_rows = launcher.slab_rows(problem.kernel_mode, tile, split1, rows)
        buffers = (workspace.kernel_buffers.view(*sizes, wgmma, slab_rows) if pooled
                   else launcher.KernelBuffers.allocate(*sizes, problem.device, wgmma, slab_rows))
        memset_stream = problem.localized_memset_stream if problem.shards is not None else problem.aux_stream
        aux = streams.fork_join([memset_stream]) if memset_stream is not None else None
        shard_streams = streams.fork_join(problem.localized_streams) if problem.localized_streams else None
        return launcher.forward(problem, routing, buffers, out, problem.enable_pdl, (split1, split2), aux,
                                shard_streams)


HOPPER = HopperBackend()


def backend_for(problem: MoEProblem):
    return HOPPER if HOPPER.supports(problem) else REFERENCE


def op_key(problem: MoEProblem, backend, op: str) -> tuple:
    """Tuning-cache key: op, backend, the card (tuning.device_signature), quant mode, activation parameters,
    finalize, shapes (experts in all and local: they set the load a rank's experts see) and the token bucket."""
    return (op, backend.name, device_signature(problem.device), problem.quant_mode, problem.activation.cache_key(),
            problem.per_token_scale is not None, problem.use_fused_finalize, problem.shards is not None,
            problem.localized_allow_nonlocalized,
            problem.hidden_size, problem.intermediate_size, problem.num_experts, problem.num_local_experts,
            problem.top_k,
            token_bucket(max(1, problem.num_tokens)))


def select_tactic(problem: MoEProblem, backend, tactic, op: str, out: torch.Tensor,
                  workspace: MoEWorkspace | None, use_cuda_graph: bool = False) -> Tactic:
    """An explicit tactic is checked against the backend's list; otherwise the tuner decides."""
    candidates = backend.tactics(problem)
    if tactic is not None:
        tactic = tuple(tactic)
        if tactic not in candidates:
            raise ValueError(f"tactic {tactic} is not valid for the {backend.name} backend on this problem; "
                             f"valid tactics: {candidates}")
        return tactic
    def make_run():
        routings = profiling_routings(problem)
        profiled = dataclasses.replace(problem, token_selected_experts=routings[0].clone())
        ids = profiled.token_selected_experts
        return ProfilingRun(lambda t: backend.run(profiled, t, out, workspace),
                            [functools.partial(ids.copy_, r) for r in routings])

    return AutoTuner.get().choose(op_key(problem, backend, op), candidates, backend.default_tactic(problem),
                                  make_run, problem.device, use_cuda_graph)


PROFILING_ROUTINGS = 4  # stand-in routings each candidate is timed on where loads are random (T*K > E)


def profiling_routings(problem: MoEProblem, count: int = PROFILING_ROUTINGS) -> list[torch.Tensor]:
    """Stand-in routings of the problem's shape that the tuner times candidates on, in place of the caller's.
    The tactic is kept for the whole token bucket, so it must not hang on one call's routing: a first call that
    sends no slot (or every slot) to this rank's experts would pick a tactic that is fastest at doing nothing, and
    at T=1 even one random routing does that to an EP rank a third of the time.
    - T*K <= E: slot s goes to expert s * E // (T*K), evenly spaced, so each EP rank gets exactly its share (one
      routing: there is nothing random to average).
    - T*K > E: token t takes K experts spaced E // K apart from a seeded random offset (mod E), one routing per
      seed 0 .. count-1. Each expert then gets a Binomial(T, K/E) load, as under random routing, while a token's
      slots still spread over the EP ranks as evenly as they can. Equal loads would not do: at 8 rows per expert
      they make 8-token tiles look ideal, while real loads spill into a second tile (the session-10 sweep's tuner
      chose tile 8 on DeepSeek-V3 and gpt-oss at T=256, where 16-token tiles ran the GEMMs 1.29x faster).
      Several draws, because where few experts are hit their number can decide between tactics: at Mixtral T=8
      (16 slots on 8 experts) GEMM2 split in two launches 384 three-CTA streaming CTAs with 6 experts hit (396
      slots on 132 SMs) and 512 with 8. Timed on seed 0's routing alone the tuner took that split, which graph
      replays on four random routings ran 1.05x slower than the unsplit default (h100_session47_checks.md).
    A token's K experts are distinct in both."""
    T, K, E = problem.num_tokens, problem.top_k, problem.num_experts
    if T * K <= E:
        draws = [torch.arange(T * K) * E // (T * K)]
    else:
        offsets = [torch.randint(E, (T, 1), generator=torch.Generator().manual_seed(seed)) for seed in range(count)]
        draws = [(o + torch.arange(K) * (E // K)) % E for o in offsets]
    return [ids.to(device=problem.device, dtype=torch.int32).reshape(T, K) for ids in draws]
