"""Tactic selection: token buckets, the `autotune()` context manager and a persistent tuning cache.

A tactic is a flat tuple of ints that a backend understands. Under `autotune(True)` every candidate a backend
offers for a problem is profiled once per (op key, token bucket) and the fastest is cached (where forwards take
SUSTAINED_MIN_S or more, the fastest back to back of the few fastest sampled: `sustained`); outside it the cached
tactic is used, else the backend's default. Profiling never runs while a CUDA graph is being captured.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import statistics
import threading
import time
import warnings
from typing import Callable, NamedTuple, Sequence

import torch

Tactic = tuple


class ProfilingRun(NamedTuple):
    """What the tuner times: `run(tactic)` runs one candidate on inputs that stay in place (a graph captures
    them), and each of `routings` (if any) rewrites those inputs' routing, untimed, before a round of samples."""

    run: Callable[[Tactic], None]
    routings: Sequence[Callable[[], None]] = ()


# Whether profile evicts the GPU's L2 before each timed sample. A served layer's weights come from DRAM (the
# other layers' run in between) and moe_ext.bench rotates weight copies so that they do; timed back to back on the
# same inputs a candidate keeps part of its weights in L2 (50-60 MB), which may favour the kernel chain over the
# one-launch decode: session 38's tuner took the chain at DeepSeek-V3 EP8 T=8 (73.6 µs) where graph replays of the
# heuristic's one-launch forward took 65.7-66.1 (benchmarks/tuner_timings.py --warm-l2 times them the old way).
FLUSH_L2_BETWEEN_SAMPLES = True
DEFAULT_L2_BYTES = 50 * 2 ** 20  # H100/H200 L2, used when the device does not report its own
# Forwards of SUSTAINED_MIN_S or more (prefill) run back to back when served, and there the card's power limit sets
# the clock; profile's samples, each after a flush and a host round trip, run cooler and faster, and may rank
# tactics the other way round. Session 56, DeepSeek-V3 T=4096 on an H200: the samples put (128, WGMMA_WIDE,
# WGMMA_WIDE) first (5.79 ms against (144, WGMMA, WGMMA_WIDE)'s 6.16), graph replays at the power cap 6.78 against
# 6.47-6.49 ms (its EP8 shard 0.83 against 0.85 sampled, 0.88 against 0.81 replayed): the 144-row tile multiplies
# fewer padding rows, so it draws less power and holds a higher clock under the cap. So the candidates within
# SUSTAINED_MARGIN of the fastest sample (at most SUSTAINED_CANDIDATES) are timed again back to back (sustained)
# and the fastest there is the pick.
SUSTAINED_MIN_S = 0.5e-3
SUSTAINED_MARGIN = 1.10
SUSTAINED_CANDIDATES = 4
SUSTAINED_WARM_S = 0.2  # untimed runs before each timed burst: long enough for the power limiter to settle
SUSTAINED_TIMED_S = 0.05
SUSTAINED_ROUNDS = 2


