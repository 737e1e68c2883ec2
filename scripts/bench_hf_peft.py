#!/usr/bin/env python3
"""Time Hugging Face transformers (+ PEFT) training steps: the peer for spotune's benchmarks.

    pip install torch transformers==5.24.0 peft==0.21.2 safetensors
    python3 scripts/bench_hf_peft.py --model MODEL_DIR --mode lora --micro-batch 4 \\
        --seq-len 256 --threads 8 --steps 10 --warmup 2 [--device cuda --dtype bfloat16]
    python3 scripts/bench_hf_peft.py --preset llama-7b --mode lora --micro-batch 1 \\
        --seq-len 2048 --steps 5 --warmup 1 --device cuda --dtype bfloat16

MODEL_DIR is a Hugging Face Llama-family directory (config.json + safetensors),
e.g. one made by `spotune init-model`. --preset NAME instead builds spotune's
preset of that name (tiny, small, llama-7b, llama-13b: the architecture of
`spotune init-model --preset NAME`) with random weights made directly on the
device, so nothing is written or read (a 7B model directory is 13 GB). One step = forward + loss + backward +
AdamW step + zero_grad on a random batch of micro-batch x seq-len tokens, the
same work as one spotune optimizer step with one micro-batch. Attention is
PyTorch SDPA (transformers' default). The first --warmup steps are not timed.

Modes:
  lora  PEFT LoRA r (--lora-r, default 16), alpha 32, dropout 0 on q/k/v/o/gate/up/down;
        only the adapter trains. With --dtype bfloat16 the base weights are bf16 and
        PEFT keeps the adapter (and so its AdamW state) in float32.
  full  every parameter trains, AdamW state in the weights' dtype (pure bf16 with
        --dtype bfloat16).

Prints one line of JSON on stdout (progress goes to stderr): tokens_per_s,
step_s (mean of the timed steps), the settings, library versions,
step1_loss (the first step's, before any update) and peak_mem_bytes (CUDA:
torch.cuda.max_memory_allocated; CPU: the process's peak resident set size).
Exit codes: 0 done, 2 usage, or a package that is missing or fails to import
(the error says which and why), 3 unusable model directory.
"""

import argparse
import json
import os
import resource
import sys
import time

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# spotune's presets (trainer/model_config.c): vocab, hidden, intermediate,
# layers, heads, kv heads, max positions, bos, eos
PRESETS = {
    "tiny": (260, 128, 448, 4, 4, 2, 2048, 256, 257),
    "small": (32000, 768, 1536, 12, 12, 4, 4096, 1, 2),
    "llama-7b": (32000, 4096, 11008, 32, 32, 32, 4096, 1, 2),
    "llama-13b": (32000, 5120, 13824, 40, 40, 40, 4096, 1, 2),
}


def import_deps():
    missing, broken = [], []
    for mod in ("torch", "transformers", "peft"):
        try:
            __import__(mod)
        except ImportError as e:
            if getattr(e, "name", None) == mod:
                missing.append(mod)
            else:  # the package is there but something it loads is not
                broken.append(f"import {mod}: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - any failure to import is reported as is
            broken.append(f"import {mod}: {type(e).__name__}: {e}")
    for b in broken:
        print(f"error: {b}", file=sys.stderr)
    if missing:
        print(f"error: missing Python packages: {', '.join(missing)}. Install with:\n"
              "  pip install torch transformers==5.24.0 peft==0.21.2 safetensors", file=sys.stderr)
    if missing or broken:
        sys.exit(2)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def peak_mem_bytes(device):
    import torch
    if device == "cuda":
        return int(torch.cuda.max_memory_allocated())
    # ru_maxrss is in kilobytes on Linux (bytes on macOS).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def preset_model(name, dtype, device):
    """spotune's preset with random weights (N(0, 0.02), as both initialise), made on device."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    vocab, hidden, inter, layers, heads, kv, max_pos, bos, eos = PRESETS[name]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, max_position_embeddings=max_pos, rms_norm_eps=1e-5,
                      rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=bos,
                      eos_token_id=eos, initializer_range=0.02)
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    try:  # built in the target dtype when torch allows it as a default (bf16: 2.1+)
        torch.set_default_dtype(dtype)
    except (TypeError, RuntimeError):
        pass
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.to(dtype)


def build_model(args, dtype):
    from transformers import AutoModelForCausalLM

    if args.preset:
        model = preset_model(args.preset, dtype, args.device)
    else:
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            log(f"error: {args.model}: no config.json (not a Hugging Face model directory)")
            sys.exit(3)
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=dtype, attn_implementation="sdpa", local_files_only=True)
    model.config.use_cache = False
    if args.device == "cuda":
        model.to("cuda")
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.mode == "lora":
        from peft import LoraConfig, get_peft_model
        cfg = LoraConfig(r=args.lora_r, lora_alpha=32, lora_dropout=0.0,
                         target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
        model = get_peft_model(model, cfg)
        if args.grad_checkpointing:
            model.enable_input_require_grads()
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    model.train()
    return model


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Time transformers/PEFT training steps (forward, backward, AdamW) on random "
                    "tokens; prints one JSON line. The peer of spotune's own benchmarks.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="MODEL_DIR", help="Hugging Face model directory")
    src.add_argument("--preset", choices=sorted(PRESETS),
                     help="spotune's preset with random weights made on the device")
    ap.add_argument("--mode", required=True, choices=["lora", "full"], help="LoRA or full fine-tuning")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per step (default 4)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch.set_num_threads (default: all cores)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="default cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="dtype of the model weights (default float32)")
    ap.add_argument("--grad-checkpointing", action="store_true",
                    help="recompute each layer's activations in backward")
    ap.add_argument("--lora-r", type=int, default=16, help="LoRA rank (default 16)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random batches and LoRA init")
    args = ap.parse_args(argv)
    for name in ("micro_batch", "seq_len", "threads", "steps", "lora_r"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        ap.error("--warmup must be at least 0")

    import_deps()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import peft
    import torch
    import transformers
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    if args.device == "cuda" and not torch.cuda.is_available():
        log("error: --device cuda, but torch sees no CUDA device")
        return 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]

    model = build_model(args, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in params)
    n_total = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    log(f"{args.mode}: {n_trainable:,} trainable of {n_total:,} parameters, device {args.device}, "
        f"{args.dtype}, {torch.get_num_threads()} threads")

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    times, loss_value, step1_loss = [], float("nan"), float("nan")
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=gen).to(args.device)
        sync()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()  # also waits for the device
        if step == 0:
            step1_loss = loss_value
        sync()
        dt = time.perf_counter() - t0
        timed = step >= args.warmup
        if timed:
            times.append(dt)
        log(f"step {step + 1}/{args.warmup + args.steps}{'' if timed else ' (warmup)'}: "
            f"{dt:.3f} s, loss {loss_value:.4f}")

    step_s = sum(times) / len(times)
    result = {
        "tokens_per_s": args.micro_batch * args.seq_len / step_s,
        "step_s": step_s,
        "mode": args.mode,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "threads": torch.get_num_threads(),
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": args.dtype,
        "grad_checkpointing": args.grad_checkpointing,
        "lora_r": args.lora_r if args.mode == "lora" else None,
        "steps": args.steps,
        "warmup": args.warmup,
        "trainable_params": n_trainable,
        "total_params": n_total,
        "step1_loss": step1_loss,
        "last_loss": loss_value,
        "model": args.model or f"preset {args.preset} (random weights)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "peak_mem_bytes": peak_mem_bytes(args.device),
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
