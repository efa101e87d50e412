"""Process reward model (PRM) training and scoring for causal language models, in one file.

A PRM gives every step of a solution a score: the probability that the solution is still correct after that
step (Lightman et al. 2023, https://arxiv.org/abs/2305.20050; Math-Shepherd, https://arxiv.org/abs/2312.08935;
with --loss-kind mse, a regression estimate of the label instead).
Here it is a transformer backbone (no LM head) plus a scalar head read at the last token of each step's
separator, trained on rows {"prompt", "completions": [step, ...], "labels": [0..1 per step]}.

Where this file departs from the papers and from other trainers, and why:
1. The head is one `Linear(hidden, 1)` in fp32 on the backbone's last hidden state (loaded with `AutoModel`), not
   the LM head over "+"/"-" tokens (Math-Shepherd) or a 2-class token classifier (TRL): no vocabulary logits are
   ever computed, and one logit is all a two-class softmax carries anyway.
2. Loss `bce` (binary cross-entropy, hard or soft labels: Math-Shepherd's soft estimation) or `mse` on the raw
   head output (Qwen's soft-label ablation, https://arxiv.org/abs/2501.07301); a masked mean over real steps.
3. Tokenisation: the prompt and each `step + separator` are tokenised as separate strings and concatenated, so a
   BPE merge can never cross a step boundary and each label sits on a token that ends exactly at its separator.
   Training, evaluation and scoring all go through `build_prm_example`, so scores cannot drift from training.
4. Truncation drops whole steps (never a partial step that keeps its label) and counts them; a row with no step
   left (e.g. a prompt longer than --max-length) is dropped and counted too.
5. Metrics: step accuracy at 0.5, step AUROC, and ProcessBench's first-error F1 (https://arxiv.org/abs/2412.06559)
   with its threshold chosen on validation rows that are never trained on; plus the same figures for a
   position-only baseline that ignores step content, to show what the model actually reads.
6. Runs survive interruption: `--save-every N` writes checkpoint-STEP/ atomically, SIGINT/SIGTERM end the current
   step and write one, and `--resume-from` continues to the same metrics and weights as an uninterrupted run (the
   batch order is a permutation seeded per epoch, so the step number alone rebuilds the data position).
7. Under torchrun, rows are sharded by rank and the loss of every micro-batch is divided by the global count of
   labelled steps, so one gradient all-reduce per step gives exactly the single-process update on the same batch.
   This is the same design as grpo.py's (the two scripts are deliberately self-contained, so it is repeated).

Run it:
    python prm.py                                      # tiny model, built-in stepwise task, CPU, under a minute
    python prm.py --loss-kind mse --lora-r 8           # any flag: python prm.py --help
    python prm.py --model Qwen/Qwen2.5-0.5B --data-path steps.jsonl --eval-data-path steps_eval.jsonl \\
        --lora-r 16 --learning-rate 1e-4 --step-separator $'\\n\\n' --output-dir runs/qwen-prm
    python prm.py --prm-path runs/qwen-prm/final --score-data-path rows.jsonl --scores-output scores.jsonl
    torchrun --standalone --nproc_per_node 8 prm.py --model Qwen/Qwen2.5-0.5B --data-path steps.jsonl
    torchrun --standalone --nproc_per_node 8 prm.py --fsdp --model Qwen/Qwen2.5-7B --data-path steps.jsonl
    python prm.py --output-dir runs/r --save-every 50 ...; python prm.py --output-dir runs/r ... --resume-from latest
From Python: `prm = load_prm("runs/qwen-prm/final"); score_steps(prm, prompts, steps)`.
"""

import copy
import datetime
import functools
import hashlib
import io
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
from typing import Annotated, Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro

from common import RunLogger, print0, seed_everything


@dataclass
class Args:
    # Experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the experiment: model init, built-in data and batch order all follow from it"""
    # (tyro would print "(default: None)" after the docstring's own default)
    output_dir: Annotated[Optional[str], tyro.conf.arg(
        help_behavior_hint="(default: runs/{run_name}, or the folder of the --resume-from checkpoint)")] = None
    """where metrics.jsonl, summary.json, checkpoints and final/ go"""
    track: bool = False
    """log to Weights & Biases (WANDB_MODE=offline works; a failure to start is a warning, not a crash)"""
    wandb_project_name: str = "prm"
    """the wandb project"""
    wandb_entity: Optional[str] = None
    """the wandb entity (team); None = your default"""
    wandb_group: Optional[str] = None
    """the wandb group; None = a random name for a new run, the checkpoint's run's group for a resume"""

    # Model and data
    model: str = "tiny"
    """`tiny` (a small random-init Llama built here, no download) or a hub id / local path of a transformer"""
    trust_remote_code: bool = False
    """allow code from the model repository to run (off: only enable for repositories you trust)"""
    data_path: Optional[str] = None
    """JSONL training rows {"prompt": str, "completions": [steps], "labels": [bool or 0..1]}; None = built-in"""
    eval_data_path: Optional[str] = None
    """JSONL held-out rows in the same format (with or without --data-path); None = the built-in eval set, or no
    eval with --data-path"""
    num_eval_rows: int = 500
    """at most this many held-out rows are evaluated"""
    num_val_rows: int = 200
    """rows used only to choose the eval's first-error threshold: from the built-in held-out pool, or with --data-path
    (and an --eval-data-path) held out of the training file (at most a tenth); 0 = a fixed 0.5"""
    # (tyro would print the newline itself as the default)
    step_separator: Annotated[str, tyro.conf.arg(help_behavior_hint="(default: '\\n', a newline)")] = "\n"
    """appended to every step, the last one included; the step's label sits on its last token"""
    max_length: int = 1024
    """most tokens per row: steps that do not fit whole are dropped (and counted)"""
    pack_rows: bool = True
    """pack each micro-batch's rows into shared sequences (at most twice the longest row) instead of padding every
    row to the longest: little compute on padding; off by itself for a backbone that cannot (checked at start)"""
    skip_bad_rows: bool = False
    """skip and count invalid JSONL rows instead of stopping at the first one"""
    backbone_dropout: bool = False
    """train with the backbone's own dropout; off by default, as in TRL's PRMTrainer: with it, the packed and
    padded batches of one step see different masks (the saved config.json keeps the rates either way)"""
    lora_r: int = 0
    """LoRA rank on the backbone (the head is always fully trained); 0 = full fine-tuning"""
    lora_alpha: int = 32
    """LoRA scaling numerator (the update is scaled by alpha / r)"""
    lora_dropout: float = 0.0
    """dropout on the LoRA branch"""
    lora_target_modules: str = "all-linear"
    """comma-separated module names to adapt (e.g. q_proj,v_proj), or all-linear"""

    # Loss
    loss_kind: Literal["bce", "mse"] = "bce"
    """bce: binary cross-entropy with logits (hard or soft labels); mse: squared error of the raw head output"""

    # Optimisation
    total_steps: int = 500
    """number of optimiser steps (ignored when --epochs is given)"""
    epochs: Optional[float] = None
    """train for this many passes over the training rows instead of --total-steps (rounded up to whole steps: the
    last step fills up with rows of the next pass's shuffle)"""
    batch_size: int = 32
    """rows per optimiser step, over all processes"""
    micro_batch_size: int = 0
    """rows per forward/backward pass (gradient accumulation); 0 = the whole local batch at once"""
    learning_rate: float = 2e-3
    """AdamW learning rate (1e-5 is typical for full fine-tuning of real models, 1e-4 for LoRA)"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this (0 = off)"""
    weight_decay: float = 0.0
    """AdamW weight decay, of the weight matrices only (not of biases and norm gains, as transformers' Trainer)"""
    adam_betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas"""
    warmup_steps: int = 20
    """linear learning-rate warm-up, in optimiser steps"""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """learning rate after warm-up"""
    max_bad_steps: int = 3
    """stop after this many consecutive steps with a non-finite loss or gradient (each one is skipped)"""

    # Evaluation, scoring, system
    eval_every: int = 100
    """held-out metrics every this many steps (0 = only at the start and the end)"""
    eval_batch_size: int = 64
    """rows per forward pass in evaluation and scoring"""
    save_every: int = 0
    """write a checkpoint every this many steps (0 = only when stopped by a signal, and the final model)"""
    resume_from: Optional[str] = None
    """a checkpoint-STEP directory written by this script, or `latest` (the newest in --output-dir), to continue"""
    keep_checkpoints: int = 2
    """how many checkpoint-STEP directories to keep (older ones are deleted)"""
    overwrite: bool = False
    """replace a run already in --output-dir (otherwise that is an error, unless resuming)"""
    prm_path: Optional[str] = None
    """score with this saved PRM (a final/ directory) instead of training; needs --score-data-path and
    --scores-output"""
    score_data_path: Optional[str] = None
    """JSONL rows {"prompt", "completions"} to score: with the saved --prm-path, or after training"""
    scores_output: Optional[str] = None
    """where the scores go (each input row plus "scores"); None after training = {output_dir}/scores.jsonl"""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """backbone weights and compute dtype (the head is always fp32); auto = bfloat16 on CUDA when supported, and
    with --prm-path the dtype the PRM was trained in"""
    device: str = "auto"
    """auto = cuda when available, else cpu; cuda:N for GPU N (under torchrun: cuda, each process on its own GPU)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (less memory, about 30% more compute)"""
    fsdp: bool = False
    """shard weights, gradients and optimiser state over the processes with FSDP2 (CUDA only; for models that do
    not fit one GPU): weights stay fp32, the backbone computes in --dtype"""
    peak_tflops: float = 0.0
    """peak dense TFLOP/s of one device in the run's dtype, for MFU (on any device); 0 = look up a bf16 run's by the
    GPU's name (no MFU on CPU then)"""

    # Derived (filled in at the top of train)
    run_name: tyro.conf.Suppress[str] = ""
    """{exp_name}__{seed}__{unix time}"""
    world_size: tyro.conf.Suppress[int] = 1
    """number of processes (torchrun)"""
    local_batch: tyro.conf.Suppress[int] = 0
    """rows per step on this process = batch_size / world_size"""


# ---------------------------------------------------------------------------------------------------------------
# Kernels and metrics: tensors or lists in, numbers out, no args. Tests import these.


def prm_loss(step_logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, kind: str = "bce", *,
             num_labelled: Optional[float] = None) -> tuple[torch.Tensor, dict]:
    """Masked mean over real steps of the per-step loss. Shapes: step_logits, labels, mask [B, S], S = the most
    steps in the batch; mask 1 on real steps, 0 on padding (a row with no steps is all 0 and adds nothing).

        bce: -(y log sigmoid(z) + (1 - y) log(1 - sigmoid(z)))   (y in [0, 1]: hard or soft labels)
        mse: (z - y)^2                                            (z, the raw head output, is the score)

    loss = sum(l * mask) / N, N = the number of real (labelled) steps: a mean over steps, not over solutions, so a
    10-step solution weighs ten times a 1-step one (as in TRL). When this call sees only part of the batch (a
    micro-batch, or one process's share), pass the whole batch's count as num_labelled: the parts' losses then sum
    to the loss (and gradient) of the whole batch. Computed in fp32 whatever the input dtype.
    stats (detached, over this part): accuracy (score >= 0.5 agrees with label >= 0.5), score_mean, steps.
    """
    mask = mask.bool()
    # padded slots are zeroed before any arithmetic: whatever they hold (even NaN) gets no loss and no gradient
    logits, labels = step_logits.float().masked_fill(~mask, 0.0), labels.float().masked_fill(~mask, 0.0)
    if kind == "bce":
        per_step = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")  # [B, S]
        scores = torch.sigmoid(logits)
    elif kind == "mse":
        per_step = (logits - labels) ** 2
        scores = logits
    else:
        raise ValueError(f"kind must be bce or mse, got {kind!r}")
    count = num_labelled if num_labelled is not None else mask.sum().item()
    loss = per_step.masked_fill(~mask, 0.0).sum() / max(count, 1.0)
    with torch.no_grad():
        local = mask.sum().clamp(min=1)
        agree = (scores >= 0.5) == (labels >= 0.5)
        stats = {"accuracy": (agree & mask).sum() / local, "score_mean": scores.masked_fill(~mask, 0.0).sum() / local,
                 "steps": mask.sum()}
    return loss, stats


def step_accuracy(scores, labels, threshold: float = 0.5) -> float:
    """Fraction of steps where score >= threshold agrees with label >= 0.5 (a soft label of 0.5 counts as
    correct). Flat sequences of step scores and labels; NaN when empty or when a score is NaN (a diverged model's:
    NaN >= threshold would count it as a wrong step, an accuracy that hides it)."""
    scores, labels = np.asarray(scores, dtype=float), np.asarray(labels, dtype=float)
    if len(scores) == 0 or np.isnan(scores).any():
        return float("nan")
    return float(np.mean((scores >= threshold) == (labels >= 0.5)))


def auroc(scores, labels) -> float:
    """Area under the ROC curve of step scores, correct steps (label >= 0.5) as the positive class: the chance
    that a random correct step outscores a random wrong one, ties counting one half (Mann-Whitney U with average
    ranks). NaN when either class is absent, or when a score is NaN (argsort would rank it above every number)."""
    scores, positive = np.asarray(scores, dtype=float), np.asarray(labels, dtype=float) >= 0.5
    num_pos, num_neg = int(positive.sum()), int((~positive).sum())
    if num_pos == 0 or num_neg == 0 or np.isnan(scores).any():
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    ranks = np.empty(len(scores))
    ranks[order] = np.repeat(first + (counts + 1) / 2, counts)  # 1-based rank, averaged over each tie group
    return float((ranks[positive].sum() - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg))


def first_below(values, threshold: float) -> int:
    """Index of the first value below threshold, or -1 when there is none."""
    return next((k for k, value in enumerate(values) if value < threshold), -1)


def first_error_f1(step_scores: list, step_labels: list, threshold: float) -> tuple[float, float, float]:
    """ProcessBench's F1 over solutions (ragged lists of per-step scores and labels, one list per solution).

    The true first error is the first step with label < 0.5 (-1 for a fully correct solution); the predicted one
    is the first step with score < threshold. A solution may have fewer scores than labels (steps truncated away
    unscored): a first error among the unscored steps is still its first error, which no prediction can hit, so
    the solution counts as an erroneous one missed (not as a correct one). acc_err = exact-match rate on erroneous
    solutions, acc_corr = the rate of predicting -1 on correct ones, F1 = 2 acc_err acc_corr / (acc_err + acc_corr)
    (0 when both are 0).
    Returns (f1, acc_err, acc_corr); an accuracy over no solutions, and then F1, is NaN.
    """
    hits = {True: [], False: []}  # keyed by "the solution has an error"
    for scores, labels in zip(step_scores, step_labels, strict=True):
        truth = first_below(labels, 0.5)
        hits[truth >= 0].append(first_below(scores, threshold) == truth)
    acc_err = float(np.mean(hits[True])) if hits[True] else float("nan")
    acc_corr = float(np.mean(hits[False])) if hits[False] else float("nan")
    f1 = 2 * acc_err * acc_corr / (acc_err + acc_corr) if acc_err + acc_corr > 0 else 0.0
    return (f1 if math.isfinite(acc_err + acc_corr) else float("nan")), acc_err, acc_corr


