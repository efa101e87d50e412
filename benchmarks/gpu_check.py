"""Every GPU check in one run, for a machine where a GPU is lent for a few minutes (no downloads needed there).

Builds a Qwen2.5-0.5B-shaped model from a config with random weights (494M parameters, 151,936-token
vocabulary, tied embeddings) and a character tokenizer, then runs, in bf16:
  1. grpo.py: 5 steps, 8 prompts x 8 completions, 256 new tokens, KL to a reference model (a frozen copy);
  2. prm.py: 20 steps, batch 16, rows of 1,021 tokens with 10 labelled steps (--max-length 1024);
  3. both again for a few steps with --fsdp under `torchrun --nproc_per_node 1`: the sharded code path (mixed
     precision, gathered checkpoints, generation through FSDP) on CUDA and NCCL;
and prints per-step time (first step excluded), generated and trained tokens/s, MFU and peak memory as a
Markdown table, also written with the device name to OUT/gpu_check.json and OUT/gpu_check.md.

    python benchmarks/gpu_check.py --out gpu-check                          # on the GPU: about 5 min
    python benchmarks/gpu_check.py --size tiny --device cpu --out /tmp/gc   # the same runs, shrunk (a test)

The architecture is Llama with Qwen2.5-0.5B's dimensions: Qwen2 is Llama plus q/k/v biases (FLOPs and memory
agree to 0.01%), and transformers 5.24's AutoTokenizer turns the tokenizer of a qwen2 model into a byte-level one
that drops the newline step separator. A random-weight policy rarely samples EOS, so every completion runs to 256 tokens: the worst case for the
rollout. On CPU the --fsdp runs go through tests/fsdp_on_cpu.py (users get an error for --fsdp on CPU).
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

# Qwen2.5-0.5B's dimensions (its config.json), in a Llama config: see the docstring
SIZES = {
    "qwen0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                     num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=2048, rope_theta=1000000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True),
}
# (grpo steps, prompts per step, group size, new tokens), (prm steps, batch size, max length), fsdp steps
WORKLOADS = {"qwen0.5b": ((5, 8, 8, 256), (20, 16, 1024), 3), "tiny": ((3, 4, 4, 16), (4, 4, 128), 2)}


def build_model(size: str, directory: Path) -> int:
    """The model and prm.py's character tokenizer (a superset of grpo.py's), saved in bf16; returns its size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import prm

    tokenizer = prm.build_tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(**SIZES[size], head_dim=SIZES[size]["hidden_size"] // SIZES[size]["num_attention_heads"], pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def write_prm_rows(path: Path, rows: int, max_length: int) -> None:
    """Rows that nearly fill max_length (one token a character): BOS, a prompt and 10 steps with separators."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz0123456789+-*/=().,"
    step_tokens = max_length // 11  # with its separator
    prompt_tokens = max_length - 1 - 10 * step_tokens - 3
    with open(path, "w") as f:
        for _ in range(rows):
            prompt = "".join(rng.choice(letters) for _ in range(prompt_tokens))
            steps = ["".join(rng.choice(letters) for _ in range(step_tokens - 1)) for _ in range(10)]
            labels = [rng.random() < 0.7 for _ in steps]
            f.write(json.dumps({"prompt": prompt, "completions": steps, "labels": labels}) + "\n")


def run(name: str, command: list[str], out: Path) -> dict:
    """One run as a subprocess; its summary.json, with the wall time and the command."""
    print(f"== {name}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    env = {**os.environ, "WANDB_MODE": "disabled"}
    process = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if process.returncode != 0:
        print(process.stdout[-2000:], process.stderr[-4000:], sep="\n", flush=True)
        return {"name": name, "error": f"exit code {process.returncode}", "command": command}
    with open(out / name / "summary.json") as f:
        summary = json.load(f)
    return {"name": name, "wall_s": time.perf_counter() - start, "command": command, **summary}


def table(results: list[dict]) -> str:
    lines = ["| run | steps | s/step | generated tok/s | trained tok/s | MFU | peak memory MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['error']} | | | | | |")
            continue
        trained = r.get("trained_tokens_per_s", r.get("tokens_per_s", float("nan")))
        generated = r.get("generated_tokens_per_s")
        mfu = r.get("mfu")
        lines.append(f"| {r['name']} | {r['steps']} | {r['step_time_s_mean']:.3f} | "
                     f"{f'{generated:,.0f}' if generated is not None else '-'} | {trained:,.0f} | "
                     f"{f'{100 * mfu:.1f}%' if mfu is not None else '-'} | {r['peak_memory_mb']:,.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu-check", help="where the model, the runs and the results go")
    parser.add_argument("--size", choices=list(SIZES), default="qwen0.5b")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to check this script on a small size")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="for MFU; 0 = guess from the device name")
    args = parser.parse_args()
    import torch

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir, rows_path = out / "model", out / "prm_rows.jsonl"
    parameters = build_model(args.size, model_dir)
    (grpo_steps, prompts, group, new_tokens), (prm_steps, batch, max_length), fsdp_steps = WORKLOADS[args.size]
    write_prm_rows(rows_path, batch * prm_steps * 2, max_length)
    python, dtype = sys.executable, "bfloat16"
    common = ["--model", str(model_dir), "--dtype", dtype, "--device", args.device, "--eval-every", "0",
              "--peak-tflops", str(args.peak_tflops), "--overwrite"]
    grpo_flags = [*common, "--total-steps", str(grpo_steps), "--prompts-per-step", str(prompts), "--group-size",
                  str(group), "--max-new-tokens", str(new_tokens), "--max-prompt-length", "64", "--kl-coef", "0.05",
                  "--learning-rate", "1e-6", "--num-eval-prompts", "0"]
    prm_flags = [*common, "--data-path", str(rows_path), "--num-val-rows", "0", "--batch-size", str(batch),
                 "--max-length", str(max_length), "--total-steps", str(prm_steps), "--learning-rate", "1e-5"]
    # --fsdp needs torchrun; on CPU it goes through the tests' driver, which lifts the CUDA-only check
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    fsdp = {script: [*torchrun, "tests/fsdp_on_cpu.py", script] if args.device == "cpu"
            else [*torchrun, f"{script}.py"] for script in ("grpo", "prm")}
    results = [
        run("grpo", [python, "grpo.py", *grpo_flags, "--output-dir", str(out / "grpo")], out),
        run("prm", [python, "prm.py", *prm_flags, "--output-dir", str(out / "prm")], out),
        run("grpo-fsdp", [*fsdp["grpo"], *grpo_flags, "--total-steps", str(fsdp_steps), "--fsdp",
                          "--output-dir", str(out / "grpo-fsdp")], out),
        run("prm-fsdp", [*fsdp["prm"], *prm_flags, "--total-steps", str(fsdp_steps), "--fsdp",
                         "--output-dir", str(out / "prm-fsdp")], out),
    ]
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    header = (f"{args.size}-shaped model, {parameters:,} parameters, random weights, bf16 (FSDP runs: fp32 sharded "
              f"weights, bf16 compute), on {device}; torch {torch.__version__}\n"
              f"grpo: {prompts} prompts x {group} completions, {new_tokens} new tokens, KL 0.05 (reference model); "
              f"prm: batch {batch}, --max-length {max_length}\n")
    report = header + "\n" + table(results)
    print(report)
    (out / "gpu_check.md").write_text(report + "\n")
    with open(out / "gpu_check.json", "w") as f:
        json.dump({"device": device, "size": args.size, "parameters": parameters, "results": results}, f, indent=2)
    sys.exit(1 if any("error" in r for r in results) else 0)


if __name__ == "__main__":
    main()
