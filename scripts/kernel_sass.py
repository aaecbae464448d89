"""SASS of exported kernel objects, without a GPU: the sm_90a cubin inside each `.o` that
`python3 -m moe_ext.kernels.sm90.build` writes, disassembled with nvdisasm (see nvdisasm()).

    python3 scripts/kernel_sass.py .kernels/moe_gemm2_w4a16_t128_wgmma.o            # opcode counts, local memory
    python3 scripts/kernel_sass.py --sass .kernels/moe_gemm2_w4a16_t128_wgmma.o     # the whole listing
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

EM_CUDA = 190


def _u(data: bytes, offset: int, size: int) -> int:
    return int.from_bytes(data[offset:offset + size], "little")


def embedded_cubin(obj: bytes) -> bytes:
    """The first CUDA ELF inside a host object, cut at the end of its last section or segment."""
    start = obj.find(b"\x7fELF", 4)
    while start != -1 and _u(obj, start + 18, 2) != EM_CUDA:
        start = obj.find(b"\x7fELF", start + 4)
    if start == -1:
        raise ValueError("no CUDA ELF inside the object")
    elf = obj[start:]
    shoff, shentsize, shnum = _u(elf, 40, 8), _u(elf, 58, 2), _u(elf, 60, 2)
    phoff, phentsize, phnum = _u(elf, 32, 8), _u(elf, 54, 2), _u(elf, 56, 2)
    end = max(shoff + shnum * shentsize, phoff + phnum * phentsize)
    for i in range(shnum):
        header = shoff + i * shentsize
        if _u(elf, header + 4, 4) != 8:  # SHT_NOBITS occupies no file bytes
            end = max(end, _u(elf, header + 24, 8) + _u(elf, header + 32, 8))
    for i in range(phnum):
        header = phoff + i * phentsize
        end = max(end, _u(elf, header + 8, 8) + _u(elf, header + 32, 8))
    return elf[:end]


def nvdisasm() -> str:
    """$NVDISASM if set, else PATH, the nvidia-cuda-nvdisasm wheel (scripts/install.sh installs it beside CuTe-DSL)
    or Triton's copy."""
    if os.environ.get("NVDISASM"):
        candidates = [os.environ["NVDISASM"]]
    else:
        candidates = [shutil.which("nvdisasm")]
        for package, parts in (("nvidia", ("cu13", "bin", "nvdisasm")),
                               ("triton", ("backends", "nvidia", "bin", "nvdisasm"))):
            try:
                candidates += [os.path.join(d, *parts) for d in __import__(package).__path__]
            except ImportError:
                pass
    found = next((c for c in candidates if c and os.path.exists(c)), None)
    if found is None:
        raise SystemExit("nvdisasm not found: put it on PATH or set NVDISASM")
    return found


def sass(path: str) -> str:
    with open(path, "rb") as f:
        cubin = embedded_cubin(f.read())
    with tempfile.NamedTemporaryFile(suffix=".cubin") as tmp:
        tmp.write(cubin)
        tmp.flush()
        return subprocess.run([nvdisasm(), "-c", tmp.name], capture_output=True, text=True, check=True).stdout


def opcode_counts(listing: str) -> collections.Counter:
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", listing)
    return collections.Counter(ops)


def mainloop_local_ops(listing: str) -> int:
    """Local-memory loads and stores between a kernel's first and last HGMMA or HMMA: spills inside the mainloop
    (values that only cross the setmaxnreg branches, or are parked across the whole mainloop, are stored and loaded
    outside it, once per work item or CTA)."""
    lines = listing.splitlines()
    mma = [i for i, line in enumerate(lines) if re.search(r"\bHG?MMA\b", line)]
    if not mma:
        return 0
    return sum(1 for line in lines[mma[0]:mma[-1] + 1] if re.search(r"\b(LDL|STL)\b", line))


_HGMMA_SHAPE = re.compile(r"HGMMA\.(\d+x\d+x\d+)")


def serialized_wgmmas(listing: str) -> int:
    """HGMMAs followed by a full wait (`WARPGROUP.DEPBAR.LE gsb0, 0x0`) before the next HGMMA: ptxas serialises
    wgmmas this way when it cannot prove their register operands safe, and says nothing. The mainloop's last
    wait (wait_group 0 after the last stage) is not counted."""
    lines = [line for line in listing.splitlines() if "HGMMA" in line or "DEPBAR.LE gsb0, 0x0" in line]
    return sum(1 for a, b, c in zip(lines, lines[1:], lines[2:])
               if "HGMMA" in a and "DEPBAR" in b and "HGMMA" in c)


def wgmma_widths(listing: str) -> list[int]:
    """The N of every HGMMA shape in the listing (m64nNk16), ascending."""
    return sorted({int(m.split("x")[1]) for m in _HGMMA_SHAPE.findall(listing)})


def mma_loops(listing: str) -> list[tuple[int, collections.Counter]]:
    """(instructions, opcode counts) of each innermost loop whose body issues HMMA or HGMMA: the mainloop steps
    the perf notes count instructions of (a body runs from a label to the last branch back to it)."""
    lines = listing.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", line))}
    spans = {}
    for i, line in enumerate(lines):
        m = re.search(r"BRA(?:\.\S+)? `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            spans[m.group(1)] = (labels[m.group(1)], i)
    bodies = [(a, b) for a, b in spans.values()
              if any("MMA" in line for line in lines[a:b + 1])]
    innermost = [(a, b) for a, b in bodies if not any(a < c and d < b for c, d in bodies if (c, d) != (a, b))]
    return [(sum(counts.values()), counts) for counts in
            (opcode_counts("\n".join(lines[a:b + 1])) for a, b in sorted(innermost))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("objects", nargs="+")
    parser.add_argument("--sass", action="store_true", help="print the whole listing")
    parser.add_argument("--loops", action="store_true", help="also count each MMA loop body's instructions")
    args = parser.parse_args(argv)
    for path in args.objects:
        listing = sass(path)
        if args.sass:
            sys.stdout.write(listing)
            continue
        counts = opcode_counts(listing)
        local = counts["LDL"] + counts["STL"]
        top = ", ".join(f"{op} {n}" for op, n in counts.most_common(12))
        print(f"{os.path.basename(path)}: {sum(counts.values())} instructions, local memory ops {local} "
              f"({mainloop_local_ops(listing)} inside the mainloop), serialized wgmmas "
              f"{serialized_wgmmas(listing)}, wgmma widths {wgmma_widths(listing)}; {top}")
        for n, loop in mma_loops(listing) if args.loops else []:
            print(f"  MMA loop: {n} instructions; " + ", ".join(f"{op} {k}" for op, k in loop.most_common(14)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
