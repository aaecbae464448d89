"""Backends that execute a validated MoEProblem, and the choice between them.

The reference backend runs `moe_ext.reference` on any device. The Hopper CuTe-DSL backend is not built yet
(issue 3); until it is, every device runs the reference path, and `backend_for` is the one place that changes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .problem import MoEProblem
from .reference import reference_moe
from .routing import compute_routing
from .tuning import AutoTuner, Tactic, token_bucket
from .workspace import MoEWorkspace


@dataclass(frozen=True)
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
        if workspace is not None:
            routing = workspace.store_routing(routing)
        return reference_moe(problem, routing, out)


REFERENCE = ReferenceBackend()


def backend_for(problem: MoEProblem) -> ReferenceBackend:
    return REFERENCE


def op_key(problem: MoEProblem, backend, op: str) -> tuple:
    """Tuning-cache key: op, backend, quant mode, activation parameters, finalize, shapes and the token bucket."""
    return (op, backend.name, problem.quant_mode, problem.activation.cache_key(),
            problem.per_token_scale is not None, problem.use_fused_finalize, problem.shards is not None,
            problem.hidden_size, problem.intermediate_size, problem.num_local_experts, problem.top_k,
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
    return AutoTuner.get().choose(
        op_key(problem, backend, op), candidates, backend.default_tactic(problem),
        lambda t: backend.run(problem, t, out, workspace), problem.device, use_cuda_graph)
