#!/usr/bin/env python3
"""Two figures from a callgrind profile (bench/callgrind.sh), printed as "ALLOCATIONS EXCLUDED":
- ALLOCATIONS: heap allocations, the calls made to malloc, calloc, realloc, posix_memalign,
  aligned_alloc and memalign, summed over every call site. operator new counts through the
  malloc it calls, so it is not counted twice.
- EXCLUDED: the instructions (inclusive) of calls to UCX's start-up patching of its memory hooks
  (ucm_bistro_patch). It waits for the patch to apply by spinning on gettimeofday and
  sched_yield for as long as the machine makes it wait: up to a thousand instructions per request
  of noise in a figure taken as (Ir(2N) - Ir(N)) / N, so the caller takes it out of the totals.
  callgrind_allocs.py FILE
"""
import re
import sys

ALLOCATORS = {"malloc", "calloc", "realloc", "posix_memalign", "aligned_alloc", "memalign"}
EXCLUDED = {"ucm_bistro_patch"}


def count(path):
    """Returns (allocations, excluded instructions)."""
    names = {}  # compressed function id -> name
    total = 0
    excluded = 0
    target_is_allocator = False
    target_is_excluded = False
    cost_of_call_follows = False
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("cfn="):
                m = re.match(r"cfn=\((\d+)\)(?: (.*))?", line.rstrip("\n"))
                if m:
                    fid, name = m.group(1), m.group(2)
                    if name is not None:
                        names[fid] = name
                    base = names.get(fid, "").split("'")[0]
                    target_is_allocator = base in ALLOCATORS
                    target_is_excluded = base in EXCLUDED
                continue
            if cost_of_call_follows:
                # The line after calls= holds the call's inclusive cost: position, then Ir.
                cost_of_call_follows = False
                fields = line.split()
                if len(fields) >= 2:
                    excluded += int(fields[1])
                continue
            if line.startswith("calls="):
                if target_is_allocator:
                    total += int(line.split()[0].split("=")[1])
                cost_of_call_follows = target_is_excluded
                target_is_allocator = False
                target_is_excluded = False
            elif line.startswith("fn="):
                m = re.match(r"fn=\((\d+)\)(?: (.*))?", line.rstrip("\n"))
                if m and m.group(2) is not None:
                    names[m.group(1)] = m.group(2)
    return total, excluded


if __name__ == "__main__":
    allocations, excluded = count(sys.argv[1])
    print(allocations, excluded)
