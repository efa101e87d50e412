"""GRPO (Group Relative Policy Optimization) for causal language models, in one file.

GRPO (Shao et al. 2024, https://arxiv.org/abs/2402.03300) samples `group_size` completions per prompt, scores them with
verifiable rewards, and gives each completion's tokens its reward, standardised within the group, as their advantage.
The loss is PPO's clipped surrogate plus a KL penalty to a frozen reference policy; there is no value model.

Where this file departs from the paper:
1. Clipping `-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)` for both signs of A, with DAPO's separate epsilons
   (https://arxiv.org/abs/2503.14476) and INTELLECT-2's optional bound `delta` on r (https://arxiv.org/abs/2505.07291).
2. `--loss-type` picks the aggregation; every normaliser counts the whole (mini)batch, over micro-batches and
   processes, so the update does not depend on how the batch is split.
3. `--scale-rewards batch` (the default) divides advantages by the batch's reward std instead of each group's.
4. Each prompt's completions draw from a random stream keyed by (seed, step, prompt): a resumed or multi-process
   run draws the same random numbers as one uninterrupted process.

Run it:
    python grpo.py                                    # tiny model, built-in task, CPU, about a minute
    python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --data-path gsm8k.jsonl --lora-r 16 --kl-coef 0.05 \\
        --max-new-tokens 256 --learning-rate 1e-5 --output-dir runs/qwen-gsm8k --save-every 50
    python grpo.py ... --output-dir runs/qwen-gsm8k --resume-from latest    # after a stop or a crash
    torchrun --standalone --nproc_per_node 8 grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --data-path gsm8k.jsonl
    torchrun --standalone --nproc_per_node 8 grpo.py --fsdp --model Qwen/Qwen2.5-7B-Instruct ...   # sharded
"""

import functools
import itertools
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dcp
import tyro

from common import RunLogger, print0, seed_everything


@dataclass
class Args:
    seed: int = 1  # seed of the experiment: model init, prompt order and sampling all follow from it
    output_dir: str | None = None  # metrics, checkpoints and final/ go here; None = runs/grpo__{seed}__{unix time}
    track: bool = False  # log to Weights & Biases, project grpo (WANDB_MODE=offline works)
    model: str = "tiny"  # `tiny` (a small random-init Llama built here) or a hub id / local path of a causal LM
    data_path: str | None = None  # JSONL prompts, one {"prompt": str, "answer": str} a line; None = built-in task
    eval_data_path: str | None = None  # JSONL held-out prompts; None = the built-in task's held-out ones, or none
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template, when it has one
    system_prompt: str | None = None  # a system message before every prompt (needs a chat template)
    max_prompt_length: int = 512  # a prompt longer than this many tokens is an error
    lora_r: int = 0  # LoRA rank; 0 = full fine-tuning
    lora_alpha: int = 32  # LoRA scaling numerator (the update is scaled by alpha / r)
    lora_target_modules: str = "all-linear"  # comma-separated module names to adapt (q_proj,v_proj), or all-linear
    total_steps: int = 400  # training steps, one rollout batch each
    prompts_per_step: int = 8  # prompts per step, over all processes
    group_size: int = 16  # completions sampled per prompt (the group its rewards are standardised in)
    max_new_tokens: int = 2  # maximum completion length in tokens
    temperature: float = 1.0  # sampling temperature (the training log-probs use the same)
    top_p: float = 1.0  # nucleus sampling threshold; 1.0 = off
    top_k: int = 0  # sample among the k most likely tokens; 0 = off
    mask_truncated_completions: bool = False  # leave completions cut at --max-new-tokens out of the loss (DAPO)
    answer_reward_weight: float = 1.0  # weight of the answer reward (1 when the final answer equals the reference)
    format_reward_weight: float = 0.1  # weight of the format reward (1 when the answer is stated cleanly)
    prm_path: str | None = None  # a PRM saved by prm.py: its aggregated step scores are added to the reward
    prm_aggregate: Literal["min", "prod", "last", "mean"] = "min"  # how step scores make one PRM reward
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"  # how token losses are aggregated (see grpo_loss)
    scale_rewards: Literal["group", "batch", "none"] = "batch"  # divide advantages by the group's or batch's std
    kl_coef: float = 0.02  # weight of the KL penalty to the reference policy; 0 = no reference model
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # per-token KL estimator (see kl_penalty)
    kl_ratio_weighted: bool = False  # multiply each token's KL by its ratio pi / pi_old (DeepSeek-V3.2)
    clip_eps_low: float = 0.2  # the ratio is clipped below at 1 - clip_eps_low
    clip_eps_high: float = 0.2  # the ratio is clipped above at 1 + clip_eps_high (DAPO uses 0.28)
    delta: float | None = None  # upper bound on the unclipped ratio (INTELLECT-2's two-sided clipping); None = off
    importance_sampling: Literal["token", "sequence"] = "token"  # a ratio per token, or per completion (GSPO)
    learning_rate: float = 3e-4  # AdamW learning rate (about 1e-6 for full fine-tuning of real models, 1e-5 for LoRA)
    num_iterations: int = 1  # passes over each rollout batch (PPO's epochs), ratios against the rollout policy
    num_minibatches: int = 1  # optimiser updates per pass, each on an equal share of the batch's groups
    micro_batch_size: int = 0  # completions per forward/backward pass (gradient accumulation); 0 = a whole minibatch
    max_grad_norm: float = 1.0  # clip the global gradient norm to this (0 = off)
    max_bad_steps: int = 3  # stop after this many updates in a row with a non-finite loss (each one is skipped)
    eval_every: int = 50  # greedy held-out accuracy every this many steps (0 = at the start and the end only)
    save_every: int = 0  # write checkpoint-STEP/ every this many steps (0 = only when stopped by a signal)
    resume_from: str | None = None  # a checkpoint-STEP directory, or `latest` in --output-dir, to continue from
    overwrite: bool = False  # replace a run already in --output-dir
    gradient_checkpointing: bool = False  # recompute activations in the backward pass (less memory, more compute)
    fsdp: bool = False  # shard weights, gradients and optimiser state over processes with FSDP2 (under torchrun)


