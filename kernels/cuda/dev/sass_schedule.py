#!/usr/bin/env python3
"""kernels/cuda/dev/sass_schedule.py - what the compiler made of a kernel's
main loop, read from its SASS, without a GPU: the instruction mix, the
registers and spills (ptxas), and a one-warp issue model of the loop.

usage: sass_schedule.py [--arch sm_90] [--keep DIR] SOURCE.cu KERNEL...
       sass_schedule.py --sass FILE.sass KERNEL...

SOURCE.cu is compiled as the build compiles the CUDA module (nvcc -O2
-DNDEBUG, C++20, the repository root on the include path) to a cubin for
the architecture, and disassembled by cuobjdump (the CUDA toolkit's, or
the PyPI package nvidia-cuda-cuobjdump). KERNEL: a substring of a mangled
kernel name (e.g. flash_dkdv_kernelILi128ELi1E); each matching function
gets a paragraph.

The model. Each SASS instruction carries control bits that the compiler
sets: a stall count (cycles before the warp may issue its next
instruction), the scoreboard it sets for a variable-latency result, and
the scoreboards it waits for. The model issues one warp's instructions in
order: each after the previous one's stall count and after the
scoreboards it waits on are released, a result's scoreboard at its issue
plus a nominal latency (LDSM 30, LDS 28, LDG 400, MUFU 18 cycles, ...).
It walks the loop body once: a forward branch of fewer than 0x300 bytes
is taken (the per-element masks that only edge tiles run), any other is
not. It knows nothing of other warps, of the tensor pipe's rate, of
barriers or memory bandwidth: read its cycles as the length of one warp's
dependent path through an iteration, a number to compare two versions of
a kernel by, not a time. docs/perf.md says what it predicted and what a
GPU then measured.
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

LATENCY = {'LDSM': 30, 'LDS': 28, 'LDG': 400, 'LDL': 30, 'MUFU': 18, 'S2R': 20, 'SHFL': 25,
           'LDC': 20, 'LDGSTS': 20, 'STS': 10, 'STG': 10, 'STL': 10, 'I2F': 12, 'F2I': 12,
           'R2UR': 6, 'S2UR': 20}
SHORT_SKIP = 0x300

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', '..'))


def find_cuobjdump():
    exe = shutil.which('cuobjdump')
    if exe:
        return exe
    for d in sys.path:  # the PyPI package: nvidia/cu*/bin/cuobjdump
        base = os.path.join(d, 'nvidia')
        if os.path.isdir(base):
            for sub in sorted(os.listdir(base)):
                exe = os.path.join(base, sub, 'bin', 'cuobjdump')
                if os.access(exe, os.X_OK):
                    return exe
    sys.exit('sass_schedule: no cuobjdump on PATH or in the Python path '
             '(pip install nvidia-cuda-cuobjdump)')


def compile_sass(source, arch, keep):
    nvcc = shutil.which('nvcc') or '/usr/local/cuda/bin/nvcc'
    work = keep or tempfile.mkdtemp(prefix='sass_schedule.')
    cubin = os.path.join(work, os.path.basename(source) + '.cubin')
    cmd = [nvcc, '-I' + ROOT, '-isystem=/usr/local/cuda/include', '-O2', '-DNDEBUG', '-std=c++20',
           '--generate-code=arch=compute_%s,code=%s' % (arch[3:], arch), '-Xptxas', '-v', '-cubin',
           '-o', cubin, source]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit('sass_schedule: nvcc failed:\n' + r.stderr)
    sass = subprocess.run([find_cuobjdump(), '-sass', cubin], capture_output=True, text=True,
                          check=True).stdout
    return sass, r.stderr


def ptxas_lines(log, fn):
    """ptxas -v's registers and spills of function fn."""
    out, on = [], False
    for line in log.splitlines():
        if "'" + fn + "'" in line:
            on = True
            continue
        if on:
            if 'Compiling entry function' in line:
                break
            out.append(line.split(':', 1)[-1].strip())
    return '; '.join(x for x in out if x)


