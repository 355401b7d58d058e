#!/usr/bin/env python3
"""Heap allocations in a callgrind profile: the calls made to malloc, calloc, realloc,
posix_memalign, aligned_alloc and memalign, summed over every call site (bench/callgrind.sh).
operator new counts through the malloc it calls, so it is not counted twice.
  callgrind_allocs.py FILE   -> prints one integer
"""
import re
import sys

ALLOCATORS = {"malloc", "calloc", "realloc", "posix_memalign", "aligned_alloc", "memalign"}


def count_allocations(path):
    names = {}  # compressed function id -> name
    total = 0
    target_is_allocator = False
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
                continue
            if line.startswith("calls="):
                if target_is_allocator:
                    total += int(line.split()[0].split("=")[1])
                target_is_allocator = False
            elif line.startswith("fn="):
                m = re.match(r"fn=\((\d+)\)(?: (.*))?", line.rstrip("\n"))
                if m and m.group(2) is not None:
                    names[m.group(1)] = m.group(2)
    return total


if __name__ == "__main__":
    print(count_allocations(sys.argv[1]))
