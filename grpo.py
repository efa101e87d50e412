"""GRPO (Group Relative Policy Optimization) for causal language models, in one file.

GRPO (Shao et al. 2024, https://arxiv.org/abs/2402.03300) samples `group_size` completions per prompt, scores them with
verifiable rewards, and gives each completion's tokens its reward, standardised within the group, as their advantage.
The loss is PPO's clipped surrogate plus a KL penalty to a frozen reference policy; there is no value model.
Departures from the paper: DAPO's separate clip epsilons (https://arxiv.org/abs/2503.14476); `--loss-type`'s
normalisers count the whole batch however it is split; advantages over the batch's reward std (`--scale-rewards batch`);
a prompt's completions draw from a random stream keyed by (seed, its position in the data stream): a resumed or
multi-process run draws what one uninterrupted process does.

Run it:
    python grpo.py                                    # tiny model, built-in task, CPU, about 20 seconds
    python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --data-path gsm8k.jsonl --lora-r 16 --kl-coef 0.05 \\
        --max-new-tokens 256 --learning-rate 1e-5 --output-dir runs/qwen-gsm8k --save-every 50
    python grpo.py ... --output-dir runs/qwen-gsm8k --resume-from latest    # after a stop or a crash
    torchrun --standalone --nproc_per_node 8 grpo.py --model Qwen/Qwen2.5-1.5B-Instruct ...   # --fsdp to shard it
"""

import functools
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
from typing import Literal, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dcp
import tyro

from common import RunLogger, print0, seed_everything


@dataclass
class Args:
    # Experiment
    seed: int = 1  # seed of the experiment: model init, prompt order and sampling all follow from it
    output_dir: str | None = None  # metrics, checkpoints and final/ go here; None = runs/grpo__{seed}__{unix time}
    track: bool = False  # log to Weights & Biases (WANDB_MODE=offline works; WANDB_ENTITY picks the team)
    wandb_project_name: str = "grpo"  # the Weights & Biases project of --track
    # Model and data
    model: str = "tiny"  # `tiny` (a small random-init Llama built here) or a hub id / local path of a causal LM
    data_path: str | None = None  # JSONL prompts, one {"prompt": str, "answer": str} a line; None = built-in task
    eval_data_path: str | None = None  # JSONL held-out prompts; None = the built-in task's held-out ones, or none
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template, when it has one
    system_prompt: str | None = None  # a system message before every prompt (needs a chat template)
    max_prompt_length: int = 512  # a prompt longer than this many tokens is an error
    lora_r: int = 0  # LoRA rank; 0 = full fine-tuning
    lora_alpha: int = 32  # LoRA scaling numerator (the update is scaled by alpha / r)
    lora_target_modules: str = "all-linear"  # comma-separated module names to adapt (q_proj,v_proj), or all-linear
    # Rollout
    total_steps: int = 400  # training steps, one rollout batch each
    prompts_per_step: int = 8  # prompts per step, over all processes
    group_size: int = 16  # completions sampled per prompt (the group its rewards are standardised in)
    max_new_tokens: int = 2  # maximum completion length in tokens (the built-in task's answers need 2; GSM8K ~300)
    temperature: float = 1.0  # sampling temperature (the training log-probs use the same)
    top_p: float = 1.0  # nucleus sampling threshold; 1.0 = off
    top_k: int = 0  # sample among the k most likely tokens; 0 = off
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal, sample more prompts instead (DAPO)
    max_sampling_rounds: int = 4  # with --dynamic-sampling: rollouts a step may take, then it trains on what there is
    # Rewards
    answer_reward_weight: float = 1.0  # weight of the answer reward (1 when the final answer equals the reference)
    format_reward_weight: float = 0.1  # weight of the format reward (1 when the answer is stated cleanly)
    prm_path: str | None = None  # a PRM saved by prm.py: its aggregated step scores join the reward
    prm_reward_weight: float = 1.0  # weight of the PRM reward
    prm_aggregate: Literal["min", "prod", "last", "mean"] = "min"  # how step scores make one PRM reward
    # Loss
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"  # how token losses are aggregated (see grpo_loss)
    policy_loss: Literal["ppo", "gspo"] = "ppo"  # PPO's surrogate with a ratio per token, or per completion (GSPO)
    scale_rewards: Literal["group", "batch", "none"] = "batch"  # divide advantages by the group's or batch's std
    kl_coef: float = 0.02  # weight of the KL penalty to the reference policy; 0 = no reference model
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # per-token KL estimator (see kl_penalty)
    kl_ratio_weighted: bool = False  # multiply each token's KL by its ratio pi / pi_old (DeepSeek-V3.2)
    clip_eps_low: float = 0.2  # the ratio is clipped below at 1 - clip_eps_low
    clip_eps_high: float = 0.2  # the ratio is clipped above at 1 + clip_eps_high (DAPO uses 0.28)
    delta: float | None = None  # upper bound on the unclipped ratio (INTELLECT-2's two-sided clipping); None = off
    mask_truncated_completions: bool = False  # leave completions cut at --max-new-tokens out of the loss (DAPO)
    # Optimisation
    learning_rate: float = 3e-4  # AdamW learning rate (about 1e-6 for full fine-tuning of real models, 1e-5 for LoRA)
    warmup_steps: int = 0  # linear learning-rate warm-up over this many steps
    lr_schedule: Literal["constant", "cosine"] = "constant"  # after warm-up; cosine decays to 0 at --total-steps
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    num_iterations: int = 1  # passes over each rollout batch (PPO's epochs), ratios against the rollout policy
    num_minibatches: int = 1  # optimiser updates per pass, each on an equal share of the batch's groups
    micro_batch_size: int = 0  # completions per forward/backward pass (gradient accumulation); 0 = a whole minibatch
    max_grad_norm: float = 1.0  # clip the global gradient norm to this (0 = off)
    # Evaluation, logging, checkpoints, system
    eval_every: int = 50  # held-out evaluation every this many steps (0 = at the start and the end only)
    eval_batch_size: int = 64  # held-out completions per generation batch
    num_eval_rows: int = 500  # at most this many held-out prompts are evaluated
    eval_num_samples: int = 1  # 1: greedy accuracy; k > 1: k samples a prompt for pass@1, pass@k, maj@k (and prm@k)
    log_completions_every: int | None = None  # some completions to completions.jsonl; None = every --eval-every
    save_every: int = 0  # checkpoint-STEP/ every this many steps and at the end (0 = only when stopped by a signal)
    keep_checkpoints: int = 2  # the newest checkpoints kept (0 = all)
    resume_from: str | None = None  # a checkpoint-STEP directory, or `latest` in --output-dir, to continue from
    overwrite: bool = False  # replace a run already in --output-dir
    gradient_checkpointing: bool = False  # recompute activations in the backward pass (less memory, more compute)
    fsdp: bool = False  # shard weights, gradients and optimiser state over processes with FSDP2 (under torchrun)


