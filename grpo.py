"""GRPO (Group Relative Policy Optimization) for causal language models, in one file.

GRPO (Shao et al. 2024, https://arxiv.org/abs/2402.03300) samples `group_size` completions for each prompt,
scores them with verifiable rewards, and uses each completion's reward standardised within its group as the
advantage of every one of its tokens. The loss is PPO's clipped surrogate plus a KL penalty to a frozen
reference policy. No value model.

Where this file departs from the paper, and why:
1. Clipping is `-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)` for both signs of A, with separate low and high
   epsilons (DAPO, https://arxiv.org/abs/2503.14476) and an optional two-sided bound `delta` on r
   (INTELLECT-2, https://arxiv.org/abs/2505.07291). Some trainers take `max` when A < 0, which removes the
   corrective gradient: not here.
2. The KL penalty is added to the per-token loss (the paper's form), estimated with k3 by default
   (http://joschu.net/blog/kl-approx.html); `--kl-coef 0` builds no reference model at all.
3. Loss aggregation is explicit (`--loss-type`, see `grpo_loss`), and every normaliser is the count over the
   whole batch (or minibatch: `--num-minibatches`), across micro-batches and processes, so the update never depends
   on how the batch is split.
4. `--scale-rewards group|batch|none`: the paper divides by each group's std; the default divides by the batch's
   (reward differences keep their scale across groups); Dr. GRPO (https://arxiv.org/abs/2503.20783) uses none.
5. Log-probs are computed at completion positions only, from logits divided by the sampling temperature, in
   fp32; the sampler's own log-probs are kept and their gap to the training log-probs is logged every step.
6. Each prompt's completions are sampled from its own random stream, keyed by (seed, step, prompt index), with
   the Gumbel-max trick: a prompt gets the same noise whichever process samples it (its tokens match up to the
   rounding of logits computed in another batch shape), and a resumed run samples exactly what an uninterrupted one
   would.

Run it:
    python grpo.py                                     # tiny model, built-in task, CPU, about a minute
    python grpo.py --kl-coef 0.05 --loss-type grpo     # any flag: python grpo.py --help
    python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --data-path gsm8k.jsonl --lora-r 16 --kl-coef 0.05 \\
        --max-new-tokens 256 --learning-rate 1e-5 --output-dir runs/qwen-gsm8k
    torchrun --standalone --nproc_per_node 8 grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --data-path gsm8k.jsonl
    torchrun --standalone --nproc_per_node 8 grpo.py --fsdp --model Qwen/Qwen2.5-7B-Instruct ...   # sharded
"""

import contextlib
import copy
import datetime
import functools
import hashlib
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
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, fields
from decimal import Decimal
from fractions import Fraction
from typing import Annotated, Callable, Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import tyro

from common import RunLogger, print0, seed_everything


