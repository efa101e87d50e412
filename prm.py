"""Process reward model (PRM) training and scoring, in one file.

A PRM scores every step of a solution: the probability that it is still correct after that step (Lightman et al.
2023, https://arxiv.org/abs/2305.20050; Math-Shepherd, https://arxiv.org/abs/2312.08935). Here: a transformer backbone
plus a scalar head read at the last token of each step's separator, trained on JSONL rows {"prompt": str,
"completions": [step, ...], "labels": [bool or 0..1 per step]}.

Where it departs from the papers and from other trainers:
1. The head is one fp32 `Linear(hidden, 1)` on the backbone's last hidden state (`AutoModel`), not the LM head over
   "+"/"-" (Math-Shepherd) or a 2-class token classifier (TRL): no vocabulary logits are computed.
2. Loss `bce` (hard or soft labels) or `mse` on the raw head output (Qwen's soft-label ablation,
   https://arxiv.org/abs/2501.07301): a mean over the labelled steps of the whole batch, however it is split.
3. The prompt and each `step + separator` are tokenised apart, so no BPE merge crosses a step boundary; training,
   evaluation and scoring share `build_prm_example`. Truncation drops whole steps, never a partial one with its label.
4. Metrics: step accuracy at 0.5, step AUROC, and ProcessBench's first-error F1 (https://arxiv.org/abs/2412.06559)
   at a threshold chosen on validation rows that are never trained on.
5. Training packs a micro-batch's examples end to end, position ids restarting, which transformers' sdpa/eager causal
   mask keeps apart (Llama, Qwen, Mistral...); recurrent backbones need --no-pack-rows. The backbone must be causal.

Run it:
    python prm.py                     # tiny model, built-in task, CPU: about 30 s on 2 cores; flags: --help
    python prm.py --model Qwen/Qwen2.5-0.5B --data-path steps.jsonl --eval-data-path steps_eval.jsonl \\
        --lora-r 16 --learning-rate 1e-4 --step-separator $'\\n\\n' --output-dir runs/qwen-prm
    python prm.py --prm-path runs/qwen-prm/final --data-path rows.jsonl --scores-output scores.jsonl  # scoring
    torchrun --standalone --nproc_per_node 8 prm.py --fsdp --model Qwen/Qwen2.5-7B --data-path steps.jsonl  # or DDP
    python prm.py --output-dir runs/r --save-every 50 ...; python prm.py --output-dir runs/r ... --resume-from latest
    python -c 'import prm; p = prm.load_prm("runs/qwen-prm/final"); print(prm.score_steps(p, prompts, steps))'
"""

import copy
import functools
import json
import math
import os
import random
import resource
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, processors
from torch.distributed.checkpoint import state_dict as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoModel, AutoTokenizer, LlamaConfig, LlamaModel, PreTrainedTokenizerFast
from transformers.utils.logging import disable_progress_bar

from common import RunLogger, print0, seed_everything


@dataclass
class Args:
    # Experiment
    seed: int = 1  # seed of model init, built-in data and batch order
    output_dir: str | None = None  # metrics.jsonl, summary.json, checkpoint-STEP/, final/; None = runs/{run name}
    track: bool = False  # log to Weights & Biases (WANDB_MODE=offline works; WANDB_ENTITY picks the team)
    wandb_project_name: str = "prm"  # the Weights & Biases project of the run, with --track
    # Model and data
    model: str = "tiny"  # `tiny` (a 3-layer random-init Llama built here, no download), or a hub id or local path
    data_path: str | None = None  # JSONL rows {"prompt", "completions", "labels"}; None = the built-in task
    eval_data_path: str | None = None  # JSONL held-out rows; None = built-in ones (none with --data-path)
    num_eval_rows: int = 500  # at most this many held-out rows are evaluated
    num_val_rows: int = 200  # rows that only pick the first-error threshold (a tenth of --data-path at most)
    # appended to every step; the step's label sits on its last token
    step_separator: Annotated[str, tyro.conf.arg(help_behavior_hint=r"(default: '\n', a newline)")] = "\n"
    max_length: int = 1024  # most tokens per row: steps that do not fit whole are dropped (and counted)
    lora_r: int = 0  # LoRA rank on the backbone (the head is always trained in full); 0 = full fine-tuning
    lora_alpha: int = 32  # LoRA scaling numerator (the update is scaled by alpha / r)
    lora_dropout: float = 0.0  # dropout on the input of the LoRA adapters
    lora_target_modules: str = "all-linear"  # comma-separated module names (e.g. q_proj,v_proj), or all-linear
    # Loss and optimisation
    loss_kind: Literal["bce", "mse"] = "bce"  # bce: hard or soft labels; mse: squared error of the raw head output
    total_steps: int = 800  # optimiser steps
    batch_size: int = 32  # rows per optimiser step, over all processes
    micro_batch_size: int = 0  # rows per forward/backward pass (gradient accumulation); 0 = the local batch
    learning_rate: float = 1e-3  # AdamW (1e-5 is typical for full fine-tuning of real models, 1e-4 for LoRA)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    max_grad_norm: float = 1.0  # gradients are clipped to this global L2 norm before each step
    warmup_steps: int = 20  # linear learning-rate warm-up
    lr_schedule: Literal["constant", "cosine"] = "constant"  # after warm-up
    # Evaluation, saving, scoring, system
    eval_every: int = 100  # held-out metrics every this many steps (always at the start and the end)
    eval_batch_size: int = 64  # rows per forward pass in evaluation and scoring
    save_every: int = 0  # checkpoint-STEP/ every this many steps and at the end (0: only when stopped by a signal)
    keep_checkpoints: int = 2  # the newest checkpoints kept (0 = all)
    resume_from: str | None = None  # a checkpoint-STEP/ directory, or `latest` (the newest in --output-dir)
    overwrite: bool = False  # replace a run already in --output-dir
    prm_path: str | None = None  # score the rows of --data-path with this saved PRM instead of training
    scores_output: str = "scores.jsonl"  # with --prm-path: each row with its "scores" added (null past max_length)
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"  # compute dtype; auto = bf16 on CUDA (weights stay fp32)
    device: str = "auto"  # auto = cuda when available, else cpu; under torchrun GPU LOCAL_RANK
    gradient_checkpointing: bool = False  # recompute activations in the backward pass: less memory, more compute
    pack_rows: bool = True  # examples share rows end to end, less padding; --no-pack-rows for recurrent backbones
    fsdp: bool = False  # shard weights, gradients and optimiser state over the processes (FSDP2, under torchrun)


