#!/usr/bin/env python3
"""scripts/kernel_shares.py on Nsight Compute's CSV of a real 7B LoRA step.

The fixture (tests/fixtures/ncu_step_durations.csv) is an excerpt of `ncu
--metrics gpu__time_duration.sum --csv` on `spotune bench --preset llama-7b
--steps 1 --warmup 0` (one H200, 2026-12-04): ncu's own lines and the
bench's JSON first, then the rows of two windows, each holding a step's
embedding kernel (the step marker) and random-initialisation kernels
(fill_*, excluded). Each expected figure is computed here from the raw
lines, independently of the script's CSV reading; the script prints
milliseconds to 3 decimals and shares to 1, so the tolerances are half a
unit of those.
"""

import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "scripts", "kernel_shares.py")
FIXTURE = os.path.join(HERE, "fixtures", "ncu_step_durations.csv")

failures = 0


def check(what, ok, detail=""):
    global failures
    print(("ok   " if ok else "FAIL ") + what + ("" if ok else f": {detail}"))
    if not ok:
        failures += 1


def run(*args):
    p = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def raw_ns(pattern):
    """Sum of the last field (ns, "1,234" style) of the fixture's timing lines matching pattern."""
    total, n = 0.0, 0
    with open(FIXTURE, encoding="utf-8") as f:
        for line in f:
            if '"gpu__time_duration.sum"' in line and re.search(pattern, line):
                total += float(line.rstrip().rsplit('","', 1)[1].strip('"').replace(",", ""))
                n += 1
    return total, n


def row(out, name):
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == name:
            return cells
    return None


rc, out, err = run(FIXTURE, "--top", "100")
check("the fixture: exit 0", rc == 0, f"exit {rc}: {err}")
steps = 2
_, nmark = raw_ns(r'"embedding_forward_kernel\(')
check("the fixture holds two step markers", nmark == steps, nmark)
check("the steps counted by the marker", out.startswith(f"{steps} step(s) in the file"), out[:80])

all_ns, _ = raw_ns(r".")
fill_ns, nfill = raw_ns(r'"fill_[a-z_]*kernel\(')
check("the fixture holds fill_ kernels to leave out", nfill > 0, nfill)
m = re.search(r"([0-9.]+) ms of kernels a step", out)
want = (all_ns - fill_ns) / steps / 1e6
check("ms a step: every kernel but fill_*, over the steps (0.0005 ms)",
      m is not None and abs(float(m.group(1)) - want) <= 0.0005, f"{m and m.group(1)} vs {want:.4f}")
check("fill_ kernels are not listed", "fill_" not in out.split("excluded")[1].split("\n", 1)[1], out)

for name, pattern in [("flash_forward_kernel", r'"void flash_forward_kernel<'),
                      ("rope_vec_kernel", r'"rope_vec_kernel\('),
                      ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT",
                       r'"nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT"')]:
    ns, n = raw_ns(pattern)
    r = row(out, name)
    ok = r is not None and n > 0 and abs(float(r[1]) - n / steps) < 1e-9 and \
        abs(float(r[2]) - ns / steps / 1e6) <= 0.0005 and \
        abs(float(r[3].rstrip("%")) - 100 * (ns / (all_ns - fill_ns))) <= 0.05
    check(f"{name}: calls, ms and share a step from its rows ({n} of them)", ok, r)

ns_cublas, _ = raw_ns(r'"nvjet_|"void cublasLt::')
r = row(out, "cuBLAS / cuBLASLt products")
check("the cuBLAS group sums every nvjet and cublasLt kernel",
      r is not None and abs(float(r[2]) - ns_cublas / steps / 1e6) <= 0.0005, r)

group = out.split("| group |", 1)[1]
shares = [float(c.split("|")[-2].strip().rstrip("%")) for c in group.splitlines()[2:] if c.startswith("|")]
check("the group shares add up to 100% (0.05 a row)", abs(sum(shares) - 100) <= 0.05 * len(shares),
      sum(shares))
ms = [float(c.split("|")[3]) for c in group.splitlines()[2:] if c.startswith("|")]
check("groups sorted longest first", ms == sorted(ms, reverse=True), ms)

rc, out, _ = run(FIXTURE, "--top", "3")
kernels = [line for line in out.split("| group |")[0].splitlines() if line.startswith("| ") and "---" not in line]
check("--top 3: three kernels listed, then how many more", len(kernels) == 1 + 3 and "more kernels" in out,
      kernels)

# bad input: a clear message naming the file or the kernel, a non-zero exit
with tempfile.TemporaryDirectory() as tmp:
    # cuda_skinny.cu's kernels (since 2026-12-05 LoRA's rank-r products) are
    # one group: the fixture's rope_vec_kernel rows renamed to them
    skinny = os.path.join(tmp, "skinny.csv")
    with open(FIXTURE, encoding="utf-8") as f, open(skinny, "w", encoding="utf-8") as g:
        for line in f:
            g.write(line.replace('"rope_vec_kernel(', '"void skinny_kernel<6, 1>(skinny_args) rope('))
    rope_ns, nrope = raw_ns(r'"rope_vec_kernel\(')
    rc, out, err = run(skinny)
    r = row(out, "LoRA's rank-r products (skinny_*)")
    check("skinny_* kernels are one group", rc == 0 and r is not None and nrope > 0 and
          abs(float(r[2]) - rope_ns / steps / 1e6) <= 0.0005, f"exit {rc}: {r} {err}")

    no_marker = os.path.join(tmp, "no_marker.csv")
    with open(FIXTURE, encoding="utf-8") as f, open(no_marker, "w", encoding="utf-8") as g:
        g.writelines(line for line in f if "embedding_forward_kernel" not in line)
    rc, out, err = run(no_marker)
    check("no step marker: exit 3 naming the marker", rc == 3 and "embedding_forward_kernel never ran" in err
          and no_marker in err, f"exit {rc}: {err}")

    json_only = os.path.join(tmp, "json_only.csv")
    with open(json_only, "w", encoding="utf-8") as g:
        g.write('{"preset":"llama-7b","tokens_per_s":101.3}\n')
    rc, out, err = run(json_only)
    check("no timing rows: exit 3 naming the file", rc == 3 and json_only in err and "no gpu__time_duration.sum rows" in err,
          f"exit {rc}: {err}")

    bad_value = os.path.join(tmp, "bad_value.csv")
    with open(FIXTURE, encoding="utf-8") as f, open(bad_value, "w", encoding="utf-8") as g:
        for line in f:
            if '"rope_vec_kernel(' in line and '"gpu__time_duration.sum"' in line:
                line = line.rstrip().rsplit('","', 1)[0] + '","n/a"\n'
            g.write(line)
    rc, out, err = run(bad_value)
    check("a value that is not a number: exit 2 naming the file and kernel",
          rc == 2 and bad_value in err and "rope_vec_kernel" in err and "'n/a'" in err, f"exit {rc}: {err}")

    rc, out, err = run(os.path.join(tmp, "absent.csv"))
    check("a missing file: exit 2 naming it", rc == 2 and "absent.csv: No such file" in err, f"exit {rc}: {err}")

print(f"{failures} failure(s)")
sys.exit(1 if failures else 0)