def choose_threshold(step_scores: list, step_labels: list) -> float:
    """The threshold with the best first-error F1 on these (validation) solutions, found exactly: F1 changes only
    where the threshold crosses a score, so the candidates are one below every score, the midpoints between
    neighbouring distinct scores and one above every score (min - 1, max + 1; ties go to the lowest). One sweep
    upwards instead of one first_error_f1 per candidate: a solution's predicted first error (its first step scoring
    below t) moves only when t passes one of its running minima, from -1 to the lowest score's step, then to
    earlier record lows and finally to step 0, so those records are the only events.
    0.5 when there are no scores, a score is not finite, or the solutions are not both erroneous and correct ones
    (F1 is then NaN at every threshold), and when F1 is 0 at every threshold (no threshold finds a first error
    while keeping a correct solution whole): argmax would then return the lowest candidate, min - 1, meaningless as
    a probability."""
    flat = np.asarray([s for scores in step_scores for s in scores], dtype=float)
    truths = [first_below(labels, 0.5) for labels in step_labels]
    num_err = sum(truth >= 0 for truth in truths)
    num_corr = len(truths) - num_err
    if len(flat) == 0 or not np.isfinite(flat).all() or num_err == 0 or num_corr == 0:
        return 0.5
    event_values, err_changes, corr_changes = [], [], []
    for scores, truth in zip(step_scores, truths, strict=True):
        records = []  # (step, score) of each new running minimum, lowest last
        for k, score in enumerate(scores):
            if not records or score < records[-1][1]:
                records.append((k, score))
        predicted = -1  # below every score of the solution, no step is predicted
        for k, score in reversed(records):  # t rising past `score` makes step k the first one below t
            change = int(k == truth) - int(predicted == truth)
            event_values.append(score)
            err_changes.append(change if truth >= 0 else 0)
            corr_changes.append(change if truth < 0 else 0)
            predicted = k
    values = np.unique(flat)  # [V] distinct scores, ascending
    group = np.searchsorted(values, event_values)  # each event's index among the distinct scores
    err_hits = np.cumsum(np.bincount(group, weights=err_changes, minlength=len(values)))  # [V] hits for t just above
    corr_hits = num_corr + np.cumsum(np.bincount(group, weights=corr_changes, minlength=len(values)))
    # [V + 1]: t below every score, then t between each distinct score and the next (or above the last)
    acc_err = np.concatenate([[0.0], err_hits / num_err])
    acc_corr = np.concatenate([[1.0], corr_hits / num_corr])
    total = acc_err + acc_corr
    f1 = np.divide(2 * acc_err * acc_corr, total, out=np.zeros_like(total), where=total > 0)
    # each interval's threshold: its midpoint, or its upper end where the midpoint of two scores one float apart
    # rounds down to the lower score (which a threshold must exceed to count it as below)
    midpoints = (values[1:] + values[:-1]) / 2  # [V - 1]
    midpoints = np.where(midpoints > values[:-1], midpoints, values[1:])
    candidates = np.concatenate([[values[0] - 1.0], midpoints, [values[-1] + 1.0]])
    return float(candidates[int(np.argmax(f1))]) if f1.max() > 0 else 0.5


def position_baseline(train_labels: list, lengths: list[int]) -> list[list[float]]:
    """Scores from the step index alone, blind to content: the training rate of correct steps at each index
    (the last seen index's rate beyond it). One list of `length` scores per solution."""
    longest = max((len(labels) for labels in train_labels), default=0)
    rates = [float(np.mean([labels[k] >= 0.5 for labels in train_labels if len(labels) > k])) for k in range(longest)]
    rates = rates or [0.5]
    return [[rates[min(k, len(rates) - 1)] for k in range(length)] for length in lengths]


def aggregate_scores(scores: list[float], how: str) -> float:
    """One number per solution from its step scores: min (Math-Shepherd), prod (Lightman), last or mean (used by
    grpo.py's PRM reward and by score_steps' callers, not in training).
    A solution with no scored step (e.g. all truncated away) gets 0.0, the score of a surely wrong step."""
    reducers = {"min": np.min, "prod": np.prod, "last": lambda values: values[-1], "mean": np.mean}
    if how not in reducers:
        raise ValueError(f"how must be min, prod, last or mean, got {how!r}")
    return float(reducers[how](scores)) if len(scores) else 0.0


# ---------------------------------------------------------------------------------------------------------------
# Task and data: the built-in task, JSONL rows, tokenisation, collation.

# The built-in task: a chain of steps over the values 0..4, each restating the previous result and applying a small
# change. An injected error restates a wrong value (the step's own arithmetic stays right, and later steps carry on
# consistently from it), so checking a step means comparing its first digit with the previous step's last (for the
# first step, the prompt's start value), and a later step is wrong only through an earlier one: a copy-and-compare a
# small transformer learns in a minute. Step position alone gives a fair step AUROC (about 0.7, the logged
# position-only baseline) but locates the first error poorly (first-error F1 about 0.15): that F1 shows whether the
# model reads the steps. Most rows (p_error) hold an error, so every batch has mistakes to learn from.
#     prompt "start 3\n"  completions ["3+1=4", "4-2=2", "1+3=4", "4-1=3"]  labels [1, 1, 0, 0]
TINY_CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz+-*/=%()., \n")
TINY_SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def make_solution(rng: random.Random, min_steps: int = 3, max_steps: int = 6, p_error: float = 0.8) -> dict:
    """One built-in row: with probability p_error one step (uniform) restates a wrong value."""
    num_steps = rng.randint(min_steps, max_steps)
    value = rng.randint(0, 4)
    prompt = f"start {value}\n"
    error_at = rng.randrange(num_steps) if rng.random() < p_error else num_steps
    steps = []
    for k in range(num_steps):
        stated = rng.choice([v for v in range(5) if v != value]) if k == error_at else value
        change = rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if 0 <= stated + d <= 4])
        value = stated + change
        steps.append(f"{stated}{'+' if change > 0 else '-'}{abs(change)}={value}")
    return {"prompt": prompt, "completions": steps, "labels": [float(k < error_at) for k in range(num_steps)]}


BUILTIN_HELD_OUT = 2000  # built-in rows kept out of training, for validation and eval


def builtin_task(seed: int, num_val: int, num_eval: int, num_train: int = 10000) -> tuple[list, list, list]:
    """Distinct built-in rows, split into train, validation (threshold choice) and eval: no held-out row is a
    training row. A fixed pool of BUILTIN_HELD_OUT rows is set aside whatever --num-val-rows and --num-eval-rows
    are, so that they never change the training rows (a resumed run may change them), and it is drawn by the same
    shuffle as the training rows, so that held-out rows look like training rows (the last distinct rows drawn
    would be skewed towards rare ones: longer solutions, fewer of them correct)."""
    if num_val + num_eval > BUILTIN_HELD_OUT:
        raise ValueError(f"{num_val} + {num_eval} held-out rows asked for; the built-in data holds out "
                         f"{BUILTIN_HELD_OUT}")
    rng = random.Random(seed)
    unique: dict[tuple, dict] = {}
    while len(unique) < num_train + BUILTIN_HELD_OUT:
        row = make_solution(rng)
        unique.setdefault((row["prompt"], *row["completions"]), row)
    rows = list(unique.values())
    rng.shuffle(rows)
    held_out, train = rows[:BUILTIN_HELD_OUT], rows[BUILTIN_HELD_OUT:]
    return train, held_out[:num_val], held_out[num_val:num_val + num_eval]


