#!/usr/bin/env python3
"""Two figures from a callgrind profile (bench/callgrind.sh), printed as "ALLOCATIONS EXCLUDED":
- ALLOCATIONS: heap allocations, the calls made to malloc, calloc, realloc, posix_memalign,
  aligned_alloc and memalign, summed over every call site. operator new counts through the
  malloc it calls, so it is not counted twice.
- EXCLUDED: instructions that count how long the machine made a thread wait, not work done, so
  the caller takes them out of the totals. In a figure taken as (Ir(2N) - Ir(N)) / N, either
  put up to 1,200 instructions per request of noise into one run or another:
  - every instruction (inclusive) of UCX's start-up patching of its memory hooks
    (ucm_bistro_patch), which waits for the patch to apply by spinning on gettimeofday and
    sched_yield;
  - a contended pthread_spin_lock's spinning (UCX's locks, taken by its async thread too): all
    but the 4 instructions an uncontended call runs (lock decl, jne, xor, ret in Debian 12's
    glibc; a build with endbr64 runs 5, so one per call would then be taken out too).
  callgrind_allocs.py FILE
"""
import re
import sys

ALLOCATORS = {"malloc", "calloc", "realloc", "posix_memalign", "aligned_alloc", "memalign"}
# Function -> instructions per call that are work (None: none are).
EXCLUDED = {"ucm_bistro_patch": None, "pthread_spin_lock": 4}


def count(path):
    """Returns (allocations, excluded instructions)."""
    names = {}  # compressed function id -> name
    total = 0
    excluded = 0
    target_is_allocator = False
    target_excluded = None  # the EXCLUDED name a calls= line is about, if any
    calls = 0
    cost_of_call_follows = False
    ir_field = 1  # a cost line: the positions ("positions:"), then the events ("events:")
    positions = 1
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("positions:"):
                positions = len(line.split()) - 1
                continue
            if line.startswith("events:"):
                events = line.split()[1:]
                if "Ir" not in events:
                    sys.exit(f"{path}: no Ir event")
                ir_field = positions + events.index("Ir")
                continue
            if line.startswith("cfn="):
                m = re.match(r"cfn=\((\d+)\)(?: (.*))?", line.rstrip("\n"))
                if m:
                    fid, name = m.group(1), m.group(2)
                    if name is not None:
                        names[fid] = name
                    base = names.get(fid, "").split("'")[0].split("@")[0]
                    target_is_allocator = base in ALLOCATORS
                    target_excluded = base if base in EXCLUDED else None
                continue
            if cost_of_call_follows:
                # The line after calls= holds the call's inclusive cost.
                cost_of_call_follows = False
                fields = line.split()
                if len(fields) > ir_field:
                    work = EXCLUDED[target_excluded] or 0
                    excluded += max(0, int(fields[ir_field]) - work * calls)
                target_excluded = None
                continue
            if line.startswith("calls="):
                calls = int(line.split()[0].split("=")[1])
                if target_is_allocator:
                    total += calls
                cost_of_call_follows = target_excluded is not None
                target_is_allocator = False
            elif line.startswith("fn="):
                m = re.match(r"fn=\((\d+)\)(?: (.*))?", line.rstrip("\n"))
                if m and m.group(2) is not None:
                    names[m.group(1)] = m.group(2)
    return total, excluded


if __name__ == "__main__":
    allocations, excluded = count(sys.argv[1])
    print(allocations, excluded)