# ---- Kernels: tensors in, tensors out. The tests import these.
def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """A_i = (r_i - mean(group)) / (std + eps) for rewards [B] laid out group after group, with Bessel's std (as TRL and
    verl) of the group, the batch, or none (Dr. GRPO). Equal rewards get exactly 0: they tell nothing apart."""
    grouped = rewards.double().view(-1, group_size)  # [groups, G]; float64: squares of large rewards overflow fp32
    centred = grouped - grouped.mean(1, keepdim=True)
    if scale != "none":
        centred = centred / ({"group": grouped.std(1, keepdim=True), "batch": grouped.std()}[scale] + eps)
    # the float mean of equal values can differ from them in the last bit, which /(std + eps) would blow up
    equal = grouped.amax(1, keepdim=True) == grouped.amin(1, keepdim=True)
    return torch.where(equal, 0.0, centred).view(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || pi_ref) from tokens of pi, x = ref_logp - logp (http://joschu.net/blog/kl-approx.html):
    k1 = -x, k2 = x^2/2, k3 = e^x - x - 1; as losses, k3's gradient is KL(pi_ref || pi)'s, k2's KL(pi || pi_ref)'s."""
    x = ref_logp - logp
    return {"k1": -x, "k2": 0.5 * x**2, "k3": torch.expm1(x) - x}[estimator]  # expm1: exact near 0


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    kl_coef: float = 0.0,
    loss_type: str = "grpo",
    max_completion_length: int | None = None,
    delta: float | None = None,
    importance_sampling: str = "token",
    kl_estimator: str = "k3",
    kl_ratio_weighted: bool = False,
    total_sequences: int | None = None,
    total_tokens: float | None = None,
) -> tuple[torch.Tensor, dict]:
    """Clipped GRPO surrogate plus a KL penalty. logp, old_logp, ref_logp, mask [B, T] (1 on completion tokens, EOS
    included); advantages [B]. Per token l = -min(min(r, delta) A, clip(r, 1-eps_low, 1+eps_high) A) + kl_coef KL,
    r = exp(logp - old_logp) (GSPO: exp(mean_t log r) for a whole row), KL times r with kl_ratio_weighted.
    With N sequences and M tokens in the whole batch: grpo (1/N) sum_i [sum_t l m / sum_t m]; bnpo, dapo
    sum l m / M; dr_grpo sum l m / (N max_completion_length). Given the batch's N and M (total_sequences,
    total_tokens), a part's losses (a micro-batch, a process's share) sum to the batch's. stats: token means over this
    part of ratio, clip fractions (low: A<0, r < 1-eps_low; high: A>0, r > 1+eps_high or A<0, r > delta), pg_loss, KL.
    """
    dtype = torch.promote_types(logp.dtype, torch.float32)  # a bf16 mask would count 501 tokens as 500
    logp, old_logp, advantages, mask = logp.to(dtype), old_logp.to(dtype), advantages.to(dtype), mask.to(dtype)
    num_sequences = total_sequences if total_sequences is not None else logp.shape[0]
    num_tokens = total_tokens if total_tokens is not None else mask.sum().item()
    adv, in_loss = advantages.unsqueeze(1), mask.bool()  # [B, 1], [B, T]
    log_ratio = torch.where(in_loss, logp - old_logp, 0.0)  # padding may hold anything: exp(inf) * 0 would be NaN
    token_ratio = log_ratio.exp()
    sequence_ratio = (log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)).exp().expand_as(logp)
    ratio = {"token": token_ratio, "sequence": sequence_ratio}[importance_sampling]
    unclipped = ratio if delta is None else ratio.clamp(max=delta)
    pg_loss = -torch.min(unclipped * adv, ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv)  # [B, T]
    token_loss, kl = pg_loss, None
    if kl_coef != 0.0:
        kl = kl_penalty(torch.where(in_loss, logp, 0.0), torch.where(in_loss, ref_logp.to(dtype), 0.0), kl_estimator)
        kl = token_ratio * kl if kl_ratio_weighted else kl  # tokens come from pi_old: pi / pi_old weighs them to pi
        token_loss = pg_loss + kl_coef * kl
    per_row = (token_loss * mask).sum(1)  # [B]
    if loss_type == "grpo":
        loss = (per_row / mask.sum(1).clamp(min=1.0)).sum() / num_sequences
    elif loss_type == "dr_grpo":
        loss = per_row.sum() / (num_sequences * max_completion_length)
    elif loss_type in ("bnpo", "dapo"):
        loss = per_row.sum() / max(num_tokens, 1.0)
    else:
        raise ValueError(f"loss_type must be grpo, bnpo, dr_grpo or dapo, got {loss_type!r}")
    with torch.no_grad():
        tokens = mask.sum()
        high = ((adv > 0) & (ratio > 1.0 + clip_eps_high)) | ((adv < 0) & (ratio > (delta or math.inf)))
        per_token = {
            "ratio_mean": ratio,
            "clip_frac_low": ((adv < 0) & (ratio < 1.0 - clip_eps_low)).to(dtype),
            "clip_frac_high": high.to(dtype),
            "pg_loss": pg_loss,
        }
        if kl is not None:
            per_token["kl_mean"] = kl
        stats = {name: (value * mask).sum() / tokens.clamp(min=1.0) for name, value in per_token.items()}
    return loss, {**stats, "tokens": tokens}


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    rows_per_chunk: int = 16,
    vocab_size: int | None = None,
):
    """log softmax(logits / T)[target] in fp32 of logits [B, T, V], a few rows at a time (without gradients only a
    chunk is in fp32), over the first vocab_size ids (those the sampler draws): logp [B, T], entropy [B, T] or None."""
    logps, entropies = [], []
    for start in range(0, logits.shape[0], rows_per_chunk):
        chunk = logits[start : start + rows_per_chunk, :, :vocab_size].float()
        chunk = torch.log_softmax(chunk / temperature if temperature != 1.0 else chunk, dim=-1)
        logps.append(chunk.gather(-1, targets[start : start + rows_per_chunk].unsqueeze(-1)).squeeze(-1))
        if with_entropy:
            with torch.no_grad():
                entropies.append(torch.special.entr(chunk.exp()).sum(-1))  # entr(0) = 0, where p log p is NaN
    return torch.cat(logps), (torch.cat(entropies) if with_entropy else None)


# ---- Task, data and rewards
TINY_CHARS = list("0123456789+-*/%()= ")
TINY_SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


class UserError(Exception):
    """A mistake in the user's input or flags: one line on stderr, exit code 2."""


def builtin_task(seed: int) -> tuple[list[dict], list[dict]]:
    """The last digit of N + 7, "(358+7)%10=" -> "5": 700 N to train on, 200 never trained on to evaluate."""
    rows = [{"prompt": f"({n}+7)%10=", "answer": str((n + 7) % 10)} for n in range(100, 1000)]
    random.Random(seed).shuffle(rows)
    return rows[200:], rows[:200]


