"""What the tuner saw: moe_ext.bench with every moe_ext.tuning.profile call's timings printed (candidate -> median
µs, fastest first), and those of moe_ext.tuning.sustained (its finalists timed back to back, where forwards are
long), so a tuned point can be checked against graph replays of the tactics it weighed.

    python3 benchmarks/tuner_timings.py --shapes deepseek-v3-ep8 --tokens 8 --tactic tuned [bench arguments]

`--warm-l2` times the candidates without evicting L2 between samples (tuning.FLUSH_L2_BETWEEN_SAMPLES off): the
tuner as it was up to session 40. `--profiling-routings N` times them on the first N stand-in routings
(backends.profiling_routings; 1: the tuner as it was up to session 46).
"""
import functools
import sys

from moe_ext import backends, bench, tuning


def logged(timer, label: str):
    """`timer` (tuning.profile or tuning.sustained), printing its candidates' µs, fastest first."""

    def timed(*args, **kwargs) -> dict:
        timings = timer(*args, **kwargs)
        ranked = sorted(timings.items(), key=lambda kv: kv[1])
        print(f"{label} (us): " + ", ".join(f"{tactic}: {seconds * 1e6:.1f}" for tactic, seconds in ranked),
              flush=True)
        return timings

    return timed


if __name__ == "__main__":
    # AutoTuner.choose looks the names up at each call
    tuning.profile = logged(tuning.profile, "tuner timings")
    tuning.sustained = logged(tuning.sustained, "sustained timings")
    argv = sys.argv[1:]
    if "--warm-l2" in argv:
        argv.remove("--warm-l2")
        tuning.FLUSH_L2_BETWEEN_SAMPLES = False
    if "--profiling-routings" in argv:
        at = argv.index("--profiling-routings")
        count = int(argv[at + 1])
        del argv[at:at + 2]
        backends.profiling_routings = functools.partial(backends.profiling_routings, count=count)
    sys.exit(bench.main(argv))