class UserError(Exception):
    """A mistake in the input or flags: main() prints one line and exits 2."""


# ---- Kernels and metrics: tensors or lists in, numbers out. Tests import these.


def prm_loss(step_logits, labels, mask, kind: str = "bce", *, num_labelled=None) -> tuple[torch.Tensor, dict]:
    """sum(loss * mask) / num_labelled in fp32, and the step accuracy (score >= 0.5 agreeing with label >= 0.5).

    step_logits, labels, mask: [B, S]; mask 1 on real steps, labels in [0, 1] (hard or soft). Loss per step: bce
    -(y log sigmoid(z) + (1 - y) log(1 - sigmoid(z))), or mse (z - y)^2 (the raw output z is then the score).
    num_labelled defaults to mask.sum(); given the whole batch's, the losses of its parts sum to the batch's.
    """
    mask = mask.bool()
    # padded slots are zeroed first: whatever they hold (even NaN) gets no loss and no gradient
    logits = step_logits.float().masked_fill(~mask, 0.0)
    labels = labels.float().masked_fill(~mask, 0.0)
    if kind == "bce":
        per_step = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
        scores = torch.sigmoid(logits)
    elif kind == "mse":
        per_step = (logits - labels) ** 2
        scores = logits
    else:
        raise ValueError(f"kind must be bce or mse, got {kind!r}")
    num_steps = mask.sum()
    denominator = num_steps if num_labelled is None else num_labelled  # the whole batch's count, for a part of it
    loss = per_step.masked_fill(~mask, 0.0).sum() / max(denominator, 1)
    agree = ((scores >= 0.5) == (labels >= 0.5)) & mask
    return loss, {"accuracy": agree.sum().detach() / num_steps.clamp(min=1), "steps": num_steps}


def step_accuracy(scores, labels, threshold: float = 0.5) -> float:
    """Fraction of steps where score >= threshold agrees with label >= 0.5; NaN when empty or a score is NaN."""
    scores = np.asarray(scores, dtype=float)
    labels = np.asarray(labels, dtype=float)
    if len(scores) == 0 or np.isnan(scores).any():
        return float("nan")
    return float(np.mean((scores >= threshold) == (labels >= 0.5)))


def auroc(scores, labels) -> float:
    """P(a correct step outscores a wrong one), ties half (Mann-Whitney U); NaN if a class is absent or a score NaN."""
    scores = np.asarray(scores, dtype=float)
    positive = np.asarray(labels, dtype=float) >= 0.5
    num_pos = int(positive.sum())
    num_neg = len(positive) - num_pos
    if num_pos == 0 or num_neg == 0 or np.isnan(scores).any():
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    ranks = np.empty(len(scores))
    ranks[order] = np.repeat(first + (counts + 1) / 2, counts)  # 1-based rank, averaged over each tie group
    return float((ranks[positive].sum() - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg))


def first_below(values, threshold):
    """Index of the first value below threshold; -1 if none."""
    for index, value in enumerate(values):
        if value < threshold:
            return index
    return -1


def first_error_f1(step_scores: list, step_labels: list, threshold: float) -> tuple[float, float, float]:
    """ProcessBench's (f1, acc_err, acc_corr) over solutions, each a list of step scores and one of step labels.

    A solution's first error is its first label < 0.5, predicted as its first score < threshold (-1: none).
    acc_err, acc_corr: the rates of exact predictions on erroneous and on correct solutions (NaN over none); f1
    their harmonic mean. A first error among steps truncated away (no score) is a miss.
    """
    num_erroneous = num_erroneous_hit = num_correct = num_correct_hit = 0  # solutions, and exact predictions on them
    for scores, labels in zip(step_scores, step_labels, strict=True):
        first_error = first_below(labels, 0.5)
        predicted = first_below(scores, threshold)
        if first_error >= 0:
            num_erroneous += 1
            num_erroneous_hit += predicted == first_error
        else:
            num_correct += 1
            num_correct_hit += predicted == -1
    acc_err = num_erroneous_hit / num_erroneous if num_erroneous else float("nan")
    acc_corr = num_correct_hit / num_correct if num_correct else float("nan")
    if acc_err + acc_corr == 0:
        return 0.0, acc_err, acc_corr
    return 2 * acc_err * acc_corr / (acc_err + acc_corr), acc_err, acc_corr  # (NaN when either rate is)


def choose_threshold(step_scores: list, step_labels: list) -> float:
    """The threshold of the best first-error F1 on these (validation) solutions, the lowest among ties, out of one
    between each two neighbouring distinct scores and one beyond each end; 0.5 where the best F1 is NaN or 0."""
    values = np.unique([score for scores in step_scores for score in scores])  # sorted, distinct
    if len(values) == 0 or not np.isfinite(values).all():
        return 0.5
    midpoints = (values[1:] + values[:-1]) / 2
    # two scores one float apart have no float strictly between them: the upper one then splits them
    between = np.where(midpoints > values[:-1], midpoints, values[1:])
    candidates = [values[0] - 1, *between, values[-1] + 1]
    f1 = np.nan_to_num([first_error_f1(step_scores, step_labels, threshold)[0] for threshold in candidates])
    best = int(np.argmax(f1))  # the first best: the lowest threshold
    if f1[best] <= 0:
        return 0.5
    return float(candidates[best])


def aggregate_scores(scores: list[float], how: str) -> float:
    """One number per solution: min (Math-Shepherd), prod (Lightman), last or mean; 0.0 with no scored step."""
    if len(scores) == 0:
        return 0.0
    if how == "last":
        return float(scores[-1])
    reduce = {"min": np.min, "prod": np.prod, "mean": np.mean}[how]
    return float(reduce(scores))