# ---- Kernels: tensors in, tensors out. The tests import these.
def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """A_i = (r_i - mean of r_i's group) / (std + eps) for rewards [B] laid out group after group; equal rewards get
    exactly 0. scale: the std (Bessel's, as TRL and verl) of each group, of the whole batch, or none (Dr. GRPO)."""
    grouped = rewards.double().view(-1, group_size)  # [groups, G]; float64: squares of large rewards overflow fp32
    advantages = grouped - grouped.mean(1, keepdim=True)
    if scale == "group":
        advantages = advantages / (grouped.std(1, keepdim=True) + eps)
    elif scale == "batch":
        advantages = advantages / (grouped.std() + eps)
    elif scale != "none":
        raise ValueError(f"scale must be group, batch or none, got {scale!r}")
    # the float mean of equal values can differ from them in the last bit, which /(std + eps) would blow up
    equal = grouped.amax(1, keepdim=True) == grouped.amin(1, keepdim=True)
    advantages = torch.where(equal, 0.0, advantages).view(-1)
    return advantages.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from tokens of pi, x = ref_logp - logp: k1 = -x, k2 = x^2/2, k3 = e^x - x - 1
    (http://joschu.net/blog/kl-approx.html). As losses, k3's gradient is KL(pi_ref || pi)'s, k2's KL(pi || pi_ref)'s."""
    x = ref_logp - logp
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x**2
    if estimator == "k3":
        return torch.expm1(x) - x  # expm1: exact near 0
    raise ValueError(f"estimator must be k1, k2 or k3, got {estimator!r}")


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
    """PPO's clipped surrogate plus a KL penalty per completion token, aggregated over the batch by loss_type.
    logp, old_logp, ref_logp, mask: [B, T], mask 1 on completion tokens (EOS included); advantages: [B].
    Per token, with r = exp(logp - old_logp): l = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + kl_coef KL. GSPO's
    importance_sampling "sequence" (GSPO) gives a row's tokens one r, exp(their mean log r); delta caps r (INTELLECT-2).
    With N sequences, M tokens in the batch (total_*, when this call sees a part, so that the parts' losses sum to it):
        grpo: (1/N) sum_i (sum_t l m / sum_t m)   bnpo, dapo: sum l m / M   dr_grpo: sum l m / (N max_completion_length)
    Returns (loss, stats): this part's token means of the ratio, clip fractions, pg_loss and KL, and its token count.
    """
    dtype = torch.promote_types(logp.dtype, torch.float32)  # a bf16 mask would count 501 tokens as 500
    logp = logp.to(dtype)
    mask = mask.to(dtype)
    in_loss = mask.bool()
    adv = advantages.to(dtype).unsqueeze(1)  # [B, 1]
    log_ratio = torch.where(in_loss, logp - old_logp.to(dtype), 0.0)  # padding may hold inf, and exp(inf) * 0 is NaN
    if importance_sampling == "token":
        ratio = log_ratio.exp()  # [B, T]
    elif importance_sampling == "sequence":
        mean_log_ratio = log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)  # [B, 1]
        ratio = mean_log_ratio.exp().expand_as(logp)  # [B, T]
    else:
        raise ValueError(f"importance_sampling must be token or sequence, got {importance_sampling!r}")
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    unclipped = ratio if delta is None else ratio.clamp(max=delta)
    pg_loss = -torch.min(unclipped * adv, clipped * adv)  # [B, T]: the pessimistic surrogate, for either sign of A
    token_loss = pg_loss
    kl = None
    if kl_coef != 0.0:
        kl = kl_penalty(torch.where(in_loss, logp, 0.0), torch.where(in_loss, ref_logp.to(dtype), 0.0), kl_estimator)
        if kl_ratio_weighted:  # the tokens come from pi_old: r = pi / pi_old weighs them to pi
            kl = log_ratio.exp() * kl
        token_loss = pg_loss + kl_coef * kl  # [B, T]
    num_sequences = total_sequences if total_sequences is not None else logp.shape[0]
    num_tokens = total_tokens if total_tokens is not None else mask.sum().item()
    row_sums = (token_loss * mask).sum(1)  # [B]
    if loss_type == "grpo":  # each completion's token mean, then the mean over completions (the paper)
        loss = (row_sums / mask.sum(1).clamp(min=1.0)).sum() / num_sequences
    elif loss_type in ("bnpo", "dapo"):  # every token weighs the same: a long completion weighs by its length
        loss = row_sums.sum() / max(num_tokens, 1.0)
    elif loss_type == "dr_grpo":  # a constant normaliser: no length bias (Dr. GRPO)
        loss = row_sums.sum() / (num_sequences * max_completion_length)
    else:
        raise ValueError(f"loss_type must be grpo, bnpo, dr_grpo or dapo, got {loss_type!r}")
    with torch.no_grad():  # the tokens whose gradient the clip stops
        clip_low = (adv < 0) & (ratio < 1.0 - clip_eps_low)
        clip_high = (adv > 0) & (ratio > 1.0 + clip_eps_high)
        if delta is not None:
            clip_high = clip_high | ((adv < 0) & (ratio > delta))
        per_token = {"ratio_mean": ratio, "clip_frac_low": clip_low, "clip_frac_high": clip_high, "pg_loss": pg_loss}
        if kl is not None:
            per_token["kl_mean"] = kl
        tokens = mask.sum()
        stats = {name: (value * mask).sum() / tokens.clamp(min=1.0) for name, value in per_token.items()}
        stats["tokens"] = tokens
    return loss, stats


def token_logprobs(logits, targets, temperature=1.0, with_entropy=False, rows_per_chunk=16, vocab_size=None):
    """log softmax(logits / T) [B, T] at the targets, in fp32, over the first vocab_size ids (those the sampler draws),
    and the entropy [B, T] or None. logits [B, T, V] go a few rows at a time: without gradients one chunk is in fp32."""
    logps = []
    entropies = []
    for start in range(0, logits.shape[0], rows_per_chunk):
        chunk = logits[start : start + rows_per_chunk, :, :vocab_size].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        chunk = torch.log_softmax(chunk, dim=-1)
        logps.append(chunk.gather(-1, targets[start : start + rows_per_chunk].unsqueeze(-1)).squeeze(-1))
        if with_entropy:
            entropies.append(torch.special.entr(chunk.detach().exp()).sum(-1))  # entr(0) = 0, where p log p is NaN
    entropy = torch.cat(entropies) if with_entropy else None
    return torch.cat(logps), entropy


# ---- Task, data and rewards
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
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
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
        if isinstance(row, dict) and "question" in row and "prompt" not in row:
            raise UserError(f'{path}:{number}: the row has "question": rename it to "prompt"')
        prompt_ok = isinstance(row, dict) and isinstance(row.get("prompt"), str)
        if not prompt_ok or not isinstance(row.get("answer"), str | int | float):
            raise UserError(f'{path}:{number}: a row needs a string "prompt" and a string or number "answer"')
        rows.append({"prompt": row["prompt"], "answer": str(row["answer"]), "where": f"{path}:{number}"})
    if not rows:
        raise UserError(f"{path} holds no rows")
    return rows


