"""Side streams of a forward: the fused-finalize memset overlapping GEMM1 (semantics §5.1 step 2) and the two
localized shards (semantics §4), forked from and joined back to the caller's stream with events.

A ForkJoin owns its events, made once: forking and joining inside a captured forward adds dependencies to the
graph and allocates nothing. `LocalityDomains` holds what localized execution keeps for the life of a wrapper:
one green context per shard (a fixed SM budget), its stream and a memory pool to place the shard's weights in.

PyTorch may grow `torch.cuda.execute_on_streams` (an open PR); torch 2.11 has none, so the fork and join are the
in-repo event pair below, which the recorded forward plans (moe_ext/plan.py) can replay step by step.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


class ForkJoin:
    """Fork the caller's current stream onto `streams` and join them back, with events created once."""

    def __init__(self, streams: list):
        self.streams = list(streams)
        self.start = torch.cuda.Event()
        self.done = [torch.cuda.Event() for _ in self.streams]

    def _caller(self) -> torch.cuda.Stream:
        """The current stream of the side streams' device (where the forward's other kernels go)."""
        return torch.cuda.current_stream(self.streams[0].device)

    def fork(self) -> None:
        """Work queued next on any of `streams` starts after everything queued so far on the caller's stream."""
        self.start.record(self._caller())
        for s in self.streams:
            s.wait_event(self.start)

    def join(self) -> None:
        """Work queued next on the caller's stream starts after everything queued so far on `streams`."""
        caller = self._caller()
        for s, done in zip(self.streams, self.done):
            done.record(s)
            caller.wait_event(done)


# One ForkJoin per stream (tuple): the functional API gets its streams per call; their events are made once.
_fork_joins: dict = {}


def fork_join(streams: list) -> ForkJoin:
    key = tuple(id(s) for s in streams)
    entry = _fork_joins.get(key)
    if entry is None or any(ref() is not s for ref, s in zip(entry[0], streams)):
        entry = ([weakref.ref(s) for s in streams], ForkJoin(streams))
        _fork_joins[key] = entry
    return entry[1]


def green_contexts_supported() -> bool:
    gc = getattr(torch.cuda, "green_contexts", None)
    return gc is not None and torch.cuda.is_available() and getattr(gc, "SUPPORTED", True)


@dataclass
class LocalityDomains:
    """Two equal SM partitions of one GPU, each a green context with its stream and a memory pool.

    Hopper has no locality domains (the memory is uniform), so here a domain is an SM budget: each shard's
    kernels run on `sm_count` SMs and the remaining SMs stay free for other streams.
    """

    sm_count: int
    contexts: list
    streams: list
    pools: list

    @classmethod
    def create(cls, device, sm_count: int | None = None, domains: int = 2) -> "LocalityDomains":
        device = torch.device(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).multi_processor_count
        if sm_count is None:
            sm_count = (total // domains) // 8 * 8  # Hopper partitions SMs in groups of 8
        if sm_count < 1 or sm_count * domains > total:
            raise ValueError(f"localized_sm_count must be in [1, {total // domains}] for {domains} domains on a "
                             f"{total}-SM GPU, got {sm_count}")
        if not green_contexts_supported():
            raise RuntimeError("this torch/driver has no green contexts (torch.cuda.green_contexts)")
        from torch.cuda.green_contexts import GreenContext

        contexts = [GreenContext.create(num_sms=sm_count, device_id=index) for _ in range(domains)]
        streams = [g.Stream() for g in contexts]
        pools = [torch.cuda.MemPool() for _ in range(domains)]
        return cls(sm_count, contexts, streams, pools)