def functions(sass):
    """{mangled name: [(address, text, control word)]}"""
    funcs, cur, lines = {}, None, sass.split('\n')
    for i, line in enumerate(lines):
        m = re.search(r'Function : (\S+)', line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = re.match(r'\s*/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\* 0x([0-9a-f]+) \*/', line)
        if m and cur is not None and i + 1 < len(lines):
            hi = re.search(r'/\* 0x([0-9a-f]+) \*/', lines[i + 1])
            if hi:
                cur.append((int(m.group(1), 16), m.group(2).strip(), int(hi.group(1), 16)))
    return funcs


def opcode(text):
    return re.sub(r'^@!?U?P\w+\s+', '', text).split()[0].split('.')[0]


def control(word):
    """stall, write scoreboard, read scoreboard, wait mask (7: none)"""
    return (word >> 41) & 0xF, (word >> 46) & 7, (word >> 49) & 7, (word >> 52) & 0x3F


def branch_target(text):
    m = re.search(r'\bBRA\b.*?0x([0-9a-f]+)', text)
    return int(m.group(1), 16) if m else None


def loops(ins):
    out = []
    for a, t, _ in ins:
        tgt = branch_target(t)
        if tgt is not None and tgt < a:
            out.append((tgt, a))
    return out


def model(ins, lo, hi):
    """cycles, instructions, HMMA of one warp's pass over [lo, hi]"""
    idx = {a: k for k, (a, _, _) in enumerate(ins)}
    k = next(k for k, (a, _, _) in enumerate(ins) if a >= lo)
    t, rel, n, hmma = 0, [0] * 6, 0, 0
    while k < len(ins) and ins[k][0] <= hi:
        a, text, word = ins[k]
        stall, wb, rb, wait = control(word)
        for b in range(6):
            if wait >> b & 1:
                t = max(t, rel[b])
        op = opcode(text)
        if wb != 7:
            rel[wb] = t + LATENCY.get(op, 6)
        if rb != 7:
            rel[rb] = t + 4
        n += 1
        hmma += op == 'HMMA'
        t += max(stall, 1)
        tgt = branch_target(text)
        if tgt is not None and a < tgt <= min(a + SHORT_SKIP, hi) and tgt in idx:
            k = idx[tgt]
            continue
        k += 1
    return t, n, hmma


def report(name, ins, log):
    print('%s: %d instructions' % (name, len(ins)))
    if log:
        print('  ptxas: ' + ptxas_lines(log, name))
    ls = loops(ins)
    if not ls:
        print('  no loop')
        return
    lo, hi = max(ls, key=lambda r: sum(1 for a, _, _ in ins if r[0] <= a <= r[1]))
    body = [(a, t, w) for a, t, w in ins if lo <= a <= hi]
    mix = collections.Counter(opcode(t) for _, t, _ in body)
    stalls = sum(control(w)[0] for _, _, w in body)
    keys = ['HMMA', 'LDSM', 'LDS', 'STS', 'LDG', 'LDGSTS', 'STG', 'LDL', 'STL', 'MUFU', 'BAR']
    print('  main loop %x-%x: %d instructions (%s); static stalls %d cycles' %
          (lo, hi, len(body), ', '.join('%s %d' % (k, mix[k]) for k in keys if mix[k]), stalls))
    cyc, n, hm = model(ins, lo, hi)
    print('  one warp through an iteration: %d cycles, %d instructions, %d HMMA' % (cyc, n, hm))
    bars = [a for a, t, _ in body if opcode(t) == 'BAR']
    if len(bars) >= 2:
        pre = model(ins, lo, bars[0])
        mid = model(ins, bars[0], bars[1])
        print('  of which loop top to the first barrier %d cycles (%d instructions), barrier to '
              'barrier %d cycles (%d instructions, %d HMMA)' % (pre[0], pre[1], mid[0], mid[1],
                                                                mid[2]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--sass', help='a cuobjdump -sass listing instead of compiling')
    ap.add_argument('--arch', default='sm_90')
    ap.add_argument('--keep', help='directory for the cubin (default: a temporary one)')
    ap.add_argument('args', nargs='+', help='[SOURCE.cu] KERNEL...')
    o = ap.parse_args()
    if o.sass:
        with open(o.sass) as f:
            sass, log = f.read(), ''
        names = o.args
    else:
        if len(o.args) < 2:
            ap.error('SOURCE.cu and at least one KERNEL')
        sass, log = compile_sass(o.args[0], o.arch, o.keep)
        names = o.args[1:]
    funcs = functions(sass)
    found = 0
    for want in names:
        for name in sorted(funcs):
            if want in name:
                report(name, funcs[name], log)
                found += 1
    if not found:
        sys.exit('sass_schedule: no function matches %s (have: %s)' %
                 (', '.join(names), ', '.join(sorted(funcs))))


if __name__ == '__main__':
    main()