def parse_row(line: str, need_labels: bool) -> dict:
    """One JSONL row, checked: raises ValueError saying what is wrong. Without need_labels (rows to score) the
    row comes back as given, every field kept and "labels" left unchecked (e.g. Math-Shepherd's "+"/"-"), so that
    the scores file holds each input row unchanged plus its scores."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError) as error:  # (also a 5,000-digit integer, 100,000 nested lists)
        reason = error.msg if isinstance(error, json.JSONDecodeError) else (
            "nested too deeply" if isinstance(error, RecursionError) else "a number of over 4,300 digits")
        raise ValueError(f"invalid JSON ({reason})") from None
    if not isinstance(row, dict):
        raise ValueError("a row must be a JSON object")
    prompt, steps, labels = row.get("prompt"), row.get("completions"), row.get("labels")
    if not isinstance(prompt, str):
        raise ValueError('needs a string field "prompt"' + foreign_format_hint(row))
    if not isinstance(steps, list) or not all(isinstance(step, str) for step in steps):
        raise ValueError('needs a field "completions", a list of strings (the steps)' + foreign_format_hint(row))
    broken = [name for name, text in [("the prompt", prompt)] + [(f"step {k}", step) for k, step in enumerate(steps)]
              if not is_unicode(text)]
    if broken:
        raise ValueError(f"{broken[0]} holds a lone surrogate, half of a UTF-16 pair (text cut inside an emoji?), "
                         "which no tokenizer can encode; mend or drop the row")
    if not need_labels:
        return row
    if not isinstance(labels, list):
        raise ValueError('needs a field "labels", a list of one bool or number in [0, 1] per step'
                         + foreign_format_hint(row))
    if len(labels) != len(steps):
        raise ValueError(f"{len(labels)} labels for {len(steps)} steps: there must be one label per step")
    if not steps:
        raise ValueError("no steps to learn from")
    for k, label in enumerate(labels):
        if isinstance(label, bool):
            continue
        if not isinstance(label, (int, float)) or not (0.0 <= label <= 1.0):  # NaN fails the comparison too
            raise ValueError(f"label {k} is {label!r}: labels must be bools or numbers in [0, 1]")
    return {"prompt": prompt, "completions": steps, "labels": [float(label) for label in labels]}


def foreign_format_hint(row: dict) -> str:
    """What to do with a row in a known other format, for the message that refuses it ("" when none is known)."""
    if "input" in row and "label" in row:
        return (' (this is Math-Shepherd\'s raw format, steps ending in "ки" and labelled "+"/"-" in "label": split '
                'it into {"prompt", "completions", "labels"}, as trl-lib/math_shepherd has it)')
    if isinstance(row.get("label"), dict) and "steps" in row["label"]:
        return (' (this is PRM800K\'s raw format, steps rated -1/0/1 in "label": write {"prompt", "completions", '
                '"labels"} rows, as trl-lib/prm800k has them)')
    renames = [f'"{other}" to "{name}"' for name, other in (("prompt", "question"), ("prompt", "problem"),
                                                           ("completions", "steps"), ("labels", "label"))
               if name not in row and other in row]
    return f" (rename {' and '.join(renames)})" if renames else ""


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


def load_jsonl_rows(path: str, *, need_labels: bool = True, skip_bad_rows: bool = False,
                    skipped_places: Optional[list] = None, places: Optional[list] = None) -> tuple[list[dict], int]:
    """Rows of a JSONL file and the number skipped. An invalid row is an error naming the file and line, or,
    with skip_bad_rows, a warning and a count (and, into skipped_places if given, its place among the valid rows
    and what was wrong, for write_scores). places, if given, receives each row's "path:line", for the errors found
    later (a step that is no token). A file that cannot be read at all is an error either way."""
    what = '{"prompt", "completions", "labels"}' if need_labels else '{"prompt", "completions"}'
    if not os.path.exists(path):
        raise UserError(f"data file {path!r} does not exist; pass a JSONL file of {what} rows")
    if os.path.isdir(path):
        raise UserError(f"data file {path!r} is a directory; pass a JSONL file of {what} rows")
    rows, skipped = [], 0
    notify = os.environ.get("RANK", "0") == "0"  # every torchrun process reads the file: one warning per run
    try:
        with open(path, "rb") as f:  # bytes, decoded line by line: a non-UTF-8 line is reported with its number
            data = f.read()
    except OSError as error:
        raise UserError(f"cannot read data file {path!r}: {error.strerror or error}") from None
    check_jsonl_bytes(path, data, f"a JSONL file of {what} rows")
    for line_number, raw in enumerate(jsonl_lines(data), start=1):
        try:
            line = raw.decode("utf-8-sig")  # -sig: drops the byte-order mark Windows tools write
            if not line.strip():
                continue
            rows.append(parse_row(line, need_labels))
            if places is not None:
                places.append(f"{path}:{line_number}")
        except (UnicodeDecodeError, ValueError) as problem:
            if isinstance(problem, UnicodeDecodeError):
                problem = "not UTF-8 text (is this a JSONL file?)"
            if not skip_bad_rows:
                raise UserError(f"{path}:{line_number}: {problem} (--skip-bad-rows skips such rows)") from None
            skipped += 1
            if skipped_places is not None:
                skipped_places.append((len(rows), f"line {line_number}: {problem}"))
            print0(f"warning: skipped {path}:{line_number}: {problem}", file=sys.stderr,
                   enabled=notify and skipped <= 5)
    if skipped:
        print0(f"warning: skipped {skipped} invalid rows of {path}", file=sys.stderr, enabled=notify)
    if not rows:
        raise UserError(f"{path} holds no valid rows" + (f" ({skipped} skipped as invalid)" if skipped else
                                                          f"; it needs JSONL {what} rows, one per line"))
    return rows, skipped


def build_prm_example(tokenizer, prompt: str, steps: list[str], *, step_separator: str,
                      max_length: int) -> tuple[list[int], list[int]]:
    """The one tokenisation of training, evaluation and scoring: `[bos] prompt step1 sep step2 sep ...`.

    The prompt and each `step + sep` are tokenised as separate strings (no special tokens) and concatenated, so
    no BPE merge crosses a step boundary: label_positions[k] is the index of the last token of `step k + sep`, a
    token that ends exactly where the separator ends (it may hold the end of the step's text too, where BPE merges
    them), and decoding input_ids[: label_positions[k] + 1] gives back, BOS aside, the prompt and the first k+1
    steps with their separators. (A tokenizer that prepends a space to every string it
    encodes, like sentencepiece's Metaspace, adds that space to each step: the same in training and scoring.)
    BOS is prepended when the tokenizer has one. Steps that do not fit whole in max_length tokens are dropped,
    with every step after them, so len(label_positions) <= len(steps); when the prompt alone does not fit,
    label_positions is empty (the caller counts the row as dropped) and input_ids is cut to max_length.
    """
    if not step_separator:
        raise ValueError("step_separator must not be empty: each step's label sits on its separator's last token")
    pieces = tokenizer([prompt] + [step + step_separator for step in steps], add_special_tokens=False)["input_ids"]
    input_ids = ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + list(pieces[0])
    if len(input_ids) > max_length:
        return input_ids[:max_length], []
    label_positions = []
    for k, piece in enumerate(pieces[1:]):
        if not piece:  # its label would land on the previous step's token (or on no token at all)
            raise ValueError(f"step {k} ({steps[k]!r}) with the separator {step_separator!r} is no token at all, "
                             "so no token can carry its label or score: this tokenizer drops the separator; "
                             "remove empty steps, or pick a --step-separator that the tokenizer keeps")
        if len(input_ids) + len(piece) > max_length:
            break
        input_ids += piece
        label_positions.append(len(input_ids) - 1)
    return input_ids, label_positions


def encode_rows(tokenizer, rows: list[dict], step_separator: str, max_length: int, what: str = "training",
                keep_empty: bool = False, places: Optional[list[str]] = None,
                skipped: Optional[list[str]] = None) -> tuple[list[dict], int, int]:
    """Examples {input_ids, positions, labels (of the kept steps), all_labels} for the rows that keep at least one
    step, and the numbers of dropped steps and dropped rows. keep_empty (held-out rows) keeps a row with no step
    left as an example with no positions: predict gives it no score, and a first error truncated away still counts
    in first-error F1, as a miss (left out, it would raise F1). A row with a step that is no token is an error
    naming it by places[i] (its file and line; else by `what` and its number), or, given the list skipped
    (--skip-bad-rows), left out with a warning and its place and problem appended there."""
    examples, dropped_steps, dropped_rows = [], 0, 0
    for number, row in enumerate(rows, start=1):
        try:
            input_ids, positions = build_prm_example(tokenizer, row["prompt"], row["completions"],
                                                     step_separator=step_separator, max_length=max_length)
        except ValueError as problem:
            where = places[number - 1] if places else f"{what} row {number} (prompt {row['prompt'][:40]!r})"
            if skipped is None:
                raise UserError(f"{where}: {problem} (--skip-bad-rows skips such rows)") from None
            skipped.append(f"{where}: {problem}")
            print0(f"warning: skipped {where}: {problem}", file=sys.stderr,
                   enabled=os.environ.get("RANK", "0") == "0" and len(skipped) <= 5)
            continue
        dropped_steps += len(row["completions"]) - len(positions)
        if not positions:
            dropped_rows += 1
            if not keep_empty:
                continue
        labels = row["labels"][:len(positions)] if "labels" in row else None
        examples.append({"input_ids": input_ids, "positions": positions, "labels": labels,
                         "all_labels": row.get("labels")})
    return examples, dropped_steps, dropped_rows


def pack_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Example indices grouped into rows of at most `capacity` tokens (capacity >= every length): the fewest rows
    that the total length allows and the filling manages, longest example first into the emptiest row, so that
    rows come out nearly equal and a packed batch pads only their short tails."""
    for count in range(max(1, math.ceil(sum(lengths) / capacity)), len(lengths) + 1):
        bins: list[list[int]] = [[] for _ in range(count)]
        fill = [0] * count
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            emptiest = min(range(count), key=fill.__getitem__)
            if fill[emptiest] + lengths[i] > capacity:
                break  # no room left: one row more
            bins[emptiest].append(i)
            fill[emptiest] += lengths[i]
        else:
            return bins
    raise ValueError(f"an example is longer than the capacity {capacity}")


def collate(examples: list[dict], pad_id: int, device, pack: bool = False) -> dict:
    """Model inputs for a batch of examples, and positions, labels, mask [B, S] per example.

    Unpacked: one example per row, right-padded to the longest: input_ids and attention_mask [B, T]. With right
    padding and causal attention no real token ever attends to a pad. Packed: examples share rows of at most twice
    the longest example (see pack_bins), with position_ids that restart at each example and no attention mask,
    from which transformers builds a block-diagonal causal mask: no example sees another, only the rows' tails
    are padding, and attention (quadratic in the row length) costs at most twice as much per token. On the
    benchmark's batches of 8 rows of 28-68 tokens: 22% fewer tokens, steps 20% faster on the small model.
    Packing is used only where it saves at least 10% of the tokens: rows of equal length gain nothing from it, and
    masked attention over longer rows would cost more (and rules out the fastest attention kernels on GPUs).
    Either way positions holds each label token's index among all R * T tokens of the batch, flattened."""
    lengths = [len(e["input_ids"]) for e in examples]
    bins = [[i] for i in range(len(examples))]
    if pack:
        packed = pack_bins(lengths, 2 * max(lengths))
        pack = len(packed) * max(sum(lengths[i] for i in b) for b in packed) <= 0.9 * len(examples) * max(lengths)
        bins = packed if pack else bins
    width = max(sum(lengths[i] for i in b) for b in bins)
    most_steps = max(len(e["positions"]) for e in examples)
    input_ids = torch.full((len(bins), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(bins), width), dtype=torch.long)
    position_ids = torch.zeros((len(bins), width), dtype=torch.long)
    positions = torch.zeros((len(examples), most_steps), dtype=torch.long)  # padding gathers token 0, masked out
    labels = torch.zeros((len(examples), most_steps), dtype=torch.float32)
    mask = torch.zeros((len(examples), most_steps), dtype=torch.bool)
    for row, members in enumerate(bins):
        start = 0
        for i in members:
            e, end = examples[i], start + lengths[i]
            input_ids[row, start:end] = torch.tensor(e["input_ids"])
            attention_mask[row, start:end] = 1
            position_ids[row, start:end] = torch.arange(lengths[i])
            positions[i, :len(e["positions"])] = row * width + start + torch.tensor(e["positions"])
            mask[i, :len(e["positions"])] = True
            if e["labels"] is not None:
                labels[i, :len(e["labels"])] = torch.tensor(e["labels"])
            start = end
        position_ids[row, start:] = 0  # the padded tail: one-token sequences of their own, at position 0
    batch = {"input_ids": input_ids, "attention_mask": None if pack else attention_mask,
             "position_ids": position_ids if pack else None, "positions": positions, "labels": labels,
             "mask": mask, "tokens": sum(lengths)}
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def split_steps(text: str, step_separator: str) -> list[str]:
    """A generated solution split into steps the way training rows are laid out: on the separator, without
    empty pieces (a trailing separator adds no step). Used by grpo.py's PRM reward and by callers of score_steps."""
    return [step for step in text.split(step_separator) if step.strip()]


class UserError(Exception):
    """A mistake in the user's input or flags: reported as one line, without a traceback."""


# ---------------------------------------------------------------------------------------------------------------
# Model helpers: build or load, the reward head, LoRA, saving, loading, scoring.


def build_tiny_tokenizer():
    """A character-level tokenizer over the built-in task's alphabet (one token per character)."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(TINY_SPECIALS + TINY_CHARS)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token a char
    tokenizer.add_special_tokens(TINY_SPECIALS)
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>", model_max_length=1024)


def build_tiny_backbone(tokenizer):
    """A 3-layer Llama backbone (no LM head), 64-wide (about 0.2M parameters), random init from the current seed.
    The third layer is what makes the built-in task learn reliably within a few hundred steps."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=256, max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaModel(config)


# the files of a tokenizer saved with save_pretrained (fast or slow), one of which a model directory needs
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def load_backbone_and_tokenizer(name_or_path: str, dtype: torch.dtype, trust_remote_code: bool):
    """`tiny` is built here; anything else goes through AutoModel (the transformer without its LM head, so no
    vocabulary-sized logits are ever computed) and AutoTokenizer."""
    from transformers import AutoModel, AutoTokenizer

    if name_or_path == "tiny":
        tokenizer = build_tiny_tokenizer()
        backbone = build_tiny_backbone(tokenizer)
        for weight in backbone.parameters():  # not .to(dtype), which would round the fp32 rotary frequencies
            weight.data = weight.data.to(dtype)  # (buffers) that from_pretrained recomputes when final/ is loaded
        return backbone, tokenizer
    if name_or_path.startswith(("/", "./", "../", "~")) and not os.path.exists(os.path.expanduser(name_or_path)):
        raise UserError(f"could not load model {name_or_path!r}: it does not exist (a local path, not a hub id)")
    if os.path.isfile(os.path.join(name_or_path, "adapter_config.json")):  # (a LoRA run of grpo.py, say)
        raise UserError(f"could not load model {name_or_path!r}: it is a LoRA adapter, not a model to start from; "
                        "merge it into its base first (peft's merge_and_unload, then save_pretrained of the model and "
                        "its tokenizer) and pass that")
    if os.path.isdir(name_or_path) and not os.path.isfile(os.path.join(name_or_path, "config.json")):
        final = os.path.join(name_or_path, "final")  # (a run's directory given for its model)
        raise UserError(f"could not load model {name_or_path!r}: the directory holds no config.json (a model saved "
                        "with save_pretrained has one)" + (f"; its run's model is {final}" if os.path.isdir(final)
                                                          else ""))
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        backbone = AutoModel.from_pretrained(name_or_path, dtype=dtype, trust_remote_code=trust_remote_code)
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
    rows = backbone.get_input_embeddings().num_embeddings
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id >= rows:  # pads are never attended to: any id in
        notify = os.environ.get("RANK", "0") == "0"  # range will do; one note per run, not one per process
        problem = "no pad token" if tokenizer.pad_token_id is None else f"a pad id past the model's {rows} embeddings"
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id < rows:
            print0(f"note: the tokenizer of {name_or_path} has {problem}; using EOS ({tokenizer.eos_token!r}) to pad",
                   enabled=notify)
            tokenizer.pad_token = tokenizer.eos_token
        else:
            print0(f"note: the tokenizer of {name_or_path} has {problem} and no EOS to pad with; padding with id 0",
                   enabled=notify)
            tokenizer.pad_token = None
    return backbone, tokenizer


class ProcessRewardModel(torch.nn.Module):
    """Backbone + fp32 `Linear(hidden, 1)` read at each step's label position. `.config` (saved as
    prm_config.json) holds what scoring needs: step_separator, max_length, loss_kind, base model, LoRA or not."""

    def __init__(self, backbone, hidden_size: int, tokenizer, config: dict):
        super().__init__()
        self.backbone = backbone
        self.head = torch.nn.Linear(hidden_size, 1, dtype=torch.float32)
        self.tokenizer = tokenizer
        self.config = config
        self.pack_rows = False  # pack batches (see collate); set by use_packing
        self.dropout_rates = {}  # the backbone config's rates where training zeroed them, for the saved config

    def forward(self, input_ids, attention_mask, position_ids, positions) -> torch.Tensor:
        """input_ids [R, T] with attention_mask or position_ids [R, T] (see collate); positions [B, S] (label token
        indices among the R * T tokens) -> step logits [B, S]."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state  # [R, T, H]
        label_hidden = hidden.reshape(-1, hidden.shape[-1])[positions]  # [B, S, H]
        return self.head(label_hidden.float()).squeeze(-1)  # only the S label positions reach the head


@torch.no_grad()
def use_packing(prm: ProcessRewardModel) -> bool:
    """Packs batches (prm.pack_rows, see collate) if the backbone keeps packed examples apart, and says whether it
    does. Most decoder models in transformers build a block-diagonal causal mask from position ids that restart,
    when given no attention mask; one that does not would let an example attend to the one before it, or place
    it at the wrong positions, and one with recurrent or convolutional layers (Mamba, Jamba, LFM2) carries state
    across the boundary whatever the mask. Checked once, through the whole PRM (under FSDP only its forward
    gathers the weights), scored at every token of the example packed behind, in two ways:
    - positions: a second example packed behind a first must come out as it does alone; 1% of the scale, which
      bf16 rounding stays well below (the same example is computed in rows of other lengths);
    - separation: one example packed behind two different first examples of the same length must come out the
      same to 1e-5 of the scale. Masked keys add exact zeros, so a backbone that keeps examples apart gives equal
      outputs bit for bit; a leak measured 1e-4 to 1e-1 of the scale on small random Jamba, LFM2 and BLOOM models,
      which the positions check (1e-2) lets through.
    Two packed rows each time, since some attention kernels (flash-attention's) recognise packing only in a batch
    of one."""
    was_training = prm.training
    prm.eval()  # no dropout in the comparison
    device, vocab = prm.head.weight.device, prm.backbone.config.vocab_size
    # made-up examples of ordinary tokens: a pad id is taken by some models for padding that wants an attention mask
    # (a warning), and BOS or EOS may be treated apart
    special = ({*prm.tokenizer.all_special_ids, getattr(prm.backbone.config, "pad_token_id", None)}
               if prm.tokenizer is not None else set())
    ordinary = [i for i in range(vocab) if i not in special] or list(range(vocab))

    def tokens(indices) -> list[int]:
        return [ordinary[i % len(ordinary)] for i in indices]

    def run(rows: list[list[int]], lengths: list[list[int]], scored: list[int]) -> torch.Tensor:
        """rows of packed examples of the given lengths, scored at token indices `scored` of each row"""
        positions = [[k for n in row_lengths for k in range(n)] for row_lengths in lengths]
        width = len(rows[0])
        return prm(torch.tensor(rows, device=device), None, torch.tensor(positions, device=device),
                   torch.tensor([[r * width + k for k in scored] for r in range(len(rows))], device=device))

    first, second = tokens(range(5)), tokens(range(5, 9))
    alone = [prm(torch.tensor([ids], device=device), None, None, torch.arange(len(ids), device=device)[None])
             for ids in (first, second)]
    packed = run([first + second, second + first], [[5, 4], [4, 5]], [5, 6, 7, 8])
    expected = torch.cat([alone[1], alone[0][:, 1:]])  # [2, 4]: second, then first's last four tokens
    positions_right = bool((packed - expected).abs().max() <= 1e-2 * expected.abs().max() + 1e-6)
    before = [tokens(range(12)), tokens(range(47, 47 + 7 * 12, 7))]
    behind = run([row + second for row in before], [[12, 4], [12, 4]], [12, 13, 14, 15])  # [2, 4]
    kept_apart = bool((behind[0] - behind[1]).abs().max() <= 1e-5 * behind.abs().max() + 1e-7)
    prm.train(was_training)
    prm.pack_rows = positions_right and kept_apart
    return prm.pack_rows


def disable_dropout(backbone: torch.nn.Module) -> dict:
    """Zeroes every nn.Dropout, the rates attention layers apply themselves (transformers' `self.attention_dropout`,
    read in train mode) and those in the config (GPT-Neo and Persimmon read `config.attention_dropout` in their
    forward). Returns the config's rates as they were, for the saved config.json: whoever trains the backbone
    further gets its dropout back."""
    for module in backbone.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    original_rates = {}
    for name, value in list(vars(backbone.config).items()):
        if ("dropout" in name or name.endswith("pdrop")) and isinstance(value, float):
            original_rates[name] = value
            setattr(backbone.config, name, 0.0)
    return original_rates


def apply_lora(backbone, args: Args):
    """LoRA adapters on the backbone only: the head stays outside peft and is trained in full."""
    from peft import LoraConfig, NoMatchingPeftModuleError, get_peft_model

    targets = args.lora_target_modules
    names = [name.strip() for name in targets.split(",") if name.strip()]  # ("q_proj," names no module "")
    target_modules = targets if targets == "all-linear" else names
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=target_modules, task_type="FEATURE_EXTRACTION")
    # the names to choose from: LoRA adapts linear layers (GPT-2's Conv1D is one, transposed)
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in backbone.named_modules()
                     if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"})
    architecture = type(backbone).__name__
    # (no adapter's rank can exceed its layer's smaller side; a huge --lora-r would only fail to allocate)
    largest_rank = max((min(weight.shape) for weight in backbone.parameters() if weight.dim() == 2), default=0)
    if args.lora_r > largest_rank:
        raise UserError(f"--lora-r {args.lora_r} is above the rank of every weight matrix of the model (at most "
                        f"{largest_rank}, their smaller side); pass a rank far below it, such as 8 to 64")
    try:
        backbone = get_peft_model(backbone, config)
    except NoMatchingPeftModuleError:
        unknown = target_modules
    except ValueError as error:  # peft refuses some layers of some models (Mamba's out_proj and conv1d)
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UserError(f"--lora-target-modules {targets}: peft cannot adapt them on {type(backbone).__name__} "
                        f"({reason}); pass --lora-target-modules without them") from None
    else:  # peft adapts the names that match and ignores the others: a typo would go unnoticed
        adapted = backbone.targeted_module_names
        unknown = [] if targets == "all-linear" else [
            target for target in target_modules if not any(name == target or name.endswith("." + target)
                                                           for name in adapted)]
    if unknown:
        raise UserError(f"--lora-target-modules {targets}: no module of {architecture} has that name "
                        f"({', '.join(unknown)}); its linear modules include {', '.join(linear[:8]) or 'none'} (or "
                        "use all-linear)")
    return backbone


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


# CUDA only for users (a clear error elsewhere); the tests add "cpu" here to run the sharded path over gloo
FSDP_DEVICE_TYPES = ("cuda",)


def shard_prm(prm: ProcessRewardModel, device: torch.device, compute_dtype: torch.dtype) -> None:
    """FSDP2 (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html), in place: each transformer block
    of the backbone (its `_no_split_modules`) is one unit whose weights are all-gathered just before its forward
    and freed after; the head is a unit of its own that computes in fp32; the embeddings form the root unit.
    Weights, gradients and optimiser state stay sharded in fp32; gradients are reduced in fp32 and summed, not
    averaged, over processes: each process's loss is already divided by the global count of labelled steps. They
    are reduce-scattered after every micro-batch and accumulate sharded (deferring that would hold whole fp32
    gradients on every GPU)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    block_names = {name for module in prm.modules() for name in getattr(module, "_no_split_modules", None) or []}
    blocks = [module for module in prm.backbone.modules() if type(module).__name__ in block_names]
    if not blocks:
        raise UserError(f"--fsdp: found no transformer blocks to shard in {type(prm.backbone).__name__} (its "
                        "_no_split_modules is empty); run without --fsdp")
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(prm.head, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    fully_shard(prm, mesh=mesh, mp_policy=policy)
    for module in prm.modules():
        if isinstance(module, FSDPModule):  # a plain SUM (gloo has no pre-multiplied sum)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def full_state_dicts(prm: ProcessRewardModel, optimizer=None) -> tuple[dict, Optional[dict]]:
    """Whole (unsharded) PRM and optimiser state dicts of a sharded PRM, on the CPU of rank 0 (empty elsewhere);
    every process must call it, since it gathers the shards."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(prm, options=options),
            get_optimizer_state_dict(prm, optimizer, options=options) if optimizer is not None else None)


def causal_hidden_size(backbone, name: str) -> int:
    """The width of what the backbone returns (the head reads that, not always hidden_size: OPT-350m gives 512),
    after checking that it is causal: two sequences that differ only in their last token must agree before it. A
    bidirectional encoder (BERT) would let each step's score see the steps after it, in training and in scoring."""
    rows = backbone.get_input_embeddings().num_embeddings
    ids = torch.tensor([[1, 2, 3], [1, 2, 4]]).clamp(max=rows - 1)
    try:
        with torch.no_grad():
            hidden = backbone(input_ids=ids, use_cache=False).last_hidden_state.float()  # [2, 3, H]
    except (TypeError, ValueError) as error:  # e.g. an encoder-decoder (T5), which also wants decoder inputs
        raise UserError(f"--model {name}: its base model cannot encode a token sequence on its own "
                        f"({str(error).splitlines()[0]}); use a decoder-only (causal LM) model") from None
    change = (hidden[0, :2] - hidden[1, :2]).abs().max() / hidden[:, :2].abs().max().clamp(min=1e-30)
    if change > 1e-3:  # a causal model's rows agree there up to rounding (1e-7)
        raise UserError(f"--model {name} is not causal: changing a sequence's last token changes the hidden states "
                        "before it, so each step's score would see the steps after it; use a decoder-only (causal "
                        "LM) model")
    return hidden.shape[-1]


def build_prm(args: Args, dtype: torch.dtype) -> tuple[ProcessRewardModel, Optional[torch.nn.Module]]:
    """Backbone (with LoRA when --lora-r > 0) and a new head, on the CPU. Also returns a copy of the base backbone
    when an adapter will need one saved beside it (the random-init tiny model cannot be reloaded by name). A PRM
    that this script saved with full fine-tuning is a model directory too: training goes on from its head as well
    (a new head would throw away what it learnt)."""
    saved_prm_config, saved_prm = os.path.join(args.model, "prm_config.json"), None
    head_path = os.path.join(args.model, "reward_head.safetensors")
    if os.path.isfile(saved_prm_config):
        with open(saved_prm_config) as f:
            saved_prm = json.load(f)
        if saved_prm.get("lora"):
            raise UserError(f"--model {args.model} is a PRM that prm.py trained with LoRA: an adapter, not a model to "
                            "start from; continue its run with --resume-from one of its checkpoints, or start from "
                            f"its base model ({saved_prm.get('base_model')})")
        if not os.path.isfile(head_path):
            raise UserError(f"--model {args.model} is an incomplete PRM: no reward_head.safetensors in it (a copy cut "
                            "short?); copy the whole directory that prm.py saved")
        # its head reads the hidden state at the end of each step's separator, as a logit (bce) or a score (mse)
        differing = [f"--{name.replace('_', '-')} {saved_prm[name]!r}" for name in ("loss_kind", "step_separator")
                     if saved_prm.get(name, getattr(args, name)) != getattr(args, name)]
        if differing:
            raise UserError(f"--model {args.model} is a PRM trained with {', '.join(differing)}, which its head was "
                            "trained for; pass the same to train it further")
    backbone, tokenizer = load_backbone_and_tokenizer(args.model, dtype, args.trust_remote_code)
    hidden_size = causal_hidden_size(backbone, args.model)
    dropout_rates = {} if args.backbone_dropout else disable_dropout(backbone)  # before LoRA: --lora-dropout stays
    base_copy, where = None, "."  # where the saved PRM finds its backbone: "." = final/ itself
    if args.lora_r > 0:
        base_copy = copy.deepcopy(backbone) if args.model == "tiny" else None
        where = "base" if args.model == "tiny" else (os.path.abspath(args.model) if os.path.isdir(args.model)
                                                    else args.model)
        backbone = apply_lora(backbone, args)
    config = {"base_model": args.model, "backbone": where, "lora": args.lora_r > 0, "lora_r": args.lora_r,
              "hidden_size": hidden_size, "step_separator": args.step_separator, "max_length": args.max_length,
              "loss_kind": args.loss_kind}
    prm = ProcessRewardModel(backbone, hidden_size, tokenizer, config)
    prm.dropout_rates = dropout_rates
    if saved_prm is not None:
        from safetensors.torch import load_file

        prm.head.load_state_dict(load_file(head_path))
        print0(f"note: --model {args.model} is a PRM saved by prm.py: training starts from its reward head too",
               enabled=os.environ.get("RANK", "0") == "0")
    return prm, base_copy


def remove_directory(path: str) -> None:
    """Renamed away, then deleted: a kill mid-way never leaves a half checkpoint or final/ under its name."""
    if os.path.exists(path):
        shutil.rmtree(path + ".old", ignore_errors=True)
        os.replace(path, path + ".old")
        shutil.rmtree(path + ".old")


def save_prm(path: str, prm: ProcessRewardModel, base_backbone=None, weights: Optional[dict] = None,
             args: Optional[Args] = None, trainer_state: Optional[dict] = None, step: Optional[int] = None) -> None:
    """final/: the backbone (full fine-tuning) or the LoRA adapter, reward_head.safetensors, the tokenizer and
    prm_config.json. A base that cannot be reloaded by name (the random-init tiny model) is saved under base/.
    A checkpoint-STEP/ holds the same files (so it also loads with load_prm) plus args.json and trainer_state.pt.
    weights: the gathered state dict of a sharded PRM (FSDP), which its modules cannot read themselves.
    Written to a temporary directory, then renamed: a crash mid-write leaves any previous version intact, and
    checkpoint_steps never counts a half-written checkpoint."""
    from safetensors.torch import save_file

    temporary = path.rstrip("/") + ".tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    weights = weights if weights is not None else prm.state_dict()
    backbone = {name.removeprefix("backbone."): w for name, w in weights.items() if name.startswith("backbone.")}
    head = {name.removeprefix("head."): w for name, w in weights.items() if name.startswith("head.")}
    # one weights file, so that resuming reads it back whole; the backbone alone is what AutoModel reloads
    prm.backbone.save_pretrained(temporary, max_shard_size="1000GB", state_dict=backbone)
    if base_backbone is not None:
        base_backbone.save_pretrained(os.path.join(temporary, "base"), max_shard_size="1000GB")
    for config_path in (os.path.join(temporary, "config.json"), os.path.join(temporary, "base", "config.json")):
        if prm.dropout_rates and os.path.isfile(config_path):  # the model's own rates, not training's zeros
            with open(config_path) as f:
                saved_config = json.load(f)
            with open(config_path, "w") as f:
                json.dump({**saved_config, **prm.dropout_rates}, f, indent=2, sort_keys=True)
    prm.tokenizer.save_pretrained(temporary)
    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in head.items()},
              os.path.join(temporary, "reward_head.safetensors"))
    with open(os.path.join(temporary, "prm_config.json"), "w") as f:  # pack_rows: how scoring batches, as training
        json.dump({**prm.config, "pack_rows": prm.pack_rows, **({"step": step} if step is not None else {})}, f,
                  indent=2)
    if trainer_state is not None:
        with open(os.path.join(temporary, "args.json"), "w") as f:
            json.dump({"script": "prm.py", **asdict(args)}, f, indent=2)
        torch.save(trainer_state, os.path.join(temporary, "trainer_state.pt"))
    # the old version is moved aside, the new one put in its place, and only then is the old one deleted (slow for
    # a large model): a kill at any point leaves a complete version under the name (or, between the two renames,
    # as path.old, which a save at this step cleans up)
    if os.path.exists(path):
        shutil.rmtree(path + ".old", ignore_errors=True)
        os.replace(path, path + ".old")
    os.replace(temporary, path)
    shutil.rmtree(path + ".old", ignore_errors=True)


def load_prm(path: str, device=None, dtype=None, trust_remote_code: bool = False) -> ProcessRewardModel:
    """A PRM saved by this script, in eval mode. device None = cuda when available; dtype None = the dtype it was
    trained in (prm_config.json records it), which gives the scores of the end of training: on the CPU always, on a
    GPU unless that is bf16 and the GPU lacks native bf16 (then float32); a PRM that does not record it, bfloat16 on
    a GPU with native bf16, else float32. The head is always fp32."""
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoTokenizer

    config_path = os.path.join(path, "prm_config.json")
    if not os.path.exists(path):
        raise UserError(f"{path!r} does not exist: pass the final/ or a checkpoint-STEP/ directory of a prm.py run")
    if not os.path.isfile(config_path):
        final = os.path.join(path, "final", "prm_config.json")  # (a run's directory given for its PRM)
        raise UserError(f"{path!r} is not a PRM saved by prm.py (no prm_config.json in it)"
                        + (f"; its run's PRM is {os.path.dirname(final)}" if os.path.isfile(final) else ""))
    with open(config_path) as f:
        config = json.load(f)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:  # the dtype it was trained in; on a GPU, bf16 only where it is native (else auto_dtype)
        trained_in = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(config.get("dtype"))
        usable = trained_in == torch.float32 or device.type == "cpu" or auto_dtype(device) == trained_in
        dtype = trained_in if trained_in is not None and usable else auto_dtype(device)
    weights = "adapter_model.safetensors" if config["lora"] else "model.safetensors"  # (save_prm: one file)
    head_path = os.path.join(path, "reward_head.safetensors")
    missing = [name for name in (weights, "reward_head.safetensors") if not os.path.isfile(os.path.join(path, name))]
    if missing:
        raise UserError(f"{path} is an incomplete PRM: no {' or '.join(missing)} in it (a copy cut short?); copy the "
                        "whole directory that prm.py saved")
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if config["lora"]:
        from peft import PeftModel

        base = config["backbone"]
        base = os.path.join(path, base) if os.path.isdir(os.path.join(path, base)) else base
        if os.path.isabs(base) and not os.path.isdir(base):
            raise UserError(f"{path}: its LoRA adapter's base model {base} (\"backbone\" in prm_config.json) does not "
                            "exist; point that field at the base model's new place or its hub name")
        try:
            backbone = AutoModel.from_pretrained(base, dtype=dtype, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as error:  # a hub name that cannot be reached, a directory without a model
            raise UserError(f"{path}: cannot load its LoRA adapter's base model {base!r} (\"backbone\" in "
                            f"prm_config.json): {str(error).splitlines()[0].rstrip('.')}; point that field at a "
                            "local copy of the base model") from None
        backbone = PeftModel.from_pretrained(backbone, path)
    else:
        backbone = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    prm = ProcessRewardModel(backbone, config["hidden_size"], tokenizer, config)
    prm.head.load_state_dict(load_file(head_path))
    prm.to(device).eval()
    # batched as in training (--no-pack-rows pads: packed, fp32 scores would differ by ~1e-7, bf16 ones by ~4e-4);
    # PRMs saved before this was recorded pack where the backbone allows, as they were trained by default
    if config.get("pack_rows", True):
        use_packing(prm)
    return prm


@torch.no_grad()
def predict(prm: ProcessRewardModel, examples: list[dict], batch_size: int) -> list[list[float]]:
    """Scores of every kept step of every example: sigmoid(logit) for bce, the raw output for mse. Examples
    are batched by length (less padding) and the scores returned in the original order."""
    was_training = prm.training
    prm.eval()
    device = prm.head.weight.device
    pad_id = prm.tokenizer.pad_token_id if prm.tokenizer.pad_token_id is not None else 0
    order = sorted((i for i, e in enumerate(examples) if e["positions"]), key=lambda i: len(examples[i]["input_ids"]))
    scores: list[list[float]] = [[] for _ in examples]  # an example with no step kept has no score
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        batch = collate([examples[i] for i in chunk], pad_id, device, prm.pack_rows)
        logits = prm(batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["positions"])  # [b, S]
        # fp64: fp32's sigmoid is exactly 1.0 past a logit of 16.6, which would tie confident steps in AUROC and in
        # the threshold search (fp64's, past 36.7)
        values = torch.sigmoid(logits.double()) if prm.config["loss_kind"] == "bce" else logits
        for row, i in enumerate(chunk):
            scores[i] = values[row, :len(examples[i]["positions"])].tolist()
    prm.train(was_training)
    return scores


def score_steps(prm: ProcessRewardModel, prompts: list[str], steps: list[list[str]],
                batch_size: int = 32) -> list[list[float]]:
    """Per step, the probability that the solution is still correct (sigmoid for bce; the raw output for mse),
    tokenised by build_prm_example with the PRM's own separator and max length. Steps truncated away get no
    score: a solution's list has one score per kept step, its first steps (empty when the prompt alone is too
    long; aggregate_scores gives that 0.0)."""
    return score_examples(prm, scoring_examples(prm.tokenizer, prompts, steps, prm.config["step_separator"],
                                                prm.config["max_length"]), batch_size)


def scoring_examples(tokenizer, prompts: list[str], steps: list[list[str]], step_separator: str,
                     max_length: int, places: Optional[list[str]] = None,
                     unscorable: Optional[dict] = None) -> list[dict]:
    """score_steps' examples (no labels), built before any scoring: a step that is no token at all raises
    ValueError naming its solution by places[i] (its file and line), else by its number (from 1) and prompt; or,
    given the dict unscorable (--skip-bad-rows), the solution gets no example positions and unscorable[i] says why
    (write_scores keeps its line, with a null score)."""
    if isinstance(prompts, str) or any(isinstance(solution, str) for solution in steps):  # (a str would be iterated
        raise TypeError("score_steps takes a list of prompts and, for each, a list of steps (split_steps(text, "
                        "separator) splits a solution): a string would be scored character by character")
    examples = []
    for index, (prompt, solution) in enumerate(zip(prompts, steps, strict=True)):
        try:
            input_ids, positions = build_prm_example(tokenizer, prompt, solution, step_separator=step_separator,
                                                     max_length=max_length)
        except ValueError as problem:
            where = places[index] if places else f"solution {index + 1} (prompt {prompt[:40]!r})"
            if unscorable is None:
                raise ValueError(f"{where}: {problem}") from None
            unscorable[index] = f"{where}: {problem}"
            print0(f"warning: skipped {where}: {problem}", file=sys.stderr,
                   enabled=os.environ.get("RANK", "0") == "0" and len(unscorable) <= 5)
            input_ids, positions = [], []
        examples.append({"input_ids": input_ids, "positions": positions, "labels": None})
    return examples


def score_examples(prm: ProcessRewardModel, examples: list[dict], batch_size: int) -> list[list[float]]:
    """score_steps for examples already built (scoring_examples)."""
    scored = [e for e in examples if e["positions"]]
    results = iter(predict(prm, scored, batch_size))
    return [next(results) if e["positions"] else [] for e in examples]


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints, resuming, flag checks


def rng_state() -> dict:
    """The global generators' states, as tensors and plain tuples (loadable with weights_only=True). The batch
    order needs none: it is a permutation seeded by (seed, epoch), rebuilt from the step number."""
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


def gather_rng_states(distributed: bool, world_size: int) -> list[dict]:
    """Every process's RNG states, indexed by rank: dropout draws differ between ranks, so each rank gets its own
    back on resume. Under torchrun this is a collective: every rank must call it."""
    if not distributed:
        return [rng_state()]
    # sent as torch.save bytes: all_gather_object's own unpickling cannot rebuild the CPU tensors in the states
    buffer = io.BytesIO()
    torch.save(rng_state(), buffer)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, buffer.getvalue())
    return [torch.load(io.BytesIO(data), weights_only=True) for data in gathered]


def checkpoint_steps(output_dir: str) -> list[int]:
    """Steps of the complete checkpoints in output_dir, oldest first (a *.tmp left by a crash is not one)."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(int(name.split("-")[1]) for name in os.listdir(output_dir)
                  if re.fullmatch(r"checkpoint-\d+", name) and os.path.isfile(
                      os.path.join(output_dir, name, "trainer_state.pt")))


def final_step(output_dir: str) -> Optional[int]:
    """The step of the final model in output_dir (from its prm_config.json), or None (none, or one saved before
    final models recorded their step)."""
    try:
        with open(os.path.join(output_dir, "final", "prm_config.json")) as f:
            step = json.load(f).get("step")
    except (OSError, ValueError):
        return None
    return step if isinstance(step, int) else None


RUN_FILES = ("metrics.jsonl", "summary.json", "scores.jsonl", "final", "final.tmp", "final.old")


def unfinished_saves(output_dir: str) -> list[str]:
    """What a kill during a save or a deletion leaves in output_dir: checkpoint-N.tmp or final.tmp (a save cut
    short), *.old (a version being replaced or pruned). `latest` never picks them."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    return sorted(name for name in names if re.fullmatch(r"(checkpoint-\d+|final)\.(tmp|old)", name))


def holds_run(output_dir: str) -> bool:
    """Whether output_dir already holds (part of) a run of this script."""
    return any(os.path.exists(os.path.join(output_dir, name)) for name in RUN_FILES[:4]) or bool(
        checkpoint_steps(output_dir))


def clear_run(output_dir: str) -> None:
    """--overwrite: remove the files a run writes, and only those (--output-dir may hold other things)."""
    if not os.path.isdir(output_dir):
        return
    for name in os.listdir(output_dir):
        if name in RUN_FILES or re.fullmatch(r"checkpoint-\d+(\.tmp|\.old)?", name):
            target = os.path.join(output_dir, name)
            shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)


