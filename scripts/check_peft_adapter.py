#!/usr/bin/env python3
"""Check that a LoRA adapter loads in Hugging Face PEFT exactly as written, and
optionally that it reproduces given logits.

    pip install torch transformers==5.24.0 peft==0.21.2 safetensors
    python3 scripts/check_peft_adapter.py --base MODEL_DIR --adapter ADAPTER_DIR \\
        [--tokens-file batch.safetensors --expect-logits expected.safetensors]

Used on the adapters spotune exports (adapter_model.safetensors +
adapter_config.json, PEFT layout). Loads the base model with transformers and
the adapter with PeftModel.from_pretrained, then fails if
  - PEFT rejects the config or warns about config fields it does not know,
  - PEFT reports missing adapter keys, or a tensor's shape does not match,
  - a tensor in adapter_model.safetensors is not used by the loaded model
    (PEFT silently ignores such keys), or a LoRA weight of the model does not
    come from the file, or a loaded weight differs from the file's value,
  - the base model directory itself has missing or unexpected tensors.
A DoRA adapter (use_dora) is checked the same way, its lora_magnitude_vector
tensors included.
Then prints a summary: LoRA modules loaded, r, alpha, scaling, targets.

With --tokens-file (an I32/I64 `tokens` tensor [B, T]) and --expect-logits (an
F32 `logits` tensor [B, T, V]) it runs the forward in float32 on the tokens and
compares: rel = max |logits - expected| / max |expected|; fails if rel exceeds
--tolerance (default 1e-4). A tokens tensor with one column more than the
logits (T + 1, as in tests/fixtures/hf/*/batch.safetensors) is cut to its
first T columns.

Exit codes: 0 ok; 1 logits differ beyond the tolerance; 2 usage error or a
missing package; 3 the adapter or model does not load cleanly.
"""

import argparse
import json
import os
import sys
import warnings


class LoadFailure(Exception):
    """The model or adapter does not load cleanly (exit 3)."""


def import_deps():
    missing = []
    for mod in ("torch", "transformers", "peft", "safetensors"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        print(f"error: missing Python packages: {', '.join(missing)}. Install with:\n"
              "  pip install torch transformers==5.24.0 peft==0.21.2 safetensors", file=sys.stderr)
        sys.exit(2)


# PEFT's warnings that mean the adapter did not load as written.
FATAL_WARNINGS = ("missing adapter keys", "unexpected keyword arguments", "unexpected keys",
                  "size mismatch", "were not used")


def load_base(model_dir):
    import torch
    from transformers import AutoModelForCausalLM
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise LoadFailure(f"{model_dir}: no config.json")
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, local_files_only=True, output_loading_info=True)
    except Exception as e:
        raise LoadFailure(f"{model_dir}: cannot load the base model: {e}") from e
    keys = ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
    problems = {k: v for k, v in info.items() if v and k in keys}
    if problems:
        raise LoadFailure(f"{model_dir}: base model does not load cleanly: {problems}")
    return model


def load_adapter(model, adapter_dir, adapter_name="default"):
    from peft import PeftModel
    for fn in ("adapter_config.json", "adapter_model.safetensors"):
        if not os.path.isfile(os.path.join(adapter_dir, fn)):
            raise LoadFailure(f"{adapter_dir}: no {fn}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pm = PeftModel.from_pretrained(model, adapter_dir, adapter_name=adapter_name,
                                           local_files_only=True)
        except Exception as e:
            raise LoadFailure(f"{adapter_dir}: PEFT cannot load the adapter: {e}") from e
    fatal = [str(w.message) for w in caught
             if any(s in str(w.message).lower() for s in FATAL_WARNINGS)]
    if fatal:
        raise LoadFailure(f"{adapter_dir}: PEFT warned while loading:\n  " + "\n  ".join(fatal))
    return pm


def verify_tensors(pm, adapter_dir, adapter_name="default"):
    """Every file tensor is a model parameter with the same value, and vice versa."""
    import torch
    from safetensors.torch import load_file
    file_sd = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    model_sd = {}
    for name, p in pm.named_parameters():
        if f".{adapter_name}." in name or name.endswith(f".{adapter_name}"):
            key = name.replace(f".{adapter_name}.", ".")
            if key.endswith(f".{adapter_name}"):
                key = key[: -len(adapter_name) - 1]
            # DoRA: the parameter lora_magnitude_vector.<adapter>.weight is saved
            # as lora_magnitude_vector
            if key.endswith(".lora_magnitude_vector.weight"):
                key = key[: -len(".weight")]
            model_sd[key] = p
    missing = sorted(set(model_sd) - set(file_sd))
    unexpected = sorted(set(file_sd) - set(model_sd))
    errors = []
    if missing:
        errors.append(f"{len(missing)} adapter weights of the model are not in the file, e.g. {missing[:3]}")
    if unexpected:
        errors.append(f"{len(unexpected)} tensors in the file are not used by the model, e.g. "
                      f"{unexpected[:3]}")
    for k in sorted(set(file_sd) & set(model_sd)):
        a, b = file_sd[k], model_sd[k].detach()
        if tuple(a.shape) != tuple(b.shape):
            errors.append(f"{k}: shape {tuple(a.shape)} in the file, {tuple(b.shape)} in the model")
        elif not torch.equal(a.to(torch.float32), b.to(torch.float32)):
            errors.append(f"{k}: loaded value differs from the file")
    if errors:
        raise LoadFailure(f"{adapter_dir}: adapter does not match the model:\n  " + "\n  ".join(errors))
    return file_sd