def load_jsonl(path: str) -> list[dict]:
    """Rows {"prompt": str, "answer": str or number}; a row that is not one is an error naming its line."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read data file {path}: {getattr(error, 'strerror', None) or error}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{path}:{number}: not JSON ({error.msg})") from None
        if not (
            isinstance(row, dict)
            and isinstance(row.get("prompt"), str)
            and isinstance(row.get("answer"), (str, int, float))
        ):
            hint = ' (it has "question": rename it to "prompt")' if isinstance(row, dict) and "question" in row else ""
            raise UserError(f'{path}:{number}: a row needs a string "prompt" and a string or number "answer"{hint}')
        rows.append({"prompt": row["prompt"], "answer": str(row["answer"]), "where": f"{path}:{number}"})
    if not rows:
        raise UserError(f"{path} holds no rows")
    return rows


# Answers: numbers are compared exactly as fractions by the code below, anything else by Math-Verify (TRL's checker).
MARKED = re.compile(r"####[ \t]*([^\sA-Za-z#*][^\n]*)")  # GSM8K's "#### 72", not a heading ("#### Step 2")
ANSWER_IS = re.compile(r"answer(?:\s+is\b|\s*:)[\s:]*", re.IGNORECASE)
BOXED = re.compile(r"\\boxed\s*\{((?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*)\}")  # braces nested twice at most
# a number that is no part of an expression (not the 2 of x^2, x_2, \pi/2, 2x, \sqrt{2}) nor of a scale (5 million)
NUMBER = re.compile(
    r"(?<![\w.^_/{])-?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:/\d+)?"
    r"(?![\w^\\]|\s+(?:hundred|thousand|[mbr]illion))"
)
# what only decorates a number: $18, 28\%, 90^\circ, 5\text{ cm}, \(5\); and a unit word after it, 18 dollars
NOISE = re.compile(r"\\?[$%]|\\[!,()[\]]|\^\s*\{?\\circ\}?|°|\\(?:text|mbox)\s*\{[^{}]*\}")
UNIT = re.compile(r"(?<=\d)(?:\s+(?!(?:hundred|thousand|[mbr]illion)\b)[A-Za-z]{2,}(?:\^[23]|[²³])?)+$")
# \frac{3}{4} and \dfrac34 as 3/4, but not after a digit: 2\frac{1}{2} is a mixed number, for Math-Verify
FRACTION = re.compile(r"(?<![\d.])\\[cdt]?frac\s*(?:\{\s*(-?\d+)\s*\}|(\d))\s*(?:\{\s*(\d+)\s*\}|(\d))")
# sympy takes seconds, or forever, on power towers and huge powers or factorials: refused before Math-Verify
PATHOLOGICAL = re.compile(r"\^\s*(?:\{[^{}]*|\([^()]*|\d+\s*)\^|\^\s*[{(]?\s*\d{5,}|\d{5,}\s*!")


def final_answer(text: str, numeric: bool = True, joined: bool = False) -> str | None:
    """The `####` line, else the \\boxed{}, else what the last "answer is" says (or the text): its last number, or the
    last $...$ for a symbolic answer. None for no answer, an unclosed box, or several (a hedge) unless joined."""
    marked = {line.strip(" .*$") for line in MARKED.findall(text)}
    if len(marked) > 1:
        return None
    if marked and "\\boxed" not in (text := marked.pop()):  # a #### line with a box: only it is parsed
        return text
    found = BOXED.findall(text)
    contents = list(dict.fromkeys(content.strip(" .$") for content in found))
    if len(found) < len(re.findall(r"\\boxed\s*\{", text)) or (len(contents) > 1 and not joined):
        return None  # a box left open (cut at the token limit), or a hedge
    if contents:
        return ", ".join(contents)
    said = list(ANSWER_IS.finditer(text))
    tail = text[said[-1].end() :].split("\n", 1)[0].split(". ")[0] if said else text
    if not numeric:  # the last $...$ of the last sentence: not one before a cut-off
        last = re.split(r"(?<=[.!?])\s+(?=[A-Z])|\n\s*\n", tail.strip())[-1]
        return ([""] + re.findall(r"\$+([^$]+)\$", last))[-1].strip(" .$") or last.strip(" .$") or None
    numbers = NUMBER.findall(normalise(tail))
    return numbers[-1] if numbers else None


def normalise(text: str) -> str:
    text = NOISE.sub("", text.replace("{,}", ",").replace("\u2212", "-"))
    return FRACTION.sub(lambda m: f"{m[1] or m[2]}/{m[3] or m[4]}", text)


def parse_number(text: str) -> Fraction | None:
    """'1,234' -> 1234, '$7.50' -> 15/2, '\\frac{3}{4}' -> 3/4, '18 dollars' -> 18; None for what is not a number."""
    match = NUMBER.fullmatch(UNIT.sub("", normalise(text).strip()))
    try:
        return Fraction(match[0].replace(",", "")) if match else None
    except ZeroDivisionError:
        return None


@functools.lru_cache(maxsize=4096)  # a group's completions often state the same answer
def symbolic_equal(stated: str, reference: str) -> bool:
    """Math-Verify's verdict with its timeouts off: they arm SIGALRM, which fails in threads and cancels others."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise UserError("symbolic answers are checked by Math-Verify: pip install math-verify") from None
    return verify(*(parse(f"${text}$", parsing_timeout=None) for text in (reference, stated)), timeout_seconds=None)


def answer_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer equals the reference's: exactly when both are numbers, else by
    Math-Verify. A reference with `####` or \\boxed{} is a worked solution (GSM8K, MATH): its final answer counts."""
    reference = final_answer(answer, joined=True) if "####" in answer or "\\boxed" in answer else answer.strip(" .$")
    stated = final_answer(completion, numeric=parse_number(reference) is not None) if reference else None
    if not stated or len(stated) > 200 or PATHOLOGICAL.search(stated):
        return 0.0
    values = parse_number(stated), parse_number(reference)
    return float(values[0] == values[1] if None not in values else symbolic_equal(stated, reference))


def format_reward(completion: str, answer: str) -> float:
    """1.0 for a bare canonical number (not "05"), or a text that ends with `#### n` or a non-empty \\boxed{...}."""
    text = completion.strip()
    end = text.removesuffix(".").rstrip().rstrip("$").removesuffix("\\]").removesuffix("\\)").rstrip()
    boxed = (last := re.search(BOXED.pattern + "$", end)) is not None and last[1].strip() != ""
    return float(
        bool(
            re.fullmatch(r"-?(?:0|[1-9]\d*)(?:\.\d+)?", text)
            or boxed
            or re.search(r"####[ \t]*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?$", end)
        )
    )


def compute_rewards(prompts: list[str], completions: list[str], answers: list[str], reward_fns: list) -> dict:
    """{name: [B] tensor} of fn(completion, answer) per sample; one that raises or is not finite names the sample."""
    values = {}
    for name, fn, _ in reward_fns:
        if name == "prm":  # one call for the batch; its scores are probabilities
            values[name] = fn(prompts, completions)
            continue
        values[name] = []
        for completion, answer in zip(completions, answers):
            try:
                value = float(fn(completion, answer))
            except Exception as error:
                raise UserError(f"reward {name} raised {error!r} on completion {completion[:200]!r}") from error
            if not math.isfinite(value):
                raise UserError(f"reward {name} is {value} on completion {completion[:200]!r}, answer {answer!r}")
            values[name].append(value)
    return {name: torch.tensor(scores, dtype=torch.float32) for name, scores in values.items()}


def make_reward_fns(args: Args, device) -> list[tuple]:
    """(name, function, weight) of each reward in use. A reward of your own: append its triple here."""
    fns = [("answer", answer_reward, args.answer_reward_weight), ("format", format_reward, args.format_reward_weight)]
    if args.prm_path is not None:
        import prm  # prm.py, beside this file

        scorer = prm.load_prm(args.prm_path, device=device)

        def prm_reward(prompts: list[str], completions: list[str]) -> list[float]:
            steps = [[s for s in text.split(scorer.config["step_separator"]) if s.strip()] for text in completions]
            # steps past the PRM's max length get no score and count as 0: else the policy could write on unjudged
            return [
                prm.aggregate_scores([*scores, *[0.0] * (len(row) - len(scores))], args.prm_aggregate)
                for scores, row in zip(prm.score_steps(scorer, prompts, steps), steps)
            ]

        fns.append(("prm", prm_reward, 1.0))
    return fns


# ---- Model, rollout and log-probs
def load_model(name: str, dtype: torch.dtype, seed: int):
    """(model, tokenizer), dropout off, from a hub id, a path, or `tiny`: a seeded 2-layer Llama on characters."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if name.startswith(("/", ".", "~")) and not os.path.exists(os.path.expanduser(name)):
        raise UserError(f"--model {name} does not exist")
    torch.manual_seed(seed)
    if name == "tiny":
        vocab = {token: i for i, token in enumerate(TINY_SPECIALS + TINY_CHARS)}
        core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: a token per character
        core.add_special_tokens(TINY_SPECIALS)
        core.decoder = decoders.Fuse()
        core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=core,
            pad_token="<pad>",
            bos_token="<bos>",
            eos_token="<eos>",
            unk_token="<unk>",
            model_max_length=1024,
        )
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=512,
                max_position_embeddings=256,
                tie_word_embeddings=True,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            )
        )
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        except (OSError, ValueError) as error:
            raise UserError(f"could not load --model {name}: {str(error).strip().splitlines()[0]}") from None
    for weight in model.parameters():  # not model.to(dtype), which would round the rotary frequencies too
        weight.data = weight.data.to(dtype)
    for module in model.modules():  # dropout would make the trainer's log-probs differ from the sampler's
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    return model, tokenizer


