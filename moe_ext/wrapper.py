"""`CuteDslMoEWrapper`: a stateful fused MoE for serving loops and CUDA graphs.

Unlike FlashInfer's wrapper it honours `max_num_tokens`: routing maps, intermediate, scales and output are
allocated once for that many tokens, and `run()` reuses them for any T up to it. The returned tensor is a view
of the wrapper's output buffer, overwritten by the next run (pass the result to your next layer, or copy it).

Reuse across decode steps is cheap on the host: the first run with a given set of weight tensors and input shapes
is fully validated and its kernel launches are recorded (moe_ext/plan.py); later runs with the same weight
tensors only check the per-call tensors (activations, routing, scales) and re-issue those launches.

Capture recipe (GPU): construct with `use_cuda_graph=True` and `max_num_tokens`; run once eagerly per token
bucket (inside `autotune(True)` if you tune) so kernels are compiled and tactics chosen; then capture
`wrapper.run(...)` in `torch.cuda.graph(g)` over static input tensors and replay it after copying new
activations and routing into them. No allocation, host sync or compile happens inside a captured run. Such a
wrapper times its candidate tactics as graph replays, as it will run, so host launch cost does not decide
between them at small T.

Localized execution (semantics §4): `localized=True` makes two SM partitions (green contexts of
`localized_sm_count` SMs each, with their streams and memory pools) once; `localize(prepared_weights)` builds
the two weight shards inside the partitions' pools and keeps them; every later run executes FC1 and FC2 of the two
shards concurrently on the partitions' streams.
"""
from __future__ import annotations

import torch

from . import launcher
from .activation import Activation
from .backends import backend_for, select_tactic
from .plan import ROLES, ForwardPlan
from .problem import build_problem, canonical_quant_mode
from .quant.formats import FLT_MAX
from .tuning import AutoTuner, capturing, token_bucket
from .workspace import MoEWorkspace

VALID_TILE_SIZES = (64, 128, 256)