@dataclass
class Args:
    # Experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the experiment: model init, prompt order and sampling all follow from it"""
    # (tyro would print "(default: None)" after the docstring's own default)
    output_dir: Annotated[Optional[str], tyro.conf.arg(
        help_behavior_hint="(default: runs/{run_name}, or the folder of the --resume-from checkpoint)")] = None
    """where metrics.jsonl, summary.json, checkpoints and final/ go"""
    track: bool = False
    """log to Weights & Biases (WANDB_MODE=offline works; a failure to start is a warning, not a crash)"""
    wandb_project_name: str = "grpo"
    """the wandb project"""
    wandb_entity: Optional[str] = None
    """the wandb entity (team); None = your default"""
    wandb_group: Optional[str] = None
    """the wandb group; None = a random name for a new run, the checkpoint's run's group for a resume"""

    # Model and data
    model: str = "tiny"
    """`tiny` (a small random-init Llama built here, no download) or a hub id / local path of a causal LM"""
    trust_remote_code: bool = False
    """allow code from the model repository to run (off: only enable for repositories you trust)"""
    data_path: Optional[str] = None
    """JSONL training prompts, one {"prompt": str, "answer": str} per line; None = the built-in task"""
    eval_data_path: Optional[str] = None
    """JSONL held-out prompts in the same format; None = the built-in eval set, or no eval with --data-path"""
    num_eval_prompts: int = 200
    """how many held-out prompts to evaluate (the first of --eval-data-path's; on the built-in task, this many of
    its 900 prompts are held out of training, even with --eval-data-path)"""
    chat_template: bool = True
    """wrap prompts in the tokenizer's chat template when it has one (--no-chat-template for base models)"""
    system_prompt: Optional[str] = None
    """a system message before every prompt, training and held-out alike (needs a chat template)"""
    max_prompt_length: int = 512
    """prompts longer than this many tokens are an error (they would be truncated silently otherwise)"""
    lora_r: int = 0
    """LoRA rank; 0 = full fine-tuning"""
    lora_alpha: int = 32
    """LoRA scaling numerator (the update is scaled by alpha / r)"""
    lora_target_modules: str = "all-linear"
    """comma-separated module names to adapt (e.g. q_proj,v_proj), or all-linear"""

    # Rollout and reward
    total_steps: int = 400
    """number of training steps (one rollout batch each)"""
    prompts_per_step: int = 8
    """prompts per step, over all processes"""
    group_size: int = 16
    """completions sampled per prompt (the group GRPO standardises rewards in)"""
    max_new_tokens: int = 2
    """maximum completion length in tokens"""
    temperature: float = 1.0
    """sampling temperature (training log-probs use the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling threshold; 1.0 = off"""
    top_k: int = 0
    """sample among the k most likely tokens; 0 = off"""
    mask_truncated_completions: bool = False
    """leave completions that hit max_new_tokens without EOS out of the loss (DAPO's overlong filtering)"""
    answer_reward_weight: float = 1.0
    """weight of the answer-match reward (1 when the final number equals the answer)"""
    format_reward_weight: float = 0.1
    """weight of the format reward (1 when the completion states its answer as a bare number, `#### n` or \\boxed{n})"""
    prm_path: Optional[str] = None
    """a PRM saved by prm.py: its step scores become a reward (imports prm.py only when given)"""
    prm_aggregate: Literal["min", "prod", "last", "mean"] = "min"
    """how step scores make one PRM reward per completion"""
    prm_weight: float = 1.0
    """weight of the PRM reward (set --answer-reward-weight 0 to train on the PRM alone)"""
    prm_step_separator: Optional[str] = None
    """how completions are split into steps for the PRM; None = the separator the PRM was trained with"""
    reward_errors: Literal["raise", "skip"] = "raise"
    """a reward function that raises or returns a non-finite value: stop with the sample named, or leave that
    completion out of the step (counted in reward_errors)"""

    # Loss
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """how token losses are aggregated (see grpo_loss)"""
    scale_rewards: Literal["group", "batch", "none"] = "batch"
    """divide advantages by the group's reward std (the paper), the batch's, or not at all (Dr. GRPO). batch
    keeps reward scales comparable across groups: with group, a group whose answers are all wrong turns a small
    format-reward difference into full-size advantages (on the built-in task that collapses the policy)"""
    kl_coef: float = 0.02
    """weight of the KL penalty to the reference policy; 0 = no reference model at all (on the built-in task the
    pull towards the near-uniform initial policy keeps sampling diverse enough to escape wrong answers)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """per-token KL estimator (k3 = exp(ref-logp) - (ref-logp) - 1, unbiased and always >= 0; averaged over samples,
    its gradient is that of the forward KL(ref || pi); k2's, and on-policy ratio-weighted k3's (--kl-ratio-weighted),
    that of the reverse KL(pi || ref); k1's averages to 0, so that as a loss it regularises only ratio-weighted: see
    kl_penalty)"""
    kl_ratio_weighted: bool = False
    """multiply each token's KL (k1 or k3) by its ratio pi / pi_old (DeepSeek-V3.2, https://arxiv.org/abs/2512.02556;
    TRL 1.16's use_bias_correction_kl, on by default there): an importance-weighted estimate of KL(pi || ref) from
    the sampler's tokens, whose gradient is k2's on-policy"""
    clip_eps_low: float = 0.2
    """PPO clip: the ratio is clipped below at 1 - clip_eps_low"""
    clip_eps_high: float = 0.2
    """PPO clip: the ratio is clipped above at 1 + clip_eps_high (DAPO uses 0.28)"""
    delta: Optional[float] = None
    """optional upper bound on the unclipped ratio (two-sided clipping, INTELLECT-2); None = off"""
    importance_sampling: Literal["token", "sequence"] = "token"
    """token: a ratio per token (PPO, GRPO); sequence: GSPO (https://arxiv.org/abs/2507.18071), one ratio per
    completion, the geometric mean of its tokens' ratios, clipped as a whole. It differs from token only off-policy
    (--num-iterations or --num-minibatches above 1); the paper pairs it with --loss-type grpo (other loss types
    weight each completion by its length) and clip ranges of 3e-4 / 4e-4"""

    # Optimisation
    learning_rate: float = 3e-4
    """AdamW learning rate (1e-6 to 1e-5 is typical for full fine-tuning of real models, 1e-5 to 1e-4 for LoRA)"""
    num_iterations: int = 1
    """passes over each rollout batch (PPO's epochs), each of --num-minibatches optimiser updates; every update's
    ratios are taken against the rollout policy"""
    num_minibatches: int = 1
    """optimiser updates per pass over the rollout batch, each on an equal share of its prompts, groups whole (PPO's
    minibatches; TRL's steps_per_generation / gradient_accumulation_steps, verl's train_batch_size /
    ppo_mini_batch_size): a large batch, cheap to sample per token, still makes frequent updates. Above 1 the later
    minibatches' rollout-policy log-probs take a pass of their own before the first update, since each update moves
    the policy that they would be scored with"""
    micro_batch_size: int = 0
    """completions per forward/backward pass (gradient accumulation); 0 = a process's whole minibatch at once"""
    share_prompts: Literal["auto", "always", "never"] = "auto"
    """encode each prompt once per micro-batch in the reference and training passes, its keys and values shared by
    its completions; auto = when that skips at least 128 prompt positions, padding included (the break-even
    measured on a 2-core CPU; a GPU's may differ). Not under --gradient-checkpointing (transformers drops the
    cache in the training pass there, and the reference pass must compute as it does)"""
    group_by_length: bool = True
    """with micro-batches smaller than a minibatch: put completions of like length together (each minibatch's in
    order of decreasing length), so that cutting each micro-batch to its longest wastes little on padding, where
    that makes the reference and training passes process fewer positions than consecutive rows do (those hold whole
    groups, whose prompt --share-prompts encodes once). Only the rounding of the summed gradients changes"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this (0 = off)"""
    weight_decay: float = 0.0
    """AdamW weight decay, of the weight matrices only (not of biases and norm gains, as transformers' Trainer)"""
    adam_betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas"""
    warmup_steps: int = 0
    """linear learning-rate warm-up, in optimiser updates"""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """learning rate after warm-up"""
    max_bad_steps: int = 3
    """stop after this many consecutive updates with a non-finite loss or gradient (each one is skipped), or steps
    whose every reward failed (--reward-errors skip)"""

    # Evaluation, saving, system
    eval_every: int = 50
    """greedy held-out accuracy every this many steps (0 = only at the start and the end)"""
    eval_batch_size: int = 256
    """prompts per batch in evaluation"""
    save_every: int = 0
    """write a checkpoint every this many steps (0 = only when stopped by a signal, and the final model)"""
    resume_from: Optional[str] = None
    """a checkpoint-STEP or final directory written by this script, or `latest` (the newest of those in
    --output-dir), to continue; from final, with a higher --total-steps, a finished run is taken further"""
    keep_checkpoints: int = 2
    """how many checkpoint-STEP directories to keep (older ones are deleted)"""
    overwrite: bool = False
    """replace a run already in --output-dir (otherwise that is an error, unless resuming)"""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """weights and compute dtype; auto = bfloat16 on CUDA when supported, float32 otherwise"""
    device: str = "auto"
    """auto = cuda when available, else cpu; cuda:N for GPU N (under torchrun: cuda, each process on its own GPU)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (less memory, about 30% more compute)"""
    compile_decoding: bool = False
    """compile the one-token forward pass that sampling repeats (rollout and evaluation) with torch.compile: it is
    per-call overhead where the model is small against the batch. The first call pays for it (17 s cold, 5-10 s
    with inductor's cache warm, on 2 CPU cores); measured there, the tiny model's rollout is then 1.3-1.9x faster, the
    20.5M-parameter model's about as fast (see README, "Compiled decoding"). Not with --fsdp"""
    fsdp: bool = False
    """shard weights, gradients and optimiser state over the processes with FSDP2 (CUDA only; for models that do
    not fit one GPU): weights stay fp32, computed in --dtype"""
    peak_tflops: float = 0.0
    """peak dense TFLOP/s of one device in the run's dtype, for MFU (on any device); 0 = look up a bf16 run's by the
    GPU's name (no MFU on CPU then)"""

    # Derived (filled in at the top of train)
    run_name: tyro.conf.Suppress[str] = ""
    """{exp_name}__{seed}__{unix time}"""
    world_size: tyro.conf.Suppress[int] = 1
    """number of processes (torchrun)"""
    local_prompts: tyro.conf.Suppress[int] = 0
    """prompts per step on this process = prompts_per_step / world_size"""


# ---------------------------------------------------------------------------------------------------------------
# Kernels: tensors in, (loss, stats) out. Tests import these.


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """A_i = (r_i - mean(group)) / (std + eps), rewards laid out group after group: [G0 c0..c{n-1}, G1 ...].

    scale="group" divides by each group's std, "batch" by the std of the whole batch, "none" not at all.
    std is the unbiased (Bessel) estimate, as in TRL and verl. A group whose rewards are all equal gets
    advantage exactly 0 under every scale (it carries no signal about which completion is better).
    A NaN reward (a sample whose reward failed) is left out: the mean and std are those of the other samples,
    as if it had never been drawn, and its own advantage is 0.
    """
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32  # (0/1 correctness as ints or bools)
    # in float64: squared deviations of float32 rewards overflow from 1.8e19 (weights of 1e20 zeroed every advantage)
    rewards = rewards.double()
    grouped = rewards.view(-1, group_size)  # [num_groups, group_size]
    valid = ~torch.isnan(grouped)
    count = valid.sum(dim=1, keepdim=True)  # [num_groups, 1]
    mean = grouped.nansum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(valid, grouped - mean, torch.zeros_like(grouped))
    if scale == "group":
        std = (centred.square().sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std + eps)
    elif scale == "batch":
        valid_rewards = rewards[~torch.isnan(rewards)]
        centred = centred / ((valid_rewards.std() if valid_rewards.numel() > 1 else 0.0) + eps)
    elif scale != "none":
        raise ValueError(f"scale must be group, batch or none, got {scale!r}")
    # the float mean of equal values can differ from them in the last bit, and /(std + eps) would blow that up
    highest = torch.where(valid, grouped, -math.inf).amax(dim=1, keepdim=True)
    lowest = torch.where(valid, grouped, math.inf).amin(dim=1, keepdim=True)
    all_equal = highest <= lowest  # also a group with no valid reward (-inf <= inf)
    return torch.where(all_equal | ~valid, torch.zeros_like(centred), centred).reshape(-1).to(out_dtype)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (http://joschu.net/blog/kl-approx.html; the tokens
    come from pi_old, which is pi on-policy: kl_ratio_weighted in grpo_loss corrects for the difference).

    With x = ref_logp - logp: k1 = -x, k2 = x^2 / 2, k3 = exp(x) - x - 1 (unbiased and >= 0).
    As a loss term its gradient matters more than its value. Over samples of pi, k3's gradient (1 - e^x) grad logp
    averages to the gradient of the forward KL(pi_ref || pi), k2's (-x grad logp) to that of KL(pi || pi_ref)
    (https://arxiv.org/abs/2505.17508); k1's (grad logp) averages to 0, as every score function does, so that k1
    as a loss adds only noise. k3 is the GRPO paper's choice and TRL's and verl's default; multiplied by the ratio
    pi / pi_old (DeepSeek-V3.2's correction, TRL 1.16's use_bias_correction_kl, on by default there) it has k2's
    gradient on-policy.
    """
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio  # expm1 keeps precision when the policies are close
    raise ValueError(f"kl estimator must be k1, k2 or k3, got {estimator!r}")


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: Optional[torch.Tensor],
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    kl_coef: float = 0.0,
    loss_type: str = "grpo",
    max_completion_length: Optional[int] = None,
    delta: Optional[float] = None,
    importance_sampling: str = "token",
    kl_estimator: str = "k3",
    kl_ratio_weighted: bool = False,
    total_sequences: Optional[int] = None,
    total_tokens: Optional[float] = None,
) -> tuple[torch.Tensor, dict]:
    """Clipped GRPO surrogate with a KL penalty, aggregated over the batch.

    Shapes: logp, old_logp, ref_logp, mask [B, T] (mask 1 on completion tokens, EOS included); advantages [B].
    Per token: l = -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A) + kl_coef * KL, with r = exp(logp - old_logp)
    (with `delta`, the unclipped term uses min(r, delta), INTELLECT-2's two-sided bound; with `kl_ratio_weighted`,
    KL is r * KL, r the token's unclipped ratio, as TRL's use_bias_correction_kl). importance_sampling="sequence"
    (GSPO) gives every token of sequence i the same r_i = exp(sum_t m_it (logp - old_logp)_it / sum_t m_it), so a
    part must hold whole sequences. Aggregation, with m the mask, N the number of sequences (every row of the
    batch, fully masked ones included: a failed reward or a masked truncation adds 0, it does not renormalise) and
    M the number of completion tokens over the whole batch:
        grpo:          (1/N) sum_i [ sum_t l_it m_it / sum_t m_it ]   (each sequence's token mean; empty rows add 0)
        bnpo, dapo:    sum_it l_it m_it / M                            (token mean over the batch)
        dr_grpo:       sum_it l_it m_it / (N * max_completion_length)  (a constant: no length bias)
    This call may see only part of the batch (a micro-batch, or one process's share): pass the whole batch's
    `total_sequences` (N) and `total_tokens` (M); summing the returned losses over the parts then gives the loss
    and the gradient of the whole batch. When they are None the part is taken to be the whole batch.
    (TRL's bnpo normalises by each micro-batch's own token count, which makes it depend on the split; here
    bnpo and dapo are the same split-invariant token mean.)

    stats (detached, masked token means over this part, whatever loss_type: loss = pg_loss + kl_coef * kl_mean for
    bnpo and dapo only): ratio_mean, clip_frac_low (A<0 and r < 1-eps_low: the clip is active and the token gets
    no policy gradient, its KL term still does), clip_frac_high (A>0 and r > 1+eps_high, or with delta A<0 and
    r > delta: bounded above, no policy gradient either), pg_loss, kl_mean (with a reference only); plus `tokens`,
    this part's token count, to weight them when combining parts. On-policy (old_logp = logp) r is 1, and both
    clip fractions are 0.
    """
    # the arithmetic and the sums in fp32 at least, whatever the inputs' dtype: a bf16 mask counts 501 tokens as 500
    dtype = torch.promote_types(logp.dtype, torch.float32)
    logp, old_logp, advantages, mask = logp.to(dtype), old_logp.to(dtype), advantages.to(dtype), mask.to(dtype)
    ref_logp = ref_logp.to(dtype) if ref_logp is not None else None
    num_sequences = total_sequences if total_sequences is not None else logp.shape[0]
    num_tokens = total_tokens if total_tokens is not None else mask.sum().item()
    adv = advantages.unsqueeze(1)  # [B, 1]

    in_loss = mask.bool()
    # masked positions may hold anything (padding after EOS): zero their log-ratios before exp, or an overflow
    # there would turn into inf * 0 = NaN in the loss and its gradient
    log_ratio = torch.where(in_loss, logp - old_logp, 0.0)  # [B, T]
    token_ratio = torch.exp(log_ratio)  # [B, T]
    if importance_sampling == "sequence":  # GSPO: each sequence's mean log-ratio, on every one of its tokens
        ratio = torch.exp(log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
                          ).expand_as(log_ratio)  # [B, T]
    elif importance_sampling == "token":
        ratio = token_ratio
    else:
        raise ValueError(f"importance_sampling must be token or sequence, got {importance_sampling!r}")
    unclipped_ratio = ratio if delta is None else torch.clamp(ratio, max=delta)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    token_loss = -torch.min(unclipped_ratio * adv, clipped_ratio * adv)  # [B, T]
    pg_token_loss = token_loss
    kl = None
    if kl_coef != 0.0:
        if ref_logp is None:
            raise ValueError("kl_coef != 0 needs ref_logp")
        kl = kl_penalty(torch.where(in_loss, logp, 0.0), torch.where(in_loss, ref_logp, 0.0), kl_estimator)  # [B, T]
        if kl_ratio_weighted:  # tokens were sampled from pi_old: weighting by pi / pi_old estimates KL under pi
            kl = token_ratio * kl  # each token's own ratio, also under GSPO (TRL there uses the sequence's)
        token_loss = token_loss + kl_coef * kl

    if loss_type == "grpo":
        seq_token_counts = mask.sum(dim=1).clamp(min=1.0)  # [B]; a fully masked row contributes 0
        loss = ((token_loss * mask).sum(dim=1) / seq_token_counts).sum() / num_sequences
    elif loss_type in ("bnpo", "dapo"):
        loss = (token_loss * mask).sum() / max(num_tokens, 1.0)
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type dr_grpo needs max_completion_length (the constant normaliser)")
        loss = (token_loss * mask).sum() / (num_sequences * max_completion_length)
    else:
        raise ValueError(f"loss_type must be grpo, bnpo, dr_grpo or dapo, got {loss_type!r}")

    with torch.no_grad():
        local_tokens = mask.sum().clamp(min=1.0)
        low = ((adv < 0) & (ratio < 1.0 - clip_eps_low)).to(mask.dtype)
        high = (adv > 0) & (ratio > 1.0 + clip_eps_high)
        if delta is not None:
            high |= (adv < 0) & (ratio > delta)
        high = high.to(mask.dtype)
        stats = {
            "ratio_mean": (ratio * mask).sum() / local_tokens,
            "clip_frac_low": (low * mask).sum() / local_tokens,
            "clip_frac_high": (high * mask).sum() / local_tokens,
            "pg_loss": (pg_token_loss * mask).sum() / local_tokens,
            "tokens": mask.sum(),
        }
        if kl is not None:  # (without a reference there is no KL to report: a logged 0 would read as "no drift")
            stats["kl_mean"] = (kl * mask).sum() / local_tokens
    return loss, stats


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, rows_per_chunk: int = 16, vocab_size: Optional[int] = None):
    """log softmax(logits / T)[target] in fp32, a few rows at a time: without gradients (the reference and old
    log-prob passes) only a slice of the [B, T, V] logits ever exists in fp32; with them, autograd keeps each
    chunk's fp32 log-softmax for the backward, so all of them live until it runs. Returns logp [B, T] and, if asked,
    the entropy [B, T] (no grad).
    vocab_size: the softmax covers only the first vocab_size logits (the tokenizer's ids, as the sampler does)."""
    logps, entropies = [], []
    for start in range(0, logits.shape[0], rows_per_chunk):
        chunk = logits[start:start + rows_per_chunk, :, :vocab_size].float()
        if temperature != 1.0:  # else no [rows, T, V] copy (32k vocabulary: 16 MB less per chunk of 16 x 8 tokens)
            chunk = chunk / temperature
        chunk_logp = torch.log_softmax(chunk, dim=-1)
        logps.append(chunk_logp.gather(-1, targets[start:start + rows_per_chunk].unsqueeze(-1)).squeeze(-1))
        if with_entropy:
            with torch.no_grad():
                # entr(p) = -p log p, 0 at p = 0: a -inf logit (a masked id) adds 0, where p * log p is 0 * -inf = NaN
                entropies.append(torch.special.entr(chunk_logp.exp()).sum(-1))
    return torch.cat(logps), (torch.cat(entropies) if with_entropy else None)


# ---------------------------------------------------------------------------------------------------------------
# Task and data: the built-in task, JSONL prompts, rewards.

# The built-in task: the last digit of N + 7 for a 3-digit N, e.g. "(358+7)%10=" -> "5". Its answers are checked
# exactly, a constant answer is right one time in ten, and every held-out prompt is a number never seen in training,
# so the policy must learn to find N's units digit (a fixed offset back) and map it, rather than memorise prompts.
# (Two-operand versions such as (a+b)%10 need a 100-entry lookup that this tiny model does not find by RL
# within a few minutes: the policy collapses on a constant answer first.)
TINY_CHARS = list("0123456789+-*/%()= ")
TINY_SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def builtin_task(seed: int, num_eval: int) -> tuple[list[dict], list[dict]]:
    """All 900 prompts, split into train rows and `num_eval` held-out rows by a seeded shuffle."""
    rows = [{"prompt": f"({n}+7)%10=", "answer": str((n + 7) % 10)} for n in range(100, 1000)]
    random.Random(seed).shuffle(rows)
    return rows[num_eval:], rows[:num_eval]


def load_jsonl_prompts(path: str) -> list[dict]:
    """Rows {"prompt": str, "answer": str}; an invalid row is an error that names the file and line."""
    what = 'a JSONL file of {"prompt", "answer"} rows'
    if not os.path.exists(path):
        raise UserError(f"data file {path!r} does not exist; pass {what}")
    if os.path.isdir(path):
        raise UserError(f"data file {path!r} is a directory; pass {what}")
    rows, placeholder_answers = [], []
    try:
        with open(path, "rb") as f:  # bytes, decoded line by line: a non-UTF-8 line is reported with its number
            data = f.read()
    except OSError as error:
        raise UserError(f"cannot read data file {path!r}: {error.strerror or error}") from None
    check_jsonl_bytes(path, data, what)
    for line_number, raw_line in enumerate(jsonl_lines(data), start=1):
        try:
            line = raw_line.decode("utf-8-sig")  # -sig: drops the byte-order mark Windows tools write
        except UnicodeDecodeError as error:
            raise UserError(f"{path}:{line_number}: not UTF-8 text ({error.reason} at byte {error.start} of the "
                            "line); convert the file to UTF-8") from None
        if not line.strip():
            continue
        try:  # (numbers as written: a float would keep 17 of 0.333333333333333333's digits)
            row = json.loads(line, parse_float=Decimal)
        # (also a 5,000-digit integer, 100,000 nested lists, an exponent past Decimal's range: ArithmeticError)
        except (ValueError, RecursionError, ArithmeticError) as error:
            reason = error.msg if isinstance(error, json.JSONDecodeError) else (
                "nested too deeply" if isinstance(error, RecursionError) else "a number too long or too large")
            raise UserError(f"{path}:{line_number}: invalid JSON ({reason})") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), list):
            raise UserError(f"{path}:{line_number}: the prompt is a list (chat messages?); give the question as a "
                            "string, which is put in the tokenizer's chat template as the user's turn "
                            "(--system-prompt adds a system message)")
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            other = [name for name in ("question", "problem", "query", "input")
                     if isinstance(row, dict) and "prompt" not in row and name in row]  # (GSM8K's and MATH's names)
            raise UserError(f"{path}:{line_number}: each row needs a string field \"prompt\""
                            + (f" (it has \"{other[0]}\": rename that field to \"prompt\")" if other else ""))
        if not row["prompt"].strip():
            raise UserError(f"{path}:{line_number}: the prompt is empty; give the question")
        if not is_unicode(row["prompt"]):
            raise UserError(f"{path}:{line_number}: the prompt holds a lone surrogate, half of a UTF-16 pair (text cut "
                            "inside an emoji?), which no tokenizer can encode; mend or drop the row")
        answer = row.get("answer")
        if isinstance(answer, float):  # json reads NaN and Infinity as floats (other numbers as Decimal here)
            raise UserError(f"{path}:{line_number}: the answer is {answer}, which no completion can equal (a "
                            "missing value written as NaN?); give the reference answer")
        if isinstance(answer, Decimal):
            # spelled as a float spells it (2.50 -> 2.5, 1e3 -> 1000.0: a resume's data fingerprint is unchanged),
            # unless that loses digits written (0.333333333333333333) or the float's range (1e400)
            as_float = float(answer)
            if math.isfinite(as_float) and Decimal(repr(as_float)) == answer:
                answer = Decimal(repr(as_float))
            if max(answer.adjusted() + 1, 1) + max(-answer.as_tuple().exponent, 0) > 4300:
                # (1e-99999999 would be written out as a 100-million-character answer, read by every reward call)
                raise UserError(f"{path}:{line_number}: the answer {answer} has over 4,300 digits when written out, "
                                "more than a completion's number is read to; give the reference answer as a string")
            answer = format(answer, "f")  # positional notation: "5e-05" would state 5
        elif isinstance(answer, int) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str):
            raise UserError(f"{path}:{line_number}: each row needs a field \"answer\" (a string or a number)"
                            + (' (it has "solution": rename that field to "answer"; a worked solution\'s \\boxed{} '
                               "is its answer)" if "answer" not in row and "solution" in row else ""))
        if not answer.strip():  # an empty completion would equal it: the policy would learn to stop at once
            raise UserError(f"{path}:{line_number}: the answer is empty; give the reference answer")
        if answer.strip().lower() in PLACEHOLDER_ANSWERS:
            placeholder_answers.append(f"{path}:{line_number}")
        rows.append({"prompt": row["prompt"], "answer": answer, "where": f"{path}:{line_number}"})
    if not rows:
        raise UserError(f"{path} holds no rows")
    if placeholder_answers:  # (a warning, not an error: "None" can be a true answer)
        print0(f"warning: {len(placeholder_answers)} answers are None, null, nan or N/A (the first at "
               f"{placeholder_answers[0]}): missing values written as text? A completion that writes the same word "
               "is rewarded", file=sys.stderr, enabled=os.environ.get("RANK", "0") == "0")
    return rows


# answers that are, most likely, a missing value written as text (str(None), pandas' NaN, a spreadsheet's N/A)
PLACEHOLDER_ANSWERS = ("none", "null", "nan", "n/a")


def is_unicode(text: str) -> bool:
    """False for a str that holds a lone surrogate (JSON's "\\ud800"), which no UTF-8 encoder, and so no tokenizer,
    takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return False
    return True


def jsonl_lines(data: bytes) -> list[bytes]:
    """A file's lines, numbered as editors number them: split at each LF (a CR before it is JSON whitespace), or at
    each CR in a file without LFs (classic Mac line ends)."""
    return data.split(b"\n") if b"\n" in data else data.split(b"\r")


def check_jsonl_bytes(path: str, data: bytes, what: str) -> None:
    """Refuse, with what to do, the files that are not JSON lines but are often given for them."""
    if data.startswith(b"\x1f\x8b"):
        raise UserError(f"{path} is gzip-compressed; decompress it (gunzip) and pass {what}")
    if data.startswith(b"PAR1"):
        raise UserError(f"{path} is a Parquet file; pass {what}, e.g. written by pandas.read_parquet(path)"
                        ".to_json(out, orient='records', lines=True)")
    head = data.lstrip(b"\xef\xbb\xbf \t\r\n")
    first_line = head.split(b"\n", 1)[0]
    # a pretty-printed array, or one on a single line (not a list on the first of several lines: a row to skip)
    if head.startswith(b"[") and (not is_json(first_line) or not head[len(first_line):].strip()):
        raise UserError(f"{path} holds a JSON array, not JSON lines; pass {what}, one object per line (e.g. "
                        "`jq -c '.[]' file.json > file.jsonl`)")


# a number: a sign (- or +) unless it follows a word or ")" (the 3 of "8-3" or "ages 5-7" is no -3), thousands
# separated by commas only in groups of three ("1,234"; "1,2" is two numbers, not 12), a decimal part, a
# leading-dot decimal (".5", but not the ".5" of "...5" or "1.2.5"), then an exponent ("1.5e-3", of at most 3 digits:
# Fraction would build 10^n) or a fraction "a/b" whose b is written as a is, unsigned ("1.5/2.5", "1,500/2,000")
_UNSIGNED = r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<![\d.])\.\d+)"
_NUMBER = re.compile(rf"(?:(?<![\w)])[-+])?{_UNSIGNED}(?:[eE][-+]?\d{{1,3}}(?!\d)|/{_UNSIGNED})?")
# \frac{a}{b}, \dfrac or \tfrac, after a whole number when it is a mixed number (2\frac{1}{2}, not the 2 of x^2)
_LATEX_FRACTION = re.compile(r"(?:(?<![\w^.])(-?\d+)\s*)?\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
# \frac12: one-digit numerator and denominator without braces, as LaTeX allows (the MATH normaliser's _fix_fracs)
_BRACELESS_FRACTION = re.compile(r"\\([dt]?frac)\s*(\d)\s*(\d)")


# what only writes a number differently: LaTeX thousands separators (1{,}000, 10,\!000), a Unicode minus, currency
# and percent signs (the answer 18 is stated by $18 or 18%)
_NUMBER_SPELLINGS = (("{,}", ","), (",\\!", ","), ("\u2212", "-"), ("\\$", ""), ("$", ""), ("\\%", ""), ("%", ""))
# a figure, en, small or fullwidth dash glued to a number is its minus (else "\u20135" would state 5); spaced, it is
# prose ("#### \u2013 72"); hyphens (U+2010, U+2011) are no minus
_DASH_AS_MINUS = re.compile("[\u2012\u2013\ufe63\uff0d](?=\\.?\\d)")
# a unit that ends a number's statement (\boxed{18\text{ cm}}, 90^\circ, 90°), as the MATH answer normaliser drops
# it: one word in \text{} or \mbox{}, not a scale (5\text{ million}) nor more words (2\text{ and a half}, 1\text{ (mod
# 7)}), and not followed by more (5\text{ and }7, 18\text{ cm}^2); \mathrm{} is left alone (3\mathrm{i} is a value)
_LATEX_UNIT = re.compile(r"(?<=\d)\s*(?:\\[,;: ]\s*)*(?:\\(?:text|mbox)\{\s*"
                         r"(?!(?:(?i:hundred|thousand|dozen|[mb]illion|trillion|quadrillion|bn|mn)(?:th)?s?|[kKMBi])\b)"
                         r"[A-Za-z]+\.?\s*\}|\^\s*\{?\\circ\}?|°)(?![ \t]*[\w\\^{])")


def normalise_math(text: str) -> str:
    """Numbers written one way: the spellings above, without a final unit, and \\frac{a}{b} as a/b (see
    latex_fraction_as_text)."""
    for spelling, plain in _NUMBER_SPELLINGS:
        text = text.replace(spelling, plain)
    text = _DASH_AS_MINUS.sub("-", text)
    text = _BRACELESS_FRACTION.sub(r"\\\1{\2}{\3}", text)
    return _LATEX_UNIT.sub("", _LATEX_FRACTION.sub(latex_fraction_as_text, text))  # (\frac{1}{2}\text{ cup}: 1/2)


def parse_number(text: str, whole: bool = False) -> Optional[Fraction]:
    """'1,234' -> 1234, '7.50' -> 15/2, '$3' -> 3, '+3' -> 3, '3\\text{ cm}' -> 3, '1/2' -> 1/2, '.5' -> 1/2,
    '1e3' -> 1000, '\\frac{1}{2}' -> 1/2;
    None when text holds no number. whole: the text must be nothing but the number (a final period aside): the
    first number of \\sqrt{2}, x^2 or (1, 2) is not their value."""
    text = normalise_math(text).strip()
    match = _NUMBER.fullmatch(text.removesuffix(".").strip()) if whole else _NUMBER.search(text)
    if match is None:
        return None
    numerator, _, denominator = match.group(0).replace(",", "").partition("/")
    try:  # (Fraction reads "3/4" but not "1.5/2")
        return Fraction(numerator) / Fraction(denominator or 1)
    except (ValueError, ZeroDivisionError):
        return None


# a denominator that a/b can show without brackets: one factor (a number, a letter, a command such as \pi, \sqrt3,
# a bracketed group), with powers and factorials, which bind tighter than "/"; not 2x or \pi r: 1/2x reads as x/2
_BARE_DENOMINATOR = re.compile(rf"\s*[-+]?(?:{_UNSIGNED}|[A-Za-z]|\\sqrt\s*[\dA-Za-z]|\\[A-Za-z]+|\([^()]*\))"
                               r"(?:\s*(?:\^\s*(?:\d+|[A-Za-z]|\\[A-Za-z]+)|!))*\s*")


def bare_numerator(text: str) -> bool:
    """Whether a/b can show this numerator without brackets: a number, or no operator outside brackets after a
    leading sign (2x, n(n+1), \pi r; not x+1, which x+1/2 would read as x + 1/2)."""
    if re.fullmatch(rf"\s*[-+]?{_UNSIGNED}\s*", text):
        return True
    depth = 0
    for char in text.strip().lstrip("-+"):
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(char, 0)
        if depth == 0 and char in "+-*/=,<>":
            return False
    return True


def _fraction_text(numerator: str, denominator: str) -> str:
    numerator = numerator if bare_numerator(numerator) else f"({numerator})"
    denominator = denominator if _BARE_DENOMINATOR.fullmatch(denominator) else f"({denominator})"
    return f"{numerator}/{denominator}"


_POWER_AFTER = re.compile(r"\s*[\^!]")  # (\s is str.isspace's whitespace, as lstrip() strips; (1/n)! too)


def latex_fraction_as_text(match: re.Match) -> str:
    """\\frac{a}{b} -> "a/b", bracketed where a/b would read otherwise: \\frac{x+1}{2} -> "(x+1)/2" (not x+1/2, which
    is x+\\frac{1}{2}), \\frac{1}{2x} -> "1/(2x)" (not \\frac{1}{2}x), \\frac{a}{b}^2 -> "(a/b)^2" (not a/b^2, which is
    \\frac{a}{b^2}); the mixed number 2\\frac{1}{2} -> "5/2" (gluing the digits would give 21/2)."""
    whole, numerator, denominator = match.groups()
    if whole is None:
        fraction = _fraction_text(numerator, denominator)
        # (a/\\frac{b}{c} is a/(b/c), not a/b/c; \\frac{a}{b}^2 squares the whole)
        # (looked at in place, not by slicing the text: a copy of it per fraction was quadratic in a completion of
        # thousands of \\frac{}{}; both scans stop at the blanks next to the fraction, each blank read twice at most)
        before = match.start()
        while before > 0 and match.string[before - 1].isspace():
            before -= 1
        enclosed = ((before > 0 and match.string[before - 1] == "/")
                    or _POWER_AFTER.match(match.string, match.end()) is not None)
        # (after a digit that is no whole part, x^2\\frac{1}{2} or 1.5\\frac{1}{2}: kept apart, not read as 21/2)
        glued = match.string[max(match.start() - 1, 0):match.start()] in tuple("0123456789.")
        return (" " if glued else "") + (f"({fraction})" if enclosed else fraction)
    # (isdecimal, not isdigit: int() rejects the digits isdigit also accepts, such as "²")
    if not (numerator.strip().isdecimal() and denominator.strip().isdecimal()) or not denominator.strip("0 "):
        return f"{whole} {_fraction_text(numerator, denominator)}"  # no number: left as text
    try:
        magnitude = abs(int(whole)) + Fraction(int(numerator), int(denominator))
    except ValueError:  # past int()'s 4,300 digits: a degenerate completion, scored as text rather than crashing
        return f"{whole} {numerator}/{denominator}"
    value = -magnitude if whole.startswith("-") else magnitude
    return f"{value.numerator}/{value.denominator}"


def last_boxed(text: str) -> Optional[tuple[str, int]]:
    """The content of the last \\boxed{...} (nested braces matched, as in \\boxed{\\frac{1}{2}}) and the index just
    past it; None when there is none or it is never closed."""
    start = text.rfind("\\boxed{")
    depth = 0
    for index in range(start + len("\\boxed"), len(text)) if start >= 0 else ():
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[start + len("\\boxed{"):index], index + 1
    return None


# scale words, which make a number another number (5 million, 5 K): never a unit (but the M of "72 M&Ms" is no scale)
_SCALE = (r"(?i:hundred|thousand|dozen|[mb]illion|trillion|quadrillion|bn|mn)(?:th)?s?\b"
          r"|[kKMB](?=[ \t]*(?:$|[,;!?)]|\.[ \t]*$))")
# units written glued to a number (72km, 3rd, 10am); any other glued letters are algebra (2x, 2xy, 2pi, 2sin(x))
_GLUED_UNIT = (r"(?:[kcm]?m|[km]?g|m?[lL]|lbs?|oz|ft|in|yd|mi|mph|kph|min|mins|hrs?|sec|secs|ms|[aApP][mM]|st|nd|rd"
               r"|th|[kMG]B|h|s|yrs?|yo|wks?|mos?|pts?|qts?|pcs?|ea)")
# a quantity in two units, the second the next smaller and less than one of the first (4 hours and 30 minutes, 5 ft
# 6 in, 2h 45m, 18 dollars 50 cents); not a restatement in another unit (2 hours, 120 minutes; 240 minutes, 4 hours)
# nor two quantities (18 m and 2 s): (larger, smaller, amounts of the smaller below one larger)
_TWO_UNITS = [("weeks?|wks?", "days?", "[0-6]"), ("days?", "hours?|hrs?|h", r"[01]?\d|2[0-3]"),
              ("hours?|hrs?|h", "minutes?|mins?|m", r"[0-5]?\d"), ("minutes?|mins?", "seconds?|secs?|s", r"[0-5]?\d"),
              ("years?|yrs?", "months?|mos?", r"1[01]|\d"), ("miles?|mi", "yards?|yd", r"\d{1,4}"),
              ("yards?|yd", "feet|foot|ft", "[0-2]"), ("feet|foot|ft", "inch(?:es)?|in", r"1[01]|\d"),
              ("km", "m|meters?|metres?", r"\d{1,3}"), ("m|meters?|metres?", "cm", r"\d{1,2}"),
              ("pounds?|lbs?", "ounces?|oz", r"1[0-5]|\d"), ("kg", "g|grams?", r"\d{1,3}"),
              ("dollars?", "cents?", r"\d{1,2}")]
_QUANTITY_IN_TWO_UNITS = "|".join(
    rf"(?i:{larger})\b,?[ \t]+(?:(?:and|&)[ \t]+)?(?:{amount})(?!\d)[ \t]*(?i:{smaller})\b"
    for larger, smaller, amount in _TWO_UNITS)
# glued letters other than a unit (2x, 2xy, 2pi, 3i; not 72km nor 5m^2) make a number a coefficient
_GLUED_ALGEBRA = (r"(?!(?:" + _GLUED_UNIT + r"|(?:[kcm]?m|ft|yd|mi)(?:\^\{?[23]\}?|[\u00b2\u00b3]))(?![\w^(_{]))"
                  r"[A-Za-z]")
# the first number after a #### is no answer when it is part of an expression: followed by an operator, a power, a
# root, a LaTeX command, a digit (5², 2½, 3,5), a colon or em dash before a digit (10:30, 3:2, 4—6), glued algebra,
# a scale (5 million), a product (5 x 3, 5 times 3, 72 divided by 8), a fraction in words (8 and a half), a second
# number after "and" or "to" (5 and 7, 16 to 18), or a quantity in two units (4 hours and 30 minutes, 5 ft 6 in); or
# after a sign, an operator or a command (- 5, \pm 5, (1, 2), \sqrt{2}). A dash before a word of 3 or more letters,
# or ending the line, is prose ("#### 72 - the total"); "72 dollars", "3 times", "12 in 3 boxes", "72m^2", "**72**",
# "x = 72", "72 = 8 * 9", "18 because 9 x 2 = 18", "18 dollars, 2 more than yesterday" and "3/8 or 0.375" state
# the first number (an alternative after "or" gains nothing: only the first is read)
_CONTINUES_EXPRESSION = re.compile(
    r"[ \t]*(?:\\(?!boxed\{)|[\^_{\[/+\u00d7\u00b7\u00f7\u00b1\u221a\u221b\u03c0\u22c5\u2219\u2010\u2011]"
    r"|-(?!-*[ \t]*(?:$|(?!(?i:sin|cos|tan|cot|sec|csc|log|exp|sqrt))[A-Za-z]{3}))|\*\*?[ \t]*[\d(\\]"
    r"|[\u00b2\u00b3\u00b9\u2070-\u2079\u00bc-\u00be\u2150-\u215e]|\d|[,.:\u2014]\d)|" + _GLUED_ALGEBRA +
    r"|[ \t]+(?:[xX][ \t]*[\d(]|(?i:squared|cubed|pi)\b|(?i:sqrt)|" + _SCALE + ")"
    r"|[ \t]+(?:and|to|&|(?i:times|plus|minus|over|(?:divided|multiplied)[ \t]+by))[ \t]+[-+]?\.?\d"
    r"|[ \t]*(?:" + _QUANTITY_IN_TWO_UNITS + ")"
    r"|[ \t]+(?:[A-Za-z]+[ \t]+)?and[ \t]+(?:a|an|one|two|three|four|five|six|seven|eight|nine)[ \t]+"
    r"(?:halves|half|thirds?|quarters?|fourths?|fifths?|sixths?|sevenths?|eighths?|ninths?|tenths?)\b")
# (a dash after a word is a label's: "#### Answer - 72"; \quad and \approx lead to the number as a space or "=" would)
_AFTER_OPERATOR = re.compile(r"(?:(?<![A-Za-z]{3}[ \t])-|[+\u00b1(\[{^_/\u00d7\u00b7\u221a\u221b\u22c5\u2219]|(?<!\*)\*"
                             r"|\\(?!(?:q?quad|approx)\b)[A-Za-z]+)[ \t]*$")
# what may wrap a stated number without changing it: brackets, math delimiters, emphasis (#### (72), #### \(72\),
# #### *72*, #### \textbf{72})
_WRAPPED = re.compile(r"(\\\(|\\\[|\(|\[|\{|\*\*?|_|\\(?:text|textbf|mathbf|mathrm)\{)\s*([^\s()\[\]{}*_\\]+)\s*"
                      r"(\\\)|\\\]|\)|\]|\}|\*\*?|_)\.?")
_CLOSING = {"\\(": "\\)", "\\[": "\\]", "(": ")", "[": "]", "{": "}", "*": "*", "**": "**", "_": "_"}


def marked_number(marked: str) -> Optional[str]:
    """The number a `####` line states, or None when its first number is part of an expression."""
    wrapped = _WRAPPED.fullmatch(marked)
    if wrapped and _CLOSING.get(wrapped[1], "}") == wrapped[3] and _NUMBER.fullmatch(wrapped[2]):
        return wrapped[2]  # (1, 2) is not wrapped: no number fills it
    number = _NUMBER.search(marked)
    if number and not _AFTER_OPERATOR.search(marked[:number.start()]) and not _CONTINUES_EXPRESSION.match(
            marked, number.end()):
        return number.group(0)
    return None


# a completion's last number is no answer when it is under a root, an exponent or a subscript (x_1, not Markdown's
# _18_), after a "/" (\pi/2, 120 / 2) or a second argument (the 2 of \frac{\sqrt{3}}{2}, whose numerator
# normalise_math leaves as it is), after a product (3 × 4, 3 * 4, not Markdown's *72*) or a function, or is a
# coefficient: glued to one or two letters that are no unit or to a function (3x, 2xy, 3i, 2pi, 2sin; 18days and 8PM
# are units), or before \pi, a root or a power (3\pi, 2\sqrt{3}, 4^x)
_ROOT_OR_POWER_BEFORE = re.compile(r"(?:[\^/\u221a\u221b\u00d7\u00b7\u00f7\u22c5]|(?<=[\d)])[ \t]*\*|(?<=[A-Za-z}\]])_"
                                   r"|\\sqrt(?:\[\d\])?|\}(?=\{)"
                                   r"|\\(?:cdot|times|div|pm|mp|log|ln|sin|cos|tan)\b)[ \t]*(?:\{[ \t]*)?$")
# the power of a unit after a number: 49 cm^2, 49m^{2}, 49\text{ cm}^2, 8 units^3
_UNIT_POWER = re.compile(r"(?<=\d)([ \t]*(?:\\text\{[ \t]*)?(?:[kcm]?m|ft|in|yd|mi|units?)[ \t]*\}?)[ \t]*\^[ \t]*"
                         r"(?:[23]|\{[23]\})")
_ALGEBRA_AFTER = re.compile(r"(?!" + _GLUED_UNIT + r"(?![A-Za-z]))(?:[a-z]{1,2}|sin|cos|tan|log|exp|sqrt)(?![A-Za-z])"
                            r"|\^|[ \t]*(?:\\(?:pi|sqrt|cdot|times|div|pm|mp)\b|[\u03c0\u221a])")


def final_answer(completion: str) -> Optional[str]:
    """The answer a completion states (numbers normalised, \\frac{a}{b} read as a/b): after a final `####`, its first
    number (see marked_number), else the last \\boxed{} in that line, else the line's text; the content of the last
    \\boxed{}; or else its last number, unless an expression holds it (_ROOT_OR_POWER_BEFORE, _ALGEBRA_AFTER; a unit's
    power is no expression: _UNIT_POWER). A `####` counts only on the completion's last line, as GSM8K writes it: a
    Markdown heading (`#### Step 2: ...`) followed by more lines is no answer marker (its first number, 2, was read
    as the answer)."""
    completion = normalise_math(completion)
    marked = completion.split("####")[-1].strip() if "####" in completion else None
    if marked is not None and "\n" not in marked:
        number = marked_number(marked)  # "#### 72 dollars": 72; "#### 2\\sqrt{3}": the text (as in a box)
        if number is not None:
            return number
        boxed = last_boxed(marked)  # "#### Final Answer: \\boxed{2\\sqrt{3}}"
        return boxed[0] if boxed is not None else marked
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed[0]
    completion = _UNIT_POWER.sub(r"\1", completion)  # (the 2 of "49 cm^2" is no answer, and no power of 49's)
    numbers = list(_NUMBER.finditer(completion))
    if not numbers or _ROOT_OR_POWER_BEFORE.search(completion, 0, numbers[-1].start()) or _ALGEBRA_AFTER.match(
            completion, numbers[-1].end()):
        return None  # ("the answer is $2\\sqrt{3}$" states no 3, "2^{5}" no 5, "3x" no 3)
    return numbers[-1].group(0)


def answer_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer equals the reference as a number, both being nothing but a number
    (else as text, spaces aside: 2\\sqrt{3} is not the number 2; a completion with no `####`, \\boxed{} or number
    states its whole text). A reference with a \\boxed{}, or a number after a `####` on its last line, is a worked
    solution (a MATH solution boxes its answer, GSM8K's answer field ends in `#### 72`): what it states is the
    answer."""
    marked = answer.rstrip().rsplit("\n", 1)[-1].split("####")  # (a number after a #### on its last line)
    if "\\boxed{" in answer or (len(marked) > 1 and _NUMBER.search(normalise_math(marked[-1]))):
        answer = final_answer(answer) or answer
    stated = final_answer(completion)
    if stated is None:
        return float(parse_number(answer) is None and completion.strip() == answer.strip())
    stated_value, answer_value = parse_number(stated, whole=True), parse_number(answer, whole=True)
    if stated_value is not None and answer_value is not None:
        return float(stated_value == answer_value)
    reference = normalise_math(answer)
    if " ".join(stated.split()) == " ".join(reference.split()):
        return 1.0
    if re.search(r"\d\s+\.?\d", stated) and not _SPACED_THOUSANDS.fullmatch(stated.strip()):
        return 0.0  # "7 2" or "3 1/2" are two numbers, which dropping the spaces would join into 72 or 31/2
    return float("".join(stated.split()) == "".join(reference.split()))  # ("- 5" is -5, "1 / 2" is 1/2)


_SPACED_THOUSANDS = re.compile(r"[-+]?\s*\d{1,3}(?:\s+\d{3})+(?:\.\d+)?")  # 1 200 000, 1\u202f200


_CANONICAL_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?")


def marked_token(ending: str) -> Optional[str]:
    """What re.search(r"####\\s*(\\S+)$", ending) captures in a text without trailing blanks: the text after the
    first `####` that only blanks separate from the end's last word, or that starts inside it. Found from the last
    word, not by that regex, which tries every `#` of a run of them and scans to the end from each: 40,000 `#`
    before " x" took seconds."""
    words = ending.rsplit(None, 1)  # (str.split's blanks are the regex's \s)
    if not words:
        return None
    if len(words) == 2 and words[0].endswith("####"):  # "#### 5", "#####  5"
        return words[1]
    at = words[-1].find("####")  # "####5", "######5" (-> "##5", as the regex's leftmost match has it)
    return words[-1][at + 4:] if at >= 0 and at + 4 < len(words[-1]) else None


def format_reward(completion: str, answer: str) -> float:
    """1.0 when the completion states its answer cleanly: nothing but a number written canonically (no leading
    zeros: otherwise "07" games it), or a text that ends with `#### n` or with a non-empty \\boxed{...}, one closing
    `$`, `$$`, `\\)` or `\\]` and one full stop aside (`$\\boxed{5}$.`)."""
    text = completion.strip()  # (answer is unused: a reward's signature)
    ending = text.removesuffix(".").rstrip()  # the statement, one closing mark and full stop aside (no regex:
    for mark in ("$$", "$", "\\)", "\\]"):  # \s*(mark)?\s*\.?$ backtracks cubically on a long run of spaces)
        if ending.endswith(mark):
            ending = ending.removesuffix(mark).rstrip()
            break
    boxed = last_boxed(ending)
    boxed_last = boxed is not None and boxed[1] == len(ending) and boxed[0].strip() != ""
    marked = marked_token(ending)  # a number, nothing else: not "#### 5,,," nor "#### 1.2.3"
    stated_last = (marked is not None and _NUMBER.fullmatch(marked) is not None) or boxed_last
    return 1.0 if _CANONICAL_NUMBER.fullmatch(text) or stated_last else 0.0


class UserError(Exception):
    """A mistake in the user's input or flags: reported as one line, without a traceback."""


# ---------------------------------------------------------------------------------------------------------------
# Model helpers: build or load, LoRA, generation, log-probs.


def build_tiny_tokenizer():
    """A character-level tokenizer over the built-in task's alphabet: a small action space is what lets RL from
    a random init find rewards at all (a random policy must stumble on the right digit then EOS)."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(TINY_SPECIALS + TINY_CHARS)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token a char
    tokenizer.add_special_tokens(TINY_SPECIALS)
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<bos>",
                                      eos_token="<eos>", unk_token="<unk>", model_max_length=1024)
    return wrapped  # no chat template: the built-in prompts are raw text, as for a base model


def build_tiny_model(tokenizer):
    """A 2-layer Llama with 128-wide hidden states (about 0.5M parameters), random init from the current seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=512, max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


# the files of a tokenizer saved with save_pretrained (fast or slow), one of which a model directory needs
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def load_model_and_tokenizer(name_or_path: str, dtype: torch.dtype, trust_remote_code: bool):
    """`tiny` is built here; anything else goes through AutoModelForCausalLM / AutoTokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name_or_path == "tiny":
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_model(tokenizer)
        for weight in model.parameters():  # not .to(dtype), which would round the fp32 rotary frequencies
            weight.data = weight.data.to(dtype)  # (buffers) that from_pretrained recomputes when final/ is loaded
        return model, tokenizer
    if name_or_path.startswith(("/", "./", "../", "~")) and not os.path.exists(os.path.expanduser(name_or_path)):
        raise UserError(f"--model {name_or_path} does not exist (a local path, not a hub id)")
    if os.path.isfile(os.path.join(name_or_path, "prm_config.json")):  # (its head would load as a random LM head)
        raise UserError(f"--model {name_or_path} is a process reward model saved by prm.py, with no LM head to "
                        "generate with: give it as --prm-path (a process reward) and a causal LM as --model")
    adapter_config = os.path.join(name_or_path, "adapter_config.json")
    if os.path.isfile(adapter_config):  # (a LoRA run's final/ or checkpoint: transformers would load it merged only
        with open(adapter_config) as f:  # for inference, and a new adapter saved on it would name it as its base)
            base = json.load(f).get("base_model_name_or_path")
        raise UserError(f"--model {name_or_path} is a LoRA adapter (on {base}), not a model to start from: continue "
                        "its run with --resume-from (its final/ or a checkpoint), or merge it into its base first "
                        "(peft's merge_and_unload, then save_pretrained of the model and its tokenizer) and pass that")
    if os.path.isdir(name_or_path) and not os.path.isfile(os.path.join(name_or_path, "config.json")):
        final = os.path.join(name_or_path, "final")  # (a run's directory given for its model)
        raise UserError(f"could not load model {name_or_path!r}: the directory holds no config.json (a model saved "
                        "with save_pretrained has one)" + (f"; its run's model is {final}" if os.path.isdir(final)
                                                          else ""))
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        # transformers' error for a directory without a tokenizer spans lines and its first one breaks off
        if os.path.isdir(name_or_path) and not any(os.path.isfile(os.path.join(name_or_path, name))
                                                   for name in TOKENIZER_FILES):
            raise UserError(f"could not load model {name_or_path!r}: the directory has no tokenizer; save the "
                            f"model's tokenizer into it with tokenizer.save_pretrained({name_or_path!r})") from None
        if isinstance(error, OSError):
            raise UserError(f"could not load model {name_or_path!r}: it is neither a local directory with a saved "
                            f"model nor a reachable hub id ({str(error).splitlines()[0]})") from None
        # e.g. a config of an architecture this transformers version does not know
        raise UserError(f"could not load model {name_or_path!r}: {str(error).strip().splitlines()[0]}") from None
    if tokenizer.eos_token_id is None:
        raise UserError(f"the tokenizer of {name_or_path} has no EOS token, so completions could never end")
    check_causal(model, name_or_path)
    check_attention_cache(model, name_or_path)
    rows = model.get_input_embeddings().num_embeddings
    if tokenizer.eos_token_id >= rows:  # EOS is fed back in the training pass when a completion ends early
        raise UserError(f"the EOS id {tokenizer.eos_token_id} of {name_or_path}'s tokenizer is past the model's "
                        f"{rows} embeddings: save the model after model.resize_token_embeddings(len(tokenizer))")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id >= rows:  # padding is masked: any id in range does
        problem = "no pad token" if tokenizer.pad_token_id is None else f"a pad id past the model's {rows} embeddings"
        print0(f"note: the tokenizer of {name_or_path} has {problem}; using EOS ({tokenizer.eos_token!r}) to pad",
               enabled=os.environ.get("RANK", "0") == "0")  # one note per run, not one per torchrun process
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer_ids = token_id_limit(tokenizer)
    if rows > tokenizer_ids:
        print0(f"note: {name_or_path} has {rows} token rows for its tokenizer's {tokenizer_ids} ids; "
               "completions are sampled and scored over the tokenizer's ids only",
               enabled=os.environ.get("RANK", "0") == "0")
    return model, tokenizer


def token_id_limit(tokenizer, eos_ids=()) -> int:
    """One past the largest id the tokenizer (or a stop id) uses: the sampler draws below it (see generate). Not
    len(tokenizer), which counts the ids: where they have gaps (special tokens at the top of a reserved range), the
    largest lies beyond it, and the tokens there (EOS among them) could never be drawn."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1, *(i + 1 for i in eos_ids))


def check_causal(model, name: str) -> None:
    """Two sequences that differ only in their last token must get the same logits before it. A bidirectional
    model (a BERT checkpoint loads as BertLMHeadModel) would let the training pass see each completion's later
    tokens: log-probs of tokens it reads from their right, and rollouts that never saw them."""
    rows = model.get_input_embeddings().num_embeddings
    ids = torch.tensor([[1, 2, 3], [1, 2, 4]], device=model.device).clamp(max=rows - 1)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[:, :2].float()  # [2, 2, V]
    if (logits[0] - logits[1]).abs().max() > 1e-3 * logits.abs().max().clamp(min=1e-30):  # causal: equal to 1e-7
        raise UserError(f"--model {name} is not causal: changing a sequence's last token changes the logits before "
                        "it, so the training pass would read each completion token from the ones after it; use a "
                        "decoder-only (causal LM) model")


def check_attention_cache(model, name: str) -> None:
    """The rollout keeps keys and values (a DynamicCache), copies each prompt's for its group and selects rows of it;
    a model with state-space or linear-attention layers (Mamba, LFM2, Qwen3-Next, Granite 4.0-H) keeps a recurrent
    state there instead, which that cache neither holds nor copies."""
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    try:
        layers = DynamicCache(config=model.config).layers
    except (TypeError, ValueError, AttributeError, KeyError):  # a config it cannot read (a layer type of remote
        return  # code's own): the rollout will tell
    recurrent = sorted({type(layer).__name__ for layer in layers if isinstance(layer, LinearAttentionCacheLayerMixin)})
    if recurrent:
        raise UserError(f"--model {name} ({type(model).__name__}) has state-space or linear-attention layers "
                        f"({', '.join(recurrent)} in its cache), which grpo.py's key/value-cache rollout does not "
                        "support; use a transformer (attention-only) model (prm.py trains on this one)")


def disable_dropout(model: torch.nn.Module) -> dict:
    """Dropout makes the training log-probs differ from the sampler's and from the reference's (TRL #3500), and
    two training passes differ from each other (the PPO ratio would compare two dropout draws). Zeroes every
    nn.Dropout (peft's adapter dropout is one) and the rates that attention layers apply themselves
    (transformers' `self.attention_dropout`, read in train mode), and those in the config (GPT-Neo and Persimmon
    read `config.attention_dropout` in their forward). Returns the config's rates as they were: the saved
    config.json keeps them, so that whoever trains the result further gets the model's dropout back."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    original_rates = {}
    for name, value in (list(vars(config).items()) if config is not None else ()):
        if ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float):
            original_rates[name] = value
            setattr(config, name, 0.0)
    return original_rates


def encode_prompts(tokenizer, prompts: list[str], use_chat_template: bool, max_prompt_length: int,
                   where: Optional[list[str]] = None, system_prompt: Optional[str] = None) -> list[list[int]]:
    """Token ids for each prompt, through the chat template when the tokenizer has one and it is wanted, after a
    system message when one is given (which needs the template). where: each prompt's origin (file:line) for the
    error messages."""
    templated = use_chat_template and bool(tokenizer.chat_template)
    if system_prompt is not None and not templated:
        raise UserError("--system-prompt needs a chat template: the tokenizer has none"
                        + (" (a base model: put the instruction in the prompts)" if use_chat_template else
                           ", or --no-chat-template turned it off"))
    system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    encoded = []
    for index, prompt in enumerate(prompts):
        name = f"prompt {index}" if where is None else f"{where[index]}: the prompt"
        if templated:
            try:
                ids = tokenizer.apply_chat_template([*system, {"role": "user", "content": prompt}],
                                                    add_generation_prompt=True, tokenize=True, return_dict=False)
            except Exception as error:  # (jinja2's TemplateError: Gemma's template raises on a system role)
                if not system:
                    raise
                raise UserError(f"the chat template refuses the system message ({error}); leave out --system-prompt "
                                "and put the instruction in the prompts") from None
        else:
            ids = tokenizer(prompt)["input_ids"]
        if len(ids) > max_prompt_length:
            raise UserError(f"{name} is {len(ids)} tokens, longer than --max-prompt-length "
                            f"{max_prompt_length}: raise the limit or shorten the prompt")
        if not ids:  # nothing to condition on, and no position whose logits predict the first completion token
            raise UserError(f"{name} encodes to no tokens (an empty prompt with a tokenizer that adds no BOS): "
                            "give it some text")
        encoded.append(list(ids))
    return encoded


def left_pad(sequences: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad to a [B, P] id tensor and its attention mask, so that every prompt ends at the same column."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq):] = 1
    return ids.to(device), mask.to(device)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / the top-p nucleus to -inf. logits [B, V] (already divided by T)."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # a token goes when the tokens above it already hold top_p: the smallest set that reaches top_p is kept (as
        # transformers' TopPLogitsWarper and vLLM), the top token always (top_p > 0)
        remove = cumulative - sorted_logits.softmax(-1) >= top_p
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return logits


def prompt_generators(seed: int, step: int, prompt_indices: list[int], device) -> list[torch.Generator]:
    """One random stream per prompt, keyed by (seed, step, the prompt's index in the global batch): a prompt's
    completions are the same whichever process samples it and however the batch is split, and a resumed run
    samples exactly what an uninterrupted one would."""
    seeds = [int(np.random.SeedSequence([seed, step, index]).generate_state(1)[0]) for index in prompt_indices]
    return [torch.Generator(device=device).manual_seed(s) for s in seeds]


@torch.no_grad()
def generate(model, prompt_ids, prompt_mask, *, max_new_tokens: int, eos_ids, pad_id: int, temperature=1.0,
             top_p=1.0, top_k=0, generators: Optional[list] = None, group_size: int = 1, stop_together=False,
             decode_forward=None, vocab_size: Optional[int] = None):
    """Complete left-padded prompts with a KV cache. prompt_ids, prompt_mask [B, P]; eos_ids: the id, or the
    list of ids (see stop_token_ids), any of which ends a completion.

    With `generators` (one per group of B / len(generators) consecutive rows) tokens are sampled from
    softmax(logits / temperature), restricted by top-k / top-p, with the Gumbel-max trick:
    argmax(logits / T + Gumbel noise) is an exact sample, and the noise comes from each row group's own stream.
    Without generators decoding is greedy. Returns completion ids [B, T] (pad after EOS), the completion mask
    [B, T] (1 up to and including the first EOS), and the sampler's log-probs [B, T] of the chosen tokens under
    softmax(logits / T) over all vocab_size ids, unfiltered (what the training pass computes; top-k/top-p only
    choose which token is drawn: with them the ratio and the KL refer to the untruncated policy, not to the one that
    drew the tokens, as in TRL and verl). With group_size > 1, rows come in groups of identical prompts: each prompt
    is encoded once and its KV cache copied to its group (a G-fold cheaper prefill, which dominates for long
    prompts).
    stop_together: decode until every process's rows have ended (under FSDP each forward is a collective).
    decode_forward: what to call for the one-token passes instead of model (model compiled: --compile-decoding).
    vocab_size: sample only the first vocab_size ids, those the tokenizer has. Checkpoints pad their output layer
    past the tokenizer (Qwen2.5: 151,936 rows for 151,665 ids); the untrained rows' logits are noise that can be
    drawn, decode to nothing the reward sees, and would still be reinforced (sglang #38279).
    """
    from transformers import DynamicCache

    decode_forward = model if decode_forward is None else decode_forward
    batch = prompt_ids.shape[0]
    greedy = generators is None
    eos_ids = torch.tensor([eos_ids] if isinstance(eos_ids, int) else list(eos_ids), device=prompt_ids.device)
    position_ids = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens count from 0
    attention_mask = prompt_mask
    cache = DynamicCache()
    unique = slice(None, None, group_size)  # one row per group of identical prompts
    logits = model(input_ids=prompt_ids[unique], attention_mask=attention_mask[unique],
                   position_ids=position_ids[unique], cache=cache, use_cache=True,
                   logits_to_keep=1).logits[:, -1, :vocab_size]  # [U, V]
    # decoding reads this cache from the second token on: a model that did not fill it (a custom forward that ignores
    # `cache`) would sample every later token without its prompt
    if max_new_tokens > 1 and cache.get_seq_length() != prompt_ids.shape[1]:
        import transformers

        raise UserError(f"{type(model).__name__} did not fill the KV cache it was given as `cache=`, which "
                        f"transformers 5.24 and later read (this is {transformers.__version__}): upgrade transformers")
    if group_size > 1:
        cache.batch_repeat_interleave(group_size)
        logits = logits.repeat_interleave(group_size, dim=0)  # [B, V]
    next_position = position_ids[:, -1:] + 1  # [B, 1]
    finished = torch.zeros(batch, dtype=torch.bool, device=prompt_ids.device)
    tokens, logps = [], []
    for position in range(max_new_tokens):
        scaled = logits.float() / (1.0 if greedy else temperature)  # [B, V]
        if greedy:
            token = scaled.argmax(-1)
        else:
            rows_per_stream = batch // len(generators)
            uniform = torch.cat([torch.rand(rows_per_stream, scaled.shape[-1], generator=g, device=scaled.device)
                                 for g in generators])  # [B, V]
            gumbel = -torch.log(-torch.log(uniform))
            token = (filter_logits(scaled, top_k, top_p) + gumbel).argmax(-1)
        token = torch.where(finished, torch.full_like(token, pad_id), token)
        tokens.append(token)
        logps.append(torch.log_softmax(scaled, dim=-1).gather(-1, token.unsqueeze(-1)).squeeze(-1))
        finished |= torch.isin(token, eos_ids)
        all_finished = finished.all()
        if stop_together:
            all_finished = all_finished.float()
            dist.all_reduce(all_finished, op=dist.ReduceOp.MIN)
        if all_finished or position == max_new_tokens - 1:  # the last token is never fed back
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=1)
        logits = decode_forward(input_ids=token.unsqueeze(-1), attention_mask=attention_mask,
                             position_ids=next_position, cache=cache, use_cache=True).logits[:, -1, :vocab_size]
        next_position = next_position + 1
    completion_ids = torch.stack(tokens, dim=1)  # [B, T]
    is_eos = torch.isin(completion_ids, eos_ids)
    # 1 up to and including the first EOS: positions whose count of earlier EOS tokens is 0
    completion_mask = ((is_eos.cumsum(1) - is_eos.long()) == 0).long()
    return completion_ids, completion_mask, torch.stack(logps, dim=1)


def ended_by_eos(completion_ids, completion_mask, eos_ids: list[int]) -> torch.Tensor:
    """[B] bool: each completion's last kept token is a stop id; False = it ran to max_new_tokens (truncated)."""
    last = completion_ids.gather(1, (completion_mask.sum(1, keepdim=True) - 1).clamp(min=0)).squeeze(1)  # [B]
    return torch.isin(last, torch.tensor(eos_ids, device=last.device))


def decode_completions(tokenizer, completion_ids, completion_mask, eos_ids: list[int]) -> list[str]:
    """Each completion's text up to (not including) the EOS that ended it, other special tokens kept."""
    lengths = (completion_mask.sum(1) - ended_by_eos(completion_ids, completion_mask, eos_ids).long()).tolist()
    return tokenizer.batch_decode([ids[:n] for ids, n in zip(completion_ids.tolist(), lengths)],
                                  skip_special_tokens=False)


def stop_token_ids(model, tokenizer) -> list[int]:
    """The ids that end a completion, as model.generate stops: the tokenizer's EOS and every EOS of the model's
    generation config (chat models list several: Llama 3's <|eot_id|> and <|end_of_text|>, Qwen2.5's <|im_end|>
    and <|endoftext|>), which a chat template's turn can end with."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = [configured] if isinstance(configured, int) else list(configured or [])
    return sorted({tokenizer.eos_token_id, *configured})


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
                        with_entropy=False, prompt_of_row: Optional[list[int]] = None,
                        vocab_size: Optional[int] = None):
    """Log-probs of the completion tokens under the model, over the prompt and every completion token but the last
    (only ever a target: feeding it would cost a position of every layer), with logits kept only at the T positions
    that predict completion tokens (never [B, P+T, V]). Returns logp [B, T] and the entropy or None.

    prompt_of_row: each row's prompt, numbered from 0 in order of first appearance; rows with one number must have
    identical prompt_ids and prompt_mask (left-padded), and every completion mask is ones then zeros. Each prompt
    is then encoded once, and its keys and values indexed out to its rows before one pass over the completions:
    the group's prompt is computed once instead of group-size times, and gradients flow back through the indexing
    into it. None: one pass over every row's prompt and completion. vocab_size: as generate's (the softmax covers
    the ids the sampler draws from)."""
    num_completion = completion_ids.shape[1]
    attention_mask = torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1)  # [B, P+T-1]
    if prompt_of_row is None:
        input_ids = torch.cat([prompt_ids, completion_ids[:, :-1]], dim=1)  # [B, P+T-1]
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        # the last T positions, P-1 .. P+T-2, predict completion tokens 0 .. T-1
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       logits_to_keep=num_completion, use_cache=False).logits  # [B, T, V]
        return token_logprobs(logits, completion_ids, temperature, with_entropy, vocab_size=vocab_size)

    from transformers import DynamicCache

    first_rows = [prompt_of_row.index(p) for p in range(max(prompt_of_row) + 1)]
    owner = torch.tensor(prompt_of_row, device=prompt_ids.device)  # [B]
    cache = DynamicCache()
    prompt_positions = (prompt_mask[first_rows].cumsum(-1) - 1).clamp(min=0)
    # the prompt's last position predicts completion token 0
    first_logits = model(input_ids=prompt_ids[first_rows], attention_mask=prompt_mask[first_rows],
                         position_ids=prompt_positions, cache=cache, use_cache=True,
                         logits_to_keep=1).logits[owner]  # [B, 1, V]
    if num_completion == 1:
        return token_logprobs(first_logits, completion_ids, temperature, with_entropy, vocab_size=vocab_size)
    if cache.get_seq_length() != prompt_ids.shape[1]:  # else the completions would be scored without their prompt
        raise UserError(f"--share-prompts: {type(model).__name__} did not fill the KV cache it was given (as "
                        "transformers' gradient-checkpointed layers do, or a model that ignores `cache=`); run with "
                        "--share-prompts never")
    cache.batch_select_indices(owner)  # [U, heads, P, d] -> [B, heads, P, d] in every layer
    position_ids = prompt_mask.sum(1, keepdim=True) + torch.arange(num_completion - 1, device=prompt_ids.device)
    rest_logits = model(input_ids=completion_ids[:, :-1], attention_mask=attention_mask, position_ids=position_ids,
                        cache=cache, use_cache=True).logits  # [B, T-1, V]
    return token_logprobs(torch.cat([first_logits, rest_logits], dim=1), completion_ids, temperature, with_entropy,
                          vocab_size=vocab_size)


# Below this many skipped prompt positions per micro-batch, the extra forward call costs about what it saves: on 2
# CPU cores and the 20.5M-parameter model, a training pass that skips 70 positions is no faster, one that skips 224
# is 1.5x faster (the default tiny run's micro-batches skip 1,440 per step: its step went from 0.077 to 0.039 s)
SHARE_PROMPTS_MIN_SKIPPED_POSITIONS = 128


def prompt_sharing(prompts: list[int], prompt_width: int, mode: str) -> Optional[list[int]]:
    """The prompt_of_row that completion_logprobs takes for a micro-batch whose rows complete the given prompts
    (each prompt's number in the batch), or None when mode says to encode every row's prompt: never; auto when the
    rows share too few prompt positions (of prompt_width each, padding included) to be worth it; always."""
    skipped_positions = (len(prompts) - len(set(prompts))) * prompt_width
    if mode == "never" or (mode == "auto" and skipped_positions < SHARE_PROMPTS_MIN_SKIPPED_POSITIONS):
        return None
    numbers = {prompt: number for number, prompt in enumerate(dict.fromkeys(prompts))}  # in order of appearance
    return [numbers[p] for p in prompts]


def micro_batch_rows(completion_lengths: list[int], prompt_lengths: list[int], group_size: int, minibatch_rows: int,
                     micro_batch: int, share_mode: str, by_length: bool) -> list[list[list[int]]]:
    """The rows of each micro-batch, minibatch by minibatch: minibatch j is rows j * minibatch_rows onwards (whole
    groups: row r completes prompt r // group_size, of prompt_lengths[r // group_size] tokens), cut into runs of
    micro_batch rows. by_length: a minibatch's rows go in order of decreasing completion length instead, the longest
    first (a memory limit shows at once), where that makes its passes process fewer positions: a micro-batch is cut
    to its longest completion, so rows of like length waste little on padding, but its rows then come from more
    prompts, which --share-prompts encodes less often once each. Gradients are sums over the micro-batches, whatever
    their rows: only the rounding of the sums changes."""
    def positions(micro_batches: list[list[int]]) -> int:  # prompt and completion positions the passes process
        total = 0
        for rows in micro_batches:
            prompts = [row // group_size for row in rows]
            width = max(prompt_lengths[p] for p in prompts)
            encoded = len(rows) if prompt_sharing(prompts, width, share_mode) is None else len(set(prompts))
            total += encoded * width + len(rows) * max(completion_lengths[row] for row in rows)
        return total

    arrangement = []
    for start in range(0, len(completion_lengths), minibatch_rows):
        rows = list(range(start, start + minibatch_rows))
        in_order = [rows[i:i + micro_batch] for i in range(0, minibatch_rows, micro_batch)]
        longest_first = sorted(rows, key=lambda row: -completion_lengths[row])  # (stable: ties keep their order)
        by_completion = [longest_first[i:i + micro_batch] for i in range(0, minibatch_rows, micro_batch)]
        arrangement.append(by_completion if by_length and positions(by_completion) < positions(in_order)
                           else in_order)
    return arrangement


# FSDP2 also runs on CPU over gloo, which the tests use to check the sharded path; users get a clear error there
FSDP_DEVICE_TYPES = ("cuda",)


def shard_model(model, device: torch.device, compute_dtype: torch.dtype) -> None:
    """FSDP2 (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html), in place: each transformer block
    (the model's `_no_split_modules`) is one unit whose weights are all-gathered just before its forward and
    freed after, the embeddings and head form the root unit. Weights, gradients and optimiser state stay sharded
    in fp32; forward and backward run in compute_dtype, gradients are reduced in fp32. Gradients are summed, not
    averaged, over processes: each process's loss is already divided by the global counts. They are reduce-scattered
    after every micro-batch and accumulate sharded: deferring that would hold whole fp32 gradients on every GPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    block_names = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or []}
    blocks = [module for module in model.modules() if type(module).__name__ in block_names]
    if not blocks:
        raise UserError(f"--fsdp: found no transformer blocks to shard in {type(model).__name__} (its "
                        "_no_split_modules is empty); run without --fsdp")
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # a plain SUM (gloo has no pre-multiplied sum)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def tied_parameter_names(model) -> set[str]:
    """The second names of tied weights (embeddings = output head): state dicts list them once per name, files once."""
    return {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(dict(model.named_parameters()))


def full_state_dicts(model, optimizer=None) -> tuple[dict, Optional[dict]]:
    """Whole (unsharded) model and optimiser state dicts of a sharded model, on the CPU of rank 0 (empty
    elsewhere); every process must call it, since it gathers the shards."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    for name in tied_parameter_names(model):  # (saved once, as save_pretrained does)
        weights.pop(name, None)
    return weights, get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else None


def apply_lora(model, args: Args):
    from peft import LoraConfig, NoMatchingPeftModuleError, get_peft_model

    targets = args.lora_target_modules
    names = [name.strip() for name in targets.split(",") if name.strip()]  # ("q_proj," names no module "")
    target_modules = targets if targets == "all-linear" else names
    # no dropout on the adapter either: see disable_dropout
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules=target_modules,
                        task_type="CAUSAL_LM")
    candidates = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                         if isinstance(module, (torch.nn.Linear, torch.nn.Embedding))
                         or type(module).__name__ == "Conv1D"})  # GPT-2's linear layers are Conv1D
    # (no adapter's rank can exceed its layer's smaller side; a huge --lora-r would only fail to allocate)
    largest_rank = max((min(weight.shape) for weight in model.parameters() if weight.dim() == 2), default=0)
    if args.lora_r > largest_rank:
        raise UserError(f"--lora-r {args.lora_r} is above the rank of every weight matrix of the model (at most "
                        f"{largest_rank}, their smaller side); pass a rank far below it, such as 8 to 64")
    try:
        model = get_peft_model(model, config)
    except NoMatchingPeftModuleError:
        unknown = target_modules
    except ValueError as error:  # peft refuses some layers of some models (Mamba's out_proj and conv1d)
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UserError(f"--lora-target-modules {targets}: peft cannot adapt them on {type(model).__name__} "
                        f"({reason}); pass --lora-target-modules without them") from None
    else:  # peft adapts the names that match and ignores the others: a typo would go unnoticed
        adapted = model.targeted_module_names
        unknown = [] if targets == "all-linear" else [
            target for target in target_modules if not any(name == target or name.endswith("." + target)
                                                           for name in adapted)]
    if unknown:
        raise UserError(f"--lora-target-modules: no layer is named {', '.join(unknown)}; this model's include "
                        f"{', '.join(candidates)}")
    return model


def oversized_lora_note(model, rank: int) -> Optional[str]:
    """A note when adapters of rank r hold at least as many weights as a layer they adapt, r (in + out) >= in out:
    full fine-tuning would train that layer with fewer weights, and no adapter's rank exceeds min(in, out)."""
    oversized = [(name, module.in_features, module.out_features) for name, module in model.named_modules()
                 if isinstance(getattr(module, "in_features", None), int) and hasattr(module, "lora_A")
                 and rank * (module.in_features + module.out_features) >= module.in_features * module.out_features]
    if not oversized:
        return None
    name, in_features, out_features = min(oversized, key=lambda layer: layer[1] * layer[2] / (layer[1] + layer[2]))
    below = (in_features * out_features - 1) // (in_features + out_features)
    return (f"note: with --lora-r {rank}, {len(oversized)} adapters hold at least as many weights as the layer they "
            f"adapt (r x (in + out) >= in x out; smallest: {name.removeprefix('base_model.model.')}, in "
            f"{in_features}, out {out_features}); pass --lora-r {below} or less, or leave --lora-r out to train the "
            "weights in full")


# ---------------------------------------------------------------------------------------------------------------
# Training


def compute_rewards(prompts: list[str], completions: list[str], answers: list[str],
                    reward_fns: list[tuple[str, Callable, float]], on_error: str,
                    sample_indices: Optional[list[int]] = None) -> tuple[torch.Tensor, dict]:
    """Weighted sum of the reward functions for each completion. A per-sample function takes (completion, answer);
    the PRM reward (name "prm") takes the whole lists (prompts, completions), to score them in batches. A value
    that raised or is not finite is reported with the sample's index in the step's batch (sample_indices, one per
    completion: under torchrun a process holds only its share; default 0, 1, ...): raised as an error, or
    (on_error="skip") that sample's reward becomes NaN, with a warning (the first five of a call, then a count)."""
    sample_indices = sample_indices if sample_indices is not None else list(range(len(completions)))
    totals = torch.zeros(len(completions), dtype=torch.float32)
    per_fn, failures = {}, []
    for name, fn, weight in reward_fns:
        raised = set()  # samples whose reward raised (reported once, not again as the NaN it now is)
        if name == "prm":
            try:
                values = [float(v) for v in fn(prompts, completions)]
            except Exception as error:  # one call scores the whole batch: every sample's reward failed
                failure = _reward_failure(name, sample_indices[0], completions[0], answers[0],
                                          f"{type(error).__name__}: {error} "
                                          "(one call scores the whole batch: every sample failed)", on_error,
                                          failures)
                per_fn[name] = torch.full((len(completions),), failure)
                totals += weight * per_fn[name]
                continue
        else:
            values = []
            for index, (completion, answer) in enumerate(zip(completions, answers)):
                try:
                    values.append(float(fn(completion, answer)))
                except Exception as error:
                    raised.add(index)
                    values.append(_reward_failure(name, sample_indices[index], completion, answer,
                                                  f"{type(error).__name__}: {error}", on_error, failures))
        for index, value in enumerate(values):
            # (beyond float32's range a finite value becomes inf in the rewards tensor)
            if index not in raised and not (math.isfinite(value) and abs(value) <= torch.finfo(torch.float32).max):
                values[index] = _reward_failure(name, sample_indices[index], completions[index], answers[index],
                                                f"returned {value}", on_error, failures)
        per_fn[name] = torch.tensor(values, dtype=torch.float32)
        totals += weight * per_fn[name]
    for message in failures[:5]:  # (a few, not one line per sample of every step)
        print0("warning: " + message, file=sys.stderr)
    if len(failures) > 5:
        print0(f"warning: {len(failures) - 5} more reward failures among this process's samples of the step "
               "(counted in reward_errors)", file=sys.stderr)
    return totals, per_fn


def _reward_failure(name: str, index: int, completion: str, answer: str, problem: str, on_error: str,
                    failures: list) -> float:
    message = f"reward {name} failed on sample {index} (completion {completion!r}, answer {answer!r}): {problem}"
    if on_error == "raise":
        raise UserError(message + "; fix the reward function, or pass --reward-errors skip to leave such "
                        "samples out of the step")
    failures.append(message)
    return float("nan")


def make_reward_fns(args: Args, device, prompts: Optional[list[str]] = None) -> list[tuple[str, Callable, float]]:
    """(name, function, weight) of every reward with a weight. prompts: the training prompts, checked against the
    PRM's max length."""
    fns = []
    if args.answer_reward_weight:
        fns.append(("answer", answer_reward, args.answer_reward_weight))
    if args.format_reward_weight:
        fns.append(("format", format_reward, args.format_reward_weight))
    if args.prm_path is not None:
        try:  # only imported when a PRM is asked for
            import prm
        except ModuleNotFoundError as error:
            if error.name != "prm":
                raise
            raise UserError("--prm-path loads the PRM with prm.py's load_prm: put prm.py beside grpo.py (with "
                            "common.py)") from None
        try:
            process_reward_model = prm.load_prm(args.prm_path, device=device)
        except prm.UserError as error:  # another module's class: main() reports only this script's
            raise UserError(f"--prm-path: {error}") from None
        if args.prm_aggregate == "prod" and process_reward_model.config["loss_kind"] == "mse":
            raise UserError(f"--prm-aggregate prod multiplies probabilities, and {args.prm_path} was trained with "
                            "--loss-kind mse: its scores are raw values (a product of two negatives is positive); "
                            "use min, last or mean")
        separator = args.prm_step_separator if args.prm_step_separator is not None else (
            process_reward_model.config["step_separator"])
        max_length, prm_tokenizer = process_reward_model.config["max_length"], process_reward_model.tokenizer
        bos = int(prm_tokenizer.bos_token_id is not None)  # (build_prm_example puts it before the prompt)
        filled = sum(bos + len(ids) >= max_length for ids in prm_tokenizer(
            prompts, add_special_tokens=False)["input_ids"]) if prompts else 0
        if filled:  # no step of theirs can be scored: their completions all get the reward of an empty one
            message = (f"{filled} of the {len(prompts)} training prompts fill the PRM's max length ({max_length} "
                       "tokens) by themselves, leaving no room for a step: their completions get a PRM reward of 0")
            if filled == len(prompts):
                raise UserError(f"--prm-path: {message}; train the PRM with a larger --max-length")
            print0(f"warning: {message}", file=sys.stderr, enabled=os.environ.get("RANK", "0") == "0")

        truncation_reported = []

        def prm_reward(prompts: list[str], completions: list[str]) -> list[float]:
            """Split each completion into steps as prm.py's training rows are, score every step, aggregate. An
            empty completion has no step and gets 0.0, a surely wrong solution's score (scoring it as one empty
            step would reward saying nothing). A step past the PRM's max length, which it cannot see, scores 0 too
            (warned once): left out, it would let a policy raise its reward by writing on past the steps it is
            judged on."""
            steps = [prm.split_steps(completion, separator) for completion in completions]
            scores = prm.score_steps(process_reward_model, prompts, steps)
            cut = sum(len(step_scores) < len(row_steps) for step_scores, row_steps in zip(scores, steps))
            if cut and not truncation_reported:
                truncation_reported.append(cut)
                world_size = int(os.environ.get("WORLD_SIZE", "1"))  # (each process scores its own share)
                where = f" (process {os.environ.get('RANK', '0')} of {world_size})" if world_size > 1 else ""
                print0(f"warning{where}: {cut} of {len(completions)} completions have steps past the PRM's max length "
                       f"({max_length} tokens), which score 0; lower --max-new-tokens or train the PRM with a larger "
                       "--max-length", file=sys.stderr)
            return [prm.aggregate_scores([*step_scores, *[0.0] * (len(row_steps) - len(step_scores))],
                                         args.prm_aggregate) for step_scores, row_steps in zip(scores, steps)]

        fns.append(("prm", prm_reward, args.prm_weight))
    if not fns:
        raise UserError("every reward weight is 0: give --answer-reward-weight, --format-reward-weight, or --prm-path "
                        "with a --prm-weight")
    return fns


def sum_gradients(master: list, distributed: bool) -> None:
    """Gives every master weight a .grad (zeros where none arrived), summed over processes in one flat all-reduce.
    A function of its own so that no list of the gradients outlives it: one left in the training loop held the
    step's gradients through the next step's forward and backward, two sets of them at the peak (on the
    benchmark's small model: peak RSS 932 MiB, 830 with this)."""
    grads = [m.grad if m.grad is not None else torch.zeros_like(m) for m in master]
    if distributed:
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        grads = list(torch.split(flat, [g.numel() for g in grads]))
    for m, g in zip(master, grads):
        m.grad = g.view_as(m).to(m.dtype)


def decay_groups(params: list, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: weight decay on matrices only, not on vectors (biases, norm gains), as nanoGPT and
    transformers' Trainer have it: decay pulls a norm's gain towards 0, which rescales its layer's output rather
    than regularising it. "decay" marks the group that --weight-decay sets (a resumed run applies the flag to it)."""
    groups = ({"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay, "decay": True},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "decay": False})
    return [group for group in groups if group["params"]]


def regroup_optimizer_state(saved: dict, optimizer, params: list) -> dict:
    """An optimiser state saved with every parameter in one group (by this script before decay_groups), laid out in
    this optimiser's groups with each parameter's moments moved along: an earlier checkpoint still resumes. params:
    the parameters in the order that one group held them. Any other state is returned as it is."""
    if len(saved["param_groups"]) != 1 or len(optimizer.param_groups) == 1 or len(
            saved["param_groups"][0]["params"]) != len(params):
        return saved
    number = {id(p): k for k, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    renumbered = [number[id(p)] for p in params]  # the one group's index -> this optimiser's
    (saved_group,) = saved["param_groups"]
    groups = [{**saved_group, "decay": group["decay"], "params": [number[id(p)] for p in group["params"]]}
              for group in optimizer.param_groups]  # (the saved settings: the flags are applied after the load)
    return {"state": {renumbered[i]: value for i, value in saved["state"].items()}, "param_groups": groups}


def lr_lambda(args: Args, total_updates: int):
    def factor(update: int) -> float:
        if update < args.warmup_steps:
            return (update + 1) / args.warmup_steps
        if args.lr_schedule == "cosine":
            progress = (update - args.warmup_steps) / max(1, total_updates - args.warmup_steps)
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0
    return factor


def memory_mb(device) -> float:
    """Current memory: CUDA allocator, or the process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_memory_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# dense bf16 peaks (no sparsity) in TFLOP/s, the specific names before the general ones they contain
PEAK_TFLOPS = (("H200 NVL", 835.0), ("GH200", 989.0), ("H200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0),
               ("H100", 989.0), ("H800 PCIe", 756.0), ("H800", 989.0), ("H20", 148.0), ("GB200", 2500.0),
               ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
               ("A10G", 70.0), ("A10", 125.0), ("A30", 165.0), ("RTX 6000 Ada", 364.0), ("RTX A6000", 155.0),
               ("4090 D", 147.0), ("4090", 165.0), ("3090 Ti", 80.0), ("3090", 71.0))


def guess_peak_tflops(device_name: str) -> float:
    """The dense bf16 peak of a GPU by its name, for MFU; 0 for a name not in PEAK_TFLOPS (pass --peak-tflops).
    Names match as whole words: "H20" is not "H200", nor "A100" "RTX A1000"."""
    for key, tflops in PEAK_TFLOPS:
        if re.search(rf"\b{re.escape(key)}\b", device_name):
            return tflops
    return 0.0


def matmul_flops_per_s(device, dtype: torch.dtype, seconds: float = 0.5, size: int = 1024) -> float:
    """This machine's dense matmul throughput, measured on square matrices for about `seconds`: the reference of the
    FLOP-floor fraction on CPU, where no peak figure is published."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn_like(a)
    for _ in range(2):  # warm-up
        a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * size**3 * count / (time.perf_counter() - start)


def weight_counts(model) -> tuple[int, int]:
    """(body, head): the weights every processed token is multiplied by, and the output head's, which only the
    positions whose logits are computed use. The input embedding is a lookup, not a matmul: in neither."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())  # a head tied to the embedding is counted once
    return total - embedding.numel() - (0 if head is embedding else head.numel()), head.numel()


def step_flops(body: int, head: int, *, unique_prompt_tokens: int, reference_prompt_tokens: int,
               update_prompt_tokens: int, completion_tokens: int, rows: int, reference: bool, iterations: int,
               full_finetune: bool, old_prompt_tokens: int = 0, old_completion_tokens: int = 0,
               old_rows: int = 0) -> float:
    """Model FLOPs of one step, matmuls only (attention scores left out): 2 per weight per token forward; backward
    2 for the input gradients, and 2 more for the weight gradients of trained weights (not LoRA's frozen ones).
    The rollout prefills each distinct prompt once and feeds back every generated token but each row's last; the
    reference pass and each update pass process the prompt tokens they encode (fewer when prompts are shared, see
    --share-prompts) and every completion token but each row's last (of the `rows` completions), with logits at
    the completion positions only. old_*: the tokens of the forward pass that takes the rollout policy's log-probs
    of the minibatches after the first (--num-minibatches above 1)."""
    def forward(prompt_tokens: int, completions: int = completion_tokens, rows: int = rows) -> int:
        return 2 * (body * (prompt_tokens + completions - rows) + head * completions)
    rollout = forward(unique_prompt_tokens)
    update_passes = iterations * (3 if full_finetune else 2)
    return (rollout + int(reference) * forward(reference_prompt_tokens) + update_passes * forward(update_prompt_tokens)
            + forward(old_prompt_tokens, old_completion_tokens, old_rows))


@torch.no_grad()
def evaluate(model, tokenizer, rows, args: Args, device, eos_ids: list[int], vocab_size: Optional[int] = None,
             decode_forward=None) -> tuple[float, list[str]]:
    """Greedy accuracy (answer reward == 1) on held-out rows, and the first few completions to look at."""
    if not rows:
        return float("nan"), []
    was_training = model.training
    model.eval()
    correct, samples = 0.0, []
    for start in range(0, len(rows), args.eval_batch_size):
        batch = rows[start:start + args.eval_batch_size]
        ids, mask = left_pad(encode_prompts(tokenizer, [r["prompt"] for r in batch], args.chat_template,
                                            args.max_prompt_length, system_prompt=args.system_prompt),
                             tokenizer.pad_token_id, device)
        completion_ids, completion_mask, _ = generate(model, ids, mask, max_new_tokens=args.max_new_tokens,
                                                      eos_ids=eos_ids, pad_id=tokenizer.pad_token_id,
                                                      stop_together=args.fsdp, decode_forward=decode_forward,
                                                      vocab_size=vocab_size)
        texts = decode_completions(tokenizer, completion_ids, completion_mask, eos_ids)
        correct += sum(answer_reward(t, r["answer"]) for t, r in zip(texts, batch))
        samples += [f"{r['prompt']!r} -> {t!r}" for t, r in zip(texts, batch)][:3 - len(samples)]
    model.train(was_training)
    return correct / len(rows), samples


def rng_state() -> dict:
    """The global generators' states, as tensors and plain tuples (loadable with weights_only=True). The sampler
    needs none: its streams are keyed by (seed, step, prompt)."""
    numpy_state = np.random.get_state()
    return {"python": random.getstate(), "numpy": (numpy_state[0], torch.from_numpy(numpy_state[1].copy()),
                                                    *numpy_state[2:]),
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    # one state per GPU of the machine that saved it: this one may have fewer
    for index, cuda_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
        torch.cuda.set_rng_state(cuda_state, index)


def update_json(path: str, values: dict) -> None:
    with open(path) as f:
        contents = json.load(f)
    with open(path, "w") as f:
        json.dump({**contents, **values}, f, indent=2, sort_keys=True)


def remove_directory(path: str) -> None:
    """Renamed away, then deleted: a kill mid-way never leaves a half checkpoint or final/ under its name."""
    if os.path.exists(path):
        shutil.rmtree(path + ".old", ignore_errors=True)
        os.replace(path, path + ".old")
        shutil.rmtree(path + ".old")


def save_checkpoint(path: str, model, tokenizer, args: Args, trainer_state: dict, saved_config: dict,
                    state_dict: Optional[dict] = None, base_model=None) -> None:
    """Write to a temporary directory, then rename: a crash mid-write leaves any previous version intact.
    saved_config: values config.json gets in place of the training-time ones (dropout rates, use_cache).
    state_dict: the gathered weights of a sharded model (FSDP), which the model cannot read itself.
    base_model: an adapter's base that exists nowhere else (the tiny model), saved in base/ beside the adapter (final/
    only: checkpoints are for resuming, which builds the base again)."""
    temporary = path.rstrip("/") + ".tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    # one file, so that resuming can read it back whole
    model.save_pretrained(temporary, max_shard_size="1000GB", state_dict=state_dict)
    adapter_config = os.path.join(temporary, "adapter_config.json")
    if base_model is not None:  # the adapter then loads as it is: peft finds its base by this path
        base_model.save_pretrained(os.path.join(temporary, "base"))
        update_json(adapter_config, {"base_model_name_or_path": os.path.abspath(os.path.join(path, "base"))})
    elif os.path.isfile(adapter_config) and os.path.isdir(args.model):  # a local base, as typed (maybe relative):
        update_json(adapter_config, {"base_model_name_or_path": os.path.abspath(args.model)})  # found from anywhere
    for config_path in (os.path.join(temporary, "config.json"), os.path.join(temporary, "base", "config.json")):
        if os.path.exists(config_path):  # (an adapter of a hub model writes none)
            update_json(config_path, saved_config)
    tokenizer.save_pretrained(temporary)
    with open(os.path.join(temporary, "args.json"), "w") as f:
        json.dump({"script": "grpo.py", **asdict(args)}, f, indent=2)
    torch.save(trainer_state, os.path.join(temporary, "trainer_state.pt"))
    # the old version is moved aside, the new one put in its place, and only then is the old one deleted (slow for
    # a large model): a kill at any point leaves a complete version under the name (or, between the two renames,
    # as path.old, which a save at this step cleans up)
    if os.path.exists(path):
        shutil.rmtree(path + ".old", ignore_errors=True)
        os.replace(path, path + ".old")
    os.replace(temporary, path)
    shutil.rmtree(path + ".old", ignore_errors=True)


def load_saved_weights(model, directory: str) -> tuple[list[str], list[str]]:
    """The model.safetensors that save_pretrained wrote in directory, into model in place: the names of the weights
    that did not fit, (missing, unexpected); weights of other shapes raise load_state_dict's RuntimeError.
    save_pretrained writes some architectures' weights under their hub names (GPT-NeoX's lm_head as embed_out, a
    mixture of experts' fused weights one expert at a time, Gemma 3's language model under another prefix); those are
    read through transformers' loader, which maps them back (it builds a second copy of the model, so only for
    them)."""
    from safetensors.torch import load_file

    tied = tied_parameter_names(model)  # (saved once)
    missing, unexpected = model.load_state_dict(load_file(os.path.join(directory, "model.safetensors")), strict=False)
    as_named = sorted(set(missing) - tied), list(unexpected)
    if not any(as_named):
        return as_named
    with open(os.path.join(directory, "config.json")) as f:
        if json.load(f).get("model_type") != model.config.model_type:  # another architecture's weights
            return as_named
    saved, report = type(model).from_pretrained(directory, dtype=model.dtype, output_loading_info=True)
    if any(report[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")):
        return as_named
    missing, unexpected = model.load_state_dict(saved.state_dict(), strict=False)
    return sorted(set(missing) - tied), list(unexpected)


def checkpoint_steps(output_dir: str) -> list[int]:
    """Steps of the complete checkpoints in output_dir, oldest first (a *.tmp left by a crash is not one)."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(int(name.split("-")[1]) for name in os.listdir(output_dir)
                  if re.fullmatch(r"checkpoint-\d+", name) and os.path.isfile(
                      os.path.join(output_dir, name, "trainer_state.pt")))


def final_step(output_dir: str) -> Optional[int]:
    """The step of output_dir/final, None when there is none. A final model is written only when a run reaches
    its --total-steps."""
    try:
        with open(os.path.join(output_dir, "final", "args.json")) as f:
            step = json.load(f).get("total_steps")
    except (OSError, ValueError, AttributeError):  # none, or damaged: no final model to count on
        return None
    return step if isinstance(step, int) else None


# the files of a run in its --output-dir besides its checkpoint-STEP directories (what --overwrite removes)
RUN_FILES = ("metrics.jsonl", "summary.json", "final", "final.tmp", "final.old")


def unfinished_saves(output_dir: str) -> list[str]:
    """What a kill during a save or a deletion leaves in output_dir: checkpoint-N.tmp or final.tmp (a save cut
    short), *.old (a version being replaced or pruned). `latest` never picks them."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    return sorted(name for name in names if re.fullmatch(r"(checkpoint-\d+|final)\.(tmp|old)", name))


# what a checkpoint must agree on with the run that resumes from it
# (not data_path: the rows' content is checked instead, so that the same file can be given by another path)
RESUME_MUST_MATCH = ("model", "lora_r", "lora_alpha", "lora_target_modules", "chat_template", "system_prompt",
                     "prompts_per_step", "group_size", "num_iterations", "num_minibatches", "loss_type",
                     "importance_sampling", "kl_coef", "seed", "fsdp")


def resolve_resume(args: Args, output_dir: str) -> Optional[str]:
    """The checkpoint directory to resume from (`latest` = the newest in --output-dir), checked against args."""
    if args.resume_from is None:
        return None
    path = args.resume_from
    if path == "latest":  # the newest of the checkpoints and the final model
        steps, final = checkpoint_steps(output_dir), final_step(output_dir)
        if not steps and final is None:
            raise UserError(f"--resume-from latest: no checkpoint-* or final directory in {output_dir}: pass the "
                            "run's --output-dir, or, for a run stopped before its first checkpoint, start it again "
                            "with --overwrite")
        newest_is_final = final is not None and (not steps or final > steps[-1])
        path = os.path.join(output_dir, "final" if newest_is_final else f"checkpoint-{steps[-1]}")
    args_file = os.path.join(path, "args.json")
    if not os.path.exists(path):
        raise UserError(f"--resume-from {path} does not exist: pass a checkpoint-STEP or final directory of a run, or "
                        "latest (the newest in --output-dir)")
    if os.path.isfile(args_file) and not os.path.isfile(os.path.join(path, "trainer_state.pt")):
        raise UserError(f"--resume-from {path}: no trainer_state.pt in it (a copy cut short, or a final model written "
                        f"before final models kept their trainer state): it cannot be continued, but a new run can "
                        f"start from its weights (--model {path})")
    if not os.path.isfile(args_file):
        raise UserError(f"--resume-from {path}: not a checkpoint written by grpo.py (no args.json and "
                        "trainer_state.pt in it)")
    try:
        with open(args_file) as f:
            saved = json.load(f)
    except (OSError, ValueError) as error:
        raise UserError(f"--resume-from {path}: cannot read its args.json ({error})") from None
    if not isinstance(saved, dict) or saved.get("script") != "grpo.py":
        script = saved.get("script") if isinstance(saved, dict) else None
        raise UserError(f"--resume-from {path}: this checkpoint was written by {script or 'another program'}, not "
                        "grpo.py")
    defaults = {field.name: field.default for field in fields(Args)}  # for a flag newer than the checkpoint
    different = [f"--{key.replace('_', '-')} {saved.get(key, defaults[key])!r} there, {getattr(args, key)!r} here"
                 for key in RESUME_MUST_MATCH if saved.get(key, defaults[key]) != getattr(args, key)]
    if different:
        raise UserError(f"--resume-from {path}: the checkpoint's run differs from this one ({'; '.join(different)}); "
                        "resume with the same settings")
    # the other flags may change (a longer run, another temperature...), but not unsaid: the run goes on otherwise
    # than it began. Not listed: where it runs and writes, and the optimiser settings (noted once restored)
    unnoted = {"resume_from", "output_dir", "overwrite", "run_name", "world_size", "local_prompts", "learning_rate",
               "weight_decay", "adam_betas"}

    def as_run(key: str, value):  # a file by its real path (the data's content is checked apart); a tuple is a list
        return os.path.realpath(value) if key.endswith("_path") and isinstance(value, str) else json.dumps(value)
    changed = [f"--{key.replace('_', '-')} {saved.get(key, defaults[key])!r} there, {getattr(args, key)!r} here"
               for key in defaults if key not in unnoted
               and as_run(key, saved.get(key, defaults[key])) != as_run(key, getattr(args, key))]
    if changed:
        print0(f"note: resuming with other settings than the checkpoint's run: {'; '.join(changed)}",
               enabled=os.environ.get("RANK", "0") == "0")
    return path


def resolve_device(name: str, local_rank: int, local_processes: int = 1) -> torch.device:
    """--device as a torch.device: auto = a GPU if there is one, else the CPU; a GPU named without an index
    ("cuda") is this process's own (LOCAL_RANK under torchrun), as torch.cuda.set_device needs an index.
    local_processes: torchrun's processes on this machine (LOCAL_WORLD_SIZE), each of which needs a GPU of its own."""
    try:
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    except RuntimeError:
        raise UserError(f"--device {name!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if device.index is not None and local_processes > 1:  # NCCL refuses two processes on one GPU
            raise UserError(f"--device {name} puts every one of the {local_processes} processes on this machine on "
                            "the same GPU: use --device cuda (each process takes GPU LOCAL_RANK), and "
                            "CUDA_VISIBLE_DEVICES to choose the GPUs")
        device = torch.device("cuda", local_rank if device.index is None else device.index)
        if device.index >= visible:
            raise UserError(f"--device {name}: there is no {device} here ({visible} CUDA devices "
                            "visible); use --device cpu or auto")
    if device.type == "meta":  # tensors without data: the first value read fails deep inside the run
        raise UserError(f"--device {name}: a meta device holds no data to train on; use --device cpu, cuda or auto")
    if device.type not in ("cpu", "cuda"):  # a type this torch knows but this machine lacks (mps on Linux)
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as error:
            raise UserError(f"--device {name}: not usable here ({str(error).splitlines()[0]}); use --device cpu, "
                            "cuda or auto") from None
    return device


def flags_set(args: Args, *names: str) -> list[str]:
    """The flags among names given a value other than their default (a flag given its default value can't be told
    from one not given)."""
    defaults = Args()
    return [f"--{name.replace('_', '-')}" for name in names if getattr(args, name) != getattr(defaults, name)]


def validate_args(args: Args, world_size: int, device: torch.device) -> None:
    """Flags that contradict each other stop the run before anything is loaded or written."""
    def check(condition: bool, message: str) -> None:
        if not condition:
            raise UserError(message)

    check(args.group_size >= 2, f"--group-size must be at least 2 (got {args.group_size}): advantages compare "
          "completions of the same prompt")
    check(args.lora_r >= 0, f"--lora-r must be >= 0 (0 = full fine-tuning), got {args.lora_r}")
    check(args.lora_r == 0 or args.lora_alpha > 0, f"--lora-alpha must be > 0 (the adapter's scale is alpha / r: at "
          f"0 nothing trains), got {args.lora_alpha}")
    check(0 <= args.seed < 2**32, f"--seed must be in [0, 2**32), got {args.seed}")
    check(args.max_bad_steps >= 1, f"--max-bad-steps must be at least 1, got {args.max_bad_steps}")
    # (inf and nan parse as numbers: --learning-rate inf made every weight NaN, --temperature inf trained nothing;
    # past float32's range, --clip-eps-high 1e300 failed to convert inside the loss)
    for name, value in vars(args).items():
        for number in value if isinstance(value, tuple) else [value]:
            check(not isinstance(number, float) or (math.isfinite(number)
                                                     and abs(number) <= torch.finfo(torch.float32).max),
                  f"--{name.replace('_', '-')} must be a finite number within float32's range (3.4e38), got {number}")
            check(not isinstance(number, int) or abs(number) < 2**63,  # (torch's integers are int64)
                  f"--{name.replace('_', '-')} must be within int64's range (2**63), got {number}")
    lora_flags = flags_set(args, "lora_alpha", "lora_target_modules")
    check(args.lora_r > 0 or not lora_flags, f"{' and '.join(lora_flags)}: LoRA settings, but --lora-r 0 (full "
          "fine-tuning) makes no adapters: pass --lora-r, or drop them")
    check(args.lora_target_modules == "all-linear" or args.lora_target_modules.strip(", "),
          f"--lora-target-modules {args.lora_target_modules!r} names no module: give names such as q_proj,v_proj, or "
          "all-linear")
    # (the typing mistake only: escapes and spaces; "\\newline" or "\\text{Step}" may be a separator)
    check(not re.fullmatch(r"(?:\\[nt]|\s)*\\[nt](?:\\[nt]|\s)*", args.prm_step_separator or ""),
          f"--prm-step-separator {args.prm_step_separator!r} holds a backslash and a letter, not a line break: a shell "
          "passes \"\\n\" as those two characters; in bash write $'\\n\\n' for a blank line")
    prm_flags = flags_set(args, "prm_aggregate", "prm_step_separator", "prm_weight")
    check(args.prm_path is not None or not prm_flags, f"{' and '.join(prm_flags)}: PRM reward settings, but there is "
          "no PRM without --prm-path: pass it, or drop them")
    check(args.prm_path is None or args.prm_weight != 0, "--prm-weight 0 turns the PRM reward of --prm-path off: "
          "drop --prm-path, or give a weight")
    check(args.prm_step_separator != "", "--prm-step-separator must not be empty (None, the default, is the "
          "separator the PRM was trained with)")
    check(min(args.total_steps, args.prompts_per_step, args.num_iterations, args.num_minibatches) >= 1,
          "--total-steps, --prompts-per-step, --num-iterations and --num-minibatches must be at least 1")
    check(args.max_new_tokens >= 1, f"--max-new-tokens must be at least 1 (got {args.max_new_tokens}); "
          "--loss-type dr_grpo also uses it as its constant normaliser")
    check(args.temperature >= 1e-3, f"--temperature must be at least 1e-3, got {args.temperature}: logits divided "
          "by less overflow float32 (0.1 already samples nearly greedily; evaluation is greedy anyway)")
    check(0 < args.top_p <= 1 and args.top_k >= 0, "--top-p must be in (0, 1] and --top-k >= 0")
    check(0 <= args.clip_eps_low < 1 and args.clip_eps_high >= 0, "--clip-eps-low must be in [0, 1) (at 1 or more "
          "the lower bound 1 - eps clips no ratio, all being above 0) and --clip-eps-high >= 0")
    check(args.delta is None or args.delta > 1 + args.clip_eps_high,
          f"--delta {args.delta} must be above 1 + --clip-eps-high, or it caps the ratios of positive advantages "
          "before PPO's own upper clip (INTELLECT-2 takes a delta well above 1 + eps, such as 4)")
    check(args.kl_coef >= 0, f"--kl-coef must be >= 0, got {args.kl_coef}")
    check(args.kl_coef > 0 or not flags_set(args, "kl_estimator"), f"--kl-estimator {args.kl_estimator} with "
          "--kl-coef 0: there is no KL penalty to estimate; pass --kl-coef above 0, or drop --kl-estimator")
    check(not args.kl_ratio_weighted or (args.kl_coef > 0 and args.kl_estimator != "k2"), "--kl-ratio-weighted "
          "weights the KL penalty by the ratio: it needs --kl-coef above 0 and --kl-estimator k1 or k3 (k2 times the "
          "ratio estimates no KL)")
    check(args.learning_rate >= 0 and args.weight_decay >= 0 and args.max_grad_norm >= 0,
          "--learning-rate, --weight-decay and --max-grad-norm must be >= 0")
    check(all(0.0 <= beta < 1.0 for beta in args.adam_betas), f"--adam-betas must be in [0, 1), got {args.adam_betas}")
    check(args.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    check(args.peak_tflops >= 0, f"--peak-tflops must be >= 0 (0 = look up a GPU's bf16 peak), got {args.peak_tflops}")
    check(args.eval_batch_size >= 1 and args.num_eval_prompts >= 0,
          "--eval-batch-size must be at least 1 and --num-eval-prompts >= 0")
    check(args.eval_every >= 0, "--eval-every must be >= 0 (0 = only at the start and the end)")
    check(args.save_every >= 0, "--save-every must be >= 0 (0 = only the final model)")
    check(args.keep_checkpoints >= 1, f"--keep-checkpoints must be at least 1 (got {args.keep_checkpoints})")
    check(args.prompts_per_step % world_size == 0, f"--prompts-per-step {args.prompts_per_step} must be "
          f"divisible by the number of processes ({world_size})")
    check(args.prompts_per_step % (world_size * args.num_minibatches) == 0, f"--prompts-per-step "
          f"{args.prompts_per_step} must be divisible by --num-minibatches {args.num_minibatches} times the number "
          f"of processes ({world_size}): every process holds an equal share of each minibatch")
    minibatch = args.prompts_per_step // (world_size * args.num_minibatches) * args.group_size
    check(args.micro_batch_size <= minibatch, f"--micro-batch-size {args.micro_batch_size} is larger than the "
          f"minibatch of {minibatch} completions per process (prompts per step / processes / minibatches x group "
          "size)")
    check(args.micro_batch_size >= 0, "--micro-batch-size must be >= 0 (0 = the whole minibatch at once)")
    check(args.dtype != "bfloat16" or device.type != "cuda" or torch.cuda.is_bf16_supported(),
          "--dtype bfloat16: this GPU does not support bf16; use --dtype float32")
    check(not args.fsdp or device.type in FSDP_DEVICE_TYPES, "--fsdp needs CUDA: it shards the model over GPUs "
          "(FSDP2 over NCCL); on CPU drop the flag (torchrun without it keeps a whole copy on every process)")
    check(not (args.fsdp and args.compile_decoding), "--compile-decoding with --fsdp: torch.compile breaks its graph "
          "at FSDP's hooks and recompiles per layer, and gained nothing measured; drop one of the two")
    check(not args.fsdp or "WORLD_SIZE" in os.environ, "--fsdp shards the model over processes: launch with "
          "torchrun --nproc_per_node N (N = 1 runs the same code unsharded), or drop the flag")


def train(args: Args) -> dict:
    # ---- set-up: processes, device, dtype, output directory
    # transformers' progress bars for writing and loading weights would break into the log's lines, and peft calls
    # a property transformers has deprecated (a warning at every LoRA run that the user can do nothing about)
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    warnings.filterwarnings("ignore", message=re.escape("`is_gradient_checkpointing` is deprecated"),
                            category=FutureWarning)
    # launched by torchrun with several processes, or with one under --fsdp (which needs a process group)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 or (args.fsdp and "WORLD_SIZE" in os.environ)
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    args.world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = resolve_device(args.device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if distributed else 1)
    validate_args(args, args.world_size, device)
    if args.importance_sampling == "sequence" and args.loss_type != "grpo":
        print0(f"warning: --importance-sampling sequence with --loss-type {args.loss_type} weights each completion's "
               "term by its length; GSPO's objective is a mean over completions (--loss-type grpo)", file=sys.stderr,
               enabled=rank == 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if distributed and not dist.is_initialized():
        # the other ranks wait in a collective while rank 0 evaluates or saves alone: PyTorch's default timeout
        # (10 minutes with NCCL) would end a run whose evaluation or checkpoint takes longer
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=2))
    is_main = rank == 0
    args.local_prompts = args.prompts_per_step // args.world_size
    local_batch = args.local_prompts * args.group_size
    minibatch_rows = local_batch // args.num_minibatches  # this process's completions in each optimiser update
    micro_batch = args.micro_batch_size or minibatch_rows
    # (auto: bf16 only where the GPU has it natively; emulated, on a V100 or T4, it is slow)
    use_bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and device.type == "cuda"
                                             and torch.cuda.is_bf16_supported(including_emulation=False))
    dtype = torch.bfloat16 if use_bf16 else torch.float32
    timestamp = int(time.time())
    if distributed:  # every rank uses rank 0's clock, so the run name is the same everywhere
        stamp = torch.tensor([timestamp], dtype=torch.long, device=device)
        dist.broadcast(stamp, src=0)
        timestamp = int(stamp.item())
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{timestamp}"
    if args.output_dir is None and args.resume_from not in (None, "latest"):  # continue the checkpoint's run
        output_dir = os.path.dirname(os.path.abspath(args.resume_from))
    else:
        output_dir = args.output_dir or os.path.join("runs", args.run_name)
    existing = output_dir
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if existing and not os.path.isdir(existing):
        raise UserError(f"--output-dir {output_dir}: {existing} exists and is not a directory")
    resume_path = resolve_resume(args, output_dir)
    resuming_here = resume_path is not None and os.path.realpath(os.path.dirname(
        os.path.abspath(resume_path.rstrip("/")))) == os.path.realpath(output_dir)
    checkpoints = checkpoint_steps(output_dir)
    holds_run = any(os.path.exists(os.path.join(output_dir, name)) for name in RUN_FILES[:3]) or bool(checkpoints)
    if not resuming_here and holds_run and not args.overwrite:
        if not checkpoints and final_step(output_dir) is None:  # (nothing --resume-from can read)
            raise UserError(f"{output_dir} already holds a run, stopped before its first checkpoint: pass --overwrite "
                            "to start it again, or another --output-dir")
        raise UserError(f"{output_dir} already holds a run: pass --overwrite to replace it, --resume-from latest "
                        "to continue it, or another --output-dir")
    if args.lora_r > 0 and os.path.isdir(args.model):
        # the saved adapter names its base model by this path; under --output-dir, its final/ and checkpoints are
        # what this run deletes and replaces (--overwrite, --keep-checkpoints, a resume from an earlier checkpoint)
        inside = os.path.relpath(os.path.realpath(args.model), os.path.realpath(output_dir)).split(os.sep)[0]
        if inside == "final" or re.fullmatch(r"checkpoint-\d+", inside):
            raise UserError(f"--model {args.model} lies among the files of --output-dir {output_dir}, which this run "
                            "deletes or replaces, while the LoRA adapter it saves names that model as its base: copy "
                            "the model elsewhere first, or pick another --output-dir")
    seed_everything(args.seed)  # the same on every rank: identical initial weights

    # ---- model, reference policy, optimiser
    # FSDP keeps the (sharded) weights in fp32 and computes in `dtype`: it needs no master copies
    model, tokenizer = load_model_and_tokenizer(args.model, torch.float32 if args.fsdp else dtype,
                                                args.trust_remote_code)
    eos_ids = stop_token_ids(model, tokenizer)
    vocab_size = token_id_limit(tokenizer, eos_ids)  # the sampler and every log-prob see these ids only
    reference = None
    tiny_base = copy.deepcopy(model) if args.lora_r > 0 and args.model == "tiny" else None  # see save_checkpoint
    from safetensors import SafetensorError  # (a checkpoint's weights file cut short)

    if args.lora_r > 0:
        if resume_path:
            from peft import PeftModel

            try:
                model = PeftModel.from_pretrained(model, resume_path, is_trainable=True)
            except (OSError, ValueError, SafetensorError) as error:  # missing, or cut short by a copy
                raise UserError(f"--resume-from {resume_path}: cannot read its LoRA adapter ({error}); resume from "
                                "another checkpoint") from None
        else:
            model = apply_lora(model, args)
            note = oversized_lora_note(model, args.lora_r)
            if note:
                print0(note, enabled=is_main)
    else:
        if args.kl_coef != 0.0:  # the reference is the initial policy: copied before any resumed weights load
            # requires_grad stays on (it only ever runs under no_grad): for the non-contiguous hidden states that
            # logits_to_keep slices, torch's matmul picks another kernel for a frozen weight, 1 ulp off the
            # identical policy's; a KL gradient of pure rounding noise that AdamW would turn into full-size steps
            reference = copy.deepcopy(model).eval()
        if resume_path:
            try:
                missing, unexpected = load_saved_weights(model, resume_path)
            except (OSError, ValueError, SafetensorError) as error:  # missing, or cut short by a copy
                raise UserError(f"--resume-from {resume_path}: cannot read its model.safetensors or config.json "
                                f"({error}); resume from another checkpoint") from None
            except RuntimeError as error:  # weights of other shapes
                reason = (str(error).strip().splitlines() or [type(error).__name__])[-1].strip()
                raise UserError(f"--resume-from {resume_path}: its weights do not fit {args.model} "
                                f"({reason})") from None
            if missing or unexpected:
                raise UserError(f"--resume-from {resume_path}: its weights do not fit {args.model} "
                                f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    # after peft has wrapped the model, so that its adapters' dropout goes too; use_cache is off for gradient
    # checkpointing in training, and on for whoever loads the saved model and generates
    saved_config = {**disable_dropout(model), "use_cache": True}
    if args.fsdp:  # each process keeps 1/N of the weights, moved to its GPU shard by shard
        shard_model(model, device, dtype)
        if reference is not None:
            shard_model(reference, device, dtype)
    else:
        model.to(device)
        reference = reference.to(device) if reference is not None else None
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False  # generation passes its own cache
    model.train()
    # --compile-decoding: a compiled view of the same module (its weights, train/eval mode and adapters); dynamic,
    # since the KV cache grows by one position a call. The other passes stay eager: compiled too, they saved 2-3 ms
    # more per step of the tiny model (of 17 ms then), for 90 s of compiling, recompiled at each change of arguments
    # or strides
    decode_forward = model
    if args.compile_decoding:
        # emulate_precision_casts (inductor's config, for this compile only): round each fused intermediate to bf16
        # as eager does; kept in fp32, the sampler's bf16 log-probs left the eager training pass's (2 new tokens:
        # logp_gap_max 0 -> 0.003-0.008), a mismatch the ratio would carry
        decode_forward = torch.compile(model, dynamic=True, options={"emulate_precision_casts": True})
    trainable = [p for p in model.parameters() if p.requires_grad]
    # bf16 weights round away updates smaller than ~1/256 of the weight; the optimiser steps fp32 master
    # copies and writes them back (LoRA adapters are already fp32, peft's default)
    master = [p.detach().float().clone() if p.dtype != torch.float32 else p for p in trainable]
    mastered = [(p, m) for p, m in zip(trainable, master) if m is not p]  # (bf16 weight, its fp32 copy)
    # fused: one kernel per group for all its parameters instead of a loop of small ops (4-5x faster steps on CPU)
    optimizer = torch.optim.AdamW(decay_groups(master, args.weight_decay), lr=args.learning_rate, betas=args.adam_betas,
                                  eps=1e-8, fused=True)
    total_updates = args.total_steps * args.num_iterations * args.num_minibatches
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args, total_updates))
    if args.warmup_steps > total_updates:
        print0(f"note: --warmup-steps {args.warmup_steps} is more than the run's {total_updates} optimiser updates: "
               f"the learning rate never reaches --learning-rate (at most {total_updates / args.warmup_steps:.2g} of "
               "it); lower --warmup-steps", enabled=is_main)

    # ---- data
    if args.data_path is None:
        train_rows, eval_rows = builtin_task(args.seed, args.num_eval_prompts)
        if not train_rows:
            raise UserError(f"--num-eval-prompts {args.num_eval_prompts} leaves none of the built-in task's 900 "
                            "prompts to train on; lower it")
    else:
        train_rows, eval_rows = load_jsonl_prompts(args.data_path), []
    if args.eval_data_path:  # replaces the built-in held-out prompts too
        eval_rows = load_jsonl_prompts(args.eval_data_path)[:args.num_eval_prompts]
    # short hashes of the rows, kept with the trainer state: resuming on other training rows is an error, and the
    # accuracies a checkpoint keeps are reused only on the same held-out rows
    fingerprint, eval_fingerprint = (hashlib.sha256(json.dumps([[r["prompt"], r["answer"]] for r in rows]).encode())
                                     .hexdigest()[:16] for rows in (train_rows, eval_rows))
    # every prompt checked now, before anything is written: too long, empty, or no room left to complete it
    places = [r.get("where", f"built-in prompt {i}") for i, r in enumerate(train_rows + eval_rows)]
    encoded_prompts = encode_prompts(tokenizer, [r["prompt"] for r in train_rows + eval_rows], args.chat_template,
                                     args.max_prompt_length, where=places, system_prompt=args.system_prompt)
    longest = max(len(ids) for ids in encoded_prompts)
    num_embeddings = model.get_input_embeddings().weight.shape[0]  # (peft's LoRA embedding has no num_embeddings)
    past_rows = [index for index, ids in enumerate(encoded_prompts) if max(ids) >= num_embeddings]
    if past_rows:  # (tokens added to the tokenizer without resizing the model: the embedding lookup would fail)
        raise UserError(f"{places[past_rows[0]]}: the prompt holds token id {max(encoded_prompts[past_rows[0]])}, "
                        f"past {args.model}'s {num_embeddings} embeddings ({len(past_rows)} prompts do): save the "
                        "model after model.resize_token_embeddings(len(tokenizer))")
    # characters the tokenizer has no token for: the model sees one token for all of them (not counted where the
    # unknown token is also BOS or EOS, as GPT-2's <|endoftext|> is: a template puts those in every prompt)
    unknown_id = tokenizer.unk_token_id
    if unknown_id in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        unknown_id = None
    unknown = [0 if unknown_id is None else ids.count(unknown_id) for ids in encoded_prompts]
    if sum(unknown):
        first_unknown = places[next(i for i, count in enumerate(unknown) if count)]
        print0(f"warning: {sum(unknown)} of the prompts' {sum(map(len, encoded_prompts))} tokens are the tokenizer's "
               f"unknown token {tokenizer.unk_token!r} (the first in {first_unknown})"
               + (f": --model tiny knows only the characters {''.join(TINY_CHARS)!r}; pass --model, a hub model or a "
                  "local one, for text" if args.model == "tiny" else ""), file=sys.stderr, enabled=is_main)
    context = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if context and longest + args.max_new_tokens > context:
        # a learned table of positions (GPT-2's) has no row beyond it; rotary positions run on, untrained
        learned = any(isinstance(module, torch.nn.Embedding) and context <= module.num_embeddings <= context + 2
                      and module is not model.get_input_embeddings() for module in model.modules())  # (OPT: +2)
        message = (f"a prompt of {longest} tokens plus --max-new-tokens {args.max_new_tokens} exceeds the model's "
                   f"{context} positions")
        if learned:
            raise UserError(f"{message}: lower --max-new-tokens or --max-prompt-length")
        print0(f"warning: {message}, beyond which it was not trained", file=sys.stderr, enabled=is_main)
    reward_fns = make_reward_fns(args, device, [r["prompt"] for r in train_rows])

    @functools.lru_cache(maxsize=2)
    def epoch_order(epoch: int) -> np.ndarray:
        return np.random.default_rng([args.seed, epoch]).permutation(len(train_rows))

    def prompts_for_step(step: int) -> tuple[list[int], list[dict]]:
        """This rank's share of a step's prompts, with their indices in the global batch. Each epoch is a fresh
        permutation seeded by (seed, epoch), so any step can be rebuilt from its number alone."""
        chosen = []
        for position in range(step * args.prompts_per_step, (step + 1) * args.prompts_per_step):
            epoch, index = divmod(position, len(train_rows))
            chosen.append(train_rows[epoch_order(epoch)[index]])
        indices = list(range(rank, args.prompts_per_step, args.world_size))
        return indices, [chosen[i] for i in indices]

    # ---- resume, logging
    start_step = 0
    bad_steps_in_a_row = skipped_updates = 0
    failed_reward_steps_in_a_row = 0  # steps whose every reward failed (--reward-errors skip): nothing to learn from
    saved_eval_start = saved_eval_last = None
    resumed_wandb_id = resumed_wandb_group = None  # with --track, a resume logs into the checkpoint's wandb run
    if resume_path:
        # (on the CPU first: the optimiser's load puts each state beside its parameter, on this process's device)
        try:
            state = torch.load(os.path.join(resume_path, "trainer_state.pt"), map_location="cpu", weights_only=True)
        except Exception as error:  # torch.load raises many kinds (EOFError, UnpicklingError, RuntimeError)
            # (not torch's own advice to load with weights_only=False, which would run whatever the file holds)
            reason = ("not tensors and plain values: corrupt, or not saved by this script" if "weights_only" in
                      str(error) else (str(error).strip().splitlines() or ["corrupt file"])[0])
            raise UserError(f"--resume-from {resume_path}: cannot read its trainer_state.pt ({type(error).__name__}: "
                            f"{reason}); resume from another checkpoint") from None
        resumed_wandb_id, resumed_wandb_group = state.get("wandb_id"), state.get("wandb_group")
        if state.get("dtype", str(dtype)) != str(dtype):  # (bf16 `auto` on a GPU, float32 on a CPU)
            raise UserError(f"--resume-from {resume_path}: the checkpoint's run computed in {state['dtype']}, this "
                            f"one in {dtype}: pass the same --dtype")
        if state.get("data", fingerprint) != fingerprint:  # (older checkpoints do not record it)
            cause = ("the same --data-path, but the file changed?" if args.data_path else
                     "the built-in task holds out --num-eval-prompts of its prompts: pass the checkpoint's")
            raise UserError(f"--resume-from {resume_path}: the training rows differ from the checkpoint's ({cause})")
        if args.fsdp and state["optimizer"] is not None:  # saved whole (keyed by name): each process keeps its shard
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(model, optimizer, state["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
        elif not args.fsdp:
            try:
                optimizer.load_state_dict(regroup_optimizer_state(state["optimizer"], optimizer, master))
            except ValueError as error:  # another set of parameters (a checkpoint of another model or LoRA setting)
                raise UserError(f"--resume-from {resume_path}: its optimiser state does not fit this run "
                                f"({str(error).strip().splitlines()[0]})") from None
        scheduler.load_state_dict(state["scheduler"])
        # the flags win over the optimiser settings the checkpoint restored, with the schedule where it had got to
        restored = {"--learning-rate": scheduler.base_lrs[0],
                    "--adam-betas": tuple(optimizer.param_groups[0]["betas"]),
                    "--weight-decay": optimizer.param_groups[0]["weight_decay"]}
        wanted = {"--learning-rate": args.learning_rate, "--adam-betas": tuple(args.adam_betas),
                  "--weight-decay": args.weight_decay}
        for flag in (flag for flag in restored if restored[flag] != wanted[flag]):
            print0(f"resuming with {flag} {wanted[flag]} (the checkpoint's run had {restored[flag]})", enabled=is_main)
        scheduler.base_lrs = [args.learning_rate] * len(optimizer.param_groups)
        for group in optimizer.param_groups:
            decay = args.weight_decay if group.get("decay", True) else 0.0  # (older checkpoints: one group, decayed)
            group.update(lr=args.learning_rate * scheduler.lr_lambdas[0](scheduler.last_epoch), betas=args.adam_betas,
                         weight_decay=decay, initial_lr=args.learning_rate)
        for (_, m), saved in zip(mastered, state.get("master", []), strict=bool(state.get("master"))):
            m.data.copy_(saved)  # the fp32 masters, not the weights rounded to bf16 (older checkpoints lack them)
        for p, m in mastered:
            p.data.copy_(m.data)
        start_step, bad_steps_in_a_row, skipped_updates = state["step"], state["bad_steps"], state["skipped"]
        # the held-out accuracies at step 0 and at the checkpoint's last evaluation, unless it was on other held-out
        # rows (older checkpoints record neither the rows nor the last; final/ has no last: it is written before the
        # final evaluation)
        if state.get("eval_rows", eval_fingerprint) == eval_fingerprint:
            saved_eval_start, saved_eval_last = state.get("eval_start"), state.get("eval_last")
        set_rng_state(state["rng"])
        # nothing left to train: the final model and summary stay as they are (without final/, a signal stopped the
        # run in its last step, and it goes on to the final evaluation and model)
        if start_step > args.total_steps:
            raise UserError(f"--resume-from {resume_path} is at step {start_step}, past --total-steps "
                            f"{args.total_steps}: raise --total-steps, or resume from an earlier checkpoint")
        # (a final model of an earlier step stays until this run, stopped in its last step, writes its own)
        finished = os.path.isfile(os.path.join(output_dir, "summary.json"))  # (killed in the final evaluation: not)
        if start_step == args.total_steps and final_step(output_dir) == start_step and finished:
            print0(f"{resume_path} is at step {start_step}: the run already reached --total-steps "
                   f"{args.total_steps}; nothing to do (raise --total-steps to train further)", enabled=is_main)
            if distributed:
                dist.destroy_process_group()
            return {"steps": start_step, "resumed_from_step": start_step}
        print0(f"resumed from {resume_path} at step {start_step}", enabled=is_main)
    if distributed:  # every process has checked --output-dir and read --model and the checkpoint (which may lie in
        dist.barrier()  # it) before rank 0 changes it: a late process would find a run there, or a model half deleted
    if is_main:
        if not resuming_here and args.overwrite:  # only what a run writes: the directory may hold other things
            for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
                if name in RUN_FILES or re.fullmatch(
                        r"checkpoint-\d+(\.tmp|\.old)?", name):
                    target = os.path.join(output_dir, name)
                    shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
        try:
            os.makedirs(output_dir, exist_ok=True)
            tempfile.TemporaryFile(dir=output_dir).close()  # writable: found now, not at the first log line
        except OSError as error:
            raise UserError(f"--output-dir {output_dir} cannot be created or written to ({error.strerror or error}); "
                            "choose another --output-dir") from None
        metrics_path = os.path.join(output_dir, "metrics.jsonl")
        if resume_path and os.path.isfile(metrics_path):  # drop rows logged after the checkpoint was written, and
            # the final evaluation's row at its step when this run does that evaluation again (a run killed between
            # that row and its summary); a run taken further keeps it, as the evaluation at that step
            redoes_final_evaluation = start_step >= args.total_steps
            with open(metrics_path) as f:
                lines = f.readlines()
            if lines and not lines[-1].endswith("\n"):  # torn by a crash mid-write (after the checkpoint): dropped
                lines.pop()
            logged = [(line, json.loads(line)) for line in lines if line.strip()]
            kept = [line for line, row in logged if row["step"] <= start_step and not (
                redoes_final_evaluation and row["step"] == start_step and "step_time_s" not in row)]
            with open(metrics_path, "w") as f:
                f.writelines(kept)
        # with --track the run goes on in its wandb run only from as far as it got; from an earlier checkpoint (a
        # branch) or into another directory it is a wandb run of its own (wandb ignores rows at steps it holds), in
        # the same wandb group
        reached = max([*checkpoint_steps(output_dir), final_step(output_dir) or 0]) if resuming_here else None
        if reached is None or reached > start_step:
            resumed_wandb_id = None
        if resuming_here:  # the branch after the checkpoint is gone: `--resume-from latest` must not pick up its
            # checkpoints, nor a resume after a last-step signal take its final model for this run's
            for later in (step for step in checkpoint_steps(output_dir) if step > start_step):
                remove_directory(os.path.join(output_dir, f"checkpoint-{later}"))
            # (a final model at or before the checkpoint is this run's own past, the one it resumes from even: it
            # stays until this run writes its own)
            final_at = final_step(output_dir)
            if final_at is None or final_at > start_step:
                remove_directory(os.path.join(output_dir, "final"))
            if os.path.isfile(os.path.join(output_dir, "summary.json")):
                os.remove(os.path.join(output_dir, "summary.json"))
            # a step this run does not save again (a stop checkpoint's) would keep its unfinished save for good
            unfinished = [name for name in unfinished_saves(output_dir)  # (unless named by --resume-from: complete)
                          if os.path.realpath(os.path.join(output_dir, name)) != os.path.realpath(resume_path)]
            for name in unfinished:
                shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
            if unfinished:
                print0(f"removed {', '.join(unfinished)} from {output_dir}: left by a run killed while saving")
    console = {"reward": "reward", "accuracy": "acc", "kl_mean": "kl", "clip_frac_low": "clip_lo",
               "clip_frac_high": "clip_hi", "completion_length": "len", "eval_accuracy": "eval_acc",
               "step_time_s": "dt", "generation_time_s": "gen", "update_time_s": "upd"}
    logger = RunLogger(output_dir, asdict(args), console_keys=console, track=args.track,
                       wandb_project=args.wandb_project_name, wandb_entity=args.wandb_entity,
                       wandb_group=args.wandb_group or resumed_wandb_group, run_name=args.run_name, enabled=is_main,
                       append=resume_path is not None, wandb_id=resumed_wandb_id)
    n_params = sum(p.numel() for p in model.parameters())
    body_weights, head_weights = weight_counts(model)
    print0(f"model {args.model}: {n_params:,} parameters ({sum(p.numel() for p in trainable):,} trained), "
           f"{dtype}, {device}; {args.world_size} process(es), {args.prompts_per_step} prompts x "
           f"{args.group_size} completions per step", enabled=is_main)
    # what the model is given: which prompts, written how (the first one as the model sees it)
    templated = args.chat_template and bool(tokenizer.chat_template)
    first = tokenizer.decode(encode_prompts(tokenizer, [train_rows[0]["prompt"]], args.chat_template, 10**9,
                                            system_prompt=args.system_prompt)[0])
    print0(f"{len(train_rows)} training prompts ({args.data_path or 'the built-in task'}), {len(eval_rows)} held out "
           f"({args.eval_data_path or ('the built-in task' if args.data_path is None else 'none')}); prompts "
           f"{'in the chat template' if templated else 'as raw text'}, the first: "
           f"{first if len(first) <= 300 else first[:150] + ' ... ' + first[-150:]!r}", enabled=is_main)
    unevaluated = flags_set(args, "eval_every", "eval_batch_size", "num_eval_prompts")
    if args.data_path is not None and not args.eval_data_path and unevaluated:
        print0(f"note: {', '.join(unevaluated)} set the evaluation, but --data-path without --eval-data-path holds no "
               "prompts out to evaluate on", enabled=is_main)

    def save_run_state(path: str, step: int, base_model=None, evaluated: bool = True) -> None:
        """The model and everything a resume needs, written on rank 0 (under FSDP every rank calls it: the shards
        are gathered). evaluated: whether the last evaluation, kept for a resume, is up to date at this step."""
        # (under FSDP, gathering the state of an optimiser that has not stepped yet would make it take a step)
        weights, optimizer_state = (full_state_dicts(model, optimizer if optimizer.state else None) if args.fsdp
                                    else (None, optimizer.state_dict()))
        if is_main:
            save_checkpoint(path, model, tokenizer, args, {
                "optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "step": step,
                "bad_steps": bad_steps_in_a_row, "skipped": skipped_updates, "rng": rng_state(), "dtype": str(dtype),
                "wandb_id": logger.wandb_id, "wandb_group": logger.wandb_group,
                "data": fingerprint, "eval_rows": eval_fingerprint, "eval_start": eval_accuracy_start,
                "eval_last": eval_accuracy if evaluated else None,
                "master": [m.detach().cpu() for _, m in mastered]},
                saved_config, weights, base_model)

    def checkpoint(step: int) -> str:
        """checkpoint-STEP, keeping the newest --keep-checkpoints."""
        path = os.path.join(output_dir, f"checkpoint-{step}")
        save_run_state(path, step)
        if is_main:
            for old_step in checkpoint_steps(output_dir)[:-args.keep_checkpoints]:
                remove_directory(os.path.join(output_dir, f"checkpoint-{old_step}"))
        return path

    def run_eval(step: int) -> float:
        """Greedy held-out accuracy on rank 0 (other ranks wait at their next collective). Under FSDP every rank
        evaluates the same rows, since every forward pass is a collective."""
        if not eval_rows or (not is_main and not args.fsdp):  # (no held-out rows: no line of NaN accuracy)
            return float("nan")
        accuracy, samples = evaluate(model, tokenizer, eval_rows, args, device, eos_ids, vocab_size,
                                     decode_forward=decode_forward)
        if not is_main:
            return float("nan")
        print0(f"eval accuracy at step {step}: {accuracy:.3f}" + (f"  (e.g. {'; '.join(samples)})" if samples else ""))
        return accuracy

    # a resume takes the figures from its checkpoint (the summary reads as one run, started at step 0) and spends no
    # evaluation before its first step where the checkpoint knows them, nor one that the final evaluation repeats
    if saved_eval_last is not None:
        eval_accuracy = saved_eval_last
    else:
        eval_accuracy = run_eval(start_step) if start_step < args.total_steps else float("nan")
    eval_accuracy_start = saved_eval_start if saved_eval_start is not None else eval_accuracy
    if resume_path is None and eval_rows:  # a row of its own, so that the logged eval curve starts at step 0
        logger.log(0, {"eval_accuracy": eval_accuracy})
    timings = {"generation": [], "reference": [], "reward": [], "update": []}  # seconds, per step
    step_times, step_model_flops, memory_samples = [], [], []
    generated_tokens, trained_tokens = [], []  # per step, over all processes
    run_start = time.perf_counter()
    interrupted = False

    def sync_clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    # SIGINT/SIGTERM only raise a flag; the loop checks it after each step, checkpoints and stops. A second SIGINT
    # goes to the handler there was before (a second Ctrl-C stops at once, without a checkpoint: a step can take
    # minutes)
    stop_signal = []
    # the command a stopped run's resume hint names
    # (latest: the checkpoint a stop writes is the newest; the script and directory absolute, to work from
    # anywhere)
    rerun = (f"{'torchrun <its flags>' if distributed else 'python'} {os.path.abspath(sys.argv[0])} <the same flags> "
             f"--output-dir {os.path.abspath(output_dir)} --resume-from latest")

    def stop_after_this_step(sig, frame):
        stop_signal.append(sig)
        if sig == signal.SIGINT:  # a second Ctrl-C acts at once (KeyboardInterrupt); not a second SIGTERM, which a
            signal.signal(sig, previous_handlers[sig])  # scheduler's preemption may send twice (Slurm, torchrun)

    previous_handlers = {sig: signal.signal(sig, stop_after_this_step) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:  # whatever ends the loop, the previous handlers come back
        for step in range(start_step, args.total_steps):
            step_start = sync_clock()
            # 1. rollout: every prompt repeated group_size times, sampled in one batch with a KV cache
            prompt_indices, rows = prompts_for_step(step)
            prompt_list = encode_prompts(tokenizer, [r["prompt"] for r in rows], args.chat_template,
                                         args.max_prompt_length, system_prompt=args.system_prompt)
            prompt_ids, prompt_mask = left_pad(prompt_list, tokenizer.pad_token_id, device)
            prompt_ids = prompt_ids.repeat_interleave(args.group_size, dim=0)  # [B, P], B = prompts x group
            prompt_mask = prompt_mask.repeat_interleave(args.group_size, dim=0)
            model.eval()
            completion_ids, completion_mask, sampler_logp = generate(
                model, prompt_ids, prompt_mask, max_new_tokens=args.max_new_tokens, eos_ids=eos_ids,
                pad_id=tokenizer.pad_token_id, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                generators=prompt_generators(args.seed, step, prompt_indices, device), group_size=args.group_size,
                stop_together=args.fsdp, decode_forward=decode_forward, vocab_size=vocab_size)
            model.train()
            truncated = ~ended_by_eos(completion_ids, completion_mask, eos_ids)  # [B]: no EOS within max_new_tokens
            t_generated = sync_clock()
            timings["generation"].append(t_generated - step_start)

            # 2. rewards, on the text up to EOS; other special tokens stay in it, so that a policy cannot hide junk in
            # tokens that decoding would drop
            completion_texts = decode_completions(tokenizer, completion_ids, completion_mask, eos_ids)
            answers = [r["answer"] for r in rows for _ in range(args.group_size)]
            prompt_texts = [r["prompt"] for r in rows for _ in range(args.group_size)]
            rewards, rewards_per_fn = compute_rewards(
                prompt_texts, completion_texts, answers, reward_fns, args.reward_errors,
                sample_indices=[i * args.group_size + k for i in prompt_indices for k in range(args.group_size)])
            t_rewarded = sync_clock()
            timings["reward"].append(t_rewarded - t_generated)

            # 3. advantages; a sample whose reward failed (NaN) leaves the loss, and its group is scored without it
            failed = torch.isnan(rewards)
            if distributed and args.scale_rewards == "batch":  # the batch std is over every process's rewards
                everyone = [torch.empty(local_batch, device=device) for _ in range(args.world_size)]
                dist.all_gather(everyone, rewards.to(device))
                advantages = group_advantages(torch.cat(everyone), args.group_size, "batch")
                advantages = advantages[rank * local_batch:(rank + 1) * local_batch]  # [B]
            else:
                advantages = group_advantages(rewards, args.group_size, args.scale_rewards).to(device)  # [B]
            loss_mask = completion_mask.clone()
            loss_mask[failed.to(device)] = 0
            if args.mask_truncated_completions:
                loss_mask[truncated] = 0
            # a group's advantages are all 0 exactly when its (valid) rewards are all equal
            zero_std_group_count = float((advantages.view(-1, args.group_size) == 0).all(dim=1).sum())

            # 4. reference log-probs (no grad), and the rollout policy's ("old") of the minibatches after the first
            # (see step 5). Each minibatch is a run of whole groups: process r's prompts are r, r + W, ... (W
            # processes), so its minibatch j holds the prompts of the whole batch's minibatch j
            # Each micro-batch is cut to its own longest prompt and completion: columns that are padding in all of its
            # rows change no log-prob and cost a position of every layer. Measured, tiny model, up to 64 new tokens,
            # micro-batches of 8: reference and update passes 10-17% faster. Simulated, 8 x 8 completions of
            # lognormal lengths (median 100 tokens, sigma 0.7, at most 512), against one width for the whole batch:
            # micro-batches of 16 consecutive rows process 24% fewer completion positions, of 8 37%; of like
            # lengths (--group-by-length, see micro_batch_rows) 57% and 66%
            prompt_lengths = [len(ids) for ids in prompt_list]
            completion_lengths = completion_mask.sum(1).tolist()  # one host copy per step
            # Under --gradient-checkpointing transformers drops the cache in the training pass, so no pass shares
            # prompts: the reference must be scored as the policy is, else rounding differences (~5e-7) between the
            # two ways give a policy identical to its reference a KL gradient of noise that AdamW scales up to
            # full-size steps (measured: KL 0.1 by step 3 with equal rewards)
            share_mode = "never" if args.gradient_checkpointing else args.share_prompts
            row_lists = [rows for minibatch in micro_batch_rows(
                completion_lengths, prompt_lengths, args.group_size, minibatch_rows, micro_batch, share_mode,
                by_length=args.group_by_length) for rows in minibatch]
            prompts_of = [[row // args.group_size for row in rows] for rows in row_lists]
            longest_prompts = [max(prompt_lengths[p] for p in prompts) for prompts in prompts_of]
            longest_completions = [max(completion_lengths[row] for row in rows) for rows in row_lists]
            # Under FSDP every forward is a collective: every process must run the same passes for each micro-batch,
            # and their number depends on these widths (shared prompts or not; a second pass only for completions
            # longer than one token), so all processes use the widest of any (completions: at most T, the same on
            # every process since decoding stops together)
            sharing_widths = longest_prompts
            if args.fsdp:
                widths = torch.tensor([longest_prompts, longest_completions], device=device)  # [2, micro-batches]
                dist.all_reduce(widths, op=dist.ReduceOp.MAX)
                sharing_widths, longest_completions = widths.tolist()
            plans = [prompt_sharing(prompts, width, share_mode) for prompts, width in zip(prompts_of, sharing_widths)]
            if args.fsdp:
                # and the same choice to share: with --group-by-length one process's micro-batch may hold rows of
                # more prompts than another's (fewer repeated prompt positions, under auto's threshold), so prompts
                # are shared where every process would share them
                shared = torch.tensor([plan is not None for plan in plans], dtype=torch.int32, device=device)
                dist.all_reduce(shared, op=dist.ReduceOp.MIN)
                plans = [plan if everywhere else None for plan, everywhere in zip(plans, shared.tolist())]
            # (rows: a slice where they follow each other, a view; else a tensor of indices, a copy; prompt columns,
            # completion columns, the rows numbered by prompt or None: see --share-prompts)
            micro_batches = [(slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1))
                              else torch.tensor(rows, device=device),
                              slice(prompt_ids.shape[1] - prompt_width, None), slice(0, completion_width), plan)
                             for rows, prompt_width, completion_width, plan
                             in zip(row_lists, longest_prompts, longest_completions, plans)]
            per_minibatch = len(micro_batches) // args.num_minibatches
            micro_batches_of = [micro_batches[start:start + per_minibatch]
                                for start in range(0, len(micro_batches), per_minibatch)]
            ref_logp = torch.zeros_like(sampler_logp)
            if args.kl_coef != 0.0:
                # LoRA: the base model is the reference, with the adapter switched off; otherwise the frozen copy
                reference_model = model if reference is None else reference
                switch = model.disable_adapter() if reference is None else contextlib.nullcontext()
                with torch.no_grad(), switch:
                    for mb, prompts, completions, plan in micro_batches:
                        ref_logp[mb, completions] = completion_logprobs(
                            reference_model, prompt_ids[mb, prompts], prompt_mask[mb, prompts],
                            completion_ids[mb, completions], completion_mask[mb, completions], args.temperature,
                            prompt_of_row=plan, vocab_size=vocab_size)[0]
            # the first minibatch's old log-probs come free from its first update's forward, before any step; each
            # update moves the policy that later ones would be scored with, so theirs are taken now (in training mode,
            # as the updates: no dropout, see disable_dropout)
            old_logp = torch.zeros_like(sampler_logp)
            with torch.no_grad():
                for mb, prompts, completions, plan in itertools.chain(*micro_batches_of[1:]):
                    old_logp[mb, completions] = completion_logprobs(
                        model, prompt_ids[mb, prompts], prompt_mask[mb, prompts], completion_ids[mb, completions],
                        completion_mask[mb, completions], args.temperature, prompt_of_row=plan,
                        vocab_size=vocab_size)[0]
            t_referenced = sync_clock()
            timings["reference"].append(t_referenced - t_rewarded)

            # 5. update: num_iterations passes over the batch, each an optimiser step per minibatch, accumulating
            # micro-batches. No step precedes the first minibatch's first update, so its log-probs *are* the rollout
            # policy's: kept as old_logp. Each update's loss is normalised by its own minibatch's counts, over all
            # processes.
            counts = torch.stack([loss_mask.view(args.num_minibatches, -1).sum(1).float(),
                                  torch.full((args.num_minibatches,), float(minibatch_rows), device=device)], 1)
            if distributed:
                dist.all_reduce(counts)
            counts = counts.tolist()  # [minibatches][tokens, sequences]
            stat_sums: dict[str, torch.Tensor] = {}  # token-weighted sums, kept on the device: no sync per micro-batch
            reported_losses, reported_grad_norms = [], []
            too_many_bad_updates = False  # --max-bad-steps skipped updates in a row: the run stops after this step
            for iteration, minibatch in itertools.product(range(args.num_iterations), range(args.num_minibatches)):
                loss_sum = torch.zeros((), device=device)
                reported = iteration == args.num_iterations - 1  # the last iteration's view of the batch is logged
                total_tokens, total_sequences = counts[minibatch][0], int(counts[minibatch][1])
                for mb, prompts, completions, plan in micro_batches_of[minibatch]:
                    logp, entropy = completion_logprobs(
                        model, prompt_ids[mb, prompts], prompt_mask[mb, prompts], completion_ids[mb, completions],
                        completion_mask[mb, completions], args.temperature, with_entropy=reported,
                        prompt_of_row=plan, vocab_size=vocab_size)  # [b, t]
                    if iteration == 0 and minibatch == 0:
                        old_logp[mb, completions] = logp.detach()
                    loss, stats = grpo_loss(
                        logp, old_logp[mb, completions], ref_logp[mb, completions], advantages[mb],
                        loss_mask[mb, completions],
                        clip_eps_low=args.clip_eps_low, clip_eps_high=args.clip_eps_high, kl_coef=args.kl_coef,
                        loss_type=args.loss_type, max_completion_length=args.max_new_tokens, delta=args.delta,
                        importance_sampling=args.importance_sampling, kl_estimator=args.kl_estimator,
                        kl_ratio_weighted=args.kl_ratio_weighted, total_sequences=total_sequences,
                        total_tokens=total_tokens)
                    loss.backward()
                    if not args.fsdp:  # bf16 weights: each micro-batch's gradient is added in fp32, not in bf16
                        for p, m in mastered:
                            if p.grad is not None:
                                m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                                p.grad = None
                    loss_sum += loss.detach()
                    if reported:
                        tokens = stats.pop("tokens")
                        stats["entropy"] = (entropy * loss_mask[mb, completions]).sum() / tokens.clamp(min=1.0)
                        for key, value in {**stats, "tokens": torch.ones(())}.items():
                            stat_sums[key] = stat_sums.get(key, 0.0) + value * tokens
                # gradients: each process's loss is already divided by the global counts, so the sum is the mean
                # (FSDP has summed them already, in its reduce-scatter)
                if not args.fsdp:
                    sum_gradients(master, distributed)
                grad_norm = torch.nn.utils.clip_grad_norm_(master, args.max_grad_norm if args.max_grad_norm > 0
                                                           else float("inf"))
                if hasattr(grad_norm, "full_tensor"):  # FSDP: a norm over shards, reduced over processes here
                    grad_norm = grad_norm.full_tensor()
                if distributed:  # every process must take the same decision below
                    dist.all_reduce(loss_sum)
                loss_value = loss_sum.item()
                if reported:
                    reported_losses.append(loss_value)
                    reported_grad_norms.append(grad_norm.item())
                if math.isfinite(loss_value) and torch.isfinite(grad_norm):
                    bad_steps_in_a_row = 0
                    if total_tokens > 0:  # no token in the loss: AdamW's momentum alone would still move the weights
                        optimizer.step()
                        for p, m in mastered:
                            p.data.copy_(m.data)
                else:  # a non-finite loss or gradient would poison the weights: skip this update
                    skipped_updates += 1
                    bad_steps_in_a_row += 1
                    print0(f"warning: non-finite loss or gradient at step {step + 1}; update skipped", file=sys.stderr,
                           enabled=is_main)
                    too_many_bad_updates |= bad_steps_in_a_row >= args.max_bad_steps
                applied_lr = optimizer.param_groups[0]["lr"]  # this update's rate (logged), before the schedule moves
                with warnings.catch_warnings():  # a skipped first update is meant: the schedule counts updates tried
                    warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                model.zero_grad(set_to_none=True)
            t_updated = sync_clock()
            timings["update"].append(t_updated - t_referenced)

            # 6. log (metrics averaged over processes), evaluate, save
            step_time = t_updated - step_start
            step_times.append(step_time)
            n_generated = int(sum(completion_lengths))
            # prompt tokens each micro-batch's reference and training passes encode: once per prompt where they share
            encoded = [sum(prompt_lengths[p] for p in (prompts if plan is None else set(prompts)))
                       for prompts, plan in zip(prompts_of, plans)]
            first = len(micro_batches_of[0])  # the first minibatch's micro-batches: no old log-prob pass
            step_model_flops.append(step_flops(
                body_weights, head_weights, unique_prompt_tokens=sum(prompt_lengths),
                reference_prompt_tokens=sum(encoded), update_prompt_tokens=sum(encoded),
                completion_tokens=n_generated, rows=local_batch, reference=args.kl_coef != 0.0,
                iterations=args.num_iterations, full_finetune=args.lora_r == 0, old_prompt_tokens=sum(encoded[first:]),
                old_completion_tokens=int(sum(completion_lengths[minibatch_rows:])),
                old_rows=local_batch - minibatch_rows))
            # every figure is a sum over the batch, so that summing over processes gives the whole batch's: token-
            # weighted loss statistics with their token count; each reward's sum and count of scored (not NaN)
            # completions, and the sum of squares for the std; log-prob gaps
            gap = (old_logp - sampler_logp).abs() * completion_mask  # [B, T]
            # accuracy: the answer reward, taken for the log when it is not in the reward (--answer-reward-weight 0,
            # training on a PRM alone)
            accuracy = rewards_per_fn["answer"] if "answer" in rewards_per_fn else torch.tensor(
                [answer_reward(completion, answer) for completion, answer in zip(completion_texts, answers)])
            per_completion = {"reward": rewards, **{f"reward_{name}": v for name, v in rewards_per_fn.items()},
                              "accuracy": accuracy}
            sums = {key: value.item() for key, value in stat_sums.items()}
            for name, values in per_completion.items():
                sums[f"{name}/sum"], sums[f"{name}/count"] = values.nansum().item(), float((~values.isnan()).sum())
            sums.update({"reward/squares": rewards.double().pow(2).nansum().item(),
                         "reward_errors": float(failed.sum()), "logp_gap/sum": gap.sum().item(),
                         "logp_gap/count": float(n_generated), "completion_length/sum": float(n_generated),
                         "truncated/sum": float(truncated.sum()), "zero_std_groups/sum": zero_std_group_count,
                         "completions": float(local_batch), "groups": float(len(rows)),
                         "trained_tokens": float(loss_mask.sum()) * args.num_iterations})
            gap_max = gap.max().reshape(1)
            if distributed:
                keys = sorted(sums)
                values = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=device)
                dist.all_reduce(values)
                dist.all_reduce(gap_max, op=dist.ReduceOp.MAX)
                sums = dict(zip(keys, values.tolist()))
            generated_tokens.append(sums["completion_length/sum"])  # every process's (completion lengths differ)
            trained_tokens.append(sums["trained_tokens"])

            def ratio(numerator: str, denominator: str) -> float:
                return sums[numerator] / sums[denominator] if sums[denominator] else float("nan")

            count, total, squares = sums["reward/count"], sums["reward/sum"], sums["reward/squares"]
            local = {
                **{name: ratio(f"{name}/sum", f"{name}/count") for name in per_completion},
                "reward_std": math.sqrt(max(squares - total ** 2 / count, 0.0) / (count - 1)) if count > 1 else 0.0,
                # the last iteration's, a mean over its minibatches' updates (each already summed over processes:
                # each one's loss is its share of the mean)
                "loss": float(np.mean(reported_losses)),
                **{key: ratio(key, "tokens") for key in stat_sums if key != "tokens"},  # NaN: no token in the loss
                "grad_norm": float(np.mean(reported_grad_norms)),
                "frac_zero_std_groups": ratio("zero_std_groups/sum", "groups"),
                "completion_length": ratio("completion_length/sum", "completions"),
                "truncated_frac": ratio("truncated/sum", "completions"),
                "reward_errors": sums["reward_errors"],
                # training and sampler log-probs of the same tokens, same weights: any gap is numerical mismatch
                "logp_gap_max": gap_max.item(),
                "logp_gap_mean": ratio("logp_gap/sum", "logp_gap/count"),
            }
            memory_samples.append(memory_mb(device))
            metrics = {**local, "learning_rate": applied_lr, "step_time_s": step_time,
                       **{f"{part}_time_s": times[-1] for part, times in timings.items()},
                       "memory_mb": memory_samples[-1]}
            if args.eval_every and eval_rows and (step + 1) % args.eval_every == 0 and step + 1 < args.total_steps:
                eval_accuracy = metrics["eval_accuracy"] = run_eval(step + 1)
            logger.log(step + 1, metrics)
            if too_many_bad_updates:  # (after its row: metrics.jsonl shows the step that stopped the run)
                raise UserError(f"{args.max_bad_steps} updates in a row had a non-finite loss or gradient; lower "
                                "--learning-rate or check the reward scale")
            every_reward_failed = sums["reward_errors"] >= sums["completions"]
            failed_reward_steps_in_a_row = failed_reward_steps_in_a_row + 1 if every_reward_failed else 0
            if every_reward_failed and failed_reward_steps_in_a_row >= args.max_bad_steps:
                raise UserError(f"the reward failed on every sample of {args.max_bad_steps} steps in a row "
                                "(--reward-errors skip; see the warnings above): fix the reward function")
            # a signal stops every process after the same step (torchrun forwards it to all, not at the same moment)
            stop = torch.tensor([float(len(stop_signal))], device=device)
            if distributed:
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            interrupted = stop.item() > 0
            if (args.save_every and (step + 1) % args.save_every == 0) or interrupted:
                path = checkpoint(step + 1)
            if interrupted:
                print0(f"stopped by a signal after step {step + 1}; {path} saved; continue with: {rerun}",
                       enabled=is_main)
                break
        total_time = time.perf_counter() - run_start
        if not interrupted:
            # the final model, with its trainer state so that a finished run can be taken further (--resume-from
            # DIR/final), before the final evaluation and under the handlers above: a stop signal from the last
            # step on no longer loses the steps since the last checkpoint
            save_run_state(os.path.join(output_dir, "final"), start_step + len(step_times), tiny_base,
                           evaluated=False)  # (the final evaluation comes after it: a run taken further does it again)
        # agreed while the stop handlers are still installed: a rank that saves nothing would otherwise be
        # killed by a forwarded signal while rank 0 is still writing final/
        stopped = torch.tensor([float(len(stop_signal))], device=device)
        if distributed:
            dist.all_reduce(stopped, op=dist.ReduceOp.MAX)
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)

    # ---- final evaluation, benchmark summary; skipped after a stop signal during the final save (a resume runs them)
    if not interrupted and stopped.item() > 0:
        print0(f"stopped by a signal after saving the final model; for the final evaluation and summary: {rerun}",
               enabled=is_main)
        logger.close()
        if distributed:
            dist.destroy_process_group()
        return {"steps": start_step + len(step_times), "interrupted": True, "stop_signal": stopped_by(stop_signal)}
    if not interrupted:
        eval_accuracy = run_eval(start_step + len(step_times))
        if eval_rows:  # a second row for the last step (its training row is logged before the final save)
            logger.log(start_step + len(step_times), {"eval_accuracy": eval_accuracy})
    steps_done = len(step_times)
    timed = slice(1, None) if len(step_times) > 1 else slice(None)  # the first step pays for warm-up

    def per_second(amount: float, seconds: float) -> float:  # NaN (null) when no step ran: a resume that only
        return amount / seconds if seconds > 0 else float("nan")  # redoes the final evaluation
    summary = {
        "steps": start_step + steps_done,
        "total_time_s": total_time,
        "step_time_s_mean": float(np.mean(step_times[timed])) if step_times else float("nan"),
        "generation_time_s": sum(timings["generation"]),
        "reference_time_s": sum(timings["reference"]),
        "reward_time_s": sum(timings["reward"]),
        "update_time_s": sum(timings["update"]),
        # over the timed steps, as the step time (on a GPU the first step also loads kernels and allocates memory)
        "generated_tokens_per_s": per_second(sum(generated_tokens[timed]), sum(timings["generation"][timed])),
        "trained_tokens_per_s": per_second(sum(trained_tokens[timed]), sum(timings["update"][timed])),
        # (ru_maxrss, the kernel's high-water mark, can lag the resident set that the samples read: measured 0.13 MiB
        # below an earlier sample)
        "peak_memory_mb": max([peak_memory_mb(device), *memory_samples]),
        "mean_memory_mb": float(np.mean(memory_samples)) if memory_samples else memory_mb(device),
        "eval_accuracy_start": eval_accuracy_start,
        "eval_accuracy_end": eval_accuracy,
        "skipped_updates": skipped_updates,
        "interrupted": interrupted,
        **({"stop_signal": stopped_by(stop_signal)} if interrupted else {}),
        "resumed_from_step": start_step,  # (the times, totals and rates above are this launch's steps')
        "parameters": n_params,
    }
    # model FLOP/s of this process over the timed steps (see step_flops), against the device's peak (MFU: on CUDA,
    # or given --peak-tflops) and, on CPU, against the matmul throughput measured here (the FLOP-floor fraction)
    achieved = per_second(sum(step_model_flops[timed]), sum(step_times[timed]))
    summary["model_tflops_per_s"] = achieved / 1e12
    if (device.type == "cuda" or args.peak_tflops) and step_times:
        # the table holds bf16 peaks: an fp32 run (TF32 or not) has another, which only the user can give
        peak = args.peak_tflops or (guess_peak_tflops(torch.cuda.get_device_name(device))
                                    if dtype == torch.bfloat16 else 0.0)
        if not peak:
            print0(f"warning: no {dtype} peak FLOP/s known for {torch.cuda.get_device_name(device)}: mfu is NaN; "
                   "pass --peak-tflops (the device's dense figure in that dtype)", file=sys.stderr, enabled=is_main)
        summary["mfu"] = achieved / (peak * 1e12) if peak else float("nan")
    if device.type != "cuda" and step_times:
        measured = matmul_flops_per_s(device, dtype)
        summary["matmul_tflops_measured"] = measured / 1e12
        summary["flop_floor_fraction"] = achieved / measured
    logger.summary(summary, output_dir)
    logger.close()
    if distributed:
        dist.barrier()  # rank 0 may still be saving: leaving early would tear the process group down under it
        dist.destroy_process_group()
    return summary


def stopped_by(received: list) -> str:
    """The name of the signal that stopped the run (under torchrun a process can stop because another got it: every
    one gets the SIGTERM that torchrun forwards, not always before the step's check)."""
    return signal.Signals(received[0]).name if received else "SIGTERM"


def main() -> None:
    try:
        summary = train(tyro.cli(Args))
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    if summary.get("interrupted"):  # checkpointed, not finished: a retry loop or a scheduler must not take it for done
        sys.exit(128 + signal.Signals[summary["stop_signal"]])  # as the shell reports a process the signal ended


if __name__ == "__main__":
    main()