# ---- The built-in task and JSONL data.

# Chains of steps over 0..4, each restating the previous result and changing it; an injected error restates a wrong
# value. Checking a step is comparing its first digit with the previous step's last: a tiny model learns it in a minute.
#     prompt "start 3\n"  completions ["3+1=4", "4-2=2", "1+3=4", "4-1=3"]  labels [1, 1, 0, 0]
TINY_CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz+-*/=%()., \n")
TINY_SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
BUILTIN_HELD_OUT = 2000  # built-in rows never trained on: validation, then eval
ROW_FORMAT = 'rows are {"prompt": str, "completions": [str, ...], "labels": [bool or 0..1, ...]}'


def make_solution(rng: random.Random, min_steps=3, max_steps=6, p_error=0.8):
    """One built-in row: with probability p_error one step (uniform) restates a wrong value."""
    num_steps = rng.randint(min_steps, max_steps)
    value = rng.randint(0, 4)
    prompt = f"start {value}\n"
    error_at = num_steps  # no error
    if rng.random() < p_error:
        error_at = rng.randrange(num_steps)
    steps = []
    for k in range(num_steps):
        stated = value
        if k == error_at:
            stated = rng.choice([v for v in range(5) if v != value])
        change = rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if 0 <= stated + d <= 4])
        value = stated + change
        steps.append(f"{stated}{change:+d}={value}")
    return {"prompt": prompt, "completions": steps, "labels": [float(k < error_at) for k in range(num_steps)]}


def builtin_task(seed, num_val, num_eval, num_train=10000):
    """Distinct rows: train, validation, eval. The held-out pool is fixed whatever num_val and num_eval are."""
    rng = random.Random(seed)
    unique = {}
    while len(unique) < num_train + BUILTIN_HELD_OUT:
        row = make_solution(rng)
        unique.setdefault((row["prompt"], *row["completions"]), row)
    rows = list(unique.values())
    rng.shuffle(rows)
    held_out = rows[:BUILTIN_HELD_OUT]
    return rows[BUILTIN_HELD_OUT:], held_out[:num_val], held_out[num_val:][:num_eval]


def parse_row(line, need_labels):
    """One JSONL row, checked (a ValueError says what is wrong); without need_labels, returned as given."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error.msg})") from None
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
        raise ValueError(f'needs a field "prompt" (str); {ROW_FORMAT}')
    completions = row.get("completions")
    if not isinstance(completions, list) or not all(isinstance(step, str) for step in completions):
        raise ValueError(f'needs a field "completions" (list of str); {ROW_FORMAT}')
    if not need_labels:
        return row
    labels = row.get("labels")
    if not isinstance(labels, list):
        raise ValueError(f'needs a field "labels" (list); {ROW_FORMAT}')
    if len(labels) != len(completions):
        raise ValueError(f"{len(labels)} labels for {len(completions)} steps: one label per step")
    for label in labels:  # (NaN fails the comparison too)
        if not isinstance(label, (bool, int, float)) or not 0 <= label <= 1:
            raise ValueError(f"label {label!r}: labels must be bools or numbers in [0, 1]")
    return {**row, "labels": [float(label) for label in labels]}


def load_rows(path, need_labels=True):
    """The rows of a JSONL file, blank lines skipped; a bad row is a UserError naming its line."""
    if not os.path.isfile(path):
        raise UserError(f"data file {path} does not exist")
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise UserError(f"cannot read data file {path}: {error}") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(parse_row(line, need_labels))
        except ValueError as problem:
            raise UserError(f"{path}:{number}: {problem}") from None
    if not rows:
        raise UserError(f"{path} holds no rows")
    return rows


def load_splits(args):
    """Training, validation and eval rows; validation rows only pick the first-error threshold, never trained on."""
    if args.data_path is None:
        train_rows, val_rows, eval_rows = builtin_task(args.seed, args.num_val_rows, args.num_eval_rows)
    else:
        rows = load_rows(args.data_path)
        random.Random(args.seed).shuffle(rows)
        # validation rows only where there are eval rows to choose a threshold for
        num_val = min(args.num_val_rows, len(rows) // 10) if args.eval_data_path else 0
        train_rows, val_rows = rows[num_val:], rows[:num_val]
        eval_rows = []
    if args.eval_data_path:
        eval_rows = load_rows(args.eval_data_path)[: args.num_eval_rows]
    return train_rows, val_rows, eval_rows


# ---- Tokenisation: the one function that training, evaluation and scoring share.


def build_prm_example(tokenizer, prompt: str, steps: list[str], *, step_separator: str, max_length: int):
    """`[bos] prompt step1 sep step2 sep ...` -> (input_ids, label_positions), label_positions[k] the last token of
    `step k + sep`. The prompt and each `step + sep` are tokenised apart, so no BPE merge crosses a step boundary.
    Steps that do not fit whole in max_length are dropped, with all later ones."""
    pieces = tokenizer([prompt] + [step + step_separator for step in steps], add_special_tokens=False)["input_ids"]
    input_ids = []
    if tokenizer.bos_token_id is not None:
        input_ids.append(tokenizer.bos_token_id)
    input_ids += pieces[0]
    if len(input_ids) > max_length:
        return input_ids[:max_length], []
    label_positions = []
    for k, piece in enumerate(pieces[1:]):
        if not piece:  # its label would land on the previous step's token
            raise ValueError(f"step {k} ({steps[k]!r}) with the separator {step_separator!r} is no token at all")
        if len(input_ids) + len(piece) > max_length:
            break
        input_ids += piece
        label_positions.append(len(input_ids) - 1)
    return input_ids, label_positions


def encode_rows(tokenizer, rows, step_separator, max_length):
    """One example {input_ids, positions, labels (of the kept steps), all_labels} per row."""
    examples = []
    for row in rows:
        input_ids, positions = build_prm_example(
            tokenizer, row["prompt"], row["completions"], step_separator=step_separator, max_length=max_length
        )
        kept_labels = row["labels"][: len(positions)]
        examples.append(dict(input_ids=input_ids, positions=positions, labels=kept_labels, all_labels=row["labels"]))
    return examples


def pack_examples(examples):
    """The examples in rows of about twice the longest one (short rows keep attention cheap), longest first."""
    lengths = [len(example["input_ids"]) for example in examples]
    num_rows = math.ceil(sum(lengths) / (2 * max(lengths)))
    rows = [[] for _ in range(num_rows)]
    row_lengths = [0] * num_rows
    for example in sorted(examples, key=lambda example: -len(example["input_ids"])):  # each into the shortest row
        shortest = row_lengths.index(min(row_lengths))
        rows[shortest].append(example)
        row_lengths[shortest] += len(example["input_ids"])
    return rows


def join_examples(examples):
    """One row: the examples' tokens end to end, position ids restarting, label positions shifted to match."""
    row = {"input_ids": [], "position_ids": [], "positions": [], "labels": []}
    for example in examples:
        start = len(row["input_ids"])
        row["input_ids"] += example["input_ids"]
        row["position_ids"] += range(len(example["input_ids"]))
        row["positions"] += [start + position for position in example["positions"]]
        row["labels"] += example["labels"] or [0.0] * len(example["positions"])  # (scoring: no labels)
    return row