# what a checkpoint must agree on with the run that resumes from it: the model and its shape, the training rows and
# their split, the loss, and the batch (the number of processes may change: the update does not depend on it)
# (not data_path: the rows' content is checked instead, so that the same file can be given by another path)
RESUME_MUST_MATCH = ("model", "num_val_rows", "step_separator", "max_length", "lora_r", "lora_alpha",
                     "lora_target_modules", "loss_kind", "batch_size", "seed", "fsdp")


def train_further(final_dir: str) -> str:
    """What to do with a final PRM to train it further, which --resume-from cannot take."""
    try:
        with open(os.path.join(final_dir, "prm_config.json")) as f:
            lora = json.load(f).get("lora")
    except (OSError, ValueError, AttributeError):
        lora = None
    if lora:  # (--model refuses an adapter: peft would stack a new one on it)
        return ("its LoRA adapter can go on only from a checkpoint of its run: train again with --save-every to keep "
                "some")
    return f"to train it further, start a new run from its weights: --model {final_dir} and another --output-dir"


def resolve_resume(args: Args, output_dir: str) -> Optional[str]:
    """The checkpoint directory to resume from (`latest` = the newest in --output-dir), checked against args."""
    if args.resume_from is None:
        return None
    path = args.resume_from
    if path == "latest":
        steps = checkpoint_steps(output_dir)
        if not steps and os.path.isfile(os.path.join(output_dir, "summary.json")):
            raise UserError(f"--resume-from latest: the run in {output_dir} finished without a checkpoint (a final PRM "
                            f"holds no trainer state); {train_further(os.path.join(output_dir, 'final'))}")
        if not steps:
            raise UserError(f"--resume-from latest: no checkpoint-* directory in {output_dir}: pass the run's "
                            "--output-dir, or, for a run stopped before its first checkpoint, start it again with "
                            "--overwrite")
        path = os.path.join(output_dir, f"checkpoint-{steps[-1]}")
    args_file = os.path.join(path, "args.json")
    if not os.path.exists(path):
        raise UserError(f"--resume-from {path} does not exist: pass a checkpoint-STEP directory of a run, or latest "
                        "(the newest in --output-dir)")
    if os.path.isfile(os.path.join(path, "prm_config.json")) and not os.path.isfile(args_file):
        raise UserError(f"--resume-from {path}: a final PRM holds no trainer state, only a checkpoint can be resumed "
                        f"(latest: the newest); {train_further(path)}")
    if not os.path.isfile(args_file) or not os.path.isfile(os.path.join(path, "trainer_state.pt")):
        raise UserError(f"--resume-from {path}: not a checkpoint written by prm.py (no args.json and "
                        "trainer_state.pt in it)")
    try:
        with open(args_file) as f:
            saved = json.load(f)
    except (OSError, ValueError) as error:
        raise UserError(f"--resume-from {path}: cannot read its args.json ({error})") from None
    if not isinstance(saved, dict) or saved.get("script") != "prm.py":
        script = saved.get("script") if isinstance(saved, dict) else None
        raise UserError(f"--resume-from {path}: this checkpoint was written by {script or 'another program'}, "
                        "not prm.py")
    defaults = {field.name: field.default for field in fields(Args)}  # for a flag newer than the checkpoint
    different = [f"--{key.replace('_', '-')} {saved.get(key, defaults[key])!r} there, {getattr(args, key)!r} here"
                 for key in RESUME_MUST_MATCH if saved.get(key, defaults[key]) != getattr(args, key)]
    if different:
        raise UserError(f"--resume-from {path}: the checkpoint's run differs from this one ({'; '.join(different)}); "
                        "resume with the same settings")
    # the other flags may change (a longer run, another eval cadence...), but not unsaid: the run goes on otherwise
    # than it began. Not listed: where it runs and writes, and the optimiser settings (noted once restored)
    unnoted = {"resume_from", "output_dir", "overwrite", "run_name", "world_size", "local_batch", "learning_rate",
               "weight_decay", "adam_betas"}
    if args.epochs is not None:  # --total-steps is computed from --epochs later, and the checkpoint holds its value
        unnoted.add("total_steps")

    def as_run(key: str, value):  # a file by its real path (the data's content is checked apart); a tuple is a list
        return os.path.realpath(value) if key.endswith("_path") and isinstance(value, str) else json.dumps(value)
    changed = [f"--{key.replace('_', '-')} {saved.get(key, defaults[key])!r} there, {getattr(args, key)!r} here"
               for key in defaults if key not in unnoted
               and as_run(key, saved.get(key, defaults[key])) != as_run(key, getattr(args, key))]
    if changed:
        print0(f"note: resuming with other settings than the checkpoint's run: {'; '.join(changed)}",
               enabled=os.environ.get("RANK", "0") == "0")
    return path


