"""Steady-state SASS of a streaming GEMM's mainloop, per stage: the loop densest in full-barrier waits (one a
stage; two or four where the mainloop groups or unrolls stages, StreamConfig.stages_per_wait / unroll_ring; a ring
walked as a loop too), less every block a forward branch jumps over without a full-barrier wait in it (warp 0's
refills, the per-chunk token staging). The waits' retry paths count where ptxas leaves them in the loop. Reads listings
written by scripts/kernel_sass.py --sass:

    python3 scripts/kernel_sass.py --sass .kernels/moe_gemm1_w4a16_swiglu_t8_3cta.o > /tmp/a.sass
    python3 scripts/step_sass.py /tmp/a.sass

For a 16- to 64-token tile (a mainloop a width) the innermost loop is the narrowest width's.
"""
import re
import sys

INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]+\*/")
BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")
LABEL = re.compile(r"^(\.L_x_\d+):")
SHORT_LOOP = 8  # instructions at most in a wait's retry loop (a stage takes ~180)


def barrier_offset(line: str) -> int | None:
    """The immediate byte offset of an mbarrier operand ([R8+URZ+0x11480] -> 0x11480), None without one."""
    last = line.split("[")[1].split("]")[0].split("+")[-1]
    return int(last, 16) if last.startswith("0x") else None


def mainloop(lines: list[str]) -> tuple[int, list[str]]:
    """(stages a loop iteration, the iteration's instructions) of the hottest mainloop."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := LABEL.match(line))}
    code = [i for i, line in enumerate(lines) if INSTRUCTION.match(line)]
    # Releases arrive on the empty barriers, which follow the full ones: a wait below the first is a full wait.
    empty = min(o for i in code if "ARRIVE.TRANS64.A1T0" in lines[i] and (o := barrier_offset(lines[i])) is not None)
    full = [i for i in code if "SYNCS.PHASECHK.TRANS64.TRYWAIT" in lines[i]
            and (o := barrier_offset(lines[i])) is not None and o < empty]

    def target(i):
        m = BRANCH.search(lines[i])
        return labels[m.group(1)] if m else None

    # Unconditional back branches past the last EXIT return from out-of-line retry paths into a loop; inside the
    # body they close a loop whose exit branches forward (the ring walked as a loop, StreamConfig.unroll_ring off).
    # A wait's own retry loop (a few instructions around its TRYWAIT) is not a mainloop.
    body_end = max((i for i in code if re.search(r"\bEXIT\b", lines[i])), default=len(lines))
    loops = [(sum(head <= w < i for w in full), head, i) for i in code
             if ("@" in lines[i] or i < body_end) and (head := target(i)) is not None and head < i
             and sum(head < j < i for j in code) > SHORT_LOOP]
    # The mainloop is the loop densest in full waits (an outer loop holds the same waits among more instructions; an
    # unrolled ring's pass and a looped ring's group both qualify), more waits breaking ties.
    stages, head, back = max((loop for loop in loops if loop[0]), key=lambda loop: (loop[0] / (loop[2] - loop[1]),
                                                                                    loop[0]))
    body = [i for i in code if head < i <= back]
    skip = set()
    for i in body:
        t = target(i)
        if t is not None and i < t <= back and not any(i < w < t for w in full):
            skip |= {j for j in body if i < j < t}
    return stages, [lines[i] for i in body if i not in skip]


def main() -> None:
    for path in sys.argv[1:]:
        stages, loop = mainloop(list(open(path)))
        print(f"{path}: {len(loop) / stages:.1f} instructions a stage ({len(loop)} in a loop of {stages})")


if __name__ == "__main__":
    main()