def collate(examples, pad_id, device, pack=False):
    """Examples as right-padded tensors: input_ids, position_ids [R, T]; label positions, labels [R, S]. One
    example per row, or (pack) several end to end, position ids restarting, which transformers' causal mask keeps
    apart. Pads: pad_id in input_ids, 0 in position ids and label positions, -1 in labels (no step there).
        input_ids     bos a a b |  bos c d |  pad    (two examples packed, labels on their separators |)
        position_ids  0   1 2 3 4  0   1 2 3  0      label positions [4, 8]
    """
    if pack:
        rows = [join_examples(group) for group in pack_examples(examples)]
    else:
        rows = [join_examples([example]) for example in examples]
    batch = {}
    for key, pad in {"input_ids": pad_id, "position_ids": 0, "positions": 0, "labels": -1.0}.items():
        tensors = [torch.tensor(row[key], dtype=torch.float32 if key == "labels" else torch.long) for row in rows]
        batch[key] = pad_sequence(tensors, batch_first=True, padding_value=pad).to(device)
    return batch


# ---- Model: backbone without LM head + fp32 scalar head; save, load, score.


def build_tiny_tokenizer():
    """A character-level tokenizer over the built-in task's alphabet (one token per character)."""
    vocab = {token: index for index, token in enumerate(TINY_SPECIALS + TINY_CHARS)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.add_special_tokens(TINY_SPECIALS)
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    specials = dict(pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=1024, **specials)


class ProcessRewardModel(torch.nn.Module):
    """Backbone + fp32 `Linear(hidden, 1)` at each step's label token; `.config`: what scoring needs."""

    def __init__(self, backbone, tokenizer, config):
        super().__init__()
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.config = config
        self.head = torch.nn.Linear(backbone.config.hidden_size, 1, dtype=torch.float32)

    def forward(self, input_ids, position_ids, positions):
        """input_ids, position_ids [B, T]; positions [B, S], the label tokens -> step logits [B, S]."""
        hidden = self.backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        rows = torch.arange(len(positions), device=positions.device)[:, None]  # [B, 1]
        with torch.autocast(hidden.device.type, enabled=False):  # the head in fp32, at the label tokens only
            return self.head(hidden[rows, positions].float()).squeeze(-1)


def build_prm(args, dtype, resume_path=None):
    """A PRM on the CPU (with a checkpoint's weights when resuming) computing in `dtype` under autocast, its weights
    fp32 but a hub model's frozen LoRA base (without FSDP); and with LoRA, a copy of the tiny base to save."""
    local = os.path.exists(os.path.expanduser(args.model))
    if not local and (args.model.startswith(("/", ".", "~")) or args.model.count("/") > 1):  # a path, not ORG/NAME
        raise UserError(f"--model {args.model} does not exist")
    if args.model == "tiny":  # a 3-layer, 64-wide Llama, random init from the seed
        tokenizer = build_tiny_tokenizer()
        sizes = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4)
        backbone = LlamaModel(LlamaConfig(vocab_size=len(tokenizer), pad_token_id=0, **sizes))
    else:
        weights_dtype = dtype if args.lora_r and not args.fsdp else torch.float32  # only a frozen base in `dtype`
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model)
            backbone = AutoModel.from_pretrained(args.model, dtype=weights_dtype)
        except (OSError, ValueError) as error:
            reason = f"{str(error).strip().splitlines()[0]} (HF_HUB_OFFLINE=1 skips the hub's retries)"
            raise UserError(f"could not load --model {args.model}: {reason}") from None
    # how prm_config.json names the base: a hub id, an absolute path, or "base" (saved beside the adapter)
    base_model = os.path.abspath(args.model) if os.path.isdir(args.model) else args.model
    base_copy = None
    if args.lora_r > 0:
        if args.model == "tiny":  # random weights, which no name reloads: saved beside the adapter
            base_copy = copy.deepcopy(backbone)
            base_model = "base"
        targets = args.lora_target_modules
        lora_config = LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            task_type="FEATURE_EXTRACTION",
            target_modules=targets if targets == "all-linear" else targets.split(","),
        )
        backbone = get_peft_model(backbone, lora_config)
    prm_config = {
        "base_model": base_model,
        "lora": args.lora_r > 0,
        "step_separator": args.step_separator,
        "max_length": args.max_length,
        "loss_kind": args.loss_kind,
        "dtype": str(dtype).removeprefix("torch."),
    }
    prm = ProcessRewardModel(backbone, tokenizer, prm_config)
    if resume_path:  # the checkpoint's weights: the adapter (LoRA) or the backbone, and the head
        if args.lora_r:
            set_peft_model_state_dict(prm.backbone, load_file(os.path.join(resume_path, "adapter_model.safetensors")))
        else:
            prm.backbone.load_state_dict(load_file(os.path.join(resume_path, "model.safetensors")))
        prm.head.load_state_dict(load_file(os.path.join(resume_path, "reward_head.safetensors")))
    return prm, base_copy