def load_saved_weights(model, directory: str) -> tuple[list[str], list[str]]:
    """The model.safetensors that save_pretrained wrote in directory, into model in place: the names of the weights
    that did not fit, (missing, unexpected); weights of other shapes raise load_state_dict's RuntimeError.
    save_pretrained writes some architectures' weights under their hub names (a mixture of experts' fused weights one
    expert at a time, for one); those are read through transformers' loader, which maps them back (it builds a second
    copy of the backbone, so only for them)."""
    from safetensors.torch import load_file

    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(
        dict(model.named_parameters()))  # tied weights are saved once
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


def load_checkpoint_weights(prm: ProcessRewardModel, path: str, model_name: str) -> None:
    """The backbone (or its LoRA adapter) and the head of a checkpoint, into a freshly built PRM; weights that do
    not fit it (a checkpoint of another model) are an error. safetensors only: no pickle is ever run."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        if prm.config["lora"]:
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(prm.backbone, load_file(os.path.join(path, "adapter_model.safetensors")))
            missing = [name for name in result.missing_keys if "lora_" in name]  # base weights are not in it
            unexpected = list(result.unexpected_keys)
        else:
            missing, unexpected = load_saved_weights(prm.backbone, path)
        prm.head.load_state_dict(load_file(os.path.join(path, "reward_head.safetensors")))
    except (OSError, RuntimeError, ValueError, SafetensorError) as error:  # missing file, shape mismatch, corrupt
        raise UserError(f"--resume-from {path}: its weights do not load into {model_name} "
                        f"({str(error).strip().splitlines()[0]})") from None
    if missing or unexpected:
        raise UserError(f"--resume-from {path}: its weights do not fit {model_name} (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]})")


def load_trainer_state(path: str) -> dict:
    """trainer_state.pt, with weights_only=True: tensors and plain containers only, no arbitrary pickle."""
    try:
        # (on the CPU first: the optimiser's load puts each state beside its parameter, on this process's device)
        return torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load raises many kinds (EOFError, UnpicklingError, RuntimeError) on bad files
        # (not torch's own advice to load with weights_only=False, which would run whatever the file holds)
        reason = ("not tensors and plain values: corrupt, or not saved by this script" if "weights_only" in str(error)
                  else (str(error).strip().splitlines() or ["corrupt file"])[0])
        raise UserError(f"--resume-from {path}: cannot read trainer_state.pt ({type(error).__name__}: "
                        f"{reason})") from None


def data_fingerprint(*row_lists: list[dict]) -> str:
    """A short hash of row lists (training + validation, or eval): resuming on a changed data file is an error."""
    return hashlib.sha256(json.dumps(row_lists, sort_keys=True).encode()).hexdigest()[:16]


def auto_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the GPU has it natively (emulated, on a V100 or T4, it is slow), else fp32."""
    native_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.bfloat16 if native_bf16 else torch.float32