class CuteDslMoEWrapper:
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        use_cuda_graph: bool = False,
        max_num_tokens: int | None = None,
        num_local_experts: int | None = None,
        local_expert_offset: int = 0,
        tile_size: int = 128,
        sf_vec_size: int = 16,
        output_dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cuda",
        enable_pdl: bool = True,
        activation_type: int = 3,
        swiglu_alpha: float = 1.0,
        swiglu_beta: float = 0.0,
        swiglu_limit: float = FLT_MAX,
        situ_beta: float | None = None,
        situ_linear_beta: float | None = None,
        use_fused_finalize: bool = True,
        quant_mode: str = "w4a4",
        *,
        localized: bool = False,
        localized_sm_count: int | None = None,
    ) -> None:
        self.quant_mode = canonical_quant_mode(quant_mode)
        self.activation = Activation.resolve(activation_type, swiglu_alpha, swiglu_beta, swiglu_limit, situ_beta,
                                             situ_linear_beta)
        for name, value in (("num_experts", num_experts), ("top_k", top_k), ("hidden_size", hidden_size),
                            ("intermediate_size", intermediate_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_num_tokens is not None and (isinstance(max_num_tokens, bool) or not isinstance(max_num_tokens, int)
                                           or max_num_tokens < 1):
            raise ValueError(f"max_num_tokens must be a positive int or None, got {max_num_tokens!r}")
        if tile_size not in VALID_TILE_SIZES:
            raise ValueError(f"tile_size must be one of {VALID_TILE_SIZES}, got {tile_size!r}")
        if sf_vec_size not in (16, 32):
            raise ValueError(f"sf_vec_size must be 16 or 32, got {sf_vec_size!r}")
        if output_dtype != torch.bfloat16:
            raise ValueError(f"output_dtype must be torch.bfloat16, got {output_dtype}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_local_experts = num_experts if num_local_experts is None else num_local_experts
        self.local_expert_offset = local_expert_offset
        self.tile_size = tile_size
        # The Hopper kernels pick their routing tile per forward; the workspace holds maps for each of them.
        hopper_tiles = launcher.token_tiles(self.quant_mode, self.activation.kind)
        self.on_hopper = bool(hopper_tiles) and launcher.hopper_device(torch.device(device))
        self.routing_tiles = hopper_tiles if self.on_hopper else (tile_size,)
        self.sf_vec_size = sf_vec_size  # kept for FlashInfer compatibility; the quant mode fixes the block
        self.output_dtype = output_dtype
        self.device = torch.device(device)
        self.enable_pdl = enable_pdl
        self.use_fused_finalize = use_fused_finalize
        self.use_cuda_graph = use_cuda_graph
        self.max_num_tokens = max_num_tokens
        self.workspace: MoEWorkspace | None = None
        self._plans: dict = {}  # (x shape, tactic) -> ForwardPlan of the last validated run (moe_ext/plan.py)
        self.last_tactic = None  # the tactic the last validated run chose (given, tuned or the heuristic's)
        self.aux_stream = None
        if use_cuda_graph and self.device.type == "cuda":
            # Created outside any capture and reused inside it for the memset / GEMM1 overlap.
            self.aux_stream = torch.cuda.Stream(self.device)
        if not isinstance(localized, bool):
            raise TypeError(f"localized must be a bool, got {type(localized).__name__}")
        if localized_sm_count is not None and not localized:
            raise ValueError("localized_sm_count was given without localized=True")
        self.domains = None  # moe_ext.streams.LocalityDomains (GPU), kept for the wrapper's life
        self.localized_weights: list | None = None
        self.localized = localized
        self.localized_sm_count = localized_sm_count
        if localized and self.device.type == "cuda":
            from .streams import LocalityDomains

            self.domains = LocalityDomains.create(self.device, localized_sm_count)
            self.localized_sm_count = self.domains.sm_count
        if max_num_tokens is not None:
            self.workspace = self._allocate(max_num_tokens)

    def _allocate(self, capacity: int) -> MoEWorkspace:
        return MoEWorkspace.allocate(
            max_num_tokens=capacity, top_k=self.top_k, num_local_experts=self.num_local_experts,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size, quant_mode=self.quant_mode,
            tile_sizes=self.routing_tiles, output_dtype=self.output_dtype,
            device=self.device)

    def _workspace_for(self, num_tokens: int) -> MoEWorkspace:
        if self.workspace is not None and num_tokens <= self.workspace.max_num_tokens:
            return self.workspace
        if self.max_num_tokens is not None:
            raise ValueError(f"num_tokens={num_tokens} exceeds this wrapper's max_num_tokens={self.max_num_tokens}")
        if capturing():
            raise RuntimeError(f"num_tokens={num_tokens} needs a larger workspace, which cannot be allocated during "
                               "CUDA graph capture; warm up with the largest T first or set max_num_tokens")
        self.workspace = self._allocate(token_bucket(num_tokens))
        self._plans.clear()  # recorded launches point into the old workspace
        return self.workspace

    def localize(self, prepared) -> list[dict]:
        """Build and keep the two localized shards of `prepared` (moe_ext.PreparedWeights) in the partitions'
        memory pools; later runs use them (the full-width weights passed to run() then only give metadata)."""
        from .quant import split_localized_shards

        if not self.localized:
            raise ValueError("localize() needs a wrapper built with localized=True")
        self.localized_weights = split_localized_shards(
            prepared, pools=self.domains.pools if self.domains is not None else None)
        self._plans.clear()
        return self.localized_weights

    def get_valid_tactics(self) -> list[tuple]:
        """Tactics `run(..., tactic=)` accepts: on Hopper (routing tile, GEMM1 K split, GEMM2 K split; a split of
        launcher.WGMMA runs that GEMM's wgmma kernel, launcher.WGMMA_WIDE its 256-row weight tiles,
        launcher.THREE_CTAS its three-CTAs-an-SM streaming form, GEMM2's launcher.PERSISTENT its persistent 16-token
        streaming form (w4a4 per-token); (8, FUSED_DECODE, FUSED_DECODE) the one-launch forward,
        for calls of at most launcher.DECODE_MAX_PAIRS (token, expert) pairs), on the reference path (routing tile,)."""
        if not self.on_hopper:
            return [(t,) for t in self.routing_tiles]
        parts = 2 if self.localized else 1  # a localized shard holds half of each GEMM's weight rows
        n1 = 2 * self.intermediate_size if self.activation.gated else self.intermediate_size
        tactics = launcher.tactics(self.routing_tiles, **launcher.kernel_forms(
            self.quant_mode, self.activation.kind, n1 // parts, self.hidden_size // parts))
        if self.top_k <= launcher.DECODE_MAX_PAIRS and launcher.offers_fused_decode(
                self.quant_mode, self.activation.kind, self.use_fused_finalize, self.localized, self.routing_tiles):
            tactics.append((launcher.DECODE_TILE, launcher.FUSED_DECODE, launcher.FUSED_DECODE))  # T * top_k <= 64
        return tactics

    def run(self, x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha,
            fc2_input_scale, w2_weight, w2_weight_sf, w2_alpha, tactic=None, *, per_token_scale=None):
        weights = (w1_weight, w1_weight_sf, w1_alpha, fc2_input_scale, w2_weight, w2_weight_sf, w2_alpha)
        if self.localized_weights is not None:
            weights += tuple(shard[k] for shard in self.localized_weights for k in sorted(shard))
        inputs = dict(x=x, x_sf=x_sf, token_selected_experts=token_selected_experts,
                      token_final_scales=token_final_scales, per_token_scale=per_token_scale)
        tuner = AutoTuner.get()
        # Plans are kept per input shape and explicit tactic; a tactic given as a list always runs validated.
        key = (getattr(x, "shape", None), tactic) if tactic is None or isinstance(tactic, tuple) else None
        use_plans = self.on_hopper and key is not None and not tuner.tuning
        if use_plans:
            plan = self._plans.get(key)
            if plan is not None and plan.matches(weights, tuner.cache.generation):
                out = plan.run(inputs)
                if out is not None:
                    return out
        with launcher.recording() as recorded:
            out = self._run_validated(inputs, weights, tactic)
        if use_plans and recorded:
            self._plans[key] = ForwardPlan.from_recording(recorded, weights, inputs, out, tuner.cache.generation)
        return out

    def _run_validated(self, inputs: dict, weights: tuple, tactic):
        x, x_sf, token_selected_experts, token_final_scales, per_token_scale = (inputs[r] for r in ROLES)
        w1_weight, w1_weight_sf, w1_alpha, fc2_input_scale, w2_weight, w2_weight_sf, w2_alpha = weights[:7]
        localized = {}
        if self.localized_weights is not None:
            localized = dict(localized_weights=self.localized_weights, localized_sm_count=self.localized_sm_count,
                             localized_streams=self.domains.streams if self.domains is not None else None,
                             localized_memset_stream=self.aux_stream)
        problem = build_problem(
            x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha,
            fc2_input_scale, w2_weight, w2_weight_sf, w2_alpha, self.num_experts, self.top_k,
            self.num_local_experts, self.local_expert_offset, self.output_dtype, self.use_fused_finalize, None,
            self.activation.activation_type, self.activation.swiglu_alpha, self.activation.swiglu_beta,
            self.activation.swiglu_limit, self.activation.situ_beta, self.activation.situ_linear_beta,
            quant_mode=self.quant_mode, per_token_scale=per_token_scale, **localized)
        problem.tile_size = self.tile_size
        problem.aux_stream = self.aux_stream
        problem.enable_pdl = self.enable_pdl
        if (problem.hidden_size, problem.intermediate_size) != (self.hidden_size, self.intermediate_size):
            raise ValueError(f"weights give (hidden_size, intermediate_size) = ({problem.hidden_size}, "
                             f"{problem.intermediate_size}); this wrapper was built for ({self.hidden_size}, "
                             f"{self.intermediate_size})")
        if problem.device != self.device and not (self.device.index is None and
                                                  problem.device.type == self.device.type):
            raise ValueError(f"inputs are on {problem.device}; this wrapper was built for {self.device}")
        workspace = self._workspace_for(problem.num_tokens)
        out = workspace.output[:problem.num_tokens]
        backend = backend_for(problem)
        chosen = select_tactic(problem, backend, tactic, "CuteDslMoEWrapper.run", out, workspace,
                               use_cuda_graph=self.use_cuda_graph)
        self.last_tactic = chosen
        return backend.run(problem, chosen, out, workspace)
