#!/usr/bin/env python3
"""Where a kernel's warps wait, instruction by instruction, from Nsight Compute's source view.

    ncu --clock-control none --section WarpStateStats --section SourceCounters \\
        --page source --print-source sass --csv -k regex:^KERNEL --launch-skip 1 \\
        --launch-count 1 attn_bench ... > src_KERNEL.csv
    python3 scripts/stall_lines.py src_KERNEL.csv [--top 12]

Reads the table that starts at the "Address" header (ncu's own messages and
the program's output before it are skipped): one row per SASS instruction,
with its warp-stall samples ("Warp Stall Sampling (All Samples)") and those
samples by reason (the stall_* columns, "Not Issued" ones left out). Prints
Markdown: the kernel's samples by reason, then its TOP instructions by
samples, each with its offset in the kernel, its SASS, its samples and share,
and its two largest reasons. A copy wait (cp.async.wait_group) shows as a
"DEPBAR.LE SB0" followed by "@!PT LDS RZ, [RZ]" rows that take the samples;
a wgmma wait as "WARPGROUP.DEPBAR". The samples are where warps were
waiting, so a kernel's time goes mostly to its top lines.

Exit codes: 0 done, 2 usage or an unreadable file, 3 no source table or no
samples in the file (the message says which).
"""

import argparse
import csv
import io
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def read_table(text):
    """The rows of the source table (dicts by header), or None without one."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"Address"')), None)
    if start is None:
        return None, None, None
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header = rows[0]
    name = None
    for l in lines[:start]:  # "Kernel Name","void flash_dq_kernel<128>(flash_args)",
        if l.startswith('"Kernel Name"'):
            name = next(csv.reader([l]))[1]
    return header, [dict(zip(header, r)) for r in rows[1:] if len(r) == len(header)], name


def count(v):
    try:
        return int(v.replace(",", "")) if v not in ("", "-") else 0
    except ValueError:
        return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --page source --print-source sass --csv output")
    ap.add_argument("--top", type=int, default=12, help="instructions listed (default 12)")
    args = ap.parse_args()
    if args.top < 1:
        print("stall_lines.py: --top must be at least 1", file=sys.stderr)
        return 2
    try:
        with open(args.csv, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        print(f"stall_lines.py: {args.csv}: {e.strerror}", file=sys.stderr)
        return 2
    header, rows, name = read_table(text)
    if header is None:
        print(f"stall_lines.py: {args.csv}: no source table (no \"Address\" header: "
              "was ncu run with --page source --csv?)", file=sys.stderr)
        return 3
    if SAMPLES not in header:
        print(f"stall_lines.py: {args.csv}: no \"{SAMPLES}\" column "
              "(ncu needs --section WarpStateStats --section SourceCounters)", file=sys.stderr)
        return 3
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(count(r[SAMPLES]) for r in rows)
    if total == 0:
        print(f"stall_lines.py: {args.csv}: no warp-stall samples in {len(rows)} instructions",
              file=sys.stderr)
        return 3
    base = None
    for r in rows:
        try:
            a = int(r["Address"], 16)
        except ValueError:
            continue
        base = a if base is None else min(base, a)
    by_reason = sorted(((sum(count(r[c]) for r in rows), c[6:]) for c in reasons), reverse=True)
    title = name or args.csv
    print(f"### {title}: {total} warp-stall samples over {len(rows)} instructions")
    print()
    print("by reason: " + ", ".join(f"{n} {100.0 * v / total:.1f}%"
                                    for v, n in by_reason[:6] if v > 0))
    print()
    print("| offset | instruction | samples | share | largest reasons |")
    print("| ---: | --- | ---: | ---: | --- |")
    top = sorted(rows, key=lambda r: -count(r[SAMPLES]))[:args.top]
    for r in top:
        n = count(r[SAMPLES])
        if n == 0:
            break
        try:
            off = f"{int(r['Address'], 16) - base:#x}"
        except (ValueError, TypeError):
            off = r["Address"]
        big = sorted(((count(r[c]), c[6:]) for c in reasons), reverse=True)[:2]
        why = ", ".join(f"{k} {v}" for v, k in big if v > 0)
        sass = " ".join(r.get("Source", "").split()).replace("|", "/")
        # branch targets as offsets in the kernel too
        sass = re.sub(r"0x[0-9a-f]{9,16}",
                      lambda m: f"{int(m.group(0), 16) - base:#x}"
                      if int(m.group(0), 16) >= base else m.group(0), sass)
        print(f"| {off} | `{sass}` | {n} | {100.0 * n / total:.1f}% | {why} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