def token_bucket(num_tokens: int) -> int:
    """Round T up to FlashInfer's hybrid buckets: powers of 2 to 256, steps of 256 to 2048, of 512 to 4096, then
    powers of 2 again."""
    if num_tokens <= 256:
        return 1 << max(0, (num_tokens - 1).bit_length())
    if num_tokens <= 2048:
        return -(-num_tokens // 256) * 256
    if num_tokens <= 4096:
        return -(-num_tokens // 512) * 512
    return 1 << (num_tokens - 1).bit_length()


def bucket_list(max_num_tokens: int) -> list[int]:
    """Every bucket up to and including the one holding max_num_tokens."""
    buckets, t = [], 1
    while True:
        b = token_bucket(t)
        buckets.append(b)
        if b >= max_num_tokens:
            return buckets
        t = b + 1


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _TacticCache(dict):
    """A dict that counts its changes, so a recorded forward plan can tell that its tactic may be stale."""

    generation = 0

    def _changed(self):
        self.generation += 1

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._changed()

    def clear(self):
        super().clear()
        self._changed()

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self._changed()

    def pop(self, *args):
        self._changed()
        return super().pop(*args)

    def popitem(self):
        self._changed()
        return super().popitem()

    def setdefault(self, key, default=None):
        self._changed()
        return super().setdefault(key, default)


# The cache file's format. Version 2 keys carry the card (device_signature): version 1 entries, keyed without it,
# are dropped on load, and those points retune.
CACHE_VERSION = 2


class AutoTuner:
    """Process-wide tactic cache. Keys are tuples of plain values; the cache file stores their repr()."""

    _instance: "AutoTuner | None" = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.tuning = False
        self.cache: dict[str, Tactic] = _TacticCache()
        self.warmup = 1
        self.repeats = 5

    @classmethod
    def get(cls) -> "AutoTuner":
        if cls._instance is not None:  # every forward asks: no lock once it exists
            return cls._instance
        with cls._lock:
            if cls._instance is None:
                cls._instance = AutoTuner()
            return cls._instance

    def lookup(self, key: tuple) -> Tactic | None:
        return self.cache.get(repr(key))

    def choose(self, key: tuple, candidates: Sequence[Tactic], default: Tactic,
               make_run: Callable[[], ProfilingRun], device: torch.device,
               use_cuda_graph: bool = False) -> Tactic:
        """The tactic to run for `key`: profile the candidates when tuning (and not capturing), else the cache.
        `make_run()` gives what profile times; it is called only when profiling."""
        cached = self.lookup(key)
        if cached in candidates:
            return cached
        if not self.tuning or capturing() or len(candidates) == 1:
            return default
        run, routings = make_run()
        timings = profile(run, list(candidates), device, self.warmup, self.repeats, use_cuda_graph,
                          routings=routings)
        best = min(timings, key=timings.get)
        pool = finalists(timings)
        if len(pool) > 1:
            steady = sustained(run, {tactic: timings[tactic] for tactic in pool}, device, routings)
            best = min(steady, key=steady.get)
        self.cache[repr(key)] = best
        return best

    def load(self, path: str) -> None:
        if not os.path.exists(path):
            return
        with open(path) as f:
            data = json.load(f)
        if data.get("version") == 1:
            warnings.warn(f"{path}: a version 1 tuning cache (keys without the card); its points will retune")
            return
        if data.get("version") != CACHE_VERSION:
            raise ValueError(f"{path}: unknown tuning cache version {data.get('version')!r}")
        for entry in data["entries"]:
            self.cache[entry["key"]] = tuple(entry["tactic"])

    def save(self, path: str) -> None:
        entries = [{"key": k, "tactic": list(v)} for k, v in sorted(self.cache.items())]
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1)
        os.replace(tmp, path)


def device_signature(device: torch.device) -> tuple:
    """The card a tactic is tuned on, for the cache key: its name and SM count. The fastest tactic differs between
    Hopper parts (session 56-57: at T=8 the H100's tuner kept the one-launch decode at Qwen3-30B-A3B, which the
    H200 runs 1.15x slower than the chain), and a cache file may move between machines."""
    if device.type != "cuda":
        return (device.type,)
    return _cuda_signature(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _cuda_signature(index: int) -> tuple:
    props = torch.cuda.get_device_properties(index)
    return (props.name, props.multi_processor_count)


def l2_bytes(device: torch.device) -> int:
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def l2_flush(device: torch.device) -> Callable[[], None]:
    """A call that evicts what the L2 of `device` holds by reading twice its size (a reduction on the current
    stream) from a buffer written once here: read, its lines stay clean. A write flush would leave the L2 full of
    dirty lines whose write-back the next timed run pays (session 31: 1.09-1.16x, 3.5-13 µs more at T=1)."""
    clean = torch.zeros(2 * l2_bytes(device) // 4, dtype=torch.int32, device=device)
    return functools.partial(torch.sum, clean, dtype=torch.int64)


def profile(run: Callable[[Tactic], None], tactics: Sequence[Tactic], device: torch.device, warmup: int,
            repeats: int, use_cuda_graph: bool, budget_s: float = 2e-3, max_repeats: int = 25,
            flush: Callable[[], None] | None = None, routings: Sequence[Callable[[], None]] = ()) -> dict:
    """Median seconds of one run of each of `tactics`; through CUDA-graph replay when asked, so launch cost does
    not decide between tactics at small T. The candidates are sampled in rounds (one run of each, in an order
    that rotates), so a drift of the clocks (a power-capped H200 spread one prefill point's forwards by 14%) shifts
    every candidate alike instead of deciding between them. At least `repeats` rounds, and more (up to
    `max_repeats`) while each candidate's samples add up to under `budget_s`: a decode forward of tens of
    microseconds gets a median that separates tactics a few percent apart, a prefill forward of milliseconds is
    not timed for longer than it needs. `flush` runs before each sample, untimed (on a GPU, by default, l2_flush
    where FLUSH_L2_BETWEEN_SAMPLES). With `routings` (ProfilingRun's), round r first runs routings[r % n], the
    rounds come in whole cycles of them, and a candidate's time is the mean over routings of its median on each:
    the tactic that is fastest on average over the routings, not on one."""
    if flush is None and device.type == "cuda" and FLUSH_L2_BETWEEN_SAMPLES:
        flush = l2_flush(device)
    graphs = {}
    for tactic in tactics:
        for _ in range(warmup):
            run(tactic)
        if device.type == "cuda" and use_cuda_graph:
            graphs[tactic] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[tactic]):
                run(tactic)

    def sample(tactic) -> float:
        if flush is not None:
            flush()
        return elapsed(device, graphs[tactic].replay if tactic in graphs else functools.partial(run, tactic))

    cycle = max(1, len(routings))
    samples = {tactic: [[] for _ in range(cycle)] for tactic in tactics}

    def spent() -> float:
        return max(sum(map(sum, per_routing)) for per_routing in samples.values())

    rounds = 0
    while rounds < repeats or rounds % cycle or (rounds < max_repeats and spent() < budget_s):
        if routings:
            routings[rounds % cycle]()
        order = list(tactics[rounds % len(tactics):]) + list(tactics[:rounds % len(tactics)])
        for tactic in order:
            samples[tactic][rounds % cycle].append(sample(tactic))
        rounds += 1
    return {tactic: statistics.fmean(map(statistics.median, per_routing)) for tactic, per_routing in samples.items()}


def finalists(timings: dict) -> list:
    """The candidates `sustained` times again, fastest sample first: those within SUSTAINED_MARGIN of the fastest,
    at most SUSTAINED_CANDIDATES; none where the fastest takes under SUSTAINED_MIN_S (a decode forward, which the
    samples already time as it is served: launched alone, its weights out of L2)."""
    ranked = sorted(timings, key=timings.get)
    if not ranked or timings[ranked[0]] < SUSTAINED_MIN_S:
        return []
    return [tactic for tactic in ranked if timings[tactic] <= SUSTAINED_MARGIN * timings[ranked[0]]][
        :SUSTAINED_CANDIDATES]


def sustained(run: Callable[[Tactic], None], estimates: dict, device: torch.device,
              routings: Sequence[Callable[[], None]] = ()) -> dict:
    """Seconds a run of each candidate (`estimates`: candidate -> its sampled seconds, which size the bursts) takes
    in a back-to-back stream of its runs, the clock held by the card's power limit: in each of SUSTAINED_ROUNDS
    rounds (round r on routings[r % n], the order rotating) a candidate is enqueued for SUSTAINED_WARM_S untimed,
    then for SUSTAINED_TIMED_S timed as one burst; its time is the mean of its rounds'. Eager runs: at
    SUSTAINED_MIN_S and up the launches hide behind the GPU's work."""
    tactics = list(estimates)
    per_round = {tactic: [] for tactic in tactics}
    for r in range(SUSTAINED_ROUNDS):
        if routings:
            routings[r % len(routings)]()
        for tactic in tactics[r % len(tactics):] + tactics[:r % len(tactics)]:
            for _ in range(math.ceil(SUSTAINED_WARM_S / estimates[tactic])):
                run(tactic)
            runs = max(3, math.ceil(SUSTAINED_TIMED_S / estimates[tactic]))
            burst = elapsed(device, lambda: [run(tactic) for _ in range(runs)])
            per_round[tactic].append(burst / runs)
    return {tactic: statistics.fmean(seconds) for tactic, seconds in per_round.items()}


def elapsed(device: torch.device, body: Callable[[], object]) -> float:
    """Seconds `body()` takes: between CUDA events on the current stream on a GPU, else by the host's clock."""
    if device.type != "cuda":
        start = time.perf_counter()
        body()
        return time.perf_counter() - start
    stream = torch.cuda.current_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    body()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@contextlib.contextmanager
def autotune(tune_mode: bool = True, cache: str | os.PathLike | None = None):
    """Profile and cache tactics for the calls made inside (tune_mode=True); `cache` names a JSON file that is
    loaded on entry and written on exit, so a restart does not retune."""
    tuner = AutoTuner.get()
    previous = tuner.tuning
    if cache is not None:
        tuner.load(os.fspath(cache))
    tuner.tuning = bool(tune_mode)
    try:
        yield tuner
    finally:
        tuner.tuning = previous
        if cache is not None:
            tuner.save(os.fspath(cache))
