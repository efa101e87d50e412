"""grpo.py's rollout (`generate`) against transformers' `model.generate` on the same batch: generated tokens/s.

Both sample (temperature 1, no top-k/top-p) the same number of new tokens for every row (EOS is ignored on both
sides, so that neither stops early), from prompts of a given length repeated `--group` times: grpo.py encodes each
prompt once and copies its KV cache to the group; model.generate gets num_return_sequences. Median of --reps
timed calls after one warm-up call, on torch's default threads.

    python benchmarks/rollout_vs_generate.py --model bench-out/tiny-model bench-out/small-model
    python benchmarks/rollout_vs_generate.py --model bench-out/tiny-model --new-tokens 64
"""

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpo  # noqa: E402


def timed(fn, reps: int, *fn_args) -> float:
    fn(*fn_args)  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(*fn_args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ours(model, prompts, mask, args) -> None:
    """grpo.py's sampler: each prompt encoded once, its KV cache copied to its group."""
    pad = SimpleNamespace(pad_token_id=0)  # generate reads only the pad id of the tokenizer
    policy = grpo.Policy(model, pad, eos_ids=[-1], vocab_size=None, device=torch.device("cpu"), bf16=False)
    repeated = [row for row in prompts.tolist() for _ in range(args.group)]
    generators = [torch.Generator().manual_seed(i) for i in range(args.prompts)]
    sampling = grpo.Args(max_new_tokens=args.new_tokens)
    out = grpo.generate(policy, repeated, sampling, generators, args.group).completion_ids
    assert out.shape[1] == args.new_tokens


@torch.no_grad()
def theirs(model, prompts, mask, args) -> None:
    out = model.generate(
        input_ids=prompts,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        num_return_sequences=args.group,
        pad_token_id=0,
    )
    assert out.shape[1] == prompts.shape[1] + args.new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", required=True, help="saved causal LM directories")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[5, 120])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    print("| model, prompt length | grpo.py `generate` | `model.generate` | speed-up |\n|---|---|---|---|")
    for path in args.model:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        vocab = model.config.vocab_size
        for length in args.prompt_lengths:
            torch.manual_seed(0)
            prompts = torch.randint(4, vocab, (args.prompts, length))
            mask = torch.ones_like(prompts)
            tokens = args.prompts * args.group * args.new_tokens
            ours_rate = tokens / timed(ours, args.reps, model, prompts, mask, args)
            theirs_rate = tokens / timed(theirs, args.reps, model, prompts, mask, args)
            print(
                f"| {Path(path).name}, {length} tokens | {ours_rate:.0f} tok/s | {theirs_rate:.0f} tok/s | "
                f"{ours_rate / theirs_rate:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