# Answers: the last answer a text states, compared exactly as a number (a fraction), else by Math-Verify (TRL's).
# "#### 72" (not "#### Step 2"), a "# Answer" heading's next line, "The answer is $18$." (not "... is correct"), "A: 7"
SAID = re.compile(
    r"(?im)^####[ \t]*(?P<marked>[^\sA-Za-z#*][^\n]*)"
    r"|^#+[ \t]*(?:final[ \t]+)?answer[ \t:]*\n\s*(?P<heading>[^\n]+)"
    r"|(?:answer(?:[ \t]+is\b|[ \t]*:)|^A:)[\s:]*(?![A-Za-z]{2})"
    r"(?P<sentence>[^\s.:](?:[^\n.,]|\.(?=\S)|,(?!\s*[a-z]{2}))*)"
)
BOXED = re.compile(r"\\boxed\s*\{((?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*)(\}?)")  # \boxed{\frac{1}{2}}, or cut: \boxed{18
TOGETHER = re.compile(r"[\W_]*(?:\b(?:or|and)\b[\W_]*)?")  # between answers stated together: \boxed{5} or \boxed{6}
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])|\n\s*\n")  # "... is 18. Then" or a blank line
MATHS = re.compile(r"\$([^$]+)\$")  # inline maths: $AB = 2\sqrt{3}$
PROSE = re.compile(r"(?<![\\{])\b(?!and\b)[a-z]{3,}\b")  # a word ("so she makes"), not \tan, {pmatrix}, AB, and
# what only decorates an answer: $18, \$18, 28\%, 90^\circ, 5\text{ cm}, \left(, \!, \(5\)
NOISE = re.compile(r"\\?[$%]|°|\^\s*\{?\\circ\}?|\\(?:text|mbox)\s*\{\s[^{}]*\}(?:\^\d)?|\\(?:left|right|[!,;()[\]])")
WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}|\{([,:.])\}")  # \text{(C)} -> (C), 1{,}234 -> 1,234
LIST_WORD = re.compile(r"\s*(?:\\text\{\s*(?:or|and)\s*\}|\b(?:or|and)\b)\s*")  # "5 or 6" is the list 5, 6
# \frac{3}{4}, \dfrac34 as 3/4; 3\frac{6}{11}, a mixed number, as 3 6/11
FRACTION = re.compile(r"(?P<whole>\d\s*)?\\[cdt]?frac\s*\{?(?P<top>-?\d+)\}?\s*\{?(?P<bottom>\d+)\}?(?![\w.])")
# a number as written: 1,234.5, .2, -3/4, +5, 31.95/2, 3 6/11, 32 million; not the 2 of x^2, x_2, 2x or \pi/2
NUMBER = re.compile(
    r"(?<![\w.^_/{])(?P<sign>[-+]?)(?:(?P<whole>\d+)\s+(?=\d+/\d))?"
    r"(?P<top>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:/(?P<bottom>\d+(?:\.\d+)?))?"
    r"(?:\s*(?P<scale>thousand|million|billion|trillion)\b)?(?![\w^\\])"
)
SCALES = {"thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12}
UNIT = re.compile(r"(?<=\d)(?:\s+(?!(?:thousand|[mbtr]illion)\b)[A-Za-z]+(?:\^[23]|[²³])?)+$")  # 18 dollars, 6 cm^2
# not maths, refused before Math-Verify: no digit nor letter ("()"), an operator at an end ("5+", "/5"), unclosed "(5"
MALFORMED = re.compile(r"^[^\dA-Za-z]*$|^[*/=^,)\]]|[-+*/=^,]$|[(\[][^)\]]*$")
# sympy takes seconds, or forever, on power towers, huge powers, factorials and binomials: refused before Math-Verify
PATHOLOGICAL = re.compile(r"\^\s*(?:\{[^{}]*|\([^()]*|\d+\s*)\^|\^[{(]?\d{5,}|(?:\d{4,}|[)}])\s*!|\\binom\{\d{4,}")


def stated_answer(text: str, otherwise: str | None) -> str | None:
    """The last answer a text states, with those stated with it ("5, 6"), else `otherwise`; None: cut, none or long."""
    boxes = [(match.start(), match.end(), match[1]) for match in BOXED.finditer(text) if match[2]]
    boxes += [(match.start(), len(text), None) for match in BOXED.finditer(text) if not match[2]]
    said = [(match.start(match.lastgroup), match.end(), match[match.lastgroup]) for match in SAID.finditer(text)]
    said = [span for span in said if not any(span[0] <= box[0] < span[1] for box in boxes)]  # "is $\\boxed{5}$"
    found = sorted(boxes + said)
    first = len(found) - 1
    while first > 0 and TOGETHER.fullmatch(text[found[first - 1][1] : found[first][0]]):
        first -= 1
    answers = [answer for _, _, answer in found[first:]] or [otherwise]
    answer = ", ".join(dict.fromkeys(filter(None, answers)))
    if None in answers or len(answer) > 200:
        return None
    return answer or None


def unstated(text: str, reference: str) -> str | None:
    """What a text stating no answer ends on: a bare-maths last sentence, else its last number (GSM8K's "... so she
    makes $18.") for a numeric reference, or the last sentence's last $...$."""
    last = SENTENCE_END.split(text.strip())[-1]
    if not PROSE.search(NOISE.sub("", last)):  # a unit, "6\\text{ square units}", is no prose
        return last
    if parse_number(normalise(reference)) is not None:
        return ([None] + [match[0] for match in NUMBER.finditer(normalise(text))])[-1]
    return ([None] + MATHS.findall(last))[-1]


def normalise(text: str) -> str:
    """Drops what only decorates an answer: '$18.00.' -> '18.00', '\\text{(C)}' -> '(C)', '5 or 6' -> '5, 6'."""
    text = NOISE.sub("", LIST_WORD.sub(", ", text.replace("\u2212", "-")))
    text = WRAPPER.sub(r"\1\2", text)
    return text.strip(" *\n").removesuffix(".").strip()


@functools.lru_cache(maxsize=4096)  # a group's reference, and many of its answers, recur
def parse_number(text: str) -> tuple[int, int] | None:
    """A normalised number as (numerator, denominator): '7.50' -> (15, 2), '72/375' -> (72, 375) kept unreduced."""
    slashed = FRACTION.sub(r"\g<whole> \g<top>/\g<bottom>", text).strip()  # \frac{3}{4} -> 3/4, 3\frac{6}{11} -> 3 6/11
    match = NUMBER.fullmatch(UNIT.sub("", slashed))
    if match is None or float(match["bottom"] or 1) == 0:
        return None
    top = Fraction(match["sign"] + match["top"].replace(",", "")) * SCALES.get(match["scale"], 1)
    bottom = Fraction(match["bottom"] or 1)
    top += int(match["sign"] + (match["whole"] or "0")) * bottom
    if top.denominator == bottom.denominator == 1:  # a fraction of integers as written: MATH asks for lowest terms
        return top.numerator, bottom.numerator
    return (top / bottom).as_integer_ratio()


@functools.lru_cache(maxsize=4096)  # a group's completions often state the same answer
def symbolic_equal(stated: str, reference: str) -> bool:
    """Math-Verify's verdict with its timeouts off: they arm SIGALRM, which fails in threads and cancels others."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise UserError("symbolic answers are checked by Math-Verify: pip install math-verify") from None
    return verify(*(parse(f"${text}$", parsing_timeout=None) for text in (reference, stated)), timeout_seconds=None)


def same_answer(stated: str, reference: str) -> bool:
    """Numbers exactly as written, words as text, the rest by Math-Verify; an equation by right side or lhs - rhs."""
    stated, reference = normalise(stated), normalise(reference)
    if "=" in stated and "=" not in reference:
        stated = stated.rsplit("=", 1)[1].strip()
    words = [re.sub(r"[\s()]", "", text).lower() for text in (stated, reference)]
    if stated == reference or any(word.isascii() and word.isalpha() for word in words):  # 12:30; LXQS, (C) as text
        return words[0] == words[1]
    numbers = parse_number(stated), parse_number(reference)
    if None not in numbers:
        return numbers[0] == numbers[1]
    if MALFORMED.search(stated) or PATHOLOGICAL.search(stated) or PATHOLOGICAL.search(reference):
        return False
    if "=" in stated and "=" in reference:
        stated, reference = ["{}-({})".format(*side.split("=", 1)) for side in (stated, reference)]
    return symbolic_equal(stated, reference)


def answer_reward(completion: str, answer: str) -> float:
    """1.0 when the answer the completion states last equals the one the reference states (or the reference itself)."""
    reference = stated_answer(answer, answer.strip())
    if reference is None:
        return 0.0
    stated = stated_answer(completion, unstated(completion, reference))
    return float(stated is not None and same_answer(stated, reference))


def format_reward(completion: str, answer: str) -> float:
    """1.0 for a bare canonical number (not "05"), or a text that ends with `#### n` or a non-empty \\boxed{...}."""
    end = completion.strip().removesuffix(".").rstrip().rstrip("$").removesuffix("\\]").removesuffix("\\)").rstrip()
    last_box = re.search(BOXED.pattern + "$", end)
    bare = re.fullmatch(r"\s*-?(?:0|[1-9]\d*)(?:\.\d+)?\s*", completion)  # 5, -3.5; not 05
    marked = re.search(r"####[ \t]*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?$", end)  # #### 1,234
    if last_box and last_box[2] and last_box[1].strip():
        return 1.0
    return float(bool(bare or marked))


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
        separator = scorer.config["step_separator"]

        def prm_reward(prompts: list[str], completions: list[str]) -> list[float]:
            solutions = [[step for step in text.split(separator) if step.strip()] for text in completions]
            scored = zip(prm.score_steps(scorer, prompts, solutions), solutions)
            # steps past the PRM's max length get no score and count as 0: else the policy could write on unjudged
            padded = [scores + [0.0] * (len(steps) - len(scores)) for scores, steps in scored]
            return [prm.aggregate_scores(scores, args.prm_aggregate) for scores in padded]

        fns.append(("prm", prm_reward, args.prm_reward_weight))
    return fns


# ---- Model, rollout and log-probs
def load_model(name: str, dtype: torch.dtype, seed: int):
    """(model, tokenizer), dropout off, from a hub id, a path, or `tiny`: a seeded 2-layer Llama on characters."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if not os.path.exists(os.path.expanduser(name)) and (name.startswith(("/", ".", "~")) or name.count("/") > 1):
        raise UserError(f"--model {name} does not exist")  # a path: a hub id is ORG/NAME
    torch.manual_seed(seed)
    if name == "tiny":
        specials = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
        vocab = {token: i for i, token in enumerate([*specials.values(), *"0123456789+-*/%()= "])}
        core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: a token per character
        core.add_special_tokens(list(specials.values()))
        core.decoder = decoders.Fuse()
        core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, model_max_length=1024, **specials)
        shape = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4}
        config = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, pad_token_id=0, **shape)
        model = LlamaForCausalLM(config)
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        except (OSError, ValueError) as error:
            reason = str(error).strip().splitlines()[0]
            raise UserError(f"could not load --model {name}: {reason} (HF_HUB_OFFLINE=1 skips hub retries)") from None
    for weight in model.parameters():  # not model.to(dtype), which would round the rotary frequencies too
        weight.data = weight.data.to(dtype)
    for module in model.modules():  # dropout would make the trainer's log-probs differ from the sampler's
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


@dataclass
class Policy:
    """The model being trained, and what sampling from it needs."""

    model: torch.nn.Module
    tokenizer: object
    eos_ids: list[int]  # the ids that end a completion: chat models end a turn with any of several
    vocab_size: int  # the ids the sampler draws: the tokenizer's, not the embedding's padding rows
    device: torch.device
    bf16: bool  # compute under bf16 autocast (trained weights stay fp32)


