"""Steady-state SASS of one streaming-GEMM mainloop step (the last TMA mainloop in the object): the loop from its
head to its back branch, less warp 0's refill block (BSSY .. BSYNC) and the per-chunk token staging that the step
branches over. Reads listings written by scripts/kernel_sass.py --sass:

    python3 scripts/kernel_sass.py --sass .kernels/moe_gemm1_w4a16_swiglu_t8_3cta.o > /tmp/a.sass
    python3 scripts/step_sass.py /tmp/a.sass
"""
import re
import sys

INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]+\*/")
BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")
LABEL = re.compile(r"^(\.L_x_\d+):")


def step_instructions(lines: list[str]) -> list[str]:
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := LABEL.match(line))}
    code = [i for i, line in enumerate(lines) if INSTRUCTION.match(line)]
    wait = [i for i in code if "SYNCS.PHASECHK.TRANS64.TRYWAIT" in lines[i]][-1]  # the step's full-barrier wait

    def target(i):
        m = BRANCH.search(lines[i])
        return labels[m.group(1)] if m else None

    # the back branch: the first branch after the wait to a label before it that is not the wait's retry loop
    back = next(i for i in code if i > wait and target(i) is not None and target(i) < wait
                and "TRYWAIT" not in lines[target(i) + 1])
    head = target(back)
    body = [i for i in code if head < i <= back]
    skip = set()
    bssy = [i for i in body if "BSSY" in lines[i]]
    bsync = [i for i in body if "BSYNC" in lines[i]]
    after_refill = bsync[0] if bssy and bsync else head
    if bssy and bsync:
        skip |= {i for i in body if bssy[0] < i < bsync[0]}
    for i in body:  # forward branches between the refill and the wait jump over the token staging
        t = target(i)
        if i < wait and t is not None and i < t < wait and t > after_refill:
            skip |= {j for j in body if i < j < t}
    return [lines[i] for i in body if i not in skip]


def main() -> None:
    for path in sys.argv[1:]:
        step = step_instructions(list(open(path)))
        retry = sum(1 for line in step if "NANOSLEEP" in line or "SYNCS.PHASECHK.TRANS64 P0" in line) + 1
        print(f"{path}: {len(step)} instructions a step (the wait's retry loop {retry} of them)")


if __name__ == "__main__":
    main()