def summarize(pm, file_sd, adapter_name="default"):
    from peft.tuners.lora import LoraLayer
    cfg = pm.peft_config[adapter_name]
    layers = [(n, m) for n, m in pm.named_modules()
              if isinstance(m, LoraLayer) and adapter_name in getattr(m, "r", {})]
    ranks = sorted({m.r[adapter_name] for _, m in layers})
    scalings = sorted({float(m.scaling[adapter_name]) for _, m in layers})
    kinds = sorted({n.rsplit(".", 1)[-1] for n, _ in layers})
    targets = cfg.target_modules
    targets = sorted(targets) if isinstance(targets, (set, list, tuple)) else targets
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in file_sd.values()})
    print(f"adapter: {len(layers)} LoRA modules loaded ({', '.join(kinds)}), {len(file_sd)} tensors "
          f"({', '.join(dtypes)})")
    print(f"  r {cfg.r} (modules: {ranks}), lora_alpha {cfg.lora_alpha}, use_rslora {cfg.use_rslora}, "
          f"use_dora {cfg.use_dora}, scaling {scalings}, lora_dropout {cfg.lora_dropout}")
    print(f"  target_modules {targets}, bias {cfg.bias!r}, task_type {cfg.task_type}")
    if not layers:
        raise LoadFailure("no LoRA module was created: target_modules match nothing in the base model")


def compare_logits(pm, tokens_file, logits_file, tol):
    import torch
    from safetensors.torch import load_file
    tok = load_file(tokens_file)
    exp = load_file(logits_file)
    if "tokens" not in tok:
        raise LoadFailure(f"{tokens_file}: no 'tokens' tensor")
    if "logits" not in exp:
        raise LoadFailure(f"{logits_file}: no 'logits' tensor")
    tokens, expected = tok["tokens"], exp["logits"].to(torch.float32)
    if tokens.ndim != 2 or expected.ndim != 3:
        raise LoadFailure(f"tokens must be [B, T] and logits [B, T, V]; got {tuple(tokens.shape)} "
                          f"and {tuple(expected.shape)}")
    if tokens.shape[1] == expected.shape[1] + 1:
        tokens = tokens[:, :-1]
    if tuple(tokens.shape) != tuple(expected.shape[:2]):
        raise LoadFailure(f"tokens {tuple(tokens.shape)} do not fit logits {tuple(expected.shape)}")
    pm = pm.to(torch.float32).eval()
    with torch.no_grad():
        logits = pm(input_ids=tokens.long()).logits.to(torch.float32)
    if tuple(logits.shape) != tuple(expected.shape):
        print(f"FAIL: logits shape {tuple(logits.shape)}, expected {tuple(expected.shape)}")
        return False
    abs_err = (logits - expected).abs().max().item()
    scale = expected.abs().max().item()
    rel = abs_err / scale if scale > 0 else abs_err
    ok = rel <= tol
    print(f"logits {tuple(logits.shape)}: max abs error {abs_err:.3e}, relative {rel:.3e} "
          f"(to max |logit| {scale:.4g}), tolerance {tol:g}: {'ok' if ok else 'FAIL'}")
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Load a LoRA adapter with Hugging Face PEFT, fail on any key, shape or config "
                    "problem, print a summary and optionally compare logits.",
        epilog="Exit codes: 0 ok, 1 logits differ, 2 usage or missing package, 3 does not load cleanly.")
    ap.add_argument("--base", required=True, metavar="MODEL_DIR", help="Hugging Face base model directory")
    ap.add_argument("--adapter", required=True, metavar="ADAPTER_DIR",
                    help="directory with adapter_config.json and adapter_model.safetensors")
    ap.add_argument("--tokens-file", metavar="F.safetensors",
                    help="safetensors with an integer 'tokens' [B, T] (or [B, T+1])")
    ap.add_argument("--expect-logits", metavar="F.safetensors",
                    help="safetensors with F32 'logits' [B, T, V]")
    ap.add_argument("--tolerance", type=float, default=1e-4,
                    help="largest allowed max|error| / max|expected logit| (default 1e-4)")
    args = ap.parse_args(argv)
    if bool(args.tokens_file) != bool(args.expect_logits):
        ap.error("--tokens-file and --expect-logits go together")

    import_deps()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notes
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    try:
        model = load_base(args.base)
        pm = load_adapter(model, args.adapter)
        file_sd = verify_tensors(pm, args.adapter)
        summarize(pm, file_sd)
        if args.tokens_file:
            return 0 if compare_logits(pm, args.tokens_file, args.expect_logits, args.tolerance) else 1
    except LoadFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except (OSError, ValueError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    print("ok: the adapter loads cleanly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