def build_policy(args: Args, bf16: bool, resume_path: str | None, device: torch.device):
    """(policy, reference) on the device. The reference, a frozen copy of the initial model for the KL, is None at
    --kl-coef 0 and with LoRA, whose initial model is the model with its adapter disabled."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()  # its bars for loading and saving weights would break into the log's lines
    dtype = torch.bfloat16 if bf16 else torch.float32
    # trained weights stay fp32 (bf16 would round small updates away) and compute under autocast; LoRA's base in dtype
    weights_dtype = dtype if args.lora_r and not args.fsdp else torch.float32
    source = resume_path if resume_path and not args.lora_r else args.model  # full fine-tuning saves the whole model
    model, tokenizer = load_model(source, weights_dtype, args.seed)
    if args.lora_r and resume_path:
        model = PeftModel.from_pretrained(model, resume_path, is_trainable=True)
    elif args.lora_r:
        targets = "all-linear" if args.lora_target_modules == "all-linear" else args.lora_target_modules.split(",")
        config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules=targets, task_type="CAUSAL_LM")
        model = get_peft_model(model, config)
    reference = None
    if args.kl_coef and not args.lora_r:
        reference = load_model(args.model, weights_dtype, args.seed)[0].eval()
    for module in (model, reference):
        if module is not None and args.fsdp:
            shard_model(module, device, dtype)
        elif module is not None:
            module.to(device)
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    configured = model.generation_config.eos_token_id or []  # an id or a list of them
    eos_ids = sorted({tokenizer.eos_token_id, *np.ravel(configured).tolist()})
    vocab_size = max(len(tokenizer), max(eos_ids) + 1)
    return Policy(model.train(), tokenizer, eos_ids, vocab_size, device, bf16), reference


def shard_model(model, device: torch.device, compute_dtype: torch.dtype) -> None:
    """FSDP2: each transformer block's fp32 weights are gathered for its forward and freed after; gradients summed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    blocks = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or []}
    for module in [module for module in model.modules() if type(module).__name__ in blocks] + [model]:
        fully_shard(module, mesh=mesh, mp_policy=policy)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no pre-scaled one


def encode_prompts(tokenizer, rows: list[dict], args: Args) -> list[list[int]]:
    """Token ids of each row's prompt, in the chat template (after the system message) when the tokenizer has one."""
    if args.system_prompt is not None and not (args.chat_template and tokenizer.chat_template):
        raise UserError("--system-prompt needs a chat template, and this tokenizer has none (or it is off)")
    system = [] if args.system_prompt is None else [{"role": "system", "content": args.system_prompt}]
    encoded = []
    for row in rows:
        if args.chat_template and tokenizer.chat_template:
            messages = [*system, {"role": "user", "content": row["prompt"]}]
            ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        else:
            ids = tokenizer(row["prompt"])["input_ids"]
        if len(ids) > args.max_prompt_length:
            where = row.get("where", "a built-in prompt")
            raise UserError(f"{where}: {len(ids)} prompt tokens, over --max-prompt-length {args.max_prompt_length}")
        encoded.append(ids)
    unknown = sum(tokenizer.unk_token_id in ids for ids in encoded)
    if unknown:  # characters the tokenizer cannot spell: the model never sees them, a sure way to learn nothing
        message = f"{unknown} of {len(encoded)} prompts hold the unknown token {tokenizer.unk_token}"
        print0(f"warning: {message}", file=sys.stderr)
    return encoded


