#!/usr/bin/env python3
"""Check that a merged model exported by spotune (`spotune export CKPT --merged DIR`)
serves as base + adapter does under Hugging Face PEFT.

    pip install torch transformers==5.24.0 peft==0.21.2 safetensors numpy h5py
    python3 scripts/check_merged_export.py --base BASE_DIR --adapter ADAPTER_DIR --merged MERGED_DIR
    python3 scripts/check_merged_export.py --fixtures --spotune build/spotune [--workdir DIR]

With --base/--adapter/--merged it loads the base with transformers plus the
adapter with PeftModel.from_pretrained (the reference) and the merged directory
alone with AutoModelForCausalLM, all in float32, and fails (exit 1) unless
  - the merged config.json equals the base's except for the dtype key(s)
    ("torch_dtype", "dtype");
  - when the base has a tokenizer, AutoTokenizer on the merged directory alone
    encodes a sentence and renders a chat template as the base's does;
  - the greedy generation of --new-tokens (32) tokens from a prompt of 8 token
    ids is the same token for token (generate(do_sample=False,
    min_new_tokens=N): end-of-sequence does not cut either short);
  - the logits on one long input of --long-tokens (4160: beyond transformers'
    default Mistral window of 4096) random token ids agree:
    rel = max |merged - reference| / max |reference| <= --tolerance (1e-4
    for a float32 export; pass a bound of order 1e-2 for bf16/f16 exports).
The smallest gap between the two best logits along the reference's generation
is printed: a tie closer than the logits' error could flip a token without a
bug.

With --fixtures it runs the whole chain on every architecture of
tests/fixtures/hf (llama_gqa, llama_tied_llama3, qwen2_bias, mistral), and
llama_gqa and qwen2_bias again with DoRA (lora.dora: the adapter's use_dora
and magnitudes, the merge's m / ||W + s B A|| per row): copies
the fixture's model/ as the base (mistral's with "sliding_window": null, the
case where a rebuilt config.json made transformers fill in 4096) with the test
tokenizer of tests/fixtures/tokenizer beside it, writes a
random-token dataset (h5py), trains 12 LoRA steps with `SPOTUNE train` on all
seven projections, exports --peft and --merged, checks as above, and prints one
line per architecture.

Exit codes: 0 ok; 1 a check failed; 2 usage error; 3 something does not load
or a spotune command failed; 77 a Python package is missing (ctest: skipped;
1 instead with SPOTUNE_REQUIRE_HF_TESTS=1, as scripts/test.sh sets).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

ARCHS = ("llama_gqa", "llama_tied_llama3", "qwen2_bias", "mistral")
# --fixtures: (architecture, DoRA) chains; DoRA (lora.dora, PEFT's use_dora) on two
DORA_ARCHS = ("llama_gqa", "qwen2_bias")
CHAINS = tuple((a, False) for a in ARCHS) + tuple((a, True) for a in DORA_ARCHS)
DTYPE_KEYS = ("torch_dtype", "dtype")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LoadFailure(Exception):
    """A model, adapter or spotune step failed (exit 3)."""


def import_deps(extra=()):
    missing = []
    for mod in ("torch", "transformers", "peft", "safetensors", "numpy") + tuple(extra):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        print(f"error: missing Python packages: {', '.join(missing)}. Install with:\n"
              "  scripts/install-deps.sh --python --hf   (into .venv), or\n"
              "  pip install torch transformers==5.24.0 peft==0.21.2 safetensors numpy h5py",
              file=sys.stderr)
        # where the suite installed them (scripts/test.sh), missing is a failure
        sys.exit(1 if os.environ.get("SPOTUNE_REQUIRE_HF_TESTS") == "1" else 77)


def load_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, local_files_only=True, output_loading_info=True)
    except Exception as e:
        raise LoadFailure(f"{model_dir}: cannot load: {e}") from e
    problems = {k: v for k, v in info.items()
                if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")}
    if problems:
        raise LoadFailure(f"{model_dir}: does not load cleanly: {problems}")
    return model.eval()


def load_reference(base_dir, adapter_dir):
    from peft import PeftModel
    base = load_model(base_dir)
    try:
        return PeftModel.from_pretrained(base, adapter_dir, local_files_only=True).eval()
    except Exception as e:
        raise LoadFailure(f"{adapter_dir}: PEFT cannot load the adapter: {e}") from e


def config_diff(base_dir, merged_dir):
    """Keys whose values differ between the two config.json, dtype keys aside."""
    with open(os.path.join(base_dir, "config.json")) as f:
        base = json.load(f)
    with open(os.path.join(merged_dir, "config.json")) as f:
        merged = json.load(f)
    keys = (set(base) | set(merged)) - set(DTYPE_KEYS)
    return sorted(k for k in keys if k not in base or k not in merged or base[k] != merged[k])


def check(base_dir, adapter_dir, merged_dir, new_tokens=32, long_tokens=4160, tol=1e-4, seed=0):
    """Returns (ok, figures): figures is a dict of what was measured."""
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoTokenizer
    fig = {}
    ok = True
    diff = config_diff(base_dir, merged_dir)
    fig["config_keys_differing"] = diff
    if diff:
        print(f"FAIL: {merged_dir}/config.json differs from the base's in {diff}")
        ok = False
    cfg = AutoConfig.from_pretrained(merged_dir, local_files_only=True)
    fig["merged_sliding_window"] = getattr(cfg, "sliding_window", None)
    fig["tokenizer"] = "none in the base"
    if any(f.startswith("tokenizer") for f in os.listdir(base_dir)):
        # the merged directory's tokenizer alone encodes as the base's does
        text = "The merged model reads this sentence the way the base model does."
        chat = [{"role": "user", "content": "Which tokens?"}]
        try:
            t_base = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
            t_mer = AutoTokenizer.from_pretrained(merged_dir, local_files_only=True)
            same = t_base(text)["input_ids"] == t_mer(text)["input_ids"]
            if t_base.chat_template:
                same = same and (t_base.apply_chat_template(chat, tokenize=False) ==
                                 t_mer.apply_chat_template(chat, tokenize=False))
            fig["tokenizer"] = "same as the base's" if same else "DIFFERENT"
        except Exception as e:
            fig["tokenizer"] = f"fails: {e}"
        print(f"tokenizer (AutoTokenizer on the merged directory): {fig['tokenizer']}")
        ok = ok and fig["tokenizer"] == "same as the base's"
    ref = load_reference(base_dir, adapter_dir)
    merged = load_model(merged_dir)
    vocab = cfg.vocab_size
    rng = np.random.default_rng(seed)
    # greedy generation
    prompt = torch.tensor(rng.integers(0, vocab, size=(1, 8)), dtype=torch.long)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              pad_token_id=0, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        g_ref = ref.generate(input_ids=prompt, **kw)[0, prompt.shape[1]:].tolist()
        g_mer = merged.generate(input_ids=prompt, **kw)[0, prompt.shape[1]:].tolist()
        # the closest call along the reference's path: the gap between its two best logits
        seq = torch.tensor([prompt[0].tolist() + g_ref], dtype=torch.long)
        lg = ref(input_ids=seq).logits[0, prompt.shape[1] - 1:-1]
        top2 = lg.topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()
    same = g_ref == g_mer
    first_diff = next((i for i, (a, b) in enumerate(zip(g_ref, g_mer)) if a != b), None)
    fig.update(generation_equal=same, generated=len(g_mer), min_top2_gap=margin,
               first_difference=first_diff)
    print(f"greedy generation of {new_tokens} tokens: {'equal' if same else 'DIFFERENT'} "
          f"(smallest top-2 logit gap along the reference's path {margin:.3g})")
    if not same:
        print(f"  reference {g_ref}\n  merged    {g_mer}")
        ok = False
    # logits on a long input
    ids = torch.tensor(rng.integers(0, vocab, size=(1, long_tokens)), dtype=torch.long)
    with torch.no_grad():
        l_ref = ref(input_ids=ids).logits.to(torch.float32)
        l_mer = merged(input_ids=ids).logits.to(torch.float32)
    scale = l_ref.abs().max().item()
    rel = (l_mer - l_ref).abs().max().item() / scale
    fig.update(long_tokens=long_tokens, long_logits_rel=rel)
    good = rel <= tol
    print(f"logits on {long_tokens} tokens: rel {rel:.3g} (max |logit| {scale:.4g}), tolerance "
          f"{tol:g}: {'ok' if good else 'FAIL'}")
    ok = ok and good
    return ok, fig


# ---- --fixtures: the whole chain on the fixture architectures -----------------------

def write_dataset(path, vocab, n, seed):
    import h5py
    import numpy as np
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=n).astype(np.uint32)
    mask = np.ones(n, dtype=np.uint8)
    mask[::50] = 0
    offsets = np.arange(0, n + 1, 50, dtype=np.uint64)
    if offsets[-1] != n:
        offsets = np.append(offsets, np.uint64(n))
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", data=tokens)
        f.create_dataset("loss_mask", data=mask)
        f.create_dataset("doc_offsets", data=offsets)
        f.attrs["vocab_size"] = np.int64(vocab)
        f.attrs["eos_id"] = np.int64(2)
        f.attrs["tokenizer"] = "random ids (check_merged_export.py)"


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        raise LoadFailure(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}")
    return p.stdout


def fixture_chain(arch, dora, spotune, work, args):
    d = os.path.join(work, arch + ("_dora" if dora else ""))
    shutil.rmtree(d, ignore_errors=True)
    base = os.path.join(d, "base")
    shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "hf", arch, "model"), base)
    cfg_path = os.path.join(base, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if arch == "mistral":
        cfg["sliding_window"] = None  # no window: must not become transformers' 4096
    with open(cfg_path, "w") as f:
        f.write(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    # a real tokenizer beside the weights (tests/fixtures/tokenizer: byte-level BPE with a
    # chat template), which the merged directory must carry
    tok_dir = os.path.join(ROOT, "tests", "fixtures", "tokenizer")
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), base)
    write_dataset(os.path.join(d, "train.h5"), cfg["vocab_size"], 4000, 1)
    write_dataset(os.path.join(d, "val.h5"), cfg["vocab_size"], 800, 2)
    run_dir = os.path.join(d, "run")
    with open(os.path.join(d, "run.yaml"), "w") as f:
        f.write(f"run:\n  dir: {run_dir}\n  seed: 5\nmodel:\n  path: {base}\n"
                f"data:\n  train: {d}/train.h5\n  val: {d}/val.h5\n  val_every: 6\n"
                "train:\n  mode: lora\n  steps: 12\n  seq_len: 32\n  micro_batch: 2\n"
                "  grad_accum: 1\n  lr: 2e-2\n  warmup_steps: 2\n"
                "lora:\n  r: 8\n  alpha: 16\n"
                "  targets: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]\n"
                f"  dora: {'true' if dora else 'false'}\n"
                "log:\n  every: 4\nruntime:\n  backend: cpu\n  threads: 1\n"
                "checkpoint:\n  every_minutes: 0\n  every_steps: 12\n")
    run([spotune, "train", os.path.join(d, "run.yaml")])
    ck = os.path.join(run_dir, "checkpoints", "step-00000012")
    adapter, merged = os.path.join(d, "peft"), os.path.join(d, "merged")
    run([spotune, "export", ck, "--peft", adapter, "--merged", merged])
    # every tensor of the adapter (DoRA's magnitudes too) loads into PEFT as written
    run([sys.executable, os.path.join(ROOT, "scripts", "check_peft_adapter.py"), "--base", base,
         "--adapter", adapter])
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        if json.load(f).get("use_dora") is not dora:
            raise LoadFailure(f"{adapter}/adapter_config.json: use_dora is not {dora}")
    print(f"== {arch}{' (DoRA)' if dora else ''}: base {base}, adapter {adapter}, merged {merged}")
    return check(base, adapter, merged, args.new_tokens, args.long_tokens, args.tolerance)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Check that spotune's merged export equals base + adapter under PEFT: "
                    "config, greedy generation, long-input logits.",
        epilog="Exit codes: 0 ok, 1 a check failed, 2 usage error, 3 load or spotune failure, "
               "77 a Python package is missing.")
    ap.add_argument("--base", metavar="DIR", help="the base model directory")
    ap.add_argument("--adapter", metavar="DIR", help="the PEFT adapter (spotune export --peft)")
    ap.add_argument("--merged", metavar="DIR", help="the merged model (spotune export --merged)")
    ap.add_argument("--fixtures", action="store_true",
                    help="train, export and check every tests/fixtures/hf architecture")
    ap.add_argument("--spotune", metavar="BIN", help="the spotune binary (with --fixtures)")
    ap.add_argument("--workdir", metavar="DIR",
                    help="where --fixtures works (default: a temporary directory, removed)")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens (default 32)")
    ap.add_argument("--long-tokens", type=int, default=4160,
                    help="length of the long input (default 4160, beyond a 4096 window)")
    ap.add_argument("--tolerance", type=float, default=1e-4,
                    help="largest rel of the long-input logits (default 1e-4)")
    args = ap.parse_args(argv)
    if args.fixtures == bool(args.base or args.adapter or args.merged):
        ap.error("give either --base, --adapter and --merged, or --fixtures")
    if not args.fixtures and not (args.base and args.adapter and args.merged):
        ap.error("--base, --adapter and --merged go together")
    if args.fixtures and not args.spotune:
        ap.error("--fixtures needs --spotune BIN")
    import_deps(("h5py",) if args.fixtures else ())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    import torch
    torch.manual_seed(0)
    try:
        if not args.fixtures:
            ok, _ = check(args.base, args.adapter, args.merged, args.new_tokens,
                          args.long_tokens, args.tolerance)
            return 0 if ok else 1
        work = args.workdir or tempfile.mkdtemp(prefix="check-merged-")
        rows, all_ok = [], True
        try:
            for arch, dora in CHAINS:
                ok, fig = fixture_chain(arch, dora, os.path.abspath(args.spotune), work, args)
                rows.append((arch + (" dora" if dora else ""), ok, fig))
                all_ok = all_ok and ok
        finally:
            if not args.workdir:
                shutil.rmtree(work, ignore_errors=True)
        print("\narchitecture       generation (32 tokens)  min top-2 gap  logits rel "
              f"({args.long_tokens} tokens)  sliding_window  config            tokenizer")
        for arch, ok, f in rows:
            conf = "= base but dtype" if not f["config_keys_differing"] else \
                str(f["config_keys_differing"])
            print(f"{arch:18s} {'equal' if f['generation_equal'] else 'DIFFERENT':23s} "
                  f"{f['min_top2_gap']:<14.3g} {f['long_logits_rel']:<25.3g} "
                  f"{str(f['merged_sliding_window']):15s} {conf:17s} {f['tokenizer']}")
        return 0 if all_ok else 1
    except LoadFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
