"""A recorded forward: the kernel launches of one validated run, replayed for the next call's inputs.

A wrapper reused across decode steps repeats the same work on the host every call: validate every argument,
build the MoEProblem, look up the tactic, size the buffer views, check and flatten a dozen tensors and launch.
Only the activations and routing change between steps; the weights, workspace, tactic and every scalar stay. A
ForwardPlan keeps the launches of the first (fully validated) run, with the buffers of the per-call tensors
marked by their role (launcher.PerCall), and a later call with the same weight tensors, the same per-call shapes
and dtypes and the same tuning state only checks those tensors and re-issues the launches: tens of microseconds
instead of hundreds.
Anything else (another weight tensor, a new shape, a tuning run) takes the validated path again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ROLES = ("x", "x_sf", "token_selected_experts", "token_final_scales", "per_token_scale")


@dataclass(frozen=True)
class InputSpec:
    dtype: torch.dtype
    shape: tuple
    device: torch.device

    @staticmethod
    def of(t: torch.Tensor | None) -> "InputSpec | None":
        return None if t is None else InputSpec(t.dtype, tuple(t.shape), t.device)

    def admits(self, t) -> bool:
        """Same dtype, shape and device, contiguous and 16-byte aligned (what the recorded launches assumed: the
        validated path checks the same, with its error messages)."""
        return (isinstance(t, torch.Tensor) and t.dtype == self.dtype and t.shape == self.shape
                and t.device == self.device and t.is_contiguous() and t.data_ptr() % 16 == 0)


class StepList:
    """Launches and memsets re-issued from Python one at a time: what `_C.LaunchPlan` does in one C++ call, for a
    module without it (a test's fake)."""

    def __init__(self, module):
        self.module, self.steps = module, []

    def add_launch(self, name, tensors, scalars, pdl, side_stream, patches):
        self.steps.append((name, list(tensors), scalars, pdl, side_stream, patches))

    def add_memset(self, ptr, nbytes, side_stream):
        self.steps.append((None, ptr, nbytes, side_stream))

    def run(self, role_pointers, stream):
        for step in self.steps:
            if step[0] is None:
                _, ptr, nbytes, side = step
                self.module.memset_async(ptr, nbytes, side or stream)
                continue
            name, buffers, scalars, pdl, side, patches = step
            if patches:
                buffers = list(buffers)
                for i, role in patches:
                    buffers[i] = (role_pointers[role], buffers[i][1])
            self.module.launch(name, buffers, scalars, pdl, side or stream)


def _new_segment(module):
    return module.LaunchPlan() if hasattr(module, "LaunchPlan") else StepList(module)


@dataclass
class ForwardPlan:
    weights: tuple  # the weight tensors of the recorded run (identity and data pointer must match)
    weight_pointers: tuple
    inputs: dict  # role -> InputSpec or None (absent)
    # Host callables (event fork/join) and, between them, segments of launches and memsets (_C.LaunchPlan, or
    # StepList) that take the per-call pointers in ROLES order.
    segments: list
    out: torch.Tensor
    tuning_generation: int

    @classmethod
    def from_recording(cls, recorded: list, weights: tuple, inputs: dict, out: torch.Tensor,
                       tuning_generation: int) -> "ForwardPlan | None":
        """The plan of a recorded run (launcher.recording(): Launch, Memset and Call steps); None if a recorded
        per-call buffer is not the tensor passed for its role (nothing to patch it from)."""
        from . import launcher

        module = launcher._module()
        segments = []
        for step in recorded:
            if isinstance(step, launcher.Call):
                segments.append(step.fn)
                continue
            if not segments or callable(segments[-1]):
                segments.append(_new_segment(module))
            side = 0 if step.stream is None else step.stream.cuda_stream
            if isinstance(step, launcher.Memset):
                segments[-1].add_memset(step.ptr, step.nbytes, side)
                continue
            patches = []
            for i, role in step.roles:
                t = inputs.get(role)
                if t is None or t.data_ptr() != step.buffers[i][0]:
                    return None
                patches.append((i, ROLES.index(role)))
            segments[-1].add_launch(step.name, step.buffers, step.scalars, step.pdl, side, patches)
        return cls(weights, _pointers(weights), {role: InputSpec.of(t) for role, t in inputs.items()}, segments,
                   out, tuning_generation)

    def matches(self, weights: tuple, tuning_generation: int) -> bool:
        if tuning_generation != self.tuning_generation or len(weights) != len(self.weights):
            return False
        for a, b in zip(weights, self.weights):
            if a is not b:
                return False
        return _pointers(weights) == self.weight_pointers

    def run(self, inputs: dict) -> torch.Tensor | None:
        """Re-issue the forward for `inputs`; None (nothing launched) when an input does not fit the plan, so the
        caller takes the validated path and its error messages."""
        pointers = [0] * len(ROLES)
        for i, role in enumerate(ROLES):
            spec, t = self.inputs.get(role), inputs.get(role)
            if spec is None:
                if t is not None:
                    return None
            elif spec.admits(t):
                pointers[i] = t.data_ptr()
            else:
                return None
        stream = torch.cuda.current_stream(self.out.device).cuda_stream
        for segment in self.segments:
            if callable(segment):
                segment()
            else:
                segment.run(pointers, stream)
        return self.out


def _pointers(tensors: tuple) -> tuple:
    return tuple(0 if t is None else t.data_ptr() for t in tensors)