def build_policy(args: Args, dtype: torch.dtype, resume_path: str | None, device: torch.device):
    """(policy, tokenizer, reference, stop ids) on the device; the reference, a frozen copy of the policy, is None for
    LoRA (the adapter disabled is the initial policy) and at --kl-coef 0."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()  # its bars for loading and saving weights would break into the log's lines
    # trained weights stay fp32 (bf16 would round small updates away) and compute under autocast; LoRA's base in dtype
    weights = dtype if args.lora_r and not args.fsdp else torch.float32
    model, tokenizer = load_model(resume_path if resume_path and not args.lora_r else args.model, weights, args.seed)
    targets = args.lora_target_modules
    if args.lora_r:
        model = (
            PeftModel.from_pretrained(model, resume_path, is_trainable=True)
            if resume_path
            else get_peft_model(
                model,
                LoraConfig(
                    r=args.lora_r,
                    lora_alpha=args.lora_alpha,
                    task_type="CAUSAL_LM",
                    lora_dropout=0.0,
                    target_modules=targets if targets == "all-linear" else targets.split(","),
                ),
            )
        )
    reference = load_model(args.model, weights, args.seed)[0].eval() if args.kl_coef and not args.lora_r else None
    for module in [m for m in (model, reference) if m is not None]:
        if args.fsdp:
            shard_model(module, device, dtype)
        else:
            module.to(device)
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    configured = model.generation_config.eos_token_id  # chat models end a turn with any of several
    stop_ids = {tokenizer.eos_token_id, *([configured] if isinstance(configured, int) else configured or [])}
    return model.train(), tokenizer, reference, sorted(stop_ids)


def shard_model(model, device: torch.device, compute_dtype: torch.dtype) -> None:
    """FSDP2: each transformer block's fp32 weights are gathered for its forward and freed after; gradients summed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    blocks = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or []}
    for module in [m for m in model.modules() if type(m).__name__ in blocks] + [model]:
        fully_shard(module, mesh=mesh, mp_policy=policy)
    for module in [m for m in model.modules() if isinstance(m, FSDPModule)]:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no pre-scaled one


