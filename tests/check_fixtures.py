#!/usr/bin/env python3
"""Regenerate every golden-value fixture from Hugging Face and compare it with
the committed one (ctest: fixtures_reproduce_py).

The model tests check spotune against files in tests/fixtures/ (hf/, nf4/,
tokenizer/) that scripts in scripts/ generate with torch, transformers, PEFT
and bitsandbytes. This runs those scripts into an empty temporary tree, in
the order they depend on each other:

    make_test_tokenizer.py    -> tokenizer/
    make_fixtures.py          -> hf/<case>/ (model, batch, logits, gradients, adapters)
    make_dropout_fixtures.py  -> hf/<case>/lora_dropout_expected.safetensors
    make_packed_fixtures.py   -> hf/<case>/packed.safetensors (from the new hf/)
    make_nf4_fixtures.py      -> nf4/

and fails (exit 1) unless every committed file (README.md files aside: they
are written by hand) was made again and agrees, and nothing was made that is
not committed:
  - .safetensors: the same tensor names, dtypes, shapes and metadata; integer
    tensors (NF4 codes, token ids) equal; float32 ones within rel 1e-6, rel
    = max |new - committed| / max |committed| per tensor (the scripts compute
    in float64 on one thread; another CPU's vector width can move a float32
    by an ulp, nothing more);
  - .json: equal as parsed values;
  - anything else: equal bytes.

Exit codes: 0 ok; 1 a fixture differs, is missing or is new; 3 a generating
script failed; 77 torch, transformers, peft or bitsandbytes is missing (ctest:
skipped) — 1 instead when SPOTUNE_REQUIRE_HF_TESTS=1 (scripts/test.sh sets it:
there `scripts/install-deps.sh --python --hf` has installed them).
"""

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
DIRS = ("tokenizer", "hf", "nf4")
FLOAT_TOL = 1e-6


def missing_packages():
    import importlib.util  # found, not imported: the scripts import them (a broken one: exit 3)
    return [mod for mod in ("torch", "transformers", "peft", "bitsandbytes", "safetensors", "numpy")
            if importlib.util.find_spec(mod) is None]


def generate(tmp):
    """Run the generating scripts into tmp/{tokenizer,hf,nf4}; None or the
    failing script's name."""
    s = os.path.join(ROOT, "scripts")
    steps = [
        ("make_test_tokenizer.py", ["--out", os.path.join(tmp, "tokenizer")]),
        ("make_fixtures.py", ["--out", os.path.join(tmp, "hf")]),
        ("make_dropout_fixtures.py", ["--out", os.path.join(tmp, "hf")]),
        ("make_packed_fixtures.py", ["--out", os.path.join(tmp, "hf")]),
        ("make_nf4_fixtures.py", ["--out", os.path.join(tmp, "nf4")]),
    ]
    for script, args in steps:
        r = subprocess.run([sys.executable, os.path.join(s, script)] + args,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            print(r.stdout)
            return script
        print(f"{script}: ok ({len(r.stdout.splitlines())} lines of log)")
    return None


def files_under(top):
    out = set()
    for d, _, fs in os.walk(top):
        for f in fs:
            if f != "README.md":
                out.add(os.path.relpath(os.path.join(d, f), top))
    return out


def compare_safetensors(new, old):
    """(problem or None, worst float rel) for two .safetensors files."""
    from safetensors import safe_open
    import torch
    with safe_open(new, "pt") as a, safe_open(old, "pt") as b:
        if a.metadata() != b.metadata():
            return f"metadata {a.metadata()} != {b.metadata()}", 0.0
        ka, kb = set(a.keys()), set(b.keys())
        if ka != kb:
            return (f"tensors differ: new only {sorted(ka - kb)[:4]}, "
                    f"committed only {sorted(kb - ka)[:4]}"), 0.0
        worst = 0.0
        for k in sorted(kb):
            x, y = a.get_tensor(k), b.get_tensor(k)
            if x.dtype != y.dtype or x.shape != y.shape:
                return f"{k}: {x.dtype} {tuple(x.shape)} != {y.dtype} {tuple(y.shape)}", worst
            if x.dtype.is_floating_point:
                x64, y64 = x.double(), y.double()
                if not bool(torch.isfinite(x64).all()) or not bool(torch.isfinite(y64).all()):
                    if not bool(torch.equal(x64.nan_to_num(), y64.nan_to_num())):
                        return f"{k}: non-finite values differ", worst
                    continue
                scale = float(y64.abs().max()) if y64.numel() else 0.0
                diff = float((x64 - y64).abs().max()) if y64.numel() else 0.0
                rel = diff / scale if scale > 0 else diff
                worst = max(worst, rel)
                if rel > FLOAT_TOL:
                    return f"{k}: rel {rel:.3g} > {FLOAT_TOL:g}", worst
            elif not bool(torch.equal(x, y)):
                n = int((x != y).sum())
                return f"{k}: {n} of {x.numel()} values differ (exact compare)", worst
        return None, worst


def compare(tmp):
    bad, exact, within, worst = [], 0, 0, 0.0
    for d in DIRS:
        committed, made = files_under(os.path.join(FIXTURES, d)), files_under(os.path.join(tmp, d))
        for rel in sorted(committed - made):
            bad.append(f"{d}/{rel}: committed, but no script makes it")
        for rel in sorted(made - committed):
            bad.append(f"{d}/{rel}: made by a script, but not committed")
        for rel in sorted(committed & made):
            new, old = os.path.join(tmp, d, rel), os.path.join(FIXTURES, d, rel)
            with open(new, "rb") as f1, open(old, "rb") as f2:
                if f1.read() == f2.read():
                    exact += 1
                    continue
            if rel.endswith(".safetensors"):
                problem, w = compare_safetensors(new, old)
                worst = max(worst, w)
            elif rel.endswith(".json"):
                with open(new) as f1, open(old) as f2:
                    problem = None if json.load(f1) == json.load(f2) else "JSON values differ"
            else:
                problem = "bytes differ"
            if problem:
                bad.append(f"{d}/{rel}: {problem}")
            else:
                within += 1
    return bad, exact, within, worst


def main():
    missing = missing_packages()
    if missing:
        print("check_fixtures: missing Python packages: " + ", ".join(missing) +
              " (scripts/install-deps.sh --python --hf installs them into .venv)")
        return 1 if os.environ.get("SPOTUNE_REQUIRE_HF_TESTS") == "1" else 77
    with tempfile.TemporaryDirectory(prefix="spotune-fixtures-check-") as tmp:
        failed = generate(tmp)
        if failed:
            print(f"check_fixtures: {failed} failed (its output above)")
            return 3
        bad, exact, within, worst = compare(tmp)
    for line in bad:
        print("DIFFERS " + line)
    print(f"check_fixtures: {exact + within + len(bad)} files compared: {exact} byte for byte, "
          f"{within} within the tolerance (worst float rel {worst:.3g}, bound {FLOAT_TOL:g}), "
          f"{len(bad)} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
