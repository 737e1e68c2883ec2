#!/usr/bin/env python3
"""scripts/stall_lines.py on Nsight Compute's source view of a real kernel.

The fixture (tests/fixtures/ncu_source_forward_wgmma.csv) is an excerpt of
`ncu --section WarpStateStats --section SourceCounters --page source
--print-source sass --csv` on the wgmma forward inside attn_bench (one H100,
2026-12-05): ncu's and attn_bench's lines first, then the kernel's name and
the table, of which the excerpt keeps the first three instructions and
those with 150 samples or more. Each expected figure is computed here from
the raw rows with the csv module, independently of the script; the script
prints shares to 1 decimal, so the tolerance is half a unit of that.
"""

import csv
import io
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "scripts", "stall_lines.py")
FIXTURE = os.path.join(HERE, "fixtures", "ncu_source_forward_wgmma.csv")
SAMPLES = "Warp Stall Sampling (All Samples)"

failures = 0


def check(what, ok, detail=""):
    global failures
    print(("ok   " if ok else "FAIL ") + what + ("" if ok else f": {detail}"))
    if not ok:
        failures += 1


def run(*args):
    p = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def raw_rows():
    with open(FIXTURE, encoding="utf-8") as f:
        lines = f.read().splitlines()
    start = [i for i, l in enumerate(lines) if l.startswith('"Address"')][0]
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    return [dict(zip(rows[0], r)) for r in rows[1:]]


rows = raw_rows()
total = sum(int(r[SAMPLES]) for r in rows)
base = min(int(r["Address"], 16) for r in rows)
top = sorted(rows, key=lambda r: -int(r[SAMPLES]))

rc, out, err = run(FIXTURE, "--top", "3")
check("the fixture: exit 0", rc == 0, f"exit {rc}: {err}")
check("the title: the kernel, its samples and instructions",
      f"### void flash_forward_wgmma_kernel<(int)128>(flash_args): {total} warp-stall samples "
      f"over {len(rows)} instructions" in out, out)
lines = [l for l in out.splitlines() if l.startswith("| 0x")]
check("--top 3: three instruction rows", len(lines) == 3, out)
for i, r in enumerate(top[:3]):
    cells = [c.strip() for c in lines[i].strip().strip("|").split("|")] if i < len(lines) else []
    n = int(r[SAMPLES])
    ok = (len(cells) == 5 and cells[0] == f"{int(r['Address'], 16) - base:#x}"
          and cells[2] == str(n) and abs(float(cells[3].rstrip("%")) - 100.0 * n / total) <= 0.05)
    check(f"row {i + 1}: offset, samples and share of the instruction with the most samples",
          ok, f"{cells} against {r['Address']} {n}")
first = lines[0] if lines else ""
check("row 1: the copy wait's dummy load, its largest reason long scoreboard",
      "`@!PT LDS RZ, [RZ]`" in first and "long_sb " + top[0]["stall_long_sb"] in first, first)
by = {c[6:]: sum(int(r[c] or 0) for r in rows) for c in rows[0] if c.startswith("stall_")
      and "Not Issued" not in c}
want = f"long_sb {100.0 * by['long_sb'] / total:.1f}%"
check("by reason: long scoreboard first, its share of every sample", f"by reason: {want}" in out,
      out)
branch = [l for l in out.splitlines() if "BRA" in l]
check("a branch target printed as an offset in the kernel", bool(branch) and
      all("0x7f" not in l for l in branch), "\n".join(branch))

with tempfile.TemporaryDirectory() as d:
    plain = os.path.join(d, "plain.txt")
    with open(plain, "w") as f:
        f.write("==PROF== Disconnected from process 1\n")
    rc, out, err = run(plain)
    check("no source table: exit 3 and why", rc == 3 and "no source table" in err, f"{rc} {err}")
    nosamp = os.path.join(d, "nosamples.csv")
    with open(FIXTURE, encoding="utf-8") as f:
        text = f.read()
    with open(nosamp, "w") as f:
        f.write(text.replace(f'"{SAMPLES}"', '"Something Else"'))
    rc, out, err = run(nosamp)
    check("no samples column: exit 3 naming the sections", rc == 3 and
          "WarpStateStats" in err, f"{rc} {err}")
    rc, out, err = run(os.path.join(d, "absent.csv"))
    check("an unreadable file: exit 2 naming it", rc == 2 and "absent.csv" in err, f"{rc} {err}")
    rc, out, err = run(FIXTURE, "--top", "0")
    check("--top 0: exit 2", rc == 2, f"{rc} {err}")

print(f"{failures} failure(s)")
sys.exit(1 if failures else 0)
