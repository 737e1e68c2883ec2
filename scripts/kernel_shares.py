#!/usr/bin/env python3
"""Where a training step's GPU time goes, kernel by kernel, from Nsight Compute's CSV.

    ncu --metrics gpu__time_duration.sum --csv --print-units base \\
        spotune bench --backend cuda --preset llama-7b --steps 1 --warmup 0 ... > step.csv
    python3 scripts/kernel_shares.py step.csv [--top 30] [--exclude-prefix fill_]

Reads the rows whose metric is gpu__time_duration.sum (nanoseconds; other
lines, such as ncu's own messages and the bench's JSON, are skipped), leaves
out the kernels whose name starts with an excluded prefix (default: fill_,
the random initialisation of the bench's weights), and counts the steps in
the file by a kernel that runs once a step (default
embedding_forward_kernel, once per forward). Prints a Markdown table: each
kernel (its name without arguments or template parameters), its calls and
milliseconds per step and its share of the step; then the same by group
(cuBLAS products, the fused attention, LoRA's rank-r products by
kernels/cuda/cuda_skinny.cu, everything else by name).

ncu runs kernels one at a time with the caches flushed between them, so the
milliseconds are longer than in a real step: read the shares.

Exit codes: 0 done, 2 usage or an unreadable file, 3 no timing rows or no
step marker in the file (the message says which).
"""

import argparse
import csv
import re
import sys

METRIC = "gpu__time_duration.sum"


def base_name(name):
    """flash_dkdv_kernel<128>(flash_args) -> flash_dkdv_kernel; void f(int) -> f."""
    n = name.strip()
    if n.startswith("void "):
        n = n[5:]
    n = re.split(r"[(<]", n, maxsplit=1)[0]
    return n.strip()


def group_of(name):
    if name.startswith(("nvjet", "cutlass", "sm90_", "sm80_", "ampere_", "gemm")) or \
            "gemm" in name.lower() or name.startswith("cublas"):
        return "cuBLAS / cuBLASLt products"
    if name.startswith("flash_"):
        return "fused attention (flash_*)"
    if name.startswith("skinny_"):
        return "LoRA's rank-r products (skinny_*)"
    return name


class BadInput(Exception):
    pass


def read_rows(path):
    """(kernel name, nanoseconds) of every timing row of ncu's CSV."""
    rows, header = [], None
    try:
        f = sys.stdin if path == "-" else open(path, newline="", encoding="utf-8", errors="replace")
    except OSError as e:
        raise BadInput(f"{path}: {e.strerror}") from None
    with f:
        for rec in csv.reader(f):
            if header is None:
                if "Kernel Name" in rec and "Metric Value" in rec and "Metric Name" in rec:
                    header = {k: i for i, k in enumerate(rec)}
                continue
            if len(rec) != len(header) or rec[header["Metric Name"]] != METRIC:
                continue
            value = rec[header["Metric Value"]]
            try:
                ns = float(value.replace(",", ""))
            except ValueError:
                raise BadInput(f"{path}: kernel {base_name(rec[header['Kernel Name']])}: "
                               f"a {METRIC} value that is not a number: {value!r}") from None
            rows.append((rec[header["Kernel Name"]], ns))
    return rows


def table(title, totals, calls, steps, grand):
    out = [f"| {title} | calls a step | ms a step | share |", "| --- | ---: | ---: | ---: |"]
    for name, ns in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])):
        out.append(f"| {name} | {calls[name] / steps:g} | {ns / steps / 1e6:.3f} | "
                   f"{100.0 * ns / grand:.1f}% |")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --csv output ('-': standard input)")
    ap.add_argument("--marker", default="embedding_forward_kernel",
                    help="a kernel that runs once a step (default embedding_forward_kernel)")
    ap.add_argument("--exclude-prefix", action="append", default=None,
                    help="leave out kernels whose name starts so (repeatable; default fill_)")
    ap.add_argument("--top", type=int, default=30, help="kernels listed (default 30)")
    args = ap.parse_args()
    excluded = tuple(args.exclude_prefix or ["fill_"])

    try:
        rows = read_rows(args.csv)
    except BadInput as e:
        print(f"kernel_shares: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"kernel_shares: {args.csv}: no {METRIC} rows (was ncu run with "
              f"--metrics {METRIC} --csv?)", file=sys.stderr)
        return 3
    steps = sum(1 for name, _ in rows if base_name(name) == args.marker)
    if steps == 0:
        print(f"kernel_shares: {args.csv}: the step marker {args.marker} never ran "
              f"(--marker names a kernel that runs once a step)", file=sys.stderr)
        return 3
    totals, calls, gtotals, gcalls = {}, {}, {}, {}
    for name, ns in rows:
        b = base_name(name)
        if b.startswith(excluded):
            continue
        totals[b] = totals.get(b, 0.0) + ns
        calls[b] = calls.get(b, 0) + 1
        g = group_of(b)
        gtotals[g] = gtotals.get(g, 0.0) + ns
        gcalls[g] = gcalls.get(g, 0) + 1
    grand = sum(totals.values())
    if grand <= 0:
        print(f"kernel_shares: {args.csv}: every kernel was excluded or took no time",
              file=sys.stderr)
        return 3
    top = dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))[:args.top])
    print(f"{steps} step(s) in the file; {grand / steps / 1e6:.3f} ms of kernels a step "
          f"(excluded: {', '.join(p + '*' for p in excluded)})")
    print()
    print("\n".join(table("kernel", top, calls, steps, grand)))
    if len(totals) > len(top):
        print(f"\n({len(totals) - len(top)} more kernels, "
              f"{100.0 * (grand - sum(top.values())) / grand:.1f}% of the step)")
    print()
    print("\n".join(table("group", gtotals, gcalls, steps, grand)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