def resolve_device(name: str, local_rank: int, local_processes: int = 1) -> torch.device:
    """--device as a torch.device. auto = this process's GPU when there is one, else the CPU; a CUDA device without
    an index is this process's GPU too (cuda:LOCAL_RANK under torchrun), since torch.cuda.set_device needs one.
    local_processes: torchrun's processes on this machine (LOCAL_WORLD_SIZE), each of which needs a GPU of its own."""
    try:
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    except RuntimeError:
        raise UserError(f"--device {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
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


def nearest_existing(path: str) -> str:
    """path itself, absolute, or the nearest of its parent directories that exists."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def file_in_the_way(path: str) -> Optional[str]:
    """The existing file (not a directory) at path or at one of its parent directories, if any: a directory
    cannot be created there."""
    existing = nearest_existing(path)
    return None if os.path.isdir(existing) else existing


def check_scores_output(path: str, rows_path: str) -> None:
    """--scores-output must name a file that can be written (its directory is created if missing), other than the
    rows it scores: checked before any training or scoring, which would otherwise fail only at the end."""
    if os.path.realpath(path) == os.path.realpath(rows_path):  # (skipped rows would lose their content)
        raise UserError(f"--scores-output {path} is the --score-data-path file: the scores would replace the rows "
                        "they score; give another path")
    if os.path.isdir(path):
        raise UserError(f"--scores-output {path} is a directory; give a file path, e.g. "
                        f"{os.path.join(path, 'scores.jsonl')}")
    existing = nearest_existing(os.path.dirname(os.path.abspath(path)))  # its directory or the one to create it in
    if not os.path.isdir(existing):
        raise UserError(f"--scores-output {path}: its directory cannot be created, {existing} is a file; give "
                        "another path")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as error:
        raise UserError(f"--scores-output {path}: {existing} cannot be written to ({error.strerror or error}); give "
                        "another path") from None


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

    # (inf and nan parse as numbers: --learning-rate inf made every weight NaN; the tensors are float32 at most)
    for name, value in vars(args).items():
        for number in value if isinstance(value, tuple) else [value]:
            check(not isinstance(number, float) or (math.isfinite(number)
                                                     and abs(number) <= torch.finfo(torch.float32).max),
                  f"--{name.replace('_', '-')} must be a finite number within float32's range (3.4e38), got {number}")
            check(not isinstance(number, int) or abs(number) < 2**63,  # (torch's integers are int64)
                  f"--{name.replace('_', '-')} must be within int64's range (2**63), got {number}")
    check(args.lora_r >= 0, f"--lora-r must be >= 0 (0 = full fine-tuning), got {args.lora_r}")
    lora_flags = flags_set(args, "lora_alpha", "lora_dropout", "lora_target_modules")
    check(args.lora_r > 0 or not lora_flags, f"{' and '.join(lora_flags)}: LoRA settings, but --lora-r 0 (full "
          "fine-tuning) makes no adapters: pass --lora-r, or drop them")
    check(args.lora_target_modules == "all-linear" or args.lora_target_modules.strip(", "),
          f"--lora-target-modules {args.lora_target_modules!r} names no module: give names such as q_proj,v_proj, or "
          "all-linear")
    check(args.lora_r == 0 or args.lora_alpha > 0, f"--lora-alpha must be > 0 (the adapter's scale is alpha / r: at "
          f"0 nothing trains), got {args.lora_alpha}")
    check(0 <= args.seed < 2**32, f"--seed must be in [0, 2**32), got {args.seed}")
    check(args.peak_tflops >= 0, f"--peak-tflops must be >= 0 (0 = look up a GPU's bf16 peak), got {args.peak_tflops}")
    check(0.0 <= args.lora_dropout < 1.0, f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    check(bool(args.step_separator), "--step-separator must not be empty: each step's label sits on its "
          "separator's last token")
    # (the typing mistake only: escapes and spaces; "\\newline" or "\\text{Step}" may be a separator)
    check(not re.fullmatch(r"(?:\\[nt]|\s)*\\[nt](?:\\[nt]|\s)*", args.step_separator),
          f"--step-separator {args.step_separator!r} holds a backslash and a letter, not a line break: a shell passes "
          "\"\\n\" as those two characters; in bash write $'\\n\\n' for a blank line")
    check(args.max_length >= 1, f"--max-length must be at least 1, got {args.max_length}")
    check(args.epochs is None or args.epochs > 0, f"--epochs must be > 0, got {args.epochs}")
    check(args.total_steps >= 1, f"--total-steps must be at least 1, got {args.total_steps}")
    check(args.batch_size >= 1, f"--batch-size must be at least 1, got {args.batch_size}")
    check(args.batch_size % world_size == 0, f"--batch-size {args.batch_size} must be divisible by the number of "
          f"processes ({world_size})")
    check(args.micro_batch_size >= 0, "--micro-batch-size must be >= 0 (0 = the whole local batch at once)")
    local_batch = args.batch_size // world_size
    check(args.micro_batch_size <= local_batch, f"--micro-batch-size {args.micro_batch_size} is larger than the "
          f"batch of {local_batch} rows per process (--batch-size / processes)")
    check(args.learning_rate >= 0 and args.weight_decay >= 0 and args.max_grad_norm >= 0,
          "--learning-rate, --weight-decay and --max-grad-norm must be >= 0")
    check(all(0.0 <= beta < 1.0 for beta in args.adam_betas), f"--adam-betas must be in [0, 1), got {args.adam_betas}")
    check(args.warmup_steps >= 0 and args.eval_every >= 0 and args.save_every >= 0,
          "--warmup-steps, --eval-every and --save-every must be >= 0")
    check(args.num_eval_rows >= 0 and args.num_val_rows >= 0, "--num-eval-rows and --num-val-rows must be >= 0")
    builtin_held_out = args.num_val_rows + (0 if args.eval_data_path else args.num_eval_rows)
    check(args.data_path is not None or builtin_held_out <= BUILTIN_HELD_OUT,
          f"the built-in data holds out {BUILTIN_HELD_OUT} rows: --num-val-rows + --num-eval-rows (without "
          f"--eval-data-path) must be at most that, got {builtin_held_out}")
    check(args.eval_batch_size >= 1, f"--eval-batch-size must be at least 1, got {args.eval_batch_size}")
    check(args.max_bad_steps >= 1, f"--max-bad-steps must be at least 1, got {args.max_bad_steps}")
    check(args.keep_checkpoints >= 1, f"--keep-checkpoints must be at least 1 (the newest is what resuming "
          f"needs), got {args.keep_checkpoints}")
    check(args.resume_from != "latest" or args.output_dir is not None,
          "--resume-from latest looks in --output-dir: give the run's --output-dir")
    check(not args.fsdp or device.type in FSDP_DEVICE_TYPES, "--fsdp needs CUDA: it shards the model over GPUs "
          "(FSDP2 over NCCL); on CPU drop the flag (torchrun without it keeps a whole copy on every process)")
    check(not args.fsdp or "WORLD_SIZE" in os.environ, "--fsdp shards the model over processes: launch with "
          "torchrun --nproc_per_node N (N = 1 runs the same code unsharded), or drop the flag")
    check(args.dtype != "bfloat16" or device.type != "cuda" or torch.cuda.is_bf16_supported(),
          "--dtype bfloat16: this GPU does not support bf16; use --dtype float32")
    check(args.scores_output is None or args.score_data_path is not None, "--scores-output is where the scores of "
          "--score-data-path's rows go: give --score-data-path rows.jsonl too, or drop --scores-output")
    if args.scores_output is not None:
        check_scores_output(args.scores_output, args.score_data_path)


# ---------------------------------------------------------------------------------------------------------------
# Training


def sum_gradients(master: list, distributed: bool) -> None:
    """Gives every master weight a .grad (zeros where none arrived), summed over processes in one flat all-reduce.
    A function of its own so that no list of the gradients outlives it: one left in the training loop held the
    step's gradients through the next step's forward and backward, two sets of them at the peak (on the
    benchmark's small model: peak RSS 990 MiB, 859 with this)."""
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


def step_flops(body_weights: int, tokens: int, full_finetune: bool) -> float:
    """Model FLOPs of one training step, matmuls only (attention scores left out): 2 per weight per token forward;
    backward 2 for the input gradients, and 2 more for the weight gradients of trained weights (not LoRA's frozen
    ones). body_weights: the backbone's weights less its input embedding (a lookup); the head's are negligible."""
    return (6 if full_finetune else 4) * body_weights * tokens


def evaluate(scores: list[list[float]], labels: list[list[float]], threshold: float) -> dict:
    """Step accuracy at 0.5, step AUROC and first-error F1 at the given threshold, over held-out solutions: each
    one's scores of its kept steps and labels of all its steps (see first_error_f1). All NaN when a score is not
    finite (a diverged model), which the metrics would otherwise rank or threshold as if it were a number."""
    flat_scores = [s for row in scores for s in row]
    flat_labels = [y for row_scores, row in zip(scores, labels, strict=True) for y in row[:len(row_scores)]]
    if not np.isfinite(flat_scores).all():
        return {"eval_step_accuracy": float("nan"), "eval_auroc": float("nan"), "eval_first_error_f1": float("nan"),
                "eval_first_error_threshold": threshold}
    return {"eval_step_accuracy": step_accuracy(flat_scores, flat_labels),
            "eval_auroc": auroc(flat_scores, flat_labels),
            "eval_first_error_f1": first_error_f1(scores, labels, threshold)[0],
            "eval_first_error_threshold": threshold}


def evaluate_prm(prm, val_examples: list[dict], eval_examples: list[dict], batch_size: int) -> dict:
    """The first-error threshold is chosen on validation rows, then every metric is taken on the eval rows."""
    threshold = 0.5
    if val_examples and eval_examples:
        threshold = choose_threshold(predict(prm, val_examples, batch_size), [e["all_labels"] for e in val_examples])
    return evaluate(predict(prm, eval_examples, batch_size), [e["all_labels"] for e in eval_examples], threshold)


def strict_json(value):
    """value with every float that is not finite replaced by None, which JSON writes as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [strict_json(item) for item in value]
    return value


def write_scores(path: str, rows: list[dict], scores: list[list[float]], skipped_places: list = (),
                 unscorable: Optional[dict] = None) -> dict:
    """The input rows, unchanged, with a "scores" list added to each (one per kept step), written atomically, and
    what was written, also printed. A row skipped as invalid (--skip-bad-rows) keeps its line, as
    {"skipped": "line N: what is wrong", "scores": null}, and one that could not be scored (unscorable: its index
    -> why) as itself with those two fields: output line k is input line k's (blank lines aside), so the two files
    can be read side by side. A score that is not finite (a diverged model) is written as null, since JSON has no
    NaN, and so is a NaN or Infinity the input row held (Python's json reads them; jq, pandas and JavaScript do not)."""
    unscorable = unscorable or {}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pending = list(skipped_places)  # (place among the valid rows, message), in file order
    not_finite = 0
    with open(path + ".tmp", "w") as f:
        for place in range(len(rows) + 1):
            while pending and pending[0][0] == place:
                f.write(json.dumps({"skipped": pending.pop(0)[1], "scores": None}) + "\n")
            if place in unscorable:
                f.write(json.dumps(strict_json({**rows[place], "skipped": unscorable[place], "scores": None})) + "\n")
            elif place < len(rows):
                row_scores = [score if math.isfinite(score) else None for score in scores[place]]
                not_finite += row_scores.count(None)
                # (the row's own fields as given)
                f.write(json.dumps(strict_json({**rows[place], "scores": row_scores})) + "\n")
    os.replace(path + ".tmp", path)
    scored = [place for place in range(len(rows)) if place not in unscorable]
    written = {"rows": len(scored), "skipped_rows": len(skipped_places) + len(unscorable),
               "scored_steps": sum(len(scores[place]) for place in scored),
               "dropped_steps": sum(len(rows[place]["completions"]) - len(scores[place]) for place in scored)}
    print0(f"scored {written['scored_steps']} steps of {len(scored)} rows into {path} ({written['dropped_steps']} "
           f"steps truncated away, {written['skipped_rows']} rows skipped)")
    if not_finite:
        print0(f"warning: {not_finite} scores are not finite (written as null): the model's outputs diverged",
               file=sys.stderr)
    return written


# what scoring with --prm-path reads (--step-separator and --max-length only to check them against the PRM's own)
SCORING_FLAGS = ("prm_path", "score_data_path", "scores_output", "skip_bad_rows", "eval_batch_size", "dtype", "device",
                 "trust_remote_code", "step_separator", "max_length")


def score_file(args: Args) -> dict:
    """--prm-path mode: score every row of --score-data-path with a saved PRM and write --scores-output."""
    if args.score_data_path is None or args.scores_output is None:
        raise UserError("--prm-path scores a file: give --score-data-path rows.jsonl and --scores-output out.jsonl")
    check_scores_output(args.scores_output, args.score_data_path)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # every process would score every row into the same file
        raise UserError("--prm-path scores in one process: run it with python prm.py, not torchrun")
    unused = flags_set(args, *(field.name for field in fields(Args) if field.name not in SCORING_FLAGS))
    if unused:  # (training flags: the saved PRM fixes its model, LoRA and loss; nothing is trained or logged)
        raise UserError(f"{', '.join(unused)}: training flags, which scoring with --prm-path does not use; drop them")
    if args.eval_batch_size < 1:
        raise UserError(f"--eval-batch-size must be at least 1, got {args.eval_batch_size}")
    device = resolve_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    start = time.perf_counter()
    skipped_places = []
    places, unscorable = [], {} if args.skip_bad_rows else None
    rows, _ = load_jsonl_rows(args.score_data_path, need_labels=False, skip_bad_rows=args.skip_bad_rows,
                              skipped_places=skipped_places, places=places)
    prm = load_prm(args.prm_path, device, dtype, args.trust_remote_code)
    for name in ("step_separator", "max_length"):  # given and not the PRM's own: it would be ignored unsaid
        given, own = getattr(args, name), prm.config[name]
        if flags_set(args, name) and given != own:
            raise UserError(f"--{name.replace('_', '-')} {given!r}: {args.prm_path} was trained with {own!r}, "
                            "which scoring uses; drop the flag")
    try:
        examples = scoring_examples(prm.tokenizer, [r["prompt"] for r in rows], [r["completions"] for r in rows],
                                    prm.config["step_separator"], prm.config["max_length"], places, unscorable)
    except ValueError as problem:  # a step that tokenises to nothing
        raise UserError(f"{problem} (--skip-bad-rows skips such rows)") from None
    scores = score_examples(prm, examples, args.eval_batch_size)
    summary = write_scores(args.scores_output, rows, scores, skipped_places, unscorable)
    return {**summary, "time_s": time.perf_counter() - start}


def train(args: Args) -> dict:
    # ---- set-up: processes, device, dtype, output directory; every check comes before anything is written
    # transformers' progress bars for writing and loading weights would break into the log's lines, and peft calls
    # a property transformers has deprecated (a warning at every LoRA run that the user can do nothing about)
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    warnings.filterwarnings("ignore", message=re.escape("`is_gradient_checkpointing` is deprecated"),
                            category=FutureWarning)
    # launched by torchrun with several processes, or with one under --fsdp (which needs a process group)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 or (args.fsdp and "WORLD_SIZE" in os.environ)
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(args.device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if distributed else 1)
    validate_args(args, args.world_size, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if distributed and not dist.is_initialized():
        # the other ranks wait in a collective while rank 0 evaluates or saves alone: PyTorch's default timeout
        # (10 minutes with NCCL) would end a run whose evaluation or checkpoint takes longer
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=2))
    is_main = rank == 0
    evaluates = is_main or args.fsdp  # under FSDP every forward is a collective: all ranks evaluate (the same rows)
    args.local_batch = args.batch_size // args.world_size
    micro_batch = args.micro_batch_size or args.local_batch
    dtype = auto_dtype(device) if args.dtype == "auto" else getattr(torch, args.dtype)
    timestamp = int(time.time())
    if distributed:  # every rank uses rank 0's clock, so the run name is the same everywhere
        stamp = torch.tensor([timestamp], dtype=torch.long, device=device)
        dist.broadcast(stamp, src=0)
        timestamp = int(stamp.item())
    args.run_name = args.run_name or f"{args.exp_name}__{args.seed}__{timestamp}"
    # an explicit checkpoint path continues its own run directory unless told otherwise
    resume_dir = (os.path.dirname(os.path.abspath(args.resume_from.rstrip("/")))
                  if args.resume_from not in (None, "latest") else None)
    output_dir = args.output_dir or resume_dir or os.path.join("runs", args.run_name)
    blocker = file_in_the_way(output_dir)
    if blocker == os.path.abspath(output_dir):
        raise UserError(f"--output-dir {output_dir} exists and is not a directory")
    if blocker:
        raise UserError(f"--output-dir {output_dir} cannot be created: {blocker} is a file; choose another "
                        "--output-dir")
    resume_path = resolve_resume(args, output_dir)
    resuming_here = resume_path is not None and os.path.realpath(os.path.dirname(
        os.path.abspath(resume_path.rstrip("/")))) == os.path.realpath(output_dir)
    if args.score_data_path and args.scores_output is None:  # the default scores file, checked as a given one is
        check_scores_output(os.path.join(output_dir, "scores.jsonl"), args.score_data_path)
    if holds_run(output_dir) and not resuming_here and not args.overwrite:
        if not checkpoint_steps(output_dir) and final_step(output_dir) is None:  # (nothing --resume-from can read)
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
    seed_everything(args.seed)  # the same on every rank: identical initial weights and head

    # ---- data rows, checked before any model is loaded (a bad line fails fast)
    skipped_rows = 0
    train_places = val_places = eval_places = score_places = None  # each file row's "path:line", for errors
    if args.data_path is None:
        train_rows, val_rows, eval_rows = builtin_task(args.seed, args.num_val_rows,
                                                       0 if args.eval_data_path else args.num_eval_rows)
    else:
        lines = []
        rows, skipped_rows = load_jsonl_rows(args.data_path, skip_bad_rows=args.skip_bad_rows, places=lines)
        order = list(range(len(rows)))
        random.Random(args.seed).shuffle(order)  # (the permutation that shuffling the rows themselves makes)
        rows, lines = [rows[i] for i in order], [lines[i] for i in order]
        # never more than a tenth of the training data, and none without eval rows: they only choose the
        # threshold that the eval's first-error F1 is taken at
        num_val = min(args.num_val_rows, len(rows) // 10) if args.eval_data_path else 0
        val_rows, train_rows = rows[:num_val], rows[num_val:]
        val_places, train_places = lines[:num_val], lines[num_val:]
        eval_rows = []
    if args.eval_data_path:  # replaces the built-in eval rows too (the built-in training rows stay as they are)
        eval_places = []
        eval_rows, skipped = load_jsonl_rows(args.eval_data_path, skip_bad_rows=args.skip_bad_rows, places=eval_places)
        eval_rows, skipped_rows = eval_rows[:args.num_eval_rows], skipped_rows + skipped
    score_rows, skipped_score_places = [], []
    if args.score_data_path:  # scored at the end, with the final model
        score_places = []
        score_rows, _ = load_jsonl_rows(args.score_data_path, need_labels=False, skip_bad_rows=args.skip_bad_rows,
                                        skipped_places=skipped_score_places, places=score_places)

    # ---- model: backbone (+ LoRA) and reward head; a resumed run loads the checkpoint's weights over them
    # FSDP keeps the (sharded) weights in fp32 and computes in `dtype`: it needs no master copies
    prm, base_copy = build_prm(args, torch.float32 if args.fsdp else dtype)
    prm.config["dtype"] = str(dtype).removeprefix("torch.")  # what load_prm scores in by default (FSDP: computes in)
    note = oversized_lora_note(prm.backbone, args.lora_r) if args.lora_r > 0 and not resume_path else None
    if note:
        print0(note, enabled=is_main)
    config = prm.backbone.config
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if context and args.max_length > context:
        # a learned table of positions (GPT-2's) has no row beyond it; rotary positions run on, untrained
        learned = any(isinstance(module, torch.nn.Embedding) and context <= module.num_embeddings <= context + 2
                      and module is not prm.backbone.get_input_embeddings()  # (OPT's table has 2 rows more)
                      for module in prm.backbone.modules())
        message = f"--max-length {args.max_length} exceeds the model's {context} positions"
        if learned:
            raise UserError(f"{message}: pass --max-length {context} or less")
        print0(f"warning: {message}, beyond which it was not trained", file=sys.stderr, enabled=is_main)
    if resume_path:
        load_checkpoint_weights(prm, resume_path, args.model)
    if args.fsdp:  # each process keeps 1/N of the weights (one copy in all: nothing to broadcast)
        shard_prm(prm, device, dtype)
        prm.train()
    else:
        prm.to(device).train()
    if distributed and not args.fsdp:  # the seed already makes the weights equal everywhere; a broadcast makes sure
        for tensor in prm.state_dict().values():
            dist.broadcast(tensor, src=0)
    if distributed:  # the weights are set: from here each process draws its own dropout masks (the same stream on
        torch.manual_seed(args.seed + rank)  # every process would mask the same positions of different rows)
    if args.gradient_checkpointing:
        prm.backbone.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    tokenizer = prm.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # pads are never attended to

    # ---- tokenisation, once; steps that do not fit are dropped and counted
    dropped_steps = dropped_rows = 0
    encoded = []
    unencodable = [] if args.skip_bad_rows else None  # rows with a step that is no token, when they are skipped
    for rows, places, what in ((train_rows, train_places, "training"), (val_rows, val_places, "validation"),
                               (eval_rows, eval_places, "eval")):
        examples, steps_lost, rows_lost = encode_rows(tokenizer, rows, args.step_separator, args.max_length, what,
                                                      keep_empty=what != "training", places=places,
                                                      skipped=unencodable)
        encoded.append(examples)
        dropped_steps, dropped_rows = dropped_steps + steps_lost, dropped_rows + rows_lost
    train_examples, val_examples, eval_examples = encoded
    skipped_rows += len(unencodable or [])
    unscorable = {} if args.skip_bad_rows else None
    try:  # the rows to score at the end: a step that is no token at all stops the run now, not after training
        examples_to_score = scoring_examples(tokenizer, [r["prompt"] for r in score_rows],
                                             [r["completions"] for r in score_rows], args.step_separator,
                                             args.max_length, score_places, unscorable)
    except ValueError as problem:
        raise UserError(f"{problem} (--skip-bad-rows skips such rows)") from None
    # (the weight's rows: peft's LoRA on the embeddings has no num_embeddings)
    rows_of_embeddings = prm.backbone.get_input_embeddings().weight.shape[0]
    for examples, what in ((train_examples, "training"), (val_examples, "validation"), (eval_examples, "eval"),
                           (examples_to_score, "scoring")):
        largest = max((max(example["input_ids"]) for example in examples if example["input_ids"]), default=-1)
        if largest >= rows_of_embeddings:  # (tokens added to the tokenizer without resizing the model)
            raise UserError(f"the {what} rows hold token id {largest}, past {args.model}'s {rows_of_embeddings} "
                            "embeddings: save the model after model.resize_token_embeddings(len(tokenizer))")
    if dropped_steps:
        print0(f"note: --max-length {args.max_length} dropped {dropped_steps} steps that did not fit whole, and "
               f"{dropped_rows} rows left with no step (held-out ones still count, unscored)", enabled=is_main)
    inner = sum(args.step_separator in step for row in train_rows for step in row["completions"])
    if inner:  # labelled at their ends only: a solution split at every separator has more steps than they had
        print0(f"note: {inner} training steps contain the separator {args.step_separator!r}: each is one step here, "
               "scored at its end, but split_steps (and grpo.py's PRM reward) cut generated text at every separator",
               enabled=is_main)
    blank = sum(not step.strip() for row in train_rows for step in row["completions"])
    if blank:  # trained on, but never met in generated text: split_steps leaves blank pieces out
        print0(f"note: {blank} training steps are blank: trained as steps here, but split_steps (and grpo.py's PRM "
               "reward) leave blank pieces of generated text out", enabled=is_main)
    blank_prompts = sum(not row["prompt"].strip() for row in train_rows)
    if blank_prompts:
        print0(f"note: {blank_prompts} training rows have a blank prompt: their steps are judged without the "
               "question they answer", enabled=is_main)
    correct_labels = [label >= 0.5 for row in train_rows for label in row["labels"]]
    if len(set(correct_labels)) == 1:  # (a "+"/"-" mapped the wrong way, or only a data set's chosen steps kept)
        print0(f"warning: every training label is {'correct (>= 0.5)' if correct_labels[0] else 'wrong (< 0.5)'}: "
               "the PRM can only learn to give every step that one score", file=sys.stderr, enabled=is_main)
    # characters the tokenizer has no token for: the model sees one token for all of them (not counted where the
    # unknown token is also BOS or EOS, as GPT-2's <|endoftext|> is, which starts every row)
    all_examples = train_examples + val_examples + eval_examples
    unknown_id = tokenizer.unk_token_id
    if unknown_id in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        unknown_id = None
    unknown = 0 if unknown_id is None else sum(example["input_ids"].count(unknown_id) for example in all_examples)
    if unknown:
        print0(f"warning: {unknown} of the rows' {sum(len(e['input_ids']) for e in all_examples)} tokens are the "
               f"tokenizer's unknown token {tokenizer.unk_token!r}"
               + (f": --model tiny knows only the characters {''.join(TINY_CHARS)!r}; pass --model, a hub model or a "
                  "local one, for text" if args.model == "tiny" else ""), file=sys.stderr, enabled=is_main)
    if not train_examples:
        raise UserError(f"every training row was truncated away (--max-length {args.max_length}): raise "
                        "--max-length or shorten the prompts")
    if args.epochs is not None:
        args.total_steps = max(1, math.ceil(args.epochs * len(train_examples) / args.batch_size))
        passes = args.total_steps * args.batch_size / len(train_examples)
        if passes > 1.5 * args.epochs:  # a step is a whole batch: fewer rows than one batch are repeated to fill it
            print0(f"note: --epochs {args.epochs} of {len(train_examples)} training rows in steps of --batch-size "
                   f"{args.batch_size} is {passes:.1f} passes over the rows; lower --batch-size for fewer",
                   enabled=is_main)
    elif args.batch_size > len(train_examples):
        print0(f"note: --batch-size {args.batch_size} is more than the {len(train_examples)} training rows: each step "
               "repeats rows to fill its batch", enabled=is_main)
    if args.warmup_steps > args.total_steps:
        print0(f"note: --warmup-steps {args.warmup_steps} is more than the run's {args.total_steps} steps: the "
               f"learning rate never reaches --learning-rate (at most {args.total_steps / args.warmup_steps:.2g} of "
               "it); lower --warmup-steps", enabled=is_main)

    @functools.lru_cache(maxsize=2)
    def epoch_order(epoch: int) -> np.ndarray:
        return np.random.default_rng([args.seed, epoch]).permutation(len(train_examples))

    def rows_for_step(step: int) -> list[dict]:
        """This rank's rows of a step: a fresh seeded permutation per epoch, so any step can be rebuilt from its
        number alone (which is all that resuming needs)."""
        positions = range(step * args.batch_size, (step + 1) * args.batch_size)
        chosen = [train_examples[epoch_order(p // len(train_examples))[p % len(train_examples)]] for p in positions]
        return chosen[rank::args.world_size]

    # ---- optimiser
    trainable = [p for p in prm.parameters() if p.requires_grad]
    # bf16 weights round away updates smaller than ~1/256 of the weight; the optimiser steps fp32 master
    # copies and writes them back (LoRA adapters and the head are already fp32)
    master = [p.detach().float().clone() if p.dtype != torch.float32 else p for p in trainable]
    mastered = [(p, m) for p, m in zip(trainable, master) if m is not p]  # (bf16 weight, its fp32 copy)
    # fused: one kernel per group (4-5x faster than the per-tensor loop torch picks on CPU)
    optimizer = torch.optim.AdamW(decay_groups(master, args.weight_decay), lr=args.learning_rate, betas=args.adam_betas,
                                  eps=1e-8, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args, args.total_steps))
    fingerprint = data_fingerprint(train_rows, val_rows)
    eval_fingerprint = data_fingerprint(eval_rows)  # the saved eval figures are reused only on the same rows

    # ---- resume: optimiser, scheduler, counters, RNG; the data position is the step number
    start_step = 0
    bad_steps_in_a_row = skipped_updates = 0
    saved_eval = None
    resumed_wandb_id = resumed_wandb_group = None  # with --track, a resume logs into the checkpoint's wandb run
    if resume_path:
        state = load_trainer_state(resume_path)
        resumed_wandb_id, resumed_wandb_group = state.get("wandb_id"), state.get("wandb_group")
        if state.get("data_fingerprint") != fingerprint:
            cause = ("same --data-path and --num-val-rows, and an --eval-data-path (which validation rows are held "
                     "out for) or none, but the file changed? or the checkpoint of an older prm.py, which held out "
                     "validation rows without an --eval-data-path too" if args.data_path else
                     "the built-in rows changed: a checkpoint of another version of prm.py?")
            raise UserError(f"--resume-from {resume_path}: the training rows differ from the checkpoint's ({cause}); "
                            "resume on the same data")
        saved_dtype, compute_dtype = state.get("dtype"), str(dtype).removeprefix("torch.")
        if saved_dtype is not None and saved_dtype != compute_dtype:  # (older checkpoints do not record it)
            raise UserError(f"--resume-from {resume_path}: the checkpoint's run computed in {saved_dtype}, this one "
                            f"would in {compute_dtype} (--dtype {args.dtype}); resume with --dtype {saved_dtype}")
        try:
            if args.fsdp and state["optimizer"] is not None:  # saved whole (keyed by name): each keeps its shard
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

                set_optimizer_state_dict(prm, optimizer, state["optimizer"],
                                         options=StateDictOptions(full_state_dict=True))
            elif not args.fsdp:
                optimizer.load_state_dict(regroup_optimizer_state(state["optimizer"], optimizer, master))
            scheduler.load_state_dict(state["scheduler"])
            for (_, m), saved in zip(mastered, state["master"], strict=True):  # the fp32 masters, not rounded weights
                m.data.copy_(saved)
            start_step, bad_steps_in_a_row, skipped_updates = state["step"], state["bad_steps"], state["skipped"]
            states = state["rng"]
            set_rng_state(states[rank] if rank < len(states) else states[0])
            if len(states) != args.world_size and distributed:  # another process count: each its own stream again
                torch.manual_seed(int(np.random.SeedSequence([args.seed, start_step, rank]).generate_state(1)[0]))
            if state.get("eval_rows", eval_fingerprint) == eval_fingerprint:  # (older checkpoints do not record it)
                saved_eval = state["eval_start"], state["eval_last"]
        except (KeyError, ValueError, RuntimeError) as error:  # another format, or another set of parameters
            raise UserError(f"--resume-from {resume_path}: its trainer_state.pt does not fit this run "
                            f"({type(error).__name__}: {str(error).strip().splitlines()[0]})") from None
        # nothing left to train: the final model and summary stay as they are (without final/ of that step, the run
        # was stopped by a signal in its last step, or is resumed from an earlier checkpoint: it writes its own)
        # (latest is the newest checkpoint, and a finished run's final/ may be newer: it holds no trainer state)
        finished = os.path.isfile(os.path.join(output_dir, "summary.json"))  # (killed in the final evaluation: not)
        final_at = final_step(output_dir)
        if finished and final_at is not None and final_at >= args.total_steps and (
                final_at == start_step or (args.resume_from == "latest" and final_at > start_step)):
            where = resume_path if final_at == start_step else os.path.join(output_dir, "final")
            print0(f"{where} is at step {final_at}: the run already reached --total-steps {args.total_steps}; "
                   "nothing to do (raise --total-steps or --epochs to train further)", enabled=is_main)
            if distributed:
                dist.destroy_process_group()
            return {"steps": start_step, "resumed_from_step": start_step}
        for p, m in mastered:
            p.data.copy_(m.data)
        # the flags win over the optimiser settings the checkpoint restored (args.json of the next checkpoint records
        # the flags); the current rate is recomputed as LambdaLR computes it, so an unchanged flag changes no bit
        restored = optimizer.param_groups[0]
        changed = [f"--{flag} {there!r} in the checkpoint, {here!r} now applies" for flag, there, here in (
            ("learning-rate", scheduler.base_lrs[0], args.learning_rate),
            ("weight-decay", restored["weight_decay"], args.weight_decay),
            ("adam-betas", tuple(restored["betas"]), tuple(args.adam_betas))) if there != here]
        if changed:
            print0("note: " + "; ".join(changed), enabled=is_main)
        scheduler.base_lrs = [args.learning_rate for _ in optimizer.param_groups]
        for group, schedule in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
            decay = args.weight_decay if group.get("decay", True) else 0.0  # (older checkpoints: one group, decayed)
            group.update(lr=args.learning_rate * schedule(scheduler.last_epoch), initial_lr=args.learning_rate,
                         betas=tuple(args.adam_betas), weight_decay=decay)
        print0(f"resumed from {resume_path} at step {start_step}", enabled=is_main)

    # after the optimiser and its resumed state have taken the parameters: under FSDP a forward outside training
    # leaves the root unit's weights gathered (not the sharded ones the optimiser holds) until the next forward
    if args.pack_rows and not use_packing(prm):
        print0(f"note: {args.model} does not keep examples packed into one row apart; padding each row instead",
               enabled=is_main)

    # ---- output directory and logging: nothing is written before this point
    if distributed:  # every process has checked --output-dir and read --model and the checkpoint (which may lie in
        dist.barrier()  # it) before rank 0 changes it: a late process would find a run there, or a model half deleted
    if is_main:
        if args.overwrite and not resuming_here:
            clear_run(output_dir)
        try:
            os.makedirs(output_dir, exist_ok=True)
            tempfile.TemporaryFile(dir=output_dir).close()  # writable: found now, not at the first log line
        except OSError as error:
            raise UserError(f"--output-dir {output_dir} cannot be created or written to ({error.strerror or error}); "
                            "choose another --output-dir") from None
        metrics_path = os.path.join(output_dir, "metrics.jsonl")
        if resume_path and os.path.isfile(metrics_path):  # drop rows logged after the checkpoint was written, and
            # the final evaluation's row at its step when this run does that evaluation again (a run killed between
            # that row and its summary)
            redoes_final_evaluation = start_step >= args.total_steps
            with open(metrics_path) as f:
                lines = [line for line in f if line.strip()]
            if lines and not lines[-1].endswith("\n"):  # torn by a crash mid-write (after the checkpoint): dropped
                lines.pop()
            logged = [(line, json.loads(line)) for line in lines]
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
    console = {"loss": "loss", "accuracy": "acc", "grad_norm": "gnorm", "eval_auroc": "eval_auroc",
               "eval_first_error_f1": "eval_fe_f1", "step_time_s": "dt"}
    logger = RunLogger(output_dir, asdict(args), console_keys=console, track=args.track,
                       wandb_project=args.wandb_project_name, wandb_entity=args.wandb_entity,
                       wandb_group=args.wandb_group or resumed_wandb_group, run_name=args.run_name, enabled=is_main,
                       append=resume_path is not None, wandb_id=resumed_wandb_id)
    n_params = sum(p.numel() for p in prm.parameters())
    n_trainable = sum(p.numel() for p in trainable)
    print0(f"model {args.model}: {n_params:,} parameters ({n_trainable:,} trained), {dtype}, {device}; "
           f"{args.world_size} process(es); {len(train_examples)} training rows, {len(val_examples)} validation, "
           f"{len(eval_examples)} eval; {args.total_steps} steps of {args.batch_size} rows", enabled=is_main)
    unevaluated = flags_set(args, "eval_every", "num_eval_rows", "num_val_rows")
    if args.data_path is not None and not args.eval_data_path and unevaluated:
        print0(f"note: {', '.join(unevaluated)} set the evaluation, but --data-path without --eval-data-path holds no "
               "rows out to evaluate on", enabled=is_main)

    if eval_examples:  # said now, so that a NaN metric is not taken for a diverged model
        scored_step_kinds = {label >= 0.5 for e in eval_examples for label in e["labels"]}
        solution_kinds = {first_below(e["all_labels"], 0.5) >= 0 for e in eval_examples}
        for metric, kinds, needs in (("auroc", scored_step_kinds, "correct and wrong steps"), (
                "first_error_f1", solution_kinds, "fully correct solutions and ones with an error")):
            if len(kinds) < 2:
                print0(f"note: eval {metric} will be nan: it needs both {needs}, and the eval rows hold only one kind",
                       enabled=is_main)
    # what a scorer blind to step content gets: the training rate of correct steps at each step index
    train_labels = [e["labels"] for e in train_examples]
    baseline = {"eval_step_accuracy": float("nan"), "eval_auroc": float("nan"), "eval_first_error_f1": float("nan")}
    if eval_examples:
        val_threshold = choose_threshold(position_baseline(train_labels, [len(e["labels"]) for e in val_examples]),
                                         [e["all_labels"] for e in val_examples]) if val_examples else 0.5
        baseline = evaluate(position_baseline(train_labels, [len(e["labels"]) for e in eval_examples]),
                            [e["all_labels"] for e in eval_examples], val_threshold)
    if saved_eval is not None:  # the step-0 figures come from the checkpoint: the summary reads as one run
        eval_start, eval_metrics = saved_eval
    else:  # (a resume evaluates here only on other held-out rows than its checkpoint's, or an older checkpoint's)
        eval_start = evaluate_prm(prm, val_examples, eval_examples, args.eval_batch_size) if evaluates else {}
        eval_metrics = eval_start
        print0(f"eval at step {start_step}: " + " | ".join(f"{k[5:]} {v:.3f}" for k, v in eval_start.items())
               + f" (position-only baseline: auroc {baseline['eval_auroc']:.3f}, "
               f"first_error_f1 {baseline['eval_first_error_f1']:.3f})", enabled=is_main and bool(eval_examples))
        if eval_examples and resume_path is None:  # a row of its own, so that the logged eval curves start at step 0
            logger.log(0, eval_start)
    step_times, step_tokens, memory_samples = [], [], []
    run_start = time.perf_counter()

    def sync_clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def checkpoint(step: int) -> str:
        """checkpoint-STEP on rank 0, keeping the newest --keep-checkpoints (every rank calls it: the RNG states
        are gathered)."""
        path = os.path.join(output_dir, f"checkpoint-{step}")
        rng_states = gather_rng_states(distributed, args.world_size)
        # (under FSDP, gathering the state of an optimiser that has not stepped yet would make it take a step)
        weights, optimizer_state = (full_state_dicts(prm, optimizer if optimizer.state else None) if args.fsdp
                                    else (None, optimizer.state_dict()))
        if is_main:
            save_prm(path, prm, base_copy, weights, args, {
                "optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "step": step,
                "master": [m.detach().cpu() for _, m in mastered],
                "bad_steps": bad_steps_in_a_row, "skipped": skipped_updates, "rng": rng_states,
                "wandb_id": logger.wandb_id, "wandb_group": logger.wandb_group,
                "eval_start": eval_start, "eval_last": eval_metrics, "data_fingerprint": fingerprint,
                "eval_rows": eval_fingerprint,
                "dtype": str(dtype).removeprefix("torch."),  # checked on resume: the masters exist only for bf16
                # informational: where the next batch starts (rebuilt from the step number on resume)
                "data_position": {"epoch": step * args.batch_size // len(train_examples),
                                  "row_in_epoch": step * args.batch_size % len(train_examples)}})
            for old_step in checkpoint_steps(output_dir)[:-args.keep_checkpoints]:
                remove_directory(os.path.join(output_dir, f"checkpoint-{old_step}"))
        return path

    # a signal only sets a flag: the current step finishes, then every process stops after the same step. A second
    # SIGINT goes to the handler there was before (a second Ctrl-C stops at once, without a checkpoint)
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
    interrupted = False
    try:
        for step in range(start_step, args.total_steps):
            step_start = sync_clock()
            # 1. this process's rows of the step; every micro-batch's loss is divided by the labelled-step count of
            # the whole batch (all processes), so the accumulated gradient is the batch mean however it is split
            batch = rows_for_step(step)
            count = torch.tensor([float(sum(len(e["positions"]) for e in batch))], device=device)
            if distributed:
                dist.all_reduce(count)
            total_labelled = count.item()

            # 2. forward and backward over micro-batches, gradients accumulating; the loss and the statistics are
            # summed on the device (no host sync per micro-batch): [loss, accuracy, score mean (both weighted by
            # labelled steps), labelled steps]
            sums = torch.zeros(4, dtype=torch.float64, device=device)
            tokens = 0
            for start in range(0, len(batch), micro_batch):
                inputs = collate(batch[start:start + micro_batch], pad_id, device, prm.pack_rows)
                step_logits = prm(inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"],
                                  inputs["positions"])  # [b, S]
                loss, stats = prm_loss(step_logits, inputs["labels"], inputs["mask"], args.loss_kind,
                                       num_labelled=total_labelled)
                loss.backward()
                if not args.fsdp:  # bf16 weights: each micro-batch's gradient is added in fp32, not in bf16
                    for p, m in mastered:
                        if p.grad is not None:
                            m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                            p.grad = None
                tokens += inputs["tokens"]
                sums += torch.stack([loss.detach(), stats["accuracy"] * stats["steps"],
                                     stats["score_mean"] * stats["steps"], stats["steps"]]).double()
            # sums over processes: each loss is already its share of the batch mean, so the sum is the batch loss;
            # the finiteness test below then reads the same global numbers on every rank
            sums = torch.cat([sums, torch.tensor([float(tokens)], dtype=torch.float64, device=device)])
            if distributed:
                dist.all_reduce(sums)
            loss_sum, accuracy_sum, score_sum, steps_seen, global_tokens = sums.tolist()

            # 3. update: gradients summed over processes in one flat all-reduce (FSDP: already summed by its
            # reduce-scatter), clipped, applied to the fp32 masters; a non-finite loss or gradient skips the update
            # (all ranks agree: both are global)
            if not args.fsdp:
                sum_gradients(master, distributed)
            grad_norm = torch.nn.utils.clip_grad_norm_(master, args.max_grad_norm if args.max_grad_norm > 0
                                                       else float("inf"))
            if hasattr(grad_norm, "full_tensor"):  # FSDP: a norm over shards, reduced over processes here
                grad_norm = grad_norm.full_tensor()
            if math.isfinite(loss_sum) and torch.isfinite(grad_norm):
                optimizer.step()
                bad_steps_in_a_row = 0
                for p, m in mastered:
                    p.data.copy_(m.data)
            else:  # a non-finite loss or gradient would poison the weights: skip this update
                skipped_updates += 1
                bad_steps_in_a_row += 1
                print0(f"warning: non-finite loss or gradient at step {step + 1}; update skipped "
                       f"({bad_steps_in_a_row} in a row, --max-bad-steps {args.max_bad_steps})", file=sys.stderr,
                       enabled=is_main)
            learning_rate = optimizer.param_groups[0]["lr"]  # the rate this step's update used (logged below)
            with warnings.catch_warnings():  # a skipped first update is meant: the schedule counts steps, not updates
                warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            prm.zero_grad(set_to_none=True)
            step_time = sync_clock() - step_start

            # 4. log (metrics over the whole batch, all processes), evaluate, save
            step_times.append(step_time)
            step_tokens.append(global_tokens)
            memory_samples.append(memory_mb(device))
            metrics = {"loss": loss_sum, "accuracy": accuracy_sum / max(steps_seen, 1.0),
                       "score_mean": score_sum / max(steps_seen, 1.0), "grad_norm": grad_norm.item(),
                       "learning_rate": learning_rate, "labelled_steps": total_labelled,
                       "skipped_updates": skipped_updates, "step_time_s": step_time,
                       "memory_mb": memory_samples[-1]}
            if (args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.total_steps and evaluates
                    and eval_examples):  # (without held-out rows every figure would be NaN)
                eval_metrics = evaluate_prm(prm, val_examples, eval_examples, args.eval_batch_size)
                metrics.update(eval_metrics)
            logger.log(step + 1, metrics)
            if bad_steps_in_a_row >= args.max_bad_steps:  # (after its row: metrics.jsonl shows the last one too)
                raise UserError(f"{bad_steps_in_a_row} updates in a row had a non-finite loss or gradient; "
                                "lower --learning-rate or check the labels")
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
        if evaluates and not interrupted:
            # the final model before the final evaluation and scoring, under the handlers above: a stop signal from
            # the last step on no longer loses the steps since the last checkpoint
            weights = full_state_dicts(prm)[0] if args.fsdp else None
            if is_main:
                save_prm(os.path.join(output_dir, "final"), prm, base_copy, weights, step=start_step + len(step_times))
        # agreed while the stop handlers are still installed: a rank that saves nothing would otherwise be
        # killed by a forwarded signal while rank 0 is still writing final/
        stopped = torch.tensor([float(len(stop_signal))], device=device)
        if distributed:
            dist.all_reduce(stopped, op=dist.ReduceOp.MAX)
    except BaseException:  # a stop for too many bad steps, or a crash: metrics.jsonl keeps what was logged
        logger.close()
        raise
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)

    # ---- final evaluation, scores, benchmark summary (an interrupted run: its checkpoint and a summary saying so);
    # skipped after a stop signal during the final save (a resume runs them)
    if not interrupted and stopped.item() > 0:  # (a final PRM holds no trainer state: a checkpoint beside it does)
        path = checkpoint(start_step + len(step_times))
        print0(f"stopped by a signal after saving the final model and {path}; for the final evaluation, scores and "
               f"summary: {rerun}", enabled=is_main)
        logger.close()
        if distributed:
            dist.destroy_process_group()
        return {"steps": start_step + len(step_times), "interrupted": True, "stop_signal": stopped_by(stop_signal)}
    if evaluates and not interrupted:
        eval_metrics = evaluate_prm(prm, val_examples, eval_examples, args.eval_batch_size)
        last_step = start_step + len(step_times)
        print0(f"eval at step {last_step}: " + " | ".join(f"{k[5:]} {v:.3f}" for k, v in eval_metrics.items()),
               enabled=is_main and bool(eval_examples))
        if eval_examples:  # a second row for the last step (its training row is logged before the final save)
            logger.log(last_step, eval_metrics)
        scores = score_examples(prm, examples_to_score, args.eval_batch_size) if score_rows else None
        if is_main and scores is not None:
            write_scores(args.scores_output or os.path.join(output_dir, "scores.jsonl"), score_rows, scores,
                         skipped_score_places, unscorable)
    timed = slice(1, None) if len(step_times) > 1 else slice(None)  # the first step pays for warm-up

    def per_second(amount: float, seconds: float) -> float:  # NaN (null) when no step ran: a resume that only
        return amount / seconds if seconds > 0 else float("nan")  # redoes the final evaluation
    summary = {
        "steps": start_step + len(step_times),
        "total_time_s": total_time,
        "step_time_s_mean": float(np.mean(step_times[timed])) if step_times else float("nan"),
        "tokens_per_s": per_second(sum(step_tokens[timed]), sum(step_times[timed])),
        # (ru_maxrss, the kernel's high-water mark, can lag the resident set that the samples read: measured 0.13 MiB
        # below an earlier sample)
        "peak_memory_mb": max([peak_memory_mb(device), *memory_samples]),
        "mean_memory_mb": float(np.mean(memory_samples)) if memory_samples else memory_mb(device),
        **{f"{key}_start": value for key, value in eval_start.items() if key != "eval_first_error_threshold"},
        **{f"{key}_end": value for key, value in eval_metrics.items()},
        **{f"baseline_position_{key[5:]}": value for key, value in baseline.items()},
        "train_rows": len(train_examples),
        "eval_rows": len(eval_examples),
        "dropped_steps": dropped_steps,
        "dropped_rows": dropped_rows,
        "skipped_rows": skipped_rows,
        "skipped_updates": skipped_updates,
        "interrupted": interrupted,
        **({"stop_signal": stopped_by(stop_signal)} if interrupted else {}),
        "resumed_from_step": start_step,
        "parameters": n_params,
        "trainable_parameters": n_trainable,
    }
    # model FLOP/s per process over the timed steps (tokens of all processes, shared out), against the device's
    # peak (MFU: on CUDA, or given --peak-tflops) and, on CPU, against the matmul throughput measured here (the
    # FLOP-floor fraction)
    body_weights = (sum(p.numel() for p in prm.backbone.parameters())
                    - prm.backbone.get_input_embeddings().weight.numel())
    achieved = per_second(step_flops(body_weights, sum(step_tokens[timed]), args.lora_r == 0) / args.world_size,
                          sum(step_times[timed]))
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
        args = tyro.cli(Args)
        summary = score_file(args) if args.prm_path else train(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    if summary.get("interrupted"):  # checkpointed, not finished: a retry loop or a scheduler must not take it for done
        sys.exit(128 + signal.Signals[summary["stop_signal"]])  # as the shell reports a process the signal ended


if __name__ == "__main__":
    main()