def encode_prompts(tokenizer, rows: list[dict], args: Args) -> list[list[int]]:
    """Token ids of each row's prompt, in the chat template (after the system message) when the tokenizer has one."""
    if args.chat_template and tokenizer.chat_template:
        system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
        encoded = [
            tokenizer.apply_chat_template(
                system + [{"role": "user", "content": row["prompt"]}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
            for row in rows
        ]
    elif args.system_prompt is not None:
        raise UserError("--system-prompt needs a chat template, and this tokenizer has none (or it is off)")
    else:
        encoded = tokenizer([row["prompt"] for row in rows])["input_ids"] if rows else []
    for row, ids in zip(rows, encoded):
        if len(ids) > args.max_prompt_length:
            raise UserError(
                f"{row.get('where', 'a built-in prompt')}: the prompt is {len(ids)} tokens, longer than "
                f"--max-prompt-length {args.max_prompt_length}"
            )
    return encoded


def left_pad(sequences: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] ids and attention mask, left-padded so that every prompt ends in the last column."""
    width = max(map(len, sequences))
    ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in sequences], device=device)
    return ids, torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], device=device)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [B, V] (divided by T) with those outside the top k and the top-p nucleus set to -inf."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        remove = probs.cumsum(-1) - probs >= top_p  # the smallest set that reaches top_p stays, the top token always
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return logits


@torch.no_grad()
def generate(
    model,
    prompt_ids,
    prompt_mask,
    *,
    max_new_tokens: int,
    eos_ids,
    pad_id: int,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    generators: list | None = None,
    group_size: int = 1,
    stop_together=False,
    vocab_size: int | None = None,
):
    """Complete left-padded prompts [B, P], each group_size copies of a prompt encoded once, with a KV cache: greedily,
    or argmax(filtered logits / T + Gumbel noise from each group's generator). stop_together: until every process is
    done (FSDP's forwards are collectives). ids [B, T], mask [B, T] (to EOS, included), log-probs under softmax(l/T)."""
    from transformers import DynamicCache

    batch, cache, unique = prompt_ids.shape[0], DynamicCache(), slice(None, None, group_size)  # a row per group
    eos_ids = torch.tensor(eos_ids, device=prompt_ids.device).reshape(-1)
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens count from 0
    logits = model(
        input_ids=prompt_ids[unique],
        attention_mask=prompt_mask[unique],
        position_ids=positions[unique],
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1, :vocab_size]  # [B/G, V]
    cache.batch_repeat_interleave(group_size)
    logits, attention_mask = logits.repeat_interleave(group_size, dim=0), prompt_mask  # [B, V]
    finished = torch.zeros(batch, dtype=torch.bool, device=prompt_ids.device)
    tokens, logps = [], []
    for step in range(max_new_tokens):
        scaled = logits.float() / (1.0 if generators is None else temperature)
        if generators is None:
            token = scaled.argmax(-1)
        else:
            uniform = torch.cat(
                [
                    torch.rand(batch // len(generators), scaled.shape[-1], generator=g, device=scaled.device)
                    for g in generators
                ]
            )  # [B, V]
            token = (filter_logits(scaled, top_k, top_p) - torch.log(-torch.log(uniform))).argmax(-1)  # Gumbel-max
        token = torch.where(finished, pad_id, token)
        tokens.append(token)
        logps.append(torch.log_softmax(scaled, -1).gather(-1, token.unsqueeze(-1)).squeeze(-1))
        finished |= torch.isin(token, eos_ids)
        done = finished.all().float()
        if stop_together:
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done or step == max_new_tokens - 1:  # the last token is never fed back
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
        logits = model(
            input_ids=token.unsqueeze(-1),
            attention_mask=attention_mask,
            cache=cache,
            use_cache=True,
            position_ids=positions[:, -1:] + step + 1,
        ).logits[:, -1, :vocab_size]
    completion_ids = torch.stack(tokens, 1)  # [B, T]
    is_eos = torch.isin(completion_ids, eos_ids)
    completion_mask = (is_eos.cumsum(1) - is_eos.long() == 0).long()  # no EOS before this position
    return completion_ids, completion_mask, torch.stack(logps, 1)


def completion_logprobs(
    model,
    prompt_ids,
    prompt_mask,
    completion_ids,
    completion_mask,
    temperature,
    with_entropy=False,
    prompt_of_row: list[int] | None = None,
    vocab_size: int | None = None,
):
    """Log-probs [B, T] (and entropies or None) of the completion tokens. prompt_of_row: each row's prompt, numbered
    from 0 as they appear; each prompt is then encoded once, its keys and values copied to its rows' completions."""
    from transformers import DynamicCache

    length = completion_ids.shape[1]
    attention_mask = torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1)  # [B, P+T-1]
    if prompt_of_row is None:
        logits = model(
            input_ids=torch.cat([prompt_ids, completion_ids[:, :-1]], dim=1),
            attention_mask=attention_mask,
            position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=False,
            logits_to_keep=length,
        ).logits  # [B, T, V]
        return token_logprobs(logits, completion_ids, temperature, with_entropy, vocab_size=vocab_size)
    first = [prompt_of_row.index(p) for p in range(max(prompt_of_row) + 1)]
    owner, cache = torch.tensor(prompt_of_row, device=prompt_ids.device), DynamicCache()
    logits = model(
        input_ids=prompt_ids[first],
        attention_mask=prompt_mask[first],
        cache=cache,
        use_cache=True,
        position_ids=(prompt_mask[first].cumsum(-1) - 1).clamp(min=0),
        logits_to_keep=1,
    ).logits[owner]  # [B, 1, V]: the prompt's last position predicts token 0
    if length > 1:
        cache.batch_select_indices(owner)  # [U, heads, P, d] -> [B, heads, P, d] in every layer; gradients flow back
        positions = prompt_mask.sum(1, keepdim=True) + torch.arange(length - 1, device=prompt_ids.device)
        logits = torch.cat(
            [
                logits,
                model(
                    input_ids=completion_ids[:, :-1],
                    attention_mask=attention_mask,
                    cache=cache,
                    position_ids=positions,
                    use_cache=True,
                ).logits,
            ],
            dim=1,
        )  # [B, T, V]
    return token_logprobs(logits, completion_ids, temperature, with_entropy, vocab_size=vocab_size)


def decode_completions(tokenizer, completion_ids, completion_mask, eos_ids: list[int]) -> list[str]:
    """Each completion's text before the EOS that ended it, other special tokens kept (no hiding junk in them)."""
    lengths = completion_mask.sum(1) - torch.isin(completion_ids, torch.tensor(eos_ids)).any(1).long()
    return tokenizer.batch_decode([ids[:n] for ids, n in zip(completion_ids.tolist(), lengths.tolist())])


SHARE_MIN_POSITIONS = 128  # prompt positions a micro-batch must skip to encode each prompt once (2.5x, long prompts)


def micro_batches(
    rows: range, size: int, group_size: int, prompt_lengths: list[int], completion_lengths: list[int], share: bool
) -> list[tuple]:
    """(rows, prompt columns, completion columns, prompt_of_row) per micro-batch, cut to its longest rows."""
    plans = []
    for part in (range(start, min(start + size, rows.stop)) for start in range(rows.start, rows.stop, size)):
        prompts = [row // group_size - part[0] // group_size for row in part]
        prompt_width = max(prompt_lengths[row // group_size] for row in part)
        shared = share and (len(part) - len(set(prompts))) * prompt_width >= SHARE_MIN_POSITIONS
        completion_width = max(completion_lengths[row] for row in part)
        plans.append(
            (
                slice(part.start, part.stop),
                slice(-prompt_width, None),
                slice(0, completion_width),
                prompts if shared else None,
            )
        )
    return plans


# ---- Processes, checkpoints and flag checks
# dense bf16 TFLOP/s by GPU name, for MFU (the more specific names first)
PEAK_TFLOPS = {
    "H100 PCIe": 756,
    "H100": 989,
    "H200": 989,
    "B200": 2250,
    "A100": 312,
    "L40S": 362,
    "L4": 121,
    "A10G": 70,
    "4090": 165,
}
PHASES = ("generation", "reward", "reference", "update")  # of a step, timed apart
CONSOLE = {
    "reward": "reward",
    "accuracy": "acc",
    "kl_mean": "kl",
    "clip_frac_low": "clip_lo",
    "clip_frac_high": "clip_hi",
    "completion_length": "len",
    "eval_accuracy": "eval_acc",
    "step_time_s": "dt",
}
# what a checkpoint must share with the run that resumes from it
RUN_DEFINING = (
    "model",
    "data_path",
    "lora_r",
    "lora_alpha",
    "lora_target_modules",
    "chat_template",
    "system_prompt",
    "prompts_per_step",
    "group_size",
    "loss_type",
    "kl_coef",
    "learning_rate",
    "num_iterations",
    "num_minibatches",
    "seed",
)


def all_sum(values: dict, device) -> dict:
    """A dict of numbers summed over processes, in one all-reduce."""
    summed = torch.stack([torch.as_tensor(value, dtype=torch.float64, device=device) for value in values.values()])
    if dist.is_initialized():
        dist.all_reduce(summed)
    return dict(zip(values, summed.tolist()))


def save_run(path: str, model, tokenizer, args: Args, optimizer=None, state: dict | None = None) -> None:
    """Model or adapter, tokenizer, args and, given a state, trainer_state.pt, written to path.tmp then renamed (a kill
    leaves no half checkpoint). Every process calls it, for FSDP to gather the shards; rank 0 writes."""
    options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, from FSDP's shards too
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - set(dict(model.named_parameters()))
    weights = {k: v for k, v in dcp.get_model_state_dict(model, options=options).items() if k not in tied}
    optimizer_state = dcp.get_optimizer_state_dict(model, optimizer, options=options) if optimizer else None
    if int(os.environ.get("RANK", 0)) != 0:
        return
    shutil.rmtree(path + ".tmp", ignore_errors=True)
    model.save_pretrained(path + ".tmp", state_dict=weights)
    tokenizer.save_pretrained(path + ".tmp")
    with open(os.path.join(path + ".tmp", "args.json"), "w") as f:
        json.dump(asdict(args), f, indent=2)
    if state is not None:
        torch.save({**state, "optimizer": optimizer_state}, os.path.join(path + ".tmp", "trainer_state.pt"))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(path + ".tmp", path)


def prepare_output_dir(args: Args, device) -> tuple[str, str | None]:
    """(output directory, checkpoint to resume from or None), the checkpoint's run-defining flags checked."""
    stamp = torch.tensor([time.time()], dtype=torch.float64, device=device)
    if dist.is_initialized():  # rank 0's clock: one run name everywhere
        dist.broadcast(stamp, src=0)
    resume = args.resume_from
    output_dir = args.output_dir or (
        os.path.dirname(os.path.abspath(resume))
        if resume not in (None, "latest")
        else os.path.join("runs", f"grpo__{args.seed}__{int(stamp.item())}")
    )
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    steps = sorted(int(name[11:]) for name in names if re.fullmatch(r"checkpoint-\d+", name))
    resume = os.path.join(output_dir, f"checkpoint-{(steps or [0])[-1]}") if resume == "latest" else resume
    if resume is not None:
        if not os.path.isfile(os.path.join(resume, "trainer_state.pt")):
            raise UserError(f"--resume-from {args.resume_from}: no checkpoint of grpo.py at {resume}")
        saved = json.loads(open(os.path.join(resume, "args.json")).read())
        differ = [
            f"--{key.replace('_', '-')} {saved[key]!r} there, {getattr(args, key)!r} here"
            for key in RUN_DEFINING
            if saved[key] != getattr(args, key)
        ]
        if differ:
            raise UserError(f"--resume-from {resume}: the checkpoint's run differs ({'; '.join(differ)})")
    elif "metrics.jsonl" in names or steps:
        if not args.overwrite:
            raise UserError(
                f"{output_dir} already holds a run: pass --resume-from latest to continue it, "
                "--overwrite to replace it, or another --output-dir"
            )
        for name in ["final", *[f"checkpoint-{step}" for step in steps]]:
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    return output_dir, resume


def restore(path: str, output_dir: str, model, optimizer, args: Args) -> tuple[int, float, int]:
    """The optimiser state of a checkpoint, metrics.jsonl cut back to its step; (step, first eval, skipped updates)."""
    state = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=True)
    dcp.set_optimizer_state_dict(
        model, optimizer, state["optimizer"], options=dcp.StateDictOptions(full_state_dict=args.fsdp)
    )  # each shard its part
    torch.set_rng_state(state["rng"])
    metrics_path = os.path.join(output_dir, "metrics.jsonl")
    if int(os.environ.get("RANK", 0)) == 0 and os.path.isfile(metrics_path):  # later rows: of a run being redone
        kept = [line for line in open(metrics_path) if json.loads(line)["step"] <= state["step"]]
        open(metrics_path, "w").writelines(kept)
    return state["step"], state["eval_accuracy_start"], state["skipped"]


def check_args(args: Args, world_size: int) -> None:
    """The flag values users get wrong, before anything is loaded."""
    local_rows = args.prompts_per_step // world_size * args.group_size // args.num_minibatches
    problems = {
        "--group-size must be at least 2: advantages compare the completions of a prompt": args.group_size < 2,
        "--clip-eps-low/high must be in (0, 1)": not 0 < args.clip_eps_low < 1 or not 0 < args.clip_eps_high < 1,
        "--learning-rate and --temperature must be above 0": args.learning_rate <= 0 or args.temperature <= 0,
        "--top-p must be in (0, 1]": not 0 < args.top_p <= 1,
        f"--prompts-per-step {args.prompts_per_step} must be divisible by the {world_size} processes times "
        f"--num-minibatches {args.num_minibatches}": args.prompts_per_step % (world_size * args.num_minibatches),
        f"--micro-batch-size {args.micro_batch_size} must divide the {local_rows} completions of a process's "
        "minibatch": args.micro_batch_size < 0 or (args.micro_batch_size > 0 and local_rows % args.micro_batch_size),
        "--fsdp needs a launch by torchrun": args.fsdp and "WORLD_SIZE" not in os.environ,
    }
    for message, wrong in problems.items():
        if wrong:
            raise UserError(message)


def train(args: Args) -> dict:
    # ---- 1. processes, device, output directory
    world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    cuda, is_main, distributed = torch.cuda.is_available(), rank == 0, world_size > 1 or args.fsdp
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    check_args(args, world_size)
    if cuda:
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    dtype = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported(including_emulation=False) else torch.float32
    amp = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    output_dir, resume_path = prepare_output_dir(args, device)

    # ---- 2. data, model, reference policy, optimiser
    train_rows, eval_rows = builtin_task(args.seed) if args.data_path is None else (load_jsonl(args.data_path), [])
    eval_rows = load_jsonl(args.eval_data_path) if args.eval_data_path else eval_rows
    seed_everything(args.seed)
    model, tokenizer, reference, eos_ids = build_policy(args, dtype, resume_path, device)
    vocab_size = max(len(tokenizer), max(eos_ids) + 1)  # sample the tokenizer's ids, not padded embedding rows
    train_prompts, eval_prompts = (encode_prompts(tokenizer, rows, args) for rows in (train_rows, eval_rows))
    reward_fns = make_reward_fns(args, device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
    start_step, eval_accuracy, skipped_updates, bad_updates = 0, float("nan"), 0, 0
    if resume_path:
        start_step, eval_accuracy, skipped_updates = restore(resume_path, output_dir, model, optimizer, args)

    # ---- 3. logging; the batch layout: a process holds whole groups, its minibatches are runs of them
    logger = RunLogger(
        output_dir,
        asdict(args),
        console_keys=CONSOLE,
        track=args.track,
        wandb_project="grpo",
        run_name=os.path.basename(output_dir),
        enabled=is_main,
        append=resume_path is not None,
    )
    n_params = sum(p.numel() for p in model.parameters())
    print0(
        f"model {args.model}: {n_params:,} parameters ({sum(p.numel() for p in trainable):,} trained), {dtype}, "
        f"{world_size} process(es); {len(train_rows)} training prompts, {len(eval_rows)} held out",
        enabled=is_main,
    )
    local_rows = args.prompts_per_step // world_size * args.group_size
    minibatch_rows = local_rows // args.num_minibatches
    minibatches = [range(j * minibatch_rows, (j + 1) * minibatch_rows) for j in range(args.num_minibatches)]
    share_prompts = not (args.gradient_checkpointing or args.fsdp)  # both need one forward pass per micro-batch
    peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in torch.cuda.get_device_name()), 0) if cuda else 0

    @torch.no_grad()
    def evaluate() -> float:  # greedy accuracy on the held-out prompts; every process evaluates them all
        correct = 0.0
        for start in range(0, len(eval_rows), local_rows):
            ids, mask = left_pad(eval_prompts[start : start + local_rows], tokenizer.pad_token_id, device)
            with amp():
                completion_ids, completion_mask, _ = generate(
                    model.eval(),
                    ids,
                    mask,
                    max_new_tokens=args.max_new_tokens,
                    eos_ids=eos_ids,
                    vocab_size=vocab_size,
                    pad_id=tokenizer.pad_token_id,
                    stop_together=args.fsdp,
                )
            texts = decode_completions(tokenizer, completion_ids.cpu(), completion_mask.cpu(), eos_ids)
            correct += sum(answer_reward(text, row["answer"]) for text, row in zip(texts, eval_rows[start:]))
        return correct / len(eval_rows) if eval_rows else float("nan")

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    if not resume_path and eval_rows:
        eval_accuracy = evaluate()
        logger.log(0, {"eval_accuracy": eval_accuracy})
    eval_accuracy_start, stop_signals, history, run_start, stopped = eval_accuracy, [], [], time.perf_counter(), False
    handlers = {
        sig: signal.signal(sig, lambda sig, frame: stop_signals.append(sig)) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        for step in range(start_step, args.total_steps):
            t_start = clock()
            # 1. rollout: this process's prompts r, r + W, r + 2W ... of the step's, each group_size times
            indices = list(range(rank, args.prompts_per_step, world_size))
            positions, n = [step * args.prompts_per_step + i for i in indices], len(train_rows)
            order = {e: np.random.default_rng([args.seed, e]).permutation(n) for e in {p // n for p in positions}}
            chosen = [int(order[p // n][p % n]) for p in positions]  # epoch e's order is seeded by (seed, e)
            generators = [
                torch.Generator(device).manual_seed(
                    int(np.random.SeedSequence([args.seed, step, i]).generate_state(1)[0])
                )
                for i in indices
            ]
            prompt_ids, prompt_mask = left_pad(
                [train_prompts[i] for i in chosen for _ in range(args.group_size)], tokenizer.pad_token_id, device
            )  # [B, P]
            with amp():
                completion_ids, completion_mask, sampler_logp = generate(
                    model.eval(),
                    prompt_ids,
                    prompt_mask,
                    max_new_tokens=args.max_new_tokens,
                    eos_ids=eos_ids,
                    pad_id=tokenizer.pad_token_id,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    top_k=args.top_k,
                    generators=generators,
                    group_size=args.group_size,
                    stop_together=args.fsdp,
                    vocab_size=vocab_size,
                )
            model.train()
            t_generated = clock()

            # 2. rewards, on the text before EOS
            completions = decode_completions(tokenizer, completion_ids.cpu(), completion_mask.cpu(), eos_ids)
            rows = [train_rows[i] for i in chosen for _ in range(args.group_size)]
            rewards = compute_rewards([r["prompt"] for r in rows], completions, [r["answer"] for r in rows], reward_fns)
            total = sum(weight * rewards[name] for name, _, weight in reward_fns)
            t_rewarded = clock()

            # 3. advantages, over every process's groups (the batch's std needs them all)
            scores = torch.stack([total, *rewards.values()]).to(device)  # [1 + R, B], R[0] the answer reward
            if distributed:
                parts = [torch.empty_like(scores) for _ in range(world_size)]
                dist.all_gather(parts, scores)
                scores = torch.cat(parts, 1)  # [1 + R, W*B], rank after rank
            all_advantages = group_advantages(scores[0], args.group_size, args.scale_rewards)
            advantages = all_advantages[rank * local_rows : (rank + 1) * local_rows]  # [B]
            truncated = ~torch.isin(completion_ids, torch.tensor(eos_ids, device=device)).any(1)  # [B]
            loss_mask = completion_mask * ~truncated[:, None] if args.mask_truncated_completions else completion_mask

            # 4. reference and old log-probs, no grad: minibatch 0's old ones are copied from its first training
            # forward (ratio 1); minibatches 1+ are scored here, before any update moves the policy
            plans = [
                micro_batches(
                    rows_j,
                    args.micro_batch_size or minibatch_rows,
                    args.group_size,
                    [len(train_prompts[i]) for i in chosen],
                    completion_mask.sum(1).tolist(),
                    share_prompts,
                )
                for rows_j in minibatches
            ]
            ref_logp, old_logp = torch.zeros_like(sampler_logp), torch.zeros_like(sampler_logp)

            def logprobs(policy, rows_mb, p_cols, c_cols, prompt_of_row, with_entropy=False):
                with amp():
                    return completion_logprobs(
                        policy,
                        prompt_ids[rows_mb, p_cols],
                        prompt_mask[rows_mb, p_cols],
                        completion_ids[rows_mb, c_cols],
                        completion_mask[rows_mb, c_cols],
                        args.temperature,
                        with_entropy,
                        prompt_of_row,
                        vocab_size,
                    )

            with torch.no_grad():
                if args.kl_coef:
                    with model.disable_adapter() if args.lora_r else torch.no_grad():  # no adapter: the initial policy
                        for rows_mb, p_cols, c_cols, shared in itertools.chain(*plans):
                            ref_logp[rows_mb, c_cols] = logprobs(
                                model if reference is None else reference, rows_mb, p_cols, c_cols, shared
                            )[0]
                for rows_mb, p_cols, c_cols, shared in itertools.chain(*plans[1:]):
                    old_logp[rows_mb, c_cols] = logprobs(model, rows_mb, p_cols, c_cols, shared)[0]
            t_referenced = clock()

            # 5. update: num_iterations passes of num_minibatches optimiser steps, each accumulating micro-batches
            counts = all_sum({j: loss_mask[mb.start : mb.stop].sum() for j, mb in enumerate(minibatches)}, device)
            stat_sums, grad_norms, loss_sum = {}, [], 0.0
            for iteration, j in itertools.product(range(args.num_iterations), range(args.num_minibatches)):
                last_pass = iteration == args.num_iterations - 1  # the batch as its last pass saw it is logged
                for rows_mb, p_cols, c_cols, prompt_of_row in plans[j]:
                    mask = loss_mask[rows_mb, c_cols]
                    logp, entropy = logprobs(model, rows_mb, p_cols, c_cols, prompt_of_row, with_entropy=last_pass)
                    if iteration == 0 and j == 0:
                        old_logp[rows_mb, c_cols] = logp.detach()
                    loss, stats = grpo_loss(
                        logp,
                        old_logp[rows_mb, c_cols],
                        ref_logp[rows_mb, c_cols],
                        advantages[rows_mb],
                        mask,
                        clip_eps_low=args.clip_eps_low,
                        clip_eps_high=args.clip_eps_high,
                        kl_coef=args.kl_coef,
                        loss_type=args.loss_type,
                        max_completion_length=args.max_new_tokens,
                        delta=args.delta,
                        importance_sampling=args.importance_sampling,
                        kl_estimator=args.kl_estimator,
                        kl_ratio_weighted=args.kl_ratio_weighted,
                        total_sequences=minibatch_rows * world_size,
                        total_tokens=counts[j],
                    )
                    loss.backward()
                    if last_pass:  # stats weighted by tokens (stat_sums["tokens"]: their count), mean loss
                        tokens, loss_sum = stats.pop("tokens"), loss_sum + loss.detach() / args.num_minibatches
                        stats.update(entropy=(entropy * mask).sum() / tokens.clamp(min=1.0), tokens=torch.ones(()))
                        for key, value in stats.items():
                            stat_sums[key] = stat_sums.get(key, 0.0) + value * tokens
                if distributed and not args.fsdp:  # gradients summed over processes (FSDP has done it)
                    for p in trainable:
                        dist.all_reduce(p.grad)
                grad_norm = torch.nn.utils.clip_grad_norm_(trainable, max(args.max_grad_norm, 0) or math.inf)
                grad_norms.append(float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm))
                if math.isfinite(grad_norms[-1]):  # the same on every process: the gradients are summed
                    optimizer.step()
                    bad_updates = 0
                else:  # a non-finite loss or gradient would poison the weights
                    bad_updates, skipped_updates = bad_updates + 1, skipped_updates + 1
                    print0(
                        f"warning: step {step + 1}: non-finite gradient, update skipped",
                        file=sys.stderr,
                        enabled=is_main,
                    )
                    if bad_updates >= args.max_bad_steps:
                        raise UserError(
                            f"{bad_updates} updates in a row had a non-finite loss or gradient: lower "
                            "--learning-rate or check the rewards"
                        )
                optimizer.zero_grad(set_to_none=True)
            t_updated = clock()

            # 6. log, evaluate, save; the metrics are over every process
            gap = (old_logp - sampler_logp).abs() * completion_mask  # trainer vs sampler, same weights and tokens
            sums = all_sum(
                {
                    **stat_sums,
                    "loss": loss_sum,
                    "gap": gap.sum(),
                    "generated": completion_mask.sum(),
                    "truncated": truncated.sum(),
                    "prompt_tokens": prompt_mask.sum(),
                    "stop": len(stop_signals),
                    "trained_tokens": loss_mask.sum() * args.num_iterations,
                },
                device,
            )
            metrics = {
                "reward": scores[0].mean(),
                "reward_std": scores[0].std(),
                "accuracy": scores[1].mean(),
                **{f"reward_{name}": scores[1 + i].mean() for i, name in enumerate(rewards)},
                "frac_zero_std_groups": (all_advantages.view(-1, args.group_size) == 0).all(1).float().mean(),
                "loss": sums["loss"],
                "grad_norm": np.mean(grad_norms[-args.num_minibatches :]),
                **{key: sums[key] / max(sums["tokens"], 1.0) for key in stat_sums if key != "tokens"},
                "completion_length": sums["generated"] / scores.shape[1],
                "truncated_frac": sums["truncated"] / scores.shape[1],
                "logp_gap_mean": sums["gap"] / sums["generated"],
                "generated_tokens": sums["generated"],
                "trained_tokens": sums["trained_tokens"],
                "generation_time_s": t_generated - t_start,
                "reward_time_s": t_rewarded - t_generated,
                "reference_time_s": t_referenced - t_rewarded,
                "update_time_s": t_updated - t_referenced,
                "step_time_s": t_updated - t_start,
            }
            if peak_tflops and dtype == torch.bfloat16:  # FLOPs: 2 a weight and token forward, 4 backward (LoRA: 2)
                passes = 1 + (args.kl_coef > 0) + args.num_iterations * (2 if args.lora_r else 3)  # rollout ~ 1 pass
                flops = 2 * n_params * passes * (sums["prompt_tokens"] + sums["generated"])
                metrics["mfu"] = flops / world_size / metrics["step_time_s"] / (peak_tflops * 1e12)
            if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.total_steps:
                eval_accuracy = metrics["eval_accuracy"] = evaluate()
            logger.log(step + 1, metrics)
            history.append(metrics)
            stopped = sums["stop"] > 0  # a signal stops every process after the same step
            if (args.save_every and (step + 1) % args.save_every == 0) or stopped:
                save_run(
                    os.path.join(output_dir, f"checkpoint-{step + 1}"),
                    model,
                    tokenizer,
                    args,
                    optimizer,
                    {
                        "step": step + 1,
                        "eval_accuracy_start": eval_accuracy_start,
                        "skipped": skipped_updates,
                        "rng": torch.get_rng_state(),
                    },
                )
            if stopped:
                print0(
                    f"stopped by a signal: checkpoint-{step + 1} saved; continue with the same command and "
                    f"--output-dir {output_dir} --resume-from latest",
                    enabled=is_main,
                )
                break
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

    # ---- 4. final model, evaluation, benchmark summary (the first step, which warms up, left out of the means)
    if not stopped:
        save_run(os.path.join(output_dir, "final"), model, tokenizer, args)
        eval_accuracy = evaluate()
        if eval_rows:
            logger.log(start_step + len(history), {"eval_accuracy": eval_accuracy})
    timed = history[1:] or history

    def total(key: str) -> float:
        return sum(float(m.get(key, math.nan)) for m in timed) if timed else math.nan

    summary = {
        "steps": start_step + len(history),
        "interrupted": stopped,
        "total_time_s": time.perf_counter() - run_start,
        "step_time_s_mean": total("step_time_s") / max(len(timed), 1),
        **{f"{part}_time_s": sum(m[f"{part}_time_s"] for m in history) for part in PHASES},
        "generated_tokens_per_s": total("generated_tokens") / total("generation_time_s"),
        "trained_tokens_per_s": total("trained_tokens") / total("update_time_s"),
        "peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "mfu": total("mfu") / max(len(timed), 1),
        "eval_accuracy_start": eval_accuracy_start,
        "eval_accuracy_end": eval_accuracy,
        "skipped_updates": skipped_updates,
        "resumed_from_step": start_step,
        "stop_signal": signal.Signals((stop_signals or [signal.SIGTERM])[0]).name if stopped else None,
    }
    if not stopped:
        logger.summary(summary, output_dir)
    logger.close()
    if distributed:
        dist.barrier()  # rank 0 may still be writing
        dist.destroy_process_group()
    return summary


def main() -> None:
    try:
        summary = train(tyro.cli(Args))
    except Exception as error:  # a UserError of this file or of prm.py (the PRM reward)
        if type(error).__name__ != "UserError":
            raise
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    if summary["stop_signal"]:  # checkpointed, not finished: a scheduler must not take it for done
        sys.exit(128 + signal.Signals[summary["stop_signal"]])


if __name__ == "__main__":
    main()