def save_prm(path: str, prm, base_backbone=None, weights=None, args=None, trainer_state=None, step=None) -> None:
    """Backbone or LoRA adapter (base_backbone under base/), reward_head.safetensors, tokenizer, prm_config.json,
    and for a checkpoint args.json and trainer_state.pt; weights: a sharded PRM's, gathered. Written to PATH.tmp,
    then renamed: a save cut short leaves no half PRM."""
    if weights is None:
        weights = prm.state_dict()
    temporary = path.rstrip("/") + ".tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    backbone = {name.removeprefix("backbone."): w for name, w in weights.items() if name.startswith("backbone.")}
    prm.backbone.save_pretrained(temporary, state_dict=backbone, max_shard_size="1000GB")  # one file, to reload
    if base_backbone is not None:
        base_backbone.save_pretrained(os.path.join(temporary, "base"))
    prm.tokenizer.save_pretrained(temporary)
    head = {name: weights[f"head.{name}"].detach().float().contiguous().cpu() for name in ("weight", "bias")}
    save_file(head, os.path.join(temporary, "reward_head.safetensors"))
    Path(temporary, "prm_config.json").write_text(json.dumps({**prm.config, "step": step}, indent=2))
    if trainer_state is not None:
        Path(temporary, "args.json").write_text(json.dumps(asdict(args), indent=2))
        torch.save(trainer_state, os.path.join(temporary, "trainer_state.pt"))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(temporary, path)


def load_prm(path: str, device=None, dtype=None, trust_remote_code: bool = False) -> ProcessRewardModel:
    """A PRM saved by save_prm, in eval mode (device None: cuda when available; dtype None: its training dtype)."""
    disable_progress_bar()  # (transformers' bars for loading weights would break into the caller's log)
    if not os.path.exists(path):
        raise UserError(f"{path} does not exist")
    if not os.path.isfile(os.path.join(path, "prm_config.json")):
        raise UserError(f"{path} is not a PRM saved by prm.py (no prm_config.json in it)")
    config = json.loads(Path(path, "prm_config.json").read_text())
    dtype = dtype or getattr(torch, config["dtype"])
    config["dtype"] = str(dtype).removeprefix("torch.")  # what predict computes in
    if config["lora"]:
        base = config["base_model"]
        if base == "base":  # the tiny model's random weights, saved beside the adapter
            base = os.path.join(path, "base")
        backbone = AutoModel.from_pretrained(base, dtype=dtype, trust_remote_code=trust_remote_code)
        backbone = PeftModel.from_pretrained(backbone, path)
    else:
        backbone = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    prm = ProcessRewardModel(backbone, tokenizer, config)
    prm.head.load_state_dict(load_file(os.path.join(path, "reward_head.safetensors")))
    return prm.to(device or ("cuda" if torch.cuda.is_available() else "cpu")).eval()


@torch.no_grad()
def predict(prm, examples, batch_size):
    """Scores of every kept step: sigmoid(logit) for bce, the raw output for mse; batched by length."""
    was_training = prm.training
    device = prm.head.weight.device
    dtype = getattr(torch, prm.config["dtype"])
    prm.eval()
    scores = [[] for _ in examples]  # an example with no step kept has no score
    with_steps = [i for i, example in enumerate(examples) if example["positions"]]
    order = sorted(with_steps, key=lambda i: len(examples[i]["input_ids"]))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        batch = collate([examples[i] for i in chunk], prm.tokenizer.pad_token_id or 0, device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            values = prm(batch["input_ids"], batch["position_ids"], batch["positions"])  # [b, S]
        if prm.config["loss_kind"] == "bce":
            # fp64: fp32's sigmoid is exactly 1.0 past a logit of 16.6, which would tie confident steps
            values = torch.sigmoid(values.double())
        for row, i in enumerate(chunk):
            scores[i] = values[row, : len(examples[i]["positions"])].tolist()
    prm.train(was_training)
    return scores


def score_steps(prm, prompts: list[str], steps: list[list[str]], batch_size: int = 32) -> list[list[float]]:
    """One score per kept step of each solution (none past the PRM's max_length), tokenised as in training."""
    rows = [{"prompt": p, "completions": s, "labels": []} for p, s in zip(prompts, steps, strict=True)]
    examples = encode_rows(prm.tokenizer, rows, prm.config["step_separator"], prm.config["max_length"])
    return predict(prm, examples, batch_size)


def evaluate(prm, val_examples, eval_examples, batch_size):
    """The first-error threshold chosen on the validation rows, every metric taken on the eval rows."""
    val_labels = [example["all_labels"] for example in val_examples]
    threshold = choose_threshold(predict(prm, val_examples, batch_size), val_labels)
    scores = predict(prm, eval_examples, batch_size)
    labels = [example["all_labels"] for example in eval_examples]
    # the step metrics over the scored steps (none past max_length); first-error F1 over every label
    flat_scores = [score for row in scores for score in row]
    flat_labels = [label for row, row_labels in zip(scores, labels) for label in row_labels[: len(row)]]
    return {
        "eval_step_accuracy": step_accuracy(flat_scores, flat_labels),
        "eval_auroc": auroc(flat_scores, flat_labels),
        "eval_first_error_f1": first_error_f1(scores, labels, threshold)[0],
        "eval_threshold": threshold,
    }


# ---- Training

# the flags a resume may change; every other must be the checkpoint's (--eval-data-path decides --data-path's val rows)
MAY_CHANGE_ON_RESUME = (
    "total_steps eval_every eval_batch_size num_eval_rows save_every keep_checkpoints resume_from output_dir"
    " overwrite track wandb_project_name micro_batch_size gradient_checkpointing pack_rows device dtype prm_path"
    " scores_output"
).split()
CONSOLE_KEYS = {
    "loss": "loss",
    "accuracy": "acc",
    "grad_norm": "gnorm",
    "eval_auroc": "auroc",
    "eval_first_error_f1": "fe_f1",
    "step_time_s": "dt",
}
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 70.0}  # dense bf16