def left_pad(sequences: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] ids and attention mask, left-padded so that every prompt ends in the last column."""
    width = max(len(s) for s in sequences)
    ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in sequences], device=device)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], device=device)
    return ids, mask


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


class Rollout(NamedTuple):
    """Prompts and their sampled completions."""

    prompt_ids: torch.Tensor  # [B, P], left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B, T], padded after EOS
    completion_mask: torch.Tensor  # [B, T], 1 up to and including EOS
    sampler_logp: torch.Tensor  # [B, T], the sampler's log-probs of the tokens


@torch.no_grad()
def generate(policy: Policy, prompts: list[list[int]], args: Args, generators=None, group_size: int = 1) -> Rollout:
    """Complete the prompts (token id lists, in groups of group_size copies, each prompt encoded once for its group)
    with a KV cache: greedily without generators, else sampled, a group by its generator. sampler_logp: the tokens'
    log-probs under softmax(logits / T), before top-k and top-p."""
    from transformers import DynamicCache

    model = policy.model
    pad_id = policy.tokenizer.pad_token_id
    prompt_ids, prompt_mask = left_pad(prompts, pad_id, policy.device)  # [B, P]
    batch_size = prompt_ids.shape[0]
    eos_ids = torch.tensor(policy.eos_ids, device=policy.device)
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens count from 0
    first_of_group = slice(None, None, group_size)
    cache = DynamicCache()
    model.eval()  # in training mode, gradient checkpointing turns the KV cache off
    with torch.autocast(policy.device.type, dtype=torch.bfloat16, enabled=policy.bf16):
        logits = model(
            input_ids=prompt_ids[first_of_group],
            attention_mask=prompt_mask[first_of_group],
            position_ids=positions[first_of_group],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1, : policy.vocab_size]  # [B/G, V]
        cache.batch_repeat_interleave(group_size)
        logits = logits.repeat_interleave(group_size, dim=0)  # [B, V]
        attention_mask = prompt_mask
        finished = torch.zeros(batch_size, dtype=torch.bool, device=policy.device)
        tokens = []
        logps = []
        for step in range(args.max_new_tokens):
            scaled = logits.float() / args.temperature  # [B, V]
            if generators is None:
                token = scaled.argmax(-1)
            else:
                # Gumbel-max: argmax(logits + Gumbel noise) samples softmax(logits), a group's noise by its generator
                group_shape = (batch_size // len(generators), scaled.shape[-1])
                uniform = torch.cat([torch.rand(group_shape, generator=g, device=scaled.device) for g in generators])
                gumbel = -torch.log(-torch.log(uniform))  # [B, V]
                token = (filter_logits(scaled, args.top_k, args.top_p) + gumbel).argmax(-1)
            token = torch.where(finished, pad_id, token)  # [B]
            tokens.append(token)
            logps.append(torch.log_softmax(scaled, -1).gather(-1, token.unsqueeze(-1)).squeeze(-1))
            finished |= torch.isin(token, eos_ids)
            done = finished.all().float()
            if args.fsdp:  # go on until every process is done: FSDP's forwards are collectives
                dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if done or step == args.max_new_tokens - 1:  # the last token is never fed back
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch_size, 1)], dim=1)
            logits = model(
                input_ids=token.unsqueeze(-1),
                attention_mask=attention_mask,
                position_ids=positions[:, -1:] + step + 1,
                cache=cache,
                use_cache=True,
            ).logits[:, -1, : policy.vocab_size]  # [B, V]
    model.train()
    completion_ids = torch.stack(tokens, 1)  # [B, T], padded after EOS
    is_eos = torch.isin(completion_ids, eos_ids)
    completion_mask = (is_eos.cumsum(1) - is_eos.long() == 0).long()  # [B, T], 1 up to and including EOS
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, torch.stack(logps, 1))


def completion_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    prompt_of_row: list[int] | None = None,
    vocab_size: int | None = None,
):
    """Log-probs [B, T] (and entropies [B, T], or None) of the completion tokens under softmax(logits / T). With
    prompt_of_row (each row's prompt, numbered from 0 in order of first appearance), a prompt is encoded once and its
    keys and values copied to its rows: the log-probs and gradients of every row encoded whole, at less compute."""
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
    first_rows = [prompt_of_row.index(p) for p in range(max(prompt_of_row) + 1)]  # a row of each prompt
    owner = torch.tensor(prompt_of_row, device=prompt_ids.device)
    cache = DynamicCache()
    logits = model(
        input_ids=prompt_ids[first_rows],
        attention_mask=prompt_mask[first_rows],
        position_ids=(prompt_mask[first_rows].cumsum(-1) - 1).clamp(min=0),
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[owner]  # [B, 1, V]: the prompt's last position predicts token 0
    if length > 1:
        cache.batch_select_indices(owner)  # [U, heads, P, d] -> [B, heads, P, d] in every layer; gradients flow back
        rest = model(
            input_ids=completion_ids[:, :-1],
            attention_mask=attention_mask,
            position_ids=prompt_mask.sum(1, keepdim=True) + torch.arange(length - 1, device=prompt_ids.device),
            cache=cache,
            use_cache=True,
        ).logits  # [B, T-1, V]
        logits = torch.cat([logits, rest], dim=1)  # [B, T, V]
    return token_logprobs(logits, completion_ids, temperature, with_entropy, vocab_size=vocab_size)


def decode_completions(policy: Policy, batch: Rollout) -> list[str]:
    """Each completion's text before the EOS that ended it, other special tokens kept (no hiding junk in them)."""
    completion_ids = batch.completion_ids.cpu()
    lengths = (batch.completion_mask.cpu() * ~torch.isin(completion_ids, torch.tensor(policy.eos_ids))).sum(1)
    return policy.tokenizer.batch_decode([ids[:n] for ids, n in zip(completion_ids.tolist(), lengths.tolist())])


class MicroBatch(NamedTuple):
    """Some rows of the rollout batch for one forward/backward pass, cut to their longest prompt and completion."""

    rows: slice  # of the rollout batch
    completion_cols: slice  # the completions' first columns, as many as the longest one's tokens
    inputs: tuple  # the rows' prompt ids, prompt mask, completion ids and completion mask, cut to those widths
    prompt_of_row: list[int] | None  # each row's prompt, numbered from 0, to share prompts; None: no sharing


def micro_batches(batch: Rollout, rows: slice, size: int, group_size: int, share: bool) -> list[MicroBatch]:
    """A minibatch's rows cut into micro-batches of `size` rows. share: rows that repeat a prompt encode it once, where
    that skips at least SHARE_MIN_POSITIONS prompt positions."""
    prompt_lengths = batch.prompt_mask.sum(1).tolist()
    completion_lengths = batch.completion_mask.sum(1).tolist()
    plans = []
    for start in range(rows.start, rows.stop, size):
        part = slice(start, min(start + size, rows.stop))
        prompt_width = max(prompt_lengths[part])
        prompt_cols = slice(-prompt_width, None)  # left-padded: the prompts end in the last column
        completion_cols = slice(0, max(completion_lengths[part]))
        columns = (prompt_cols, prompt_cols, completion_cols, completion_cols)  # of Rollout's first four fields
        inputs = tuple(tensor[part, cols] for tensor, cols in zip(batch, columns))
        prompt_of_row = [row // group_size - start // group_size for row in range(part.start, part.stop)]
        repeated_positions = (len(prompt_of_row) - len(set(prompt_of_row))) * prompt_width
        if not share or repeated_positions < SHARE_MIN_POSITIONS:
            prompt_of_row = None
        plans.append(MicroBatch(part, completion_cols, inputs, prompt_of_row))
    return plans


@torch.no_grad()
def fixed_logprobs(model, batch: Rollout, plans: list[MicroBatch], temperature: float, vocab_size: int):
    """Log-probs [B, T] of the completion tokens of the planned micro-batches, without gradients; 0 in other rows."""
    logp = torch.zeros_like(batch.sampler_logp)
    for micro in plans:
        micro_logp, _ = completion_logprobs(model, *micro.inputs, temperature, False, micro.prompt_of_row, vocab_size)
        logp[micro.rows, micro.completion_cols] = micro_logp
    return logp


# ---- The data stream, sampling a step, evaluation
def seeded_generator(key: list[int], device) -> torch.Generator:
    """A torch generator seeded by a list of integers, which numpy's SeedSequence mixes into one seed."""
    seed = np.random.SeedSequence(key).generate_state(1)[0]
    return torch.Generator(device).manual_seed(int(seed))


@functools.lru_cache(maxsize=2)
def epoch_order(seed: int, epoch: int, num_rows: int) -> np.ndarray:
    """The order in which epoch `epoch` visits the training rows: a permutation seeded by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


class Round(NamedTuple):
    """Groups of completions and what they earned."""

    batch: Rollout
    rows: list[dict]  # each completion's data row
    completions: list[str]
    rewards: dict  # {name: [B]}, each reward
    reward: torch.Tensor  # [B], their weighted sum


def sample_round(policy: Policy, rows, prompts, positions: range, reward_fns, args: Args, timings: dict) -> Round:
    """Steps 1 and 2 for the prompts at these positions of the data stream: group_size completions each, rewarded. The
    stream visits the rows in an order seeded by (seed, epoch) each epoch and samples position p's group by a generator
    seeded by (seed, p): a resumed or multi-process run samples what one uninterrupted process does."""
    cuda = policy.device.type == "cuda"
    start = clock(cuda)
    chosen = [epoch_order(args.seed, position // len(rows), len(rows))[position % len(rows)] for position in positions]
    generators = [seeded_generator([args.seed, position], policy.device) for position in positions]
    group_prompts = [prompts[i] for i in chosen for _ in range(args.group_size)]
    batch = generate(policy, group_prompts, args, generators, args.group_size)
    generated = clock(cuda)
    completions = decode_completions(policy, batch)  # rewards judge the text before EOS
    sample_rows = [rows[i] for i in chosen for _ in range(args.group_size)]
    prompt_texts = [row["prompt"] for row in sample_rows]
    rewards = compute_rewards(prompt_texts, completions, [row["answer"] for row in sample_rows], reward_fns)
    reward = sum(weight * rewards[name] for name, _, weight in reward_fns)  # [B]
    timings["generation"] += generated - start
    timings["reward"] += clock(cuda) - generated
    return Round(batch, sample_rows, completions, rewards, reward)


def sample_step(policy: Policy, rows, prompts, reward_fns, data_position: int, args: Args, timings: dict):
    """Steps 1 and 2: this process's groups of the step, and the sampling's counts. With --dynamic-sampling, a group
    whose rewards are all equal (no signal) is dropped and more prompts are drawn, in rounds all processes take
    together, --max-sampling-rounds at most; then the last round's groups without signal fill the step."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    num_groups = args.prompts_per_step // world_size
    max_rounds = args.max_sampling_rounds if args.dynamic_sampling else 1
    rounds = []
    kept = []  # (round, group) of the groups with signal; of every group without --dynamic-sampling
    for number in range(max_rounds):
        first = data_position + number * args.prompts_per_step
        positions = range(first + rank, first + args.prompts_per_step, world_size)
        rounds.append(sample_round(policy, rows, prompts, positions, reward_fns, args, timings))
        grouped = rounds[-1].reward.view(-1, args.group_size)
        has_signal = (grouped.amax(1) > grouped.amin(1)).tolist()  # [groups]
        kept += [(number, group) for group in range(num_groups) if has_signal[group] or not args.dynamic_sampling]
        if number + 1 == max_rounds or all_sum({"short": len(kept) < num_groups}, policy.device)["short"] == 0:
            break
    counts = {"sampling_rounds": len(rounds), "prompts_consumed": len(rounds) * args.prompts_per_step}
    counts["groups_dropped"] = len(rounds) * num_groups - max(len(kept), num_groups)  # without signal, not filled in
    # out of rounds: the last round's groups without signal fill the step
    kept += [(number, group) for group in range(num_groups) if not has_signal[group]]
    kept = kept[:num_groups]  # a last round's surplus groups with signal are not needed
    if len(rounds) == 1:  # then every group of it is kept: nothing to merge
        return rounds[0], counts
    parts = [(rounds[number], slice(group * args.group_size, (group + 1) * args.group_size)) for number, group in kept]
    pad_id = policy.tokenizer.pad_token_id
    tensors = []  # each Rollout field of the kept groups, padded to the widest
    for field, fill in zip(Rollout._fields, (pad_id, 0, pad_id, 0, 0.0)):
        pieces = [row for part, span in parts for row in getattr(part.batch, field)[span]]  # [width] each
        side = "left" if field.startswith("prompt") else "right"
        tensors.append(torch.nn.utils.rnn.pad_sequence(pieces, batch_first=True, padding_value=fill, padding_side=side))
    sample_rows = [row for part, span in parts for row in part.rows[span]]
    completions = [text for part, span in parts for text in part.completions[span]]
    rewards = {name: torch.cat([part.rewards[name][span] for part, span in parts]) for name in rounds[0].rewards}
    reward = torch.cat([part.reward[span] for part, span in parts])
    return Round(Rollout(*tensors), sample_rows, completions, rewards, reward), counts


def majority_right(completions: list[str], answer: str) -> float:
    """maj@k of one prompt: 1.0 when the answer its completions state most often is right. Two answers count as one
    when same_answer says so; a completion that states none does not vote."""
    reference = stated_answer(answer, answer.strip())
    if reference is None:
        return 0.0
    stated = [stated_answer(completion, unstated(completion, reference)) for completion in completions]
    votes = [vote for vote in stated if vote]
    winner = max(dict.fromkeys(votes), key=lambda vote: sum(same_answer(other, vote) for other in votes), default=None)
    return float(winner is not None and same_answer(winner, reference))


@torch.no_grad()
def evaluate(policy: Policy, prompts, rows, args: Args, reward_fns) -> dict:
    """Held-out metrics, every process evaluating every prompt; the first prompt's completion is printed as a sample.
    --eval-num-samples 1: greedy accuracy. k > 1: k completions a prompt at --temperature, seeded by (seed, prompt) at
    every evaluation: pass@1, pass@k (one is right), maj@k and, with --prm-path, prm@k (the PRM's pick is right)."""
    if not rows:
        return {"eval_accuracy": math.nan}
    k = args.eval_num_samples
    prompts_per_batch = max(1, args.eval_batch_size // k)
    texts = []
    for start in range(0, len(rows), prompts_per_batch):
        numbers = range(start, min(start + prompts_per_batch, len(rows)))
        generators = None
        if k > 1:  # (seed, prompt, 1): apart from the training prompts' (seed, position)
            generators = [seeded_generator([args.seed, number, 1], policy.device) for number in numbers]
        completed = generate(policy, [prompts[number] for number in numbers for _ in range(k)], args, generators, k)
        texts += decode_completions(policy, completed)
    print0(f"held-out sample: {rows[0]['prompt']!r} -> {texts[0]!r} (reference {rows[0]['answer']!r})")
    right = torch.tensor([answer_reward(text, rows[i // k]["answer"]) for i, text in enumerate(texts)]).view(-1, k)
    if k == 1:
        return {"eval_accuracy": right.mean().item()}
    metrics = {"eval_pass@1": right.mean().item(), f"eval_pass@{k}": right.amax(1).mean().item()}
    majority = [majority_right(texts[i * k : (i + 1) * k], row["answer"]) for i, row in enumerate(rows)]
    metrics[f"eval_maj@{k}"] = float(np.mean(majority))
    for name, prm_reward, _ in reward_fns:
        if name == "prm":  # best-of-k by the PRM: the standard test of a PRM (Lightman et al.)
            scores = torch.tensor(prm_reward([rows[i // k]["prompt"] for i in range(len(texts))], texts)).view(-1, k)
            metrics[f"eval_prm@{k}"] = right[torch.arange(len(rows)), scores.argmax(1)].mean().item()
    return metrics


# ---- Schedule, metrics, processes, checkpoints and flag checks
def get_lr(step: int, args: Args) -> float:
    """The learning rate of step `step` (from 0), as nanoGPT's: linear warm-up, then constant or cosine decay to 0."""
    if step < args.warmup_steps:
        return args.learning_rate * (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant":
        return args.learning_rate
    progress = (step - args.warmup_steps) / max(1, args.total_steps - args.warmup_steps)
    return args.learning_rate * (1 + math.cos(math.pi * progress)) / 2


# dense bf16 TFLOP/s by GPU name, for MFU (the more specific names first)
PEAK_TFLOPS = {"H100 PCIe": 756, "H100": 989, "H200": 989, "B200": 2250, "A100": 312, "L40S": 362, "L4": 121}
CONSOLE = {
    "reward": "reward",
    "accuracy": "acc",
    "kl_mean": "kl",
    "clip_frac_low": "clip_lo",
    "clip_frac_high": "clip_hi",
    "completion_length": "len",
    "eval_accuracy": "eval_acc",
    "eval_pass@1": "pass@1",
    "step_time_s": "dt",
}
SHARE_MIN_POSITIONS = 128  # prompt positions a micro-batch must skip to share its prompts (2.5x on long prompts)
STUCK_STEPS = 5  # steps in a row of a problem that stops learning before it is warned about
MAX_BAD_UPDATES = 3  # updates in a row with a non-finite loss (each one skipped) that stop the run


def all_sum(values: dict, device) -> dict:
    """A dict of numbers summed over processes, in one all-reduce."""
    summed = torch.stack([torch.as_tensor(value, dtype=torch.float64, device=device) for value in values.values()])
    if dist.is_initialized():
        dist.all_reduce(summed)
    return dict(zip(values, summed.tolist()))


def clock(cuda: bool) -> float:
    """Wall time in seconds, once the GPU has done the work queued so far."""
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def warn_if_stuck(metrics: dict, truncated_correct: float, streaks: dict, args: Args) -> None:
    """Warn once about a problem that keeps a run from learning when STUCK_STEPS steps in a row (streaks) show it."""
    cut = metrics["truncated_frac"] > 0.5 and truncated_correct == 0
    flat = metrics["frac_zero_std_groups"] == 1.0
    problems = {
        f"most completions were cut at --max-new-tokens {args.max_new_tokens}, none with a right answer: raise it": cut,
        "every group's completions got equal rewards: zero advantages, nothing to learn (see completions.jsonl)": flat,
    }
    for message, happening in problems.items():
        if streaks.get(message, 0) < STUCK_STEPS:  # a streak that reached it stays: no second warning
            streaks[message] = streaks.get(message, 0) + 1 if happening else 0
            if streaks[message] == STUCK_STEPS:
                print0(f"warning: {STUCK_STEPS} steps in a row: {message}", file=sys.stderr)


def completion_rows(sampled: Round, advantages: torch.Tensor, group_size: int) -> list[dict]:
    """The first completion of each group (8 at most): prompt, text, rewards and advantage, for completions.jsonl."""
    rows = []
    for i in range(0, len(sampled.completions), group_size)[:8]:
        row = {"prompt": sampled.rows[i]["prompt"], "completion": sampled.completions[i]}
        row["reward"] = sampled.reward[i].item()
        for name, values in sampled.rewards.items():
            row[f"reward_{name}"] = values[i].item()
        row["advantage"] = advantages[i].item()
        rows.append(row)
    return rows


def update_stats(logged: list[dict], num_minibatches: int, device) -> dict:
    """The last pass's statistics over every micro-batch and process: token-weighted means, the loss per minibatch."""
    sums = {"loss": 0.0}
    for stats in logged:
        for key, value in stats.items():
            weight = 1 if key in ("loss", "tokens") else stats["tokens"]  # a loss is its share of its minibatch's
            sums[key] = sums.get(key, 0.0) + value * weight
    sums = all_sum(sums, device)
    means = {key: value / max(sums["tokens"], 1.0) for key, value in sums.items() if key != "tokens"}
    means["loss"] = sums["loss"] / num_minibatches
    return means


def benchmark_summary(history: list[dict], cuda: bool) -> dict:
    """Time per step and per phase, generated and trained tokens/s, peak memory and MFU of a run's steps."""
    timed = history[1:] or history or [{}]  # the first step warms up, left out of the means and rates; no step: nan
    keys = ("step_time_s", "generated_tokens", "generation_time_s", "trained_tokens", "update_time_s", "mfu")
    totals = {key: sum(metrics.get(key, math.nan) for metrics in timed) for key in keys}
    summary = {"step_time_s_mean": totals["step_time_s"] / len(timed)}
    for phase in ("generation", "reward", "reference", "update"):
        summary[f"{phase}_time_s"] = sum(metrics[f"{phase}_time_s"] for metrics in history)
    summary["generated_tokens_per_s"] = totals["generated_tokens"] / totals["generation_time_s"]
    summary["trained_tokens_per_s"] = totals["trained_tokens"] / totals["update_time_s"]
    summary["peak_memory_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    if cuda:
        summary["peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
    summary["mfu"] = totals["mfu"] / len(timed)
    return summary


MAY_CHANGE_ON_RESUME = (  # flags a resume may change: the others define the run and must be its checkpoint's
    "total_steps eval_every eval_batch_size num_eval_rows eval_data_path eval_num_samples log_completions_every"
    " save_every keep_checkpoints resume_from output_dir overwrite track wandb_project_name micro_batch_size"
    " gradient_checkpointing"
).split()


def save_run(path: str, model, tokenizer, args: Args, optimizer=None, state: dict | None = None) -> None:
    """Model or adapter, tokenizer, args and any trainer state, to path; every process calls it, rank 0 writes."""
    options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, from FSDP's shards too
    all_names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tied = all_names - set(dict(model.named_parameters()))  # saved once, under their first name, with FSDP too
    weights = {name: w for name, w in dcp.get_model_state_dict(model, options=options).items() if name not in tied}
    if state is not None:
        state = {**state, "optimizer": dcp.get_optimizer_state_dict(model, optimizer, options=options)}
    if int(os.environ.get("RANK", 0)) != 0:
        return
    temporary = path + ".tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    model.save_pretrained(temporary, state_dict=weights)
    tokenizer.save_pretrained(temporary)
    with open(os.path.join(temporary, "args.json"), "w") as f:
        json.dump(asdict(args), f, indent=2)
    if state is not None:
        torch.save(state, os.path.join(temporary, "trainer_state.pt"))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(temporary, path)  # only now: a kill leaves no half checkpoint


def checkpoint_steps(output_dir: str) -> list[int]:
    """The steps of output_dir's checkpoints, oldest first (not checkpoint-STEP.tmp: a save cut short)."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    return sorted(int(name[11:]) for name in names if re.fullmatch(r"checkpoint-\d+", name))


def prepare_output_dir(args: Args, device) -> tuple[str, str | None, dict | None]:
    """(output directory, checkpoint to resume or None, a finished run's summary); a crash's logs alone are no run."""
    output_dir = args.output_dir
    if output_dir is None:
        stamp = torch.tensor([time.time()], dtype=torch.float64, device=device)
        if dist.is_initialized():  # rank 0's clock: one run name everywhere
            dist.broadcast(stamp, src=0)
        output_dir = os.path.join("runs", f"grpo__{args.seed}__{int(stamp.item())}")
    steps = checkpoint_steps(output_dir)
    if args.resume_from is None and (steps or os.path.isdir(os.path.join(output_dir, "final"))) and not args.overwrite:
        raise UserError(f"{output_dir} already holds a run: --resume-from latest continues it, --overwrite replaces it")
    if args.resume_from is None:
        return output_dir, None, None
    resume = args.resume_from
    if resume == "latest" and steps:
        resume = os.path.join(output_dir, f"checkpoint-{steps[-1]}")
    if resume != "latest":
        if not os.path.isfile(os.path.join(resume, "trainer_state.pt")):
            raise UserError(f"--resume-from {resume}: not a checkpoint of grpo.py")
        with open(os.path.join(resume, "args.json")) as f:
            saved = json.load(f)
        here = asdict(args)
        differ = [key for key in here if key not in MAY_CHANGE_ON_RESUME and saved[key] != here[key]]
        if differ:
            changes = "; ".join(f"--{key.replace('_', '-')} {saved[key]!r} there, {here[key]!r} here" for key in differ)
            raise UserError(f"--resume-from {resume}: the checkpoint's run differs ({changes})")
    summary_path = os.path.join(output_dir, "summary.json")
    if os.path.isfile(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
        if summary["steps"] >= args.total_steps:
            message = f"{output_dir}: the run finished at step {summary['steps']} (with a checkpoint, a larger"
            print0(f"{message} --total-steps extends it)")
            return output_dir, None, summary
    if resume == "latest":
        message = f"--resume-from latest: {output_dir} holds no checkpoint (--save-every N writes them)"
        raise UserError(f"{message}; --overwrite starts it anew")
    return output_dir, resume, None


def remove_earlier_run(output_dir: str) -> None:
    """What an earlier run, or a crash, left in output_dir: its final model, checkpoints and logs."""
    for name in ["final", *[f"checkpoint-{step}" for step in checkpoint_steps(output_dir)]]:
        shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    for path in [os.path.join(output_dir, name) for name in ("summary.json", "completions.jsonl")]:
        if os.path.isfile(path):  # (RunLogger starts metrics.jsonl anew)
            os.remove(path)


def restore(path: str, output_dir: str, model, optimizer, args: Args) -> dict:
    """The optimiser state of a checkpoint, the logs cut back to its step; its trainer state."""
    state = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=True)
    options = dcp.StateDictOptions(full_state_dict=args.fsdp)  # FSDP: each shard takes its part
    dcp.set_optimizer_state_dict(model, optimizer, state.pop("optimizer"), options=options)  # (not kept twice)
    torch.set_rng_state(state["rng"])
    for log_path in [os.path.join(output_dir, name) for name in ("metrics.jsonl", "completions.jsonl")]:
        if int(os.environ.get("RANK", 0)) == 0 and os.path.isfile(log_path):
            with open(log_path) as f:
                kept = [line for line in f if json.loads(line)["step"] <= state["step"]]
            with open(log_path, "w") as f:
                f.writelines(kept)
    return state


def check_args(args: Args, world_size: int) -> None:
    """The flag values users get wrong, before anything is loaded."""
    counts = ["prompts_per_step", "max_new_tokens", "num_iterations", "num_minibatches", "eval_batch_size"]
    for name in counts + ["max_sampling_rounds", "eval_num_samples"]:
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if args.group_size < 2:
        raise UserError("--group-size must be at least 2: advantages compare the completions of a prompt")
    if not 0 < args.clip_eps_low <= 1 or args.clip_eps_high <= 0:
        raise UserError("--clip-eps-low must be in (0, 1], --clip-eps-high above 0")
    if args.learning_rate <= 0 or args.temperature <= 0 or not 0 < args.top_p <= 1:
        raise UserError("--learning-rate and --temperature must be above 0, --top-p in (0, 1]")
    if args.prompts_per_step % (world_size * args.num_minibatches) != 0:
        message = f"--prompts-per-step {args.prompts_per_step} must be divisible by the {world_size} processes"
        raise UserError(f"{message} times --num-minibatches {args.num_minibatches}")
    minibatch_rows = args.prompts_per_step // world_size * args.group_size // args.num_minibatches
    if args.micro_batch_size and minibatch_rows % args.micro_batch_size != 0:
        raise UserError(f"--micro-batch-size {args.micro_batch_size} must divide the {minibatch_rows}-row minibatch")
    if args.fsdp and "WORLD_SIZE" not in os.environ:
        raise UserError("--fsdp needs a launch by torchrun")


def train(args: Args) -> dict:
    # ---- Set-up: processes, device, output directory
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    is_main = rank == 0
    distributed = world_size > 1 or args.fsdp
    check_args(args, world_size)
    cuda = torch.cuda.is_available()
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    bf16 = cuda and torch.cuda.is_bf16_supported(including_emulation=False)
    output_dir, resume_path, finished = prepare_output_dir(args, device)
    if finished is not None:
        if distributed:
            dist.destroy_process_group()
        return finished
    print0(f"output directory: {output_dir}")

    # ---- Data, policy, reference policy, rewards, optimiser
    if args.data_path is None:
        train_rows, eval_rows = builtin_task(args.seed)
    else:
        train_rows = load_jsonl(args.data_path)
        eval_rows = []
    if args.eval_data_path:
        eval_rows = load_jsonl(args.eval_data_path)
    eval_rows = eval_rows[: args.num_eval_rows]
    seed_everything(args.seed)
    policy, reference = build_policy(args, bf16, resume_path, device)
    model = policy.model
    train_prompts = encode_prompts(policy.tokenizer, train_rows, args)
    eval_prompts = encode_prompts(policy.tokenizer, eval_rows, args)
    reward_fns = make_reward_fns(args, device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, betas=(0.9, 0.99), weight_decay=args.weight_decay, fused=True)
    state = {"step": 0, "data_position": 0, "eval_start": {}, "skipped": 0}
    if resume_path:
        state = restore(resume_path, output_dir, model, optimizer, args)
    start_step = state["step"]
    data_position = state["data_position"]  # of the next prompt in the data stream
    eval_start = state["eval_start"]
    skipped_updates = state["skipped"]
    if resume_path is None and is_main:  # every check passed: what was there before may go
        remove_earlier_run(output_dir)

    # ---- Logging; the batch's layout: a process holds whole groups, its minibatches are runs of them
    logger = RunLogger(output_dir, asdict(args), console_keys=CONSOLE, enabled=is_main, append=resume_path is not None)
    num_params = sum(p.numel() for p in model.parameters())
    num_trained = sum(p.numel() for p in trainable)
    message = f"model {args.model}: {num_params:,} parameters ({num_trained:,} trained), bf16 {bf16}, {world_size}"
    print0(f"{message} process(es); {len(train_rows)} training prompts, {len(eval_rows)} held out")
    local_rows = args.prompts_per_step // world_size * args.group_size  # B: this process's completions per step
    minibatch_rows = local_rows // args.num_minibatches
    minibatches = [slice(j * minibatch_rows, (j + 1) * minibatch_rows) for j in range(args.num_minibatches)]
    micro_batch_size = args.micro_batch_size or minibatch_rows
    share_prompts = not (args.gradient_checkpointing or args.fsdp)  # both need one forward pass per micro-batch
    importance_sampling = "sequence" if args.policy_loss == "gspo" else "token"  # GSPO: PPO, a ratio per completion
    completions_every = args.eval_every if args.log_completions_every is None else args.log_completions_every
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    peak_tflops = next((tflops for name, tflops in PEAK_TFLOPS.items() if name in device_name), 0)

    if not resume_path and eval_rows:
        eval_start = evaluate(policy, eval_prompts, eval_rows, args, reward_fns)
        logger.log(0, eval_start)
    eval_end = eval_start
    bad_updates = 0
    streaks = {}  # see warn_if_stuck
    history = []
    stopped = False
    stop_signals = []

    def request_stop(signum, frame):  # a signal ends the step, then a checkpoint is saved
        stop_signals.append(signum)

    previous_handlers = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    run_start = time.perf_counter()
    try:
        for step in range(start_step, args.total_steps):
            step_start = clock(cuda)
            # 1. rollout and 2. rewards (see sample_step)
            timings = {"generation": 0.0, "reward": 0.0}
            sampled, sampling = sample_step(policy, train_rows, train_prompts, reward_fns, data_position, args, timings)
            data_position += sampling["prompts_consumed"]
            batch = sampled.batch
            rewarded_at = clock(cuda)

            # 3. advantages, over every process's groups (the batch's std needs them all)
            scores = torch.stack([sampled.reward, *sampled.rewards.values()]).to(device)  # [1 + R, B]: total, each
            if distributed:
                parts = [torch.empty_like(scores) for _ in range(world_size)]
                dist.all_gather(parts, scores)
                scores = torch.cat(parts, 1)  # [1 + R, W*B], rank after rank
            all_advantages = group_advantages(scores[0], args.group_size, args.scale_rewards)  # [W*B]
            advantages = all_advantages[rank * local_rows : (rank + 1) * local_rows]  # [B]
            truncated = ~torch.isin(batch.completion_ids, torch.tensor(policy.eos_ids, device=device)).any(1)  # [B]
            loss_mask = batch.completion_mask
            if args.mask_truncated_completions:
                loss_mask = batch.completion_mask * ~truncated[:, None]

            # 4. log-probs that stay fixed through the update, without gradients: the reference policy's, for the KL,
            # and the rollout policy's ("old"), which the ratio r = pi / pi_old divides by. Minibatch 0 is trained on
            # before any update moves the policy, so its old log-probs are those of its first training forward (step
            # 5); minibatches 1+ are scored here, by the policy that sampled them.
            plans = [micro_batches(batch, mb, micro_batch_size, args.group_size, share_prompts) for mb in minibatches]
            every_micro_batch = [micro for plan in plans for micro in plan]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                ref_logp = torch.zeros_like(batch.sampler_logp)  # unused at --kl-coef 0
                if args.kl_coef and args.lora_r:
                    with model.disable_adapter():  # the base model without its adapter is the initial policy
                        ref_logp = fixed_logprobs(model, batch, every_micro_batch, args.temperature, policy.vocab_size)
                elif args.kl_coef:
                    ref_logp = fixed_logprobs(reference, batch, every_micro_batch, args.temperature, policy.vocab_size)
                later_micro_batches = [micro for plan in plans[1:] for micro in plan]
                old_logp = fixed_logprobs(model, batch, later_micro_batches, args.temperature, policy.vocab_size)
            referenced_at = clock(cuda)

            # 5. update: num_iterations passes over the batch, each num_minibatches optimiser steps (PPO's epochs and
            # minibatches); a minibatch's micro-batches accumulate their gradients
            for param_group in optimizer.param_groups:
                param_group["lr"] = get_lr(step, args)
            minibatch_tokens = all_sum({j: loss_mask[mb].sum() for j, mb in enumerate(minibatches)}, device)
            grad_norms = []
            logged = []  # the last pass's statistics, one dict per micro-batch
            for iteration in range(args.num_iterations):
                last_pass = iteration == args.num_iterations - 1
                for j, plan in enumerate(plans):
                    for micro in plan:
                        part = micro.rows
                        cols = micro.completion_cols
                        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                            logp, entropy = completion_logprobs(
                                model,
                                *micro.inputs,
                                args.temperature,
                                last_pass,
                                micro.prompt_of_row,
                                policy.vocab_size,
                            )
                        if iteration == 0 and j == 0:  # the policy has not moved yet: these are the old log-probs
                            old_logp[part, cols] = logp.detach()
                        mask = loss_mask[part, cols]
                        loss, stats = grpo_loss(
                            logp,
                            old_logp[part, cols],
                            ref_logp[part, cols],
                            advantages[part],
                            mask,
                            clip_eps_low=args.clip_eps_low,
                            clip_eps_high=args.clip_eps_high,
                            kl_coef=args.kl_coef,
                            loss_type=args.loss_type,
                            max_completion_length=args.max_new_tokens,
                            delta=args.delta,
                            importance_sampling=importance_sampling,
                            kl_estimator=args.kl_estimator,
                            kl_ratio_weighted=args.kl_ratio_weighted,
                            total_sequences=minibatch_rows * world_size,
                            total_tokens=minibatch_tokens[j],
                        )
                        loss.backward()
                        if last_pass:
                            stats["loss"] = loss.detach()
                            stats["entropy"] = (entropy * mask).sum() / stats["tokens"].clamp(min=1.0)
                            logged.append(stats)
                    if distributed and not args.fsdp:  # each process's loss is its share: the gradients are summed
                        for p in trainable:
                            dist.all_reduce(p.grad)
                    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, args.max_grad_norm or math.inf)  # 0: no clip
                    if hasattr(grad_norm, "full_tensor"):  # FSDP: the norm is a tensor sharded over processes
                        grad_norm = grad_norm.full_tensor()
                    grad_norms.append(float(grad_norm))
                    if math.isfinite(grad_norms[-1]):  # the same on every process: the gradients are summed
                        optimizer.step()
                        bad_updates = 0
                    else:  # a non-finite loss or gradient would poison the weights: skip the update
                        skipped_updates += 1
                        bad_updates += 1
                        print0(f"warning: step {step + 1}: non-finite gradient, update skipped", file=sys.stderr)
                    if bad_updates == MAX_BAD_UPDATES:
                        message = f"{MAX_BAD_UPDATES} updates in a row had a non-finite loss or gradient"
                        raise UserError(f"{message}: lower --learning-rate or check the rewards")
                    optimizer.zero_grad(set_to_none=True)
            updated_at = clock(cuda)

            # 6. log, evaluate, save; the metrics are over every process
            metrics = {"reward": scores[0].mean(), "reward_std": scores[0].std(), "accuracy": scores[1].mean()}
            for i, name in enumerate(sampled.rewards):
                metrics[f"reward_{name}"] = scores[1 + i].mean()
            metrics["frac_zero_std_groups"] = (all_advantages.view(-1, args.group_size) == 0).all(1).float().mean()
            metrics.update(update_stats(logged, args.num_minibatches, device))
            metrics["grad_norm"] = np.mean(grad_norms[-args.num_minibatches :])
            metrics["learning_rate"] = get_lr(step, args)
            counts = {
                "generated": batch.completion_mask.sum(),
                "truncated": truncated.sum(),
                "truncated_correct": (truncated.cpu() & (sampled.rewards["answer"] > 0)).sum(),
                "prompt_tokens": batch.prompt_mask.sum(),
                "gap": ((old_logp - batch.sampler_logp).abs() * batch.completion_mask).sum(),  # same weights, tokens
                "groups_dropped": sampling["groups_dropped"],
                "stop": len(stop_signals),
            }
            counts = all_sum(counts, device)
            metrics["completion_length"] = counts["generated"] / scores.shape[1]
            metrics["truncated_frac"] = counts["truncated"] / scores.shape[1]
            metrics["logp_gap_mean"] = counts["gap"] / counts["generated"]  # the sampler's against the trainer's
            metrics["sampling_rounds"] = sampling["sampling_rounds"]  # more than 1 with --dynamic-sampling
            metrics["groups_dropped"] = counts["groups_dropped"]
            metrics["prompts_consumed"] = sampling["prompts_consumed"]
            metrics["generated_tokens"] = counts["generated"]
            metrics["trained_tokens"] = sum(minibatch_tokens.values()) * args.num_iterations
            metrics["generation_time_s"] = timings["generation"]
            metrics["reward_time_s"] = timings["reward"]
            metrics["reference_time_s"] = referenced_at - rewarded_at
            metrics["update_time_s"] = updated_at - referenced_at
            metrics["step_time_s"] = updated_at - step_start
            if peak_tflops and bf16:  # FLOPs: 2 per weight and token forward, 4 backward (2 with LoRA)
                passes = 1 + (args.kl_coef > 0) + args.num_iterations * (2 if args.lora_r else 3)  # rollout ~ 1 pass
                flops = 2 * num_params * passes * (counts["prompt_tokens"] + counts["generated"])
                metrics["mfu"] = flops / world_size / metrics["step_time_s"] / (peak_tflops * 1e12)
            if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.total_steps:
                eval_end = evaluate(policy, eval_prompts, eval_rows, args, reward_fns)
                metrics.update(eval_end)
            logger.log(step + 1, metrics)
            history.append(metrics)
            if completions_every and (step + 1) % completions_every == 0:
                logger.log_rows(step + 1, "completions", completion_rows(sampled, advantages, args.group_size))
            warn_if_stuck(metrics, counts["truncated_correct"], streaks, args)
            stopped = counts["stop"] > 0  # a signal to any process stops every process after the same step
            if (args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == args.total_steps)) or stopped:
                state = {"step": step + 1, "data_position": data_position, "eval_start": eval_start}
                state["skipped"] = skipped_updates
                state["rng"] = torch.get_rng_state()
                checkpoint = os.path.join(output_dir, f"checkpoint-{step + 1}")
                save_run(checkpoint, model, policy.tokenizer, args, optimizer, state)
                if is_main and args.keep_checkpoints:  # 0 keeps them all
                    for old in checkpoint_steps(output_dir)[: -args.keep_checkpoints]:
                        shutil.rmtree(os.path.join(output_dir, f"checkpoint-{old}"))
            if stopped:
                message = f"stopped by a signal: checkpoint-{step + 1} saved; continue with the same command and"
                print0(f"{message} --output-dir {output_dir} --resume-from latest")
                break
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)

    # ---- Final model, evaluation and benchmark summary
    if not stopped:
        save_run(os.path.join(output_dir, "final"), model, policy.tokenizer, args)
        eval_end = evaluate(policy, eval_prompts, eval_rows, args, reward_fns)
        if eval_rows:
            logger.log(start_step + len(history), eval_end)
    summary = {"steps": start_step + len(history), "interrupted": stopped}
    summary["total_time_s"] = time.perf_counter() - run_start
    summary.update(benchmark_summary(history, cuda))
    summary.update({f"{key}_start": value for key, value in eval_start.items()})
    summary.update({f"{key}_end": value for key, value in eval_end.items()})
    summary["skipped_updates"] = skipped_updates
    summary["resumed_from_step"] = start_step
    summary["stop_signal"] = signal.Signals(stop_signals[0]).name if stopped else None
    if not stopped:
        logger.summary(summary)
    logger.close()
    if distributed:
        dist.barrier()  # rank 0 may still be writing
        dist.destroy_process_group()
    return summary


def main() -> None:
    try:
        summary = train(tyro.cli(Args))
    except KeyboardInterrupt:  # before training starts (then a signal ends the step and saves): nothing to save yet
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as error:  # a UserError of this file or of prm.py; under torchrun every process meets it
        if type(error).__name__ != "UserError":
            raise
        print0(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    if summary["stop_signal"]:  # checkpointed, not finished: a scheduler must not take it for done
        sys.exit(128 + signal.Signals[summary["stop_signal"]])


if __name__ == "__main__":
    main()