def check_flags(args, world):
    """The flag values users get wrong, each a one-line UserError before anything is loaded."""
    for name in "batch_size total_steps max_length eval_batch_size learning_rate max_grad_norm".split():
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be > 0")
    for name in "warmup_steps eval_every save_every keep_checkpoints num_eval_rows num_val_rows lora_r".split():
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0")
    if args.batch_size % world != 0:
        raise UserError(f"--batch-size must be a multiple of the {world} processes")
    if not 0 <= args.micro_batch_size <= args.batch_size // world:
        raise UserError("--micro-batch-size must be >= 0 and at most each process's share of --batch-size")
    if args.fsdp and "RANK" not in os.environ:
        raise UserError("--fsdp shards over processes: it needs a launch by torchrun")


def shard_prm(prm, device, dtype):
    """FSDP2 (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html), a unit per transformer block, the
    head one in fp32; gradients reduced in fp32 and summed: each process's loss is a share of the batch mean."""
    block_names = set()  # the block classes transformers keeps whole when it splits a model
    for module in prm.modules():
        block_names.update(getattr(module, "_no_split_modules", None) or [])
    blocks = [module for module in prm.backbone.modules() if type(module).__name__ in block_names]
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for module in [*blocks, prm.head, prm]:  # (the head in fp32 throughout)
        fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy() if module is prm.head else policy)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied one)


def get_lr(step, args):
    """The learning rate of optimiser step `step` (from 0): linear warm-up, then constant or a cosine decay to 0."""
    warmup = min(1.0, (step + 1) / max(1, args.warmup_steps))
    if args.lr_schedule == "constant":
        return args.learning_rate * warmup
    progress = min(1, max(0, step - args.warmup_steps) / max(1, args.total_steps - args.warmup_steps))
    return args.learning_rate * (warmup * (1 + math.cos(math.pi * progress)) / 2)


@functools.lru_cache(maxsize=2)
def epoch_order(seed, epoch, num_examples):
    """The order of the training examples in this epoch."""
    # a fresh seeded permutation per epoch: the step number alone gives the data position, which is all resuming needs
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def all_reduce_gradients(parameters):
    """Sum every process's gradients, in one flat all-reduce (one collective rather than one per tensor)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat)
    for p, grad in zip(parameters, flat.split([grad.numel() for grad in grads])):
        p.grad = grad.view_as(p)


def checkpoint_steps(output_dir):
    """The steps of the checkpoints in output_dir, oldest first (not checkpoint-N.tmp: a save cut short)."""
    names = [path.name.removeprefix("checkpoint-") for path in Path(output_dir).glob("checkpoint-*")]
    return sorted(int(name) for name in names if name.isdigit())


def prepare_output_dir(args, device):
    """(output directory, checkpoint to resume from or None, the summary of a resumed run that is already finished).

    A directory holds a run when it holds a checkpoint or a final PRM: what a crash leaves (logs) is no run.
    """
    stamp = torch.tensor([int(time.time())], device=device)
    if dist.is_initialized():  # rank 0's clock: one run name everywhere
        dist.broadcast(stamp, src=0)
    output_dir = args.output_dir or os.path.join("runs", f"prm__{args.seed}__{int(stamp.item())}")
    if not args.output_dir and args.resume_from not in (None, "latest"):  # the checkpoint's own run
        output_dir = os.path.dirname(os.path.abspath(args.resume_from.rstrip("/")))
    steps = checkpoint_steps(output_dir)
    if args.resume_from is None:
        if (steps or os.path.isdir(os.path.join(output_dir, "final"))) and not args.overwrite:
            raise UserError(
                f"{output_dir} already holds a run: --resume-from latest continues it, --overwrite replaces it, "
                "or pass another --output-dir"
            )
        return output_dir, None, None
    resume_path = args.resume_from
    if resume_path == "latest" and steps:
        resume_path = os.path.join(output_dir, f"checkpoint-{steps[-1]}")
    if resume_path != "latest":
        if not os.path.isfile(os.path.join(resume_path, "args.json")):
            raise UserError(f"--resume-from {args.resume_from}: no checkpoint at {resume_path}")
        saved = json.loads(Path(resume_path, "args.json").read_text())
        differ = [
            f"--{key.replace('_', '-')} {saved[key]!r} there, {value!r} here"
            for key, value in asdict(args).items()
            if key not in MAY_CHANGE_ON_RESUME and saved[key] != value
        ]
        if differ:
            raise UserError(f"--resume-from {resume_path}: the checkpoint's run differs ({'; '.join(differ)})")
    summary_path = Path(output_dir, "summary.json")
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        if summary["steps"] >= args.total_steps:
            return output_dir, None, summary
    if resume_path == "latest":
        raise UserError(
            f"--resume-from latest: {output_dir} holds no checkpoint (a run writes them with --save-every N, and when "
            "stopped by a signal); --overwrite starts it anew"
        )
    return output_dir, resume_path, None


def restore(path, output_dir, prm, optimizer):
    """The optimiser and random state of a checkpoint, the logs cut back to its step; its trainer state."""
    state = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=True)
    options = dcp.StateDictOptions(full_state_dict=True)
    dcp.set_optimizer_state_dict(prm, optimizer, state["optimizer"], options=options)
    torch.set_rng_state(state["rng"])
    metrics_file = Path(output_dir, "metrics.jsonl")
    if int(os.environ.get("RANK", "0")) == 0 and metrics_file.exists():  # rows logged after the checkpoint are redone
        lines = metrics_file.read_text().splitlines(keepends=True)
        metrics_file.write_text("".join(line for line in lines if json.loads(line)["step"] <= state["step"]))
    return state


def save_run(path, prm, base_copy, args, state, optimizer=None):
    """final/, or with the optimiser a checkpoint (--keep-checkpoints kept); every process calls it, rank 0 writes."""
    options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = dcp.get_model_state_dict(prm, options=options)
    trainer_state = None  # final/ holds no trainer state
    if optimizer is not None:
        trainer_state = {**state, "optimizer": dcp.get_optimizer_state_dict(prm, optimizer, options=options)}
    if int(os.environ.get("RANK", "0")) != 0:
        return
    save_prm(path, prm, base_copy, weights, args, trainer_state, state["step"])
    output_dir = os.path.dirname(path)
    if args.keep_checkpoints:  # 0 keeps them all
        for old in checkpoint_steps(output_dir)[: -args.keep_checkpoints]:
            shutil.rmtree(os.path.join(output_dir, f"checkpoint-{old}"))


def train(args):
    # ---- set-up: processes, device, dtype, output directory; every check before anything is written
    disable_progress_bar()  # (transformers' bars for writing weights would break into the log's lines)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    distributed = "RANK" in os.environ  # launched by torchrun
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.device != "auto":
        device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # under torchrun, this process's GPU
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    check_flags(args, world)
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    use_bf16 = args.dtype == "bfloat16"
    if args.dtype == "auto":
        use_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    dtype = torch.bfloat16 if use_bf16 else torch.float32
    output_dir, resume_path, finished = prepare_output_dir(args, device)
    if finished is not None:
        message = f"the run finished at step {finished['steps']} (with a checkpoint, a larger --total-steps extends it)"
        print0(f"{output_dir}: {message}")
        if distributed:
            dist.destroy_process_group()
        return finished
    print0(f"output directory: {output_dir}")
    seed_everything(args.seed)  # the same on every process: identical initial weights

    # ---- data (a bad line fails before any model loads), model, tokenisation, optimiser
    train_rows, val_rows, eval_rows = load_splits(args)
    prm, base_copy = build_prm(args, dtype, resume_path)
    train_encoded = encode_rows(prm.tokenizer, train_rows, args.step_separator, args.max_length)
    val_examples = encode_rows(prm.tokenizer, val_rows, args.step_separator, args.max_length)
    eval_examples = encode_rows(prm.tokenizer, eval_rows, args.step_separator, args.max_length)
    encoded = train_encoded + val_examples + eval_examples
    dropped = [label for example in encoded for label in example["all_labels"][len(example["positions"]) :]]
    dropped_rows = sum(not example["positions"] for example in encoded)
    # a training row with no step left is left out; a held-out one stays: its first error still counts, as a miss
    train_examples = [example for example in train_encoded if example["positions"]]
    if not train_examples:
        raise UserError(f"every training row was truncated away by --max-length {args.max_length}")
    if dropped:  # wrong steps come last: truncation loses them first
        num_steps = sum(len(example["all_labels"]) for example in encoded)
        counts = f"drops {len(dropped):,} of {num_steps:,} steps, {sum(label < 0.5 for label in dropped):,} of them"
        print0(f"warning: --max-length {args.max_length} {counts} labelled wrong: raise --max-length", file=sys.stderr)
    if args.fsdp:
        shard_prm(prm, device, dtype)
    else:
        prm.to(device)
    prm.train()
    if args.gradient_checkpointing:  # (the non-reentrant kind: LoRA's frozen inputs need no gradient)
        prm.backbone.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    trainable = [p for p in prm.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, betas=(0.9, 0.99), weight_decay=args.weight_decay, fused=True)

    # ---- logging: nothing is written before this point
    if distributed:  # every process has checked --output-dir before rank 0 writes to it
        dist.barrier()
    start_step = 0
    eval_start = {}  # the held-out metrics before training
    if resume_path:
        state = restore(resume_path, output_dir, prm, optimizer)
        start_step = state["step"]
        eval_start = state["eval_start"]
    elif rank == 0:  # what an earlier run left: a crash's, or the run --overwrite replaces (metrics.jsonl: the logger)
        for name in ["final", *[f"checkpoint-{step}" for step in checkpoint_steps(output_dir)]]:
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
        Path(output_dir, "summary.json").unlink(missing_ok=True)
    logger = RunLogger(output_dir, asdict(args), console_keys=CONSOLE_KEYS, enabled=rank == 0, append=bool(resume_path))
    if eval_examples and not resume_path:  # (a resumed run's come from its checkpoint)
        eval_start = evaluate(prm, val_examples, eval_examples, args.eval_batch_size)
        logger.log(0, eval_start)
    num_params = sum(p.numel() for p in prm.parameters())
    num_trained = sum(p.numel() for p in trainable)
    micro = args.micro_batch_size or args.batch_size // world  # rows per forward/backward pass
    pad_id = prm.tokenizer.pad_token_id or 0
    step_times = []
    step_tokens = []
    stop = False
    stop_signals = []  # a signal ends the step, then a checkpoint is saved
    previous_handlers = {
        sig: signal.signal(sig, lambda signum, frame: stop_signals.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    run_start = time.perf_counter()
    try:
        for step in range(start_step, args.total_steps):
            step_start = time.perf_counter()
            # 1. batch: the global batch, of which this process takes every world-th row
            batch = []
            for position in range(step * args.batch_size, (step + 1) * args.batch_size):
                epoch, index = divmod(position, len(train_examples))
                batch.append(train_examples[epoch_order(args.seed, epoch, len(train_examples))[index]])
            num_labelled = sum(len(example["positions"]) for example in batch)  # the loss's divisor, all processes
            rows_here = batch[rank::world]  # this process's share

            # 2. forward and backward per micro-batch, gradients accumulating
            loss_sum = torch.zeros((), device=device)
            correct_sum = torch.zeros((), device=device)
            for start in range(0, len(rows_here), micro):
                inputs = collate(rows_here[start : start + micro], pad_id, device, args.pack_rows)
                with torch.autocast(device.type, dtype=dtype, enabled=use_bf16):
                    step_logits = prm(inputs["input_ids"], inputs["position_ids"], inputs["positions"])  # [R, S]
                labels = inputs["labels"]  # [R, S], -1 where there is no step
                loss, stats = prm_loss(step_logits, labels, labels >= 0, args.loss_kind, num_labelled=num_labelled)
                loss.backward()
                loss_sum += loss.detach()
                correct_sum += stats["accuracy"] * stats["steps"]

            # 3. all-reduce the gradients, clip, step
            if distributed and not args.fsdp:  # (FSDP's reduce-scatter has summed its gradients already)
                all_reduce_gradients(trainable)
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, args.max_grad_norm)
            if args.fsdp:  # a DTensor
                grad_norm = grad_norm.full_tensor()
            learning_rate = get_lr(step, args)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":  # (for the step's time)
                torch.cuda.synchronize(device)
            step_times.append(time.perf_counter() - step_start)
            step_tokens.append(sum(len(example["input_ids"]) for example in batch))

            # 4. log, evaluate, save; loss, correct steps and signals summed over processes (all stop after one step)
            totals = torch.stack([loss_sum, correct_sum, torch.tensor(float(len(stop_signals)), device=device)])
            if distributed:
                dist.all_reduce(totals)
            loss_total, num_correct, num_signals = totals.tolist()
            metrics = {
                "loss": loss_total,
                "accuracy": num_correct / max(num_labelled, 1),
                "grad_norm": grad_norm.item(),
                "learning_rate": learning_rate,
                "labelled_steps": num_labelled,
                "step_time_s": step_times[-1],
            }
            eval_due = args.eval_every > 0 and (step + 1) % args.eval_every == 0 and step + 1 < args.total_steps
            if eval_due and eval_examples:
                metrics.update(evaluate(prm, val_examples, eval_examples, args.eval_batch_size))
            logger.log(step + 1, metrics)
            stop = num_signals > 0
            if stop or (args.save_every > 0 and ((step + 1) % args.save_every == 0 or step + 1 == args.total_steps)):
                state = {"step": step + 1, "rng": torch.get_rng_state(), "eval_start": eval_start}
                save_run(os.path.join(output_dir, f"checkpoint-{step + 1}"), prm, base_copy, args, state, optimizer)
            if stop:
                break
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
    total_time = time.perf_counter() - run_start
    steps_done = start_step + len(step_times)
    if stop:
        print0(
            f"stopped by a signal after step {steps_done}, checkpoint-{steps_done} saved: continue with the same "
            f"flags and --output-dir {output_dir} --resume-from latest"
        )
        logger.close()
        if distributed:
            dist.destroy_process_group()
        # a process that got no signal itself stopped with the others: it reports SIGTERM
        received = stop_signals[0] if stop_signals else signal.SIGTERM
        return {"steps": steps_done, "interrupted": True, "signal": received}

    # ---- final save, evaluation and summary
    save_run(os.path.join(output_dir, "final"), prm, base_copy, args, {"step": steps_done})
    eval_end = {}
    if eval_examples:
        eval_end = evaluate(prm, val_examples, eval_examples, args.eval_batch_size)
        logger.log(steps_done, eval_end)
    first_timed = int(len(step_times) > 1)  # the first step pays for warm-up: left out, unless it is the only one
    tokens_per_s = sum(step_tokens[first_timed:]) / max(sum(step_times[first_timed:]), 1e-9)
    if device.type == "cuda":
        peak_memory_mb = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak_memory_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # (Linux: KiB)
    summary = {
        "steps": steps_done,
        "total_time_s": total_time,
        "step_time_s_mean": float(np.mean(step_times[first_timed:])),
        "tokens_per_s": tokens_per_s,
        "peak_memory_mb": peak_memory_mb,
        **{f"{key}_start": value for key, value in eval_start.items()},
        **{f"{key}_end": value for key, value in eval_end.items()},
        "train_rows": len(train_examples),
        "eval_rows": len(eval_examples),
        "dropped_steps": len(dropped),
        "dropped_rows": dropped_rows,
        "parameters": num_params,
        "trainable_parameters": num_trained,
    }
    if device.type == "cuda":  # MFU: 6 FLOPs per weight and token (4 with LoRA: no frozen weights' gradients)
        flops_per_weight = 6 if args.lora_r == 0 else 4
        body = num_params - prm.backbone.get_input_embeddings().weight.numel()  # (embedding lookups are no FLOPs)
        gpu = torch.cuda.get_device_name(device)
        peak = next((tflops for name, tflops in PEAK_TFLOPS.items() if name in gpu), float("nan"))
        if not use_bf16:  # PEAK_TFLOPS holds bf16 peaks
            peak = float("nan")
        summary["mfu"] = flops_per_weight * body * tokens_per_s / world / (peak * 1e12)
    logger.summary(summary)
    logger.close()
    if distributed:
        dist.destroy_process_group()
    return summary


def score_file(args):
    """--prm-path: every row of --data-path with its step scores added, written to --scores-output."""
    if args.data_path is None:
        raise UserError("--prm-path scores the rows of --data-path: give one")
    rows = load_rows(args.data_path, need_labels=False)
    device = None if args.device == "auto" else args.device  # None: load_prm's default, cuda when available
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)  # None: the PRM's training dtype
    prm = load_prm(args.prm_path, device, dtype)
    prompts = [row["prompt"] for row in rows]
    solutions = [row["completions"] for row in rows]
    scores = score_steps(prm, prompts, solutions, args.eval_batch_size)
    lines = []
    for row, row_scores in zip(rows, scores):  # a step past the PRM's max_length scores null
        lines.append(json.dumps({**row, "scores": row_scores + [None] * (len(row["completions"]) - len(row_scores))}))
    Path(args.scores_output).write_text("".join(line + "\n" for line in lines))
    num_scored = sum(len(row_scores) for row_scores in scores)
    print0(f"scored {num_scored} steps of {len(rows)} rows into {args.scores_output}")
    return {"rows": len(rows), "scored_steps": num_scored}


def main():
    try:
        args = tyro.cli(Args)
        summary = score_file(args) if args.prm_path else train(args)
    except KeyboardInterrupt:  # while starting (then a signal ends the step and saves): nothing to save yet
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except UserError as error:
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every process meets the error: one message
            print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    if summary.get("interrupted"):  # checkpointed, not finished: exit as a shell reports the signal
        sys.exit(128 + summary["signal"])


if __name__ == "__main__":
    main()
