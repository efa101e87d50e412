"""prm.py: the loss kernel, tokenisation and metrics; training, saving and scoring end to end through its command
line, as a user would launch them."""

import json
import math
import random
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.modeling_outputs import BaseModelOutput

import prm
from conftest import run_in_process

REPO_ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--total-steps", "3", "--batch-size", "8", "--eval-every", "2", "--num-eval-rows", "40",
         "--num-val-rows", "20"]
SUMMARY_KEYS = {"steps", "total_time_s", "step_time_s_mean", "tokens_per_s", "peak_memory_mb",
                "eval_step_accuracy_start", "eval_step_accuracy_end", "eval_auroc_start", "eval_auroc_end",
                "eval_first_error_f1_start", "eval_first_error_f1_end", "dropped_steps", "dropped_rows"}


def run_prm(*flags: str, expect_rc: int = 0, timeout: int = 600) -> SimpleNamespace:
    """`python prm.py FLAGS` in this process (run_in_process): (returncode, stdout, stderr). One thread, as
    OMP_NUM_THREADS=1 gives a process: the tiny model gains nothing from more, and on a shared CPU two threads
    waiting on each other can make a step 100x slower."""
    process = run_in_process(prm, list(flags), timeout, threads=1)
    assert process.returncode == expect_rc, (f"rc {process.returncode}\n{process.stdout[-3000:]}\n"
                                             f"{process.stderr[-3000:]}")
    return process


def read_summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "summary.json").read_text())


def read_all_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def read_metrics(output_dir: Path) -> list[dict]:
    """The training rows, one per step (the evaluations at the start and the end have rows of their own)."""
    return [row for row in read_all_metrics(output_dir) if "step_time_s" in row]


def read_eval_rows(output_dir: Path) -> list[dict]:
    """The rows of the evaluations at the start and the end: their step and metrics, nothing else."""
    return [row for row in read_all_metrics(output_dir) if "step_time_s" not in row]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def builtin_rows(count: int, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    return [prm.make_solution(rng) for _ in range(count)]


# ---------------------------------------------------------------------------------------------------------------
# prm_loss


def naive_loss(logits, labels, mask, kind):
    total, count = 0.0, 0
    for i in range(logits.shape[0]):
        for j in range(logits.shape[1]):
            if mask[i, j]:
                z, y = float(logits[i, j]), float(labels[i, j])
                if kind == "bce":
                    p = 1 / (1 + math.exp(-z))
                    total += -(y * math.log(p) + (1 - y) * math.log(1 - p))
                else:
                    total += (z - y) ** 2
                count += 1
    return total / max(count, 1)


@pytest.mark.parametrize("kind", ["bce", "mse"])
def test_prm_loss_matches_naive_reference_with_soft_labels_masks_and_an_empty_row(kind):
    torch.manual_seed(0)
    logits = torch.randn(4, 5) * 3
    labels = torch.tensor([[1, 1, 0, 0, 0], [0.3, 0.9, 0.5, 0, 0], [0, 0, 0, 0, 0], [1, 0.25, 0, 1, 0.7]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    loss, stats = prm.prm_loss(logits, labels, mask, kind)
    assert loss.item() == pytest.approx(naive_loss(logits, labels, mask, kind), rel=1e-5)
    assert stats["steps"].item() == 11
    # the empty row (row 2) changes nothing: the loss is the same without it
    keep = [0, 1, 3]
    assert prm.prm_loss(logits[keep], labels[keep], mask[keep], kind)[0].item() == pytest.approx(loss.item(), rel=1e-6)


def test_prm_loss_stats_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5], [-3.0, 0.0, 0.0]])  # sigmoid: .88 .27 .62 | .05 (.5 .5 padding)
    labels = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    _, stats = prm.prm_loss(logits, labels, mask, "bce")
    assert stats["accuracy"].item() == pytest.approx(2 / 4)  # right: step 0 and row 1; wrong: -1.0 and 0.5
    expected_mean = (torch.sigmoid(torch.tensor([2.0, -1.0, 0.5, -3.0]))).mean().item()
    assert stats["score_mean"].item() == pytest.approx(expected_mean, rel=1e-6)
    _, stats = prm.prm_loss(logits, labels, mask, "mse")  # the raw output is the score: 2.0 >= .5, -1 < .5 ...
    assert stats["accuracy"].item() == pytest.approx(2 / 4)
    assert stats["score_mean"].item() == pytest.approx((2.0 - 1.0 + 0.5 - 3.0) / 4)
    # a raw 0.3 is below 0.5 (right for label 0), though its sigmoid (0.57) is above
    _, stats = prm.prm_loss(torch.tensor([[0.3]]), torch.tensor([[0.0]]), torch.tensor([[True]]), "mse")
    assert stats["accuracy"].item() == 1.0 and stats["score_mean"].item() == pytest.approx(0.3)


def test_prm_loss_micro_batches_with_total_steps_sum_to_the_whole_batch():
    torch.manual_seed(1)
    logits = torch.randn(6, 4, requires_grad=True)
    labels = torch.rand(6, 4)
    mask = torch.rand(6, 4) > 0.3
    whole, _ = prm.prm_loss(logits, labels, mask, "bce")
    (whole_grad,) = torch.autograd.grad(whole, logits)
    total = mask.sum().item()
    parts = [prm.prm_loss(logits[s], labels[s], mask[s], "bce", num_labelled=total)[0]
             for s in (slice(0, 2), slice(2, 3), slice(3, 6))]
    summed = sum(parts)
    (parts_grad,) = torch.autograd.grad(summed, logits)
    assert summed.item() == pytest.approx(whole.item(), rel=1e-6)
    torch.testing.assert_close(parts_grad, whole_grad)


def test_prm_loss_all_empty_padding_garbage_and_bad_kind():
    logits = torch.tensor([[float("nan"), float("inf")]], requires_grad=True)  # padding may hold anything
    loss, stats = prm.prm_loss(logits, torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bool))
    assert loss.item() == 0.0 and stats["steps"].item() == 0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="bce or mse"):
        prm.prm_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), "hinge")


def test_prm_loss_is_fp32_for_bf16_logits():
    """The same loss as the fp32 computation on the same (bf16-rounded) logits, not one rounded to bf16 (3 digits)."""
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 3).to(torch.bfloat16), torch.rand(2, 3)
    loss, _ = prm.prm_loss(logits, labels, torch.ones(2, 3, dtype=torch.bool))
    assert loss.dtype == torch.float32
    expected = F.binary_cross_entropy_with_logits(logits.float(), labels)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# build_prm_example


def test_build_prm_example_with_the_builtin_tokenizer():
    tokenizer = prm.build_tiny_tokenizer()
    prompt, steps = "start 7\n", ["7+2=9", "9-3=6"]
    ids, positions = prm.build_prm_example(tokenizer, prompt, steps, step_separator="\n", max_length=100)
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 1 + 8 + 6 + 6  # one token per character
    assert positions == [14, 20]
    assert [tokenizer.convert_ids_to_tokens(ids[p]) for p in positions] == ["\n", "\n"]
    for k, position in enumerate(positions):
        assert tokenizer.decode(ids[:position + 1], skip_special_tokens=True) == prompt + "".join(
            step + "\n" for step in steps[:k + 1])
    with pytest.raises(ValueError, match="separator"):
        prm.build_prm_example(tokenizer, prompt, steps, step_separator="", max_length=100)


def test_truncation_drops_whole_steps_and_a_too_long_prompt_drops_the_row():
    tokenizer = prm.build_tiny_tokenizer()
    prompt, steps = "start 7\n", ["7+2=9", "9-3=6", "6+1=7"]
    # 21 tokens hold bos + prompt + two steps exactly; one token less cuts the second step, which goes whole
    ids, positions = prm.build_prm_example(tokenizer, prompt, steps, step_separator="\n", max_length=21)
    assert positions == [14, 20] and len(ids) == 21
    ids, positions = prm.build_prm_example(tokenizer, prompt, steps, step_separator="\n", max_length=20)
    assert positions == [14] and len(ids) == 15
    ids, positions = prm.build_prm_example(tokenizer, prompt, steps, step_separator="\n", max_length=5)
    assert positions == [] and len(ids) == 5
    rows = [{"prompt": prompt, "completions": steps, "labels": [1.0, 1.0, 0.0]},
            {"prompt": "start 1234567890\n", "completions": ["1+1=2"], "labels": [1.0]}]
    examples, dropped_steps, dropped_rows = prm.encode_rows(tokenizer, rows, "\n", 20)
    assert (dropped_steps, dropped_rows) == (2 + 1, 1)
    assert len(examples) == 1 and examples[0]["labels"] == [1.0]  # the label of the dropped step went with it


def merging_bpe_tokenizer(with_bos: bool = True):
    """A BPE trained with no pre-tokenizer on text where newlines are mostly followed by 'The': its merges
    cross the end of a step ('.\\n', '\\nThe', '\\n\\n')."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["The cat sat.\nThe dog ran.\nThe end.\n\nThe sum is 12.\nThe cat ate.\n"] * 200
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.decoder = decoders.Fuse()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<pad>", "<s>", "<unk>"],
                                                        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>" if with_bos else None)


def whitespace_dropping_tokenizer():
    """A WordPiece tokenizer as BERT's (and some GPT-2 checkpoints') are: whitespace only splits words, so a
    newline separator, or a blank step with it, is no token at all."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer()
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.train_from_iterator(["start 3\n3+1=4\n4-2=2\n"] * 50, trainers.WordPieceTrainer(
        vocab_size=60, special_tokens=["[PAD]", "[UNK]"], show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=wordpiece, pad_token="[PAD]", unk_token="[UNK]")


def test_a_step_that_tokenises_to_nothing_is_an_error():
    """A blank step whose separator the tokenizer drops has no token of its own: its label would land on the
    previous step's token (two labels on one token), or before the first token (index -1, read from another
    example of the batch)."""
    tokenizer = whitespace_dropping_tokenizer()
    assert tokenizer(" \n", add_special_tokens=False)["input_ids"] == []
    ids, positions = prm.build_prm_example(tokenizer, "start 3", ["3+1=4", "4-2=2"], step_separator="\n",
                                           max_length=100)
    assert len(positions) == 2 and positions[0] < positions[1] == len(ids) - 1  # labels on the steps' last tokens
    for prompt, steps, k in (("start 3", ["3+1=4", " ", "4-2=2"], 1), ("", ["", "3+1=4"], 0)):
        with pytest.raises(ValueError, match=f"step {k} .* is no token at all.*pick a --step-separator"):
            prm.build_prm_example(tokenizer, prompt, steps, step_separator="\n", max_length=100)
    rows = [{"prompt": "start 3", "completions": ["3+1=4"], "labels": [1.0]},
            {"prompt": "start 3", "completions": ["3+1=4", " "], "labels": [1.0, 0.0]}]
    with pytest.raises(prm.UserError, match=r"^validation row 2 \(prompt 'start 3'\): step 1 \(' '\)"):
        prm.encode_rows(tokenizer, rows, "\n", 100, "validation")


@pytest.mark.parametrize("separator", ["\n", "\n\n"])
def test_build_prm_example_with_a_bpe_whose_merges_cross_step_boundaries(separator):
    tokenizer = merging_bpe_tokenizer()
    prompt, steps = "The sum.\n", ["The cat sat.", "The dog ran.", "The end."]
    joined = prompt + "".join(step + separator for step in steps)
    # tokenising the joined text puts a step's end and the next step's start in one token: the classic bug
    encoding = tokenizer._tokenizer.encode(joined, add_special_tokens=False)
    ends, end = [], len(prompt)
    for step in steps:
        end += len(step + separator)
        ends.append(end)
    assert any(start < boundary < stop for start, stop in encoding.offsets for boundary in ends[:-1])

    ids, positions = prm.build_prm_example(tokenizer, prompt, steps, step_separator=separator, max_length=500)
    assert ids[0] == tokenizer.bos_token_id and len(positions) == len(steps)
    for k, position in enumerate(positions):
        expected = prompt + "".join(step + separator for step in steps[:k + 1])
        assert tokenizer.decode(ids[:position + 1], skip_special_tokens=True) == expected
        assert tokenizer.decode(ids[position]).endswith(separator[-1])  # the label token ends the separator
    # the same ids as tokenising each piece alone: what scoring does for one solution, training does for many
    pieces = [tokenizer(text, add_special_tokens=False)["input_ids"]
              for text in [prompt] + [step + separator for step in steps]]
    assert ids == [tokenizer.bos_token_id] + [i for piece in pieces for i in piece]


def test_bpe_without_bos_and_truncation_in_the_middle_of_a_merged_token():
    tokenizer = merging_bpe_tokenizer(with_bos=False)
    prompt, steps = "The sum.\n", ["The cat sat.", "The dog ran."]
    full_ids, full_positions = prm.build_prm_example(tokenizer, prompt, steps, step_separator="\n", max_length=500)
    assert tokenizer.bos_token_id is None and full_ids[0] != tokenizer.pad_token_id
    ids, positions = prm.build_prm_example(tokenizer, prompt, steps, step_separator="\n",
                                           max_length=full_positions[1])  # one token short of step 2
    assert positions == full_positions[:1] and ids == full_ids[:positions[0] + 1]
    assert tokenizer.decode(ids) == prompt + steps[0] + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Metrics


def test_step_accuracy_and_auroc_by_hand():
    assert prm.step_accuracy([0.9, 0.4, 0.5, 0.2], [1, 1, 0, 0.0]) == pytest.approx(0.5)
    assert prm.step_accuracy([0.7], [0.5]) == 1.0  # a soft label of 0.5 counts as correct
    # positives {0.9, 0.8}, negatives {0.8, 0.3}: pairs won 1 + 1 + 1, tied 1 -> (3 + 0.5) / 4
    assert prm.auroc([0.9, 0.8, 0.8, 0.3], [1, 0, 1, 0]) == pytest.approx(0.875)
    assert prm.auroc([0.1, 0.2, 0.3, 0.4], [1, 1, 0, 0]) == 0.0
    assert prm.auroc([0.5, 0.5, 0.5], [1, 0, 1]) == 0.5
    assert math.isnan(prm.auroc([0.1, 0.9], [1, 1]))
    assert prm.auroc([0.9, 0.1], [0.5, 0.0]) == 1.0  # a soft label of 0.5 is a correct step here too
    # a NaN score (a diverged model) makes both NaN: argsort ranks NaN above every number, >= calls it wrong
    assert math.isnan(prm.auroc([0.5, float("nan"), 0.2], [1, 0, 0]))
    assert math.isnan(prm.step_accuracy([0.9, float("nan")], [1, 0]))


def test_auroc_matches_pairwise_count_with_many_ties():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 200) / 4  # five distinct values: ties everywhere
    labels = rng.random(200) < 0.6
    pos, neg = scores[labels], scores[~labels]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    pairwise = wins / (len(pos) * len(neg))
    assert prm.auroc(scores, labels.astype(float)) == pytest.approx(pairwise)


def test_first_error_f1_by_hand():
    scores = [[0.9, 0.2, 0.1], [0.8, 0.3], [0.9, 0.7], [0.9, 0.4, 0.9]]
    labels = [[1, 0, 0], [0, 0], [1, 1], [1, 1, 1]]
    # threshold 0.5: predicted first errors 1, 1, -1, 1; true 1, 0, -1, -1 -> acc_err 1/2, acc_corr 1/2
    assert prm.first_error_f1(scores, labels, 0.5) == pytest.approx((0.5, 0.5, 0.5))
    # threshold 0.35: predicted 1, 1, -1, -1 -> acc_err 1/2, acc_corr 1 -> F1 = 2 * .5 / 1.5
    assert prm.first_error_f1(scores, labels, 0.35) == pytest.approx((2 / 3, 0.5, 1.0))
    # threshold 0: nothing flagged -> acc_err 0, acc_corr 1 -> F1 0
    assert prm.first_error_f1(scores, labels, 0.0) == pytest.approx((0.0, 0.0, 1.0))
    f1, acc_err, acc_corr = prm.first_error_f1(scores[2:], labels[2:], 0.5)  # no erroneous solution at all
    assert math.isnan(f1) and math.isnan(acc_err) and acc_corr == 0.5
    # a soft label of 0.5 is no error (as in step_accuracy): solution 0 is correct, solution 1's error is step 1
    assert prm.first_error_f1([[0.9], [0.9, 0.1]], [[0.5], [1, 0]], 0.5) == (1.0, 1.0, 1.0)


def test_a_first_error_truncated_away_is_a_miss_not_a_correct_solution():
    """Solution 0 kept two correct steps of three; its error (step 2) was truncated away unscored. It is still an
    erroneous solution, and no prediction can hit its first error (ProcessBench scores the full solution)."""
    scores, labels = [[0.9, 0.9], [0.9, 0.8]], [[1, 1, 0], [1, 1]]
    assert prm.first_error_f1(scores, labels, 0.5) == pytest.approx((0.0, 0.0, 1.0))
    metrics = prm.evaluate(scores, labels, 0.5)  # step metrics over the four scored steps only
    assert metrics["eval_step_accuracy"] == 1.0 and math.isnan(metrics["eval_auroc"])
    assert metrics["eval_first_error_f1"] == 0.0


def test_evaluation_keeps_the_full_labels_of_truncated_rows(monkeypatch):
    """encode_rows keeps each row's full labels beside those of its kept steps, and evaluate_prm scores against
    them: a row whose error was truncated away counts as missed (with the kept labels alone it would pass as a
    correct solution, F1 1.0 here instead of 2/3)."""
    model, _ = prm.build_prm(prm.Args(), torch.float32)
    rows = [{"prompt": "1+1=", "completions": ["1+1=2", "2+2=4", "4+4=9"], "labels": [1.0, 1.0, 0.0]},
            {"prompt": "2+3=", "completions": ["2+3=5"], "labels": [1.0]},
            {"prompt": "3+3=", "completions": ["3+3=7"], "labels": [0.0]}]
    examples, dropped_steps, _ = prm.encode_rows(model.tokenizer, rows, "\n", 18)
    assert dropped_steps == 1 and examples[0]["labels"] == [1.0, 1.0] and examples[0]["all_labels"] == [1, 1, 0]
    scores_by_length = {2: [0.9, 0.9], 1: None}  # row 0: no error flagged; rows 1, 2: by their label

    def predict(_, chosen, batch_size):
        return [scores_by_length[len(e["labels"])] or [0.9 if e["labels"][0] else 0.1] for e in chosen]

    monkeypatch.setattr(prm, "predict", predict)
    metrics = prm.evaluate_prm(model, examples[1:], examples, 8)
    assert metrics["eval_first_error_f1"] == pytest.approx(2 / 3) and metrics["eval_step_accuracy"] == 1.0


def test_held_out_rows_with_no_step_kept_count_as_missed_errors():
    """A row whose prompt alone fills --max-length keeps no step: kept (keep_empty) with no score, its error counts
    as missed; dropped, as training rows are, the best first-error F1 here would be 1 instead of 2/3."""
    model, _ = prm.build_prm(prm.Args(), torch.float32)
    rows = [{"prompt": "1+1=", "completions": ["1+1=2"]}, {"prompt": "3+3=", "completions": ["3+3=7"]},
            {"prompt": "9" * 40, "completions": ["3+3=7"], "labels": [0.0]}]
    scores = prm.predict(model, prm.encode_rows(model.tokenizer, rows, "\n", 18, "eval", keep_empty=True)[0], 8)
    assert [len(s) for s in scores] == [1, 1, 0]
    lower = int(scores[1][0] < scores[0][0])
    for row in (0, 1):  # the lower scored of the two is the wrong one: a threshold between them finds its error
        rows[row]["labels"] = [0.0 if row == lower else 1.0]
    examples, _, dropped_rows = prm.encode_rows(model.tokenizer, rows, "\n", 18, "eval", keep_empty=True)
    assert dropped_rows == 1 and len(examples) == 3 and examples[2]["positions"] == []
    assert len(prm.encode_rows(model.tokenizer, rows, "\n", 18)[0]) == 2  # training rows: dropped
    metrics = prm.evaluate_prm(model, examples, examples, 8)  # the threshold chosen on the same rows: the best F1
    assert metrics["eval_first_error_f1"] == pytest.approx(2 / 3)  # 2 errors, 1 found, nothing falsely flagged
    assert prm.evaluate_prm(model, examples[:2], examples[:2], 8)["eval_first_error_f1"] == 1.0


def test_non_finite_scores_make_every_metric_nan():
    """A diverged model's NaN scores would otherwise rank highest in AUROC and never fall below a threshold."""
    metrics = prm.evaluate([[0.9, float("nan")], [0.2]], [[1, 0], [0]], 0.5)
    assert all(math.isnan(metrics[k]) for k in ("eval_step_accuracy", "eval_auroc", "eval_first_error_f1"))
    assert prm.evaluate([[0.9, 0.1], [0.2]], [[1, 0], [0]], 0.5)["eval_auroc"] == 1.0


def best_threshold_by_brute_force(scores, labels):
    """Naive reference: first_error_f1 at every candidate (below all, each midpoint, above all), lowest on ties;
    0.5 when it is 0 at every one."""
    values = np.unique([s for row in scores for s in row])
    candidates = np.concatenate([[values[0] - 1.0], (values[1:] + values[:-1]) / 2, [values[-1] + 1.0]])
    f1s = [prm.first_error_f1(scores, labels, float(t))[0] for t in candidates]
    return float(candidates[int(np.argmax(f1s))]) if max(f1s) > 0 else 0.5


def test_choose_threshold_finds_the_best_f1():
    rng = np.random.default_rng(1)
    lengths, first_errors = rng.integers(1, 6, 80), rng.integers(0, 6, 80)
    labels = [[1.0] * min(k, n) + [0.0] * (n - min(k, n)) for n, k in zip(lengths, first_errors, strict=True)]
    scores = [[float(np.clip(y * 0.6 + rng.normal(0.2, 0.2), 0, 1)) for y in row] for row in labels]
    chosen = prm.choose_threshold(scores, labels)
    grid_best = max(prm.first_error_f1(scores, labels, t)[0] for t in np.linspace(-0.1, 1.1, 1201))
    assert prm.first_error_f1(scores, labels, chosen)[0] == pytest.approx(grid_best)
    scores, labels = [[0.9, 0.2], [0.8, 0.9]], [[1, 0], [1, 1]]  # separable: a threshold in (0.2, 0.8) is perfect
    assert 0.2 < prm.choose_threshold(scores, labels) < 0.8


def test_choose_threshold_is_exact_against_brute_force():
    """The one-sweep search picks the same threshold as trying every candidate: many distinct scores (the search
    once sampled 256 of them), tied scores, soft labels, scores truncated short of the labels, empty solutions."""
    rng = np.random.default_rng(0)
    for trial in range(150):
        scores, labels = [], []
        for _ in range(int(rng.integers(2, 60))):
            num_steps = int(rng.integers(0, 7))
            row = [float(y) for y in rng.random(num_steps) < 0.7] if rng.random() < 0.7 else [1.0] * num_steps
            if rng.random() < 0.2:
                row = [float(rng.choice([0.0, 0.25, 0.5, 0.75, 1.0])) for _ in range(num_steps)]
            row_scores = rng.random(num_steps).round(1 if trial % 2 else 6)  # ties on odd trials
            kept = num_steps if rng.random() < 0.7 else int(rng.integers(0, num_steps + 1))
            scores.append([float(s) for s in row_scores[:kept]])
            labels.append(row)
        has_error = [min(row, default=1.0) < 0.5 for row in labels]
        if not any(s for s in scores) or all(has_error) or not any(has_error):
            assert prm.choose_threshold(scores, labels) == 0.5  # F1 is NaN (or no score) at every threshold
            continue
        assert prm.choose_threshold(scores, labels) == best_threshold_by_brute_force(scores, labels)
    many_scores = [list(rng.random(8)) for _ in range(300)]  # 2400 distinct scores
    many_labels = [[1.0] * int(k) + [0.0] * (8 - int(k)) for k in rng.integers(0, 9, 300)]
    assert prm.choose_threshold(many_scores, many_labels) == best_threshold_by_brute_force(many_scores, many_labels)
    assert prm.choose_threshold([[0.3, float("nan")], [0.9]], [[1, 0], [1]]) == 0.5
    # no threshold finds the error (it lies after the lowest score): F1 is 0 everywhere, and "one below every
    # score" (-0.8 here) would print as a probability below 0
    scores, labels = [[0.2, 0.9], [0.5, 0.6]], [[1, 0], [1, 1]]
    assert max(prm.first_error_f1(scores, labels, t)[0] for t in np.linspace(-1, 2, 301)) == 0
    assert prm.choose_threshold(scores, labels) == 0.5
    # scores one float apart: their midpoint rounds to the lower one, which would flag neither step
    low = 0.1
    high = float(np.nextafter(low, 1.0))
    scores, labels = [[0.9, low], [0.9, high]], [[1, 0], [1, 1]]
    assert prm.first_error_f1(scores, labels, prm.choose_threshold(scores, labels))[0] == 1.0


def test_aggregate_scores_and_position_baseline():
    assert prm.aggregate_scores([0.9, 0.5, 0.8], "min") == 0.5
    assert prm.aggregate_scores([0.9, 0.5, 0.8], "prod") == pytest.approx(0.36)
    assert prm.aggregate_scores([0.9, 0.5, 0.8], "last") == 0.8
    assert prm.aggregate_scores([0.9, 0.5, 0.7], "mean") == pytest.approx(0.7)
    assert all(prm.aggregate_scores([], how) == 0.0 for how in ("min", "prod", "last", "mean"))
    with pytest.raises(ValueError):
        prm.aggregate_scores([0.5], "max")
    # index 0: 2 of 2 correct, index 1: 1 of 2, index 2: 0 of 1; longer solutions reuse the last rate
    assert prm.position_baseline([[1, 1, 0], [1, 0]], [2, 4]) == [[1.0, 0.5], [1.0, 0.5, 0.0, 0.0]]


def test_split_steps():
    assert prm.split_steps("a\nb\n\nc\n", "\n") == ["a", "b", "c"]
    assert prm.split_steps("one. two.", "\n\n") == ["one. two."]


# ---------------------------------------------------------------------------------------------------------------
# Data and model, in-process


@pytest.mark.parametrize("line, problem", [
    ('{"prompt": "p", "completions": ["a", "b"], "labels": [true]}', "1 labels for 2 steps"),
    ('{"prompt": "p", "completions": ["a"], "labels": [1.5]}', "label 0 is 1.5"),
    ('{"prompt": "p", "completions": ["a"], "labels": [-0.1]}', "label 0 is -0.1"),
    ('{"prompt": "p", "completions": ["a"], "labels": [NaN]}', "label 0 is nan"),
    ('{"prompt": "p", "completions": ["a"], "labels": ["+"]}', "label 0 is '+'"),
    ('{"completions": ["a"], "labels": [1]}', '"prompt"'),
    ('{"prompt": "p", "labels": [1]}', '"completions"'),
    ('{"prompt": "p", "completions": ["a"]}', '"labels"'),
    ('{"prompt": "p", "completions": "a", "labels": [1]}', '"completions"'),
    ('{"prompt": "p", "completions": [], "labels": []}', "no steps"),
    ('{"prompt": "p", "completions": ["a"], "labels": [1]', "invalid JSON"),
    ('[1, 2]', "JSON object"),
    ('{"prompt": "p\\ud83d", "completions": ["a"], "labels": [1]}', "the prompt holds a lone surrogate"),
    ('{"prompt": "p", "completions": ["a", "b\\udc00"], "labels": [1, 0]}', "step 1 holds a lone surrogate"),
    ('{"a": ' * 100000 + "1" + "}" * 100000, "invalid JSON (nested too deeply)"),
    ('{"prompt": "p", "completions": ["a"], "labels": [' + "1" * 5000 + "]}", "invalid JSON (a number of over"),
    # other data sets' raw formats and field names: what to do with them
    ('{"input": "2+2=4 \u043a\u0438", "label": "2+2=4 +"}', "Math-Shepherd's raw format"),
    ('{"question": {"problem": "p"}, "label": {"steps": []}}', "PRM800K's raw format"),
    ('{"question": "p", "steps": ["a"], "label": [1]}', 'rename "question" to "prompt" and "steps" to "completions" '
                                                         'and "label" to "labels"'),
])
def test_bad_rows_are_named(tmp_path, line, problem):
    good = '{"prompt": "p", "completions": ["a", "b"], "labels": [true, 0.25]}'
    path = write_rows(tmp_path / "rows.jsonl", [good, "", good, line, good])
    with pytest.raises(prm.UserError, match="rows.jsonl:4: .*" + re.escape(problem)):
        prm.load_jsonl_rows(str(path))
    rows, skipped = prm.load_jsonl_rows(str(path), skip_bad_rows=True)
    assert skipped == 1 and len(rows) == 3 and rows[0]["labels"] == [1.0, 0.25]


def test_scoring_rows_need_no_labels(tmp_path):
    # and come back as given: other fields kept, labels of any kind unchecked (Math-Shepherd's "+"/"-")
    rows = [{"prompt": "p", "completions": []}, {"prompt": "q", "completions": ["a"]},
            {"id": 7, "prompt": "r", "completions": ["a", "b"], "labels": ["+", "-"], "meta": {"source": "ms"}},
            {"prompt": "s", "completions": ["a"], "labels": [True, 2]}]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    loaded, _ = prm.load_jsonl_rows(str(path), need_labels=False)
    assert loaded == rows
    with pytest.raises(prm.UserError, match="does not exist"):
        prm.load_jsonl_rows(str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize("content, message", [
    (b"\x1f\x8b\x08\x00", "rows.jsonl is gzip-compressed; decompress it"),
    (b"PAR1\x15\x04", "rows.jsonl is a Parquet file"),
    (b'\xef\xbb\xbf [{"prompt": "p", "completions": ["a"], "labels": [1]}]', "rows.jsonl holds a JSON array, not JSON"),
])
def test_data_files_that_are_no_jsonl_are_named(tmp_path, content, message):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    for skip_bad_rows in (False, True):  # (no row of it is valid: not a file to skip rows of)
        with pytest.raises(prm.UserError, match=re.escape(message)):
            prm.load_jsonl_rows(str(path), skip_bad_rows=skip_bad_rows)


def test_lines_ended_by_a_lone_cr_are_lines(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"prompt": "p", "completions": ["a"], "labels": [1]}\r\r'
                     b'{"prompt": "q", "completions": ["b"], "labels": [0]}\r')
    places = []
    rows, _ = prm.load_jsonl_rows(str(path), places=places)
    assert [row["prompt"] for row in rows] == ["p", "q"] and places == [f"{path}:1", f"{path}:3"]
    # with LFs, lines end at them: a CR before one, or inside a row, is JSON whitespace (Windows' \r\r\n too)
    path.write_bytes(b'{"prompt": "p",\r"completions": ["a"], "labels": [1]}\r\r\n{"prompt": "q", "completions": '
                     b'["b"], "labels": [0]}\r\n')
    places = []
    rows, _ = prm.load_jsonl_rows(str(path), places=places)
    assert [row["prompt"] for row in rows] == ["p", "q"] and places == [f"{path}:1", f"{path}:2"]


def test_a_list_on_the_first_of_several_lines_is_a_bad_row_not_a_json_array(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'[1, 2]\n{"prompt": "p", "completions": ["a"], "labels": [1]}\n')
    assert prm.load_jsonl_rows(str(path), skip_bad_rows=True)[1] == 1
    with pytest.raises(prm.UserError, match="rows.jsonl:1: a row must be a JSON object"):
        prm.load_jsonl_rows(str(path))


def test_a_byte_order_mark_is_not_part_of_the_first_row(tmp_path):
    """Files saved by Windows tools start with a UTF-8 byte-order mark, which json rejects."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "p", "completions": ["a"], "labels": [1]}\n')
    assert prm.load_jsonl_rows(str(path)) == ([{"prompt": "p", "completions": ["a"], "labels": [1.0]}], 0)


def test_lora_trains_only_adapters_and_the_head():
    from peft import PeftModel

    model, base_copy = prm.build_prm(prm.Args(lora_r=4), torch.float32)
    assert isinstance(model.backbone, PeftModel) and base_copy is not None
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert {"head.weight", "head.bias"} <= trained
    assert any("lora_A" in name for name in trained) and any("lora_B" in name for name in trained)
    assert all("lora_" in name or name.startswith("head.") for name in trained)
    adapted = [m for m in model.backbone.modules() if hasattr(m, "lora_A")]
    layers = model.backbone.get_base_model().config.num_hidden_layers
    assert len(adapted) == 7 * layers  # every linear layer of every block: q k v o gate up down
    full, _ = prm.build_prm(prm.Args(lora_r=0), torch.float32)
    assert all(p.requires_grad for p in full.parameters())
    assert not hasattr(full.backbone, "lm_head") and type(full.backbone).__name__ == "LlamaModel"


def test_an_adapter_as_large_as_its_layer_gets_a_note(tmp_path):
    """The tiny backbone's attention projections are 64 -> 64: from rank 32, 64 r + 64 r >= 64 x 64, and an adapter
    trains as many weights as the layer holds; its MLP's 64 -> 256 and 256 -> 64 only from 52 (64 x 256 / 320 =
    51.2)."""
    model, _ = prm.build_prm(prm.Args(lora_r=31), torch.float32)
    assert prm.oversized_lora_note(model.backbone, 31) is None
    layers = model.backbone.get_base_model().config.num_hidden_layers
    process = run_prm("--lora-r", "32", "--output-dir", str(tmp_path / "run"), *QUICK)
    assert (f"note: with --lora-r 32, {4 * layers} adapters hold at least as many weights as the layer they adapt"
            in process.stdout)
    assert "in 64, out 64); pass --lora-r 31 or less" in process.stdout


def test_scores_do_not_depend_on_batching():
    torch.manual_seed(0)
    model, _ = prm.build_prm(prm.Args(), torch.float32)
    rows = builtin_rows(12)
    prompts, steps = [r["prompt"] for r in rows], [r["completions"] for r in rows]
    one_by_one = [prm.score_steps(model, [p], [s])[0] for p, s in zip(prompts, steps, strict=True)]
    batched = prm.score_steps(model, prompts, steps, batch_size=5)
    assert [len(s) for s in batched] == [len(s) for s in steps]
    for a, b in zip(one_by_one, batched, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("lengths, capacity, rows", [
    ([5], 10, 1), ([3, 3, 3, 3], 6, 2), ([9, 1, 8, 2, 7, 3], 10, 3), ([10, 10, 10], 10, 3),
    ([4, 7, 2, 9, 9, 1, 5, 6], 18, 3),
    ([11, 11, 12, 3, 11], 24, 3),  # 48 tokens would fit 2 rows of 24 (12+11+..), but not filled longest first
])
def test_pack_bins_places_every_example_once_within_capacity_in_few_nearly_equal_rows(lengths, capacity, rows):
    bins = prm.pack_bins(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    fills = [sum(lengths[i] for i in b) for b in bins]
    assert all(0 < fill <= capacity for fill in fills)
    assert len(bins) == rows >= math.ceil(sum(lengths) / capacity)
    assert max(fills) - min(fills) <= max(lengths)  # no nearly empty last row


def test_packed_batches_give_the_same_logits_and_gradients_as_padded_ones():
    torch.manual_seed(0)
    model, _ = prm.build_prm(prm.Args(), torch.float32)
    assert prm.use_packing(model) and model.pack_rows
    tokenizer = model.tokenizer
    examples, _, _ = prm.encode_rows(tokenizer, builtin_rows(9), "\n", 1024)
    lengths = [len(e["input_ids"]) for e in examples]
    assert len(set(lengths)) > 3  # padding would be waste
    results = {}
    for pack in (False, True):
        batch = prm.collate(examples, tokenizer.pad_token_id, "cpu", pack)
        logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["positions"])
        loss, _ = prm.prm_loss(logits, batch["labels"], batch["mask"], "bce")
        model.zero_grad()
        loss.backward()
        results[pack] = (batch, logits.detach(), [p.grad.clone() for p in model.parameters()])
    (padded, padded_logits, padded_grads), (packed, packed_logits, packed_grads) = results[False], results[True]
    assert packed["tokens"] == padded["tokens"] == sum(lengths)
    assert packed["input_ids"].numel() < padded["input_ids"].numel()  # fewer rows, only their tails padded
    assert packed["input_ids"].shape[1] <= 2 * max(lengths)
    assert packed["position_ids"].max() < max(lengths)  # padded tails sit at position 0, not past every example
    assert torch.equal(packed["labels"], padded["labels"]) and torch.equal(packed["mask"], padded["mask"])
    mask = padded["mask"]
    torch.testing.assert_close(packed_logits[mask], padded_logits[mask], atol=1e-5, rtol=1e-5)
    for a, b in zip(packed_grads, padded_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # scores, packed, equal the unpacked ones
    rows = builtin_rows(7)
    prompts, steps = [r["prompt"] for r in rows], [r["completions"] for r in rows]
    packed_scores = prm.score_steps(model, prompts, steps, batch_size=4)
    model.pack_rows = False
    for a, b in zip(packed_scores, prm.score_steps(model, prompts, steps, batch_size=4), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_rows_of_equal_length_are_not_packed():
    examples = [{"input_ids": [1] * 10, "positions": [9], "labels": [1.0]} for _ in range(4)]
    batch = prm.collate(examples, 0, "cpu", pack=True)
    assert batch["input_ids"].shape == (4, 10) and batch["position_ids"] is None
    assert batch["attention_mask"] is not None and batch["positions"].tolist() == [[9], [19], [29], [39]]


class PositionBlindBackbone(torch.nn.Module):
    """A backbone that drops position ids: packed examples would see each other. Packing must be turned down."""

    def __init__(self, backbone):
        super().__init__()
        self.inner, self.config = backbone, backbone.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)


def test_the_head_reads_the_width_the_backbone_returns(tmp_path):
    """OPT-350m projects its 1024-wide hidden states down to 512 (word_embed_proj_dim) before returning them."""
    from transformers import OPTConfig, OPTModel

    tokenizer = prm.build_tiny_tokenizer()
    torch.manual_seed(0)
    OPTModel(OPTConfig(hidden_size=32, word_embed_proj_dim=16, num_hidden_layers=1, ffn_dim=64, num_attention_heads=2,
                       vocab_size=len(tokenizer), max_position_embeddings=64)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, _ = prm.build_prm(prm.Args(model=str(tmp_path), max_length=64), torch.float32)
    assert model.head.in_features == 16 and model.config["hidden_size"] == 16
    scores = prm.score_steps(model, ["3+4=", "1+1="], [["3+4=7", "7"], ["1+1=2"]])
    assert [len(row) for row in scores] == [2, 1] and all(0.0 < x < 1.0 for row in scores for x in row)


@pytest.mark.parametrize("backbone_dropout", [False, True])
def test_backbone_dropout_is_off_unless_asked_and_the_saved_config_keeps_it(backbone_dropout, tmp_path):
    """A GPT-2 with dropout everywhere (embeddings, attention, residuals: 0.1 to 0.3): training runs without it
    by default (two passes agree; with --backbone-dropout they do not), and config.json keeps the rates."""
    from transformers import GPT2Config, GPT2Model

    tokenizer = prm.build_tiny_tokenizer()
    rates = {"attn_pdrop": 0.3, "embd_pdrop": 0.1, "resid_pdrop": 0.2}
    GPT2Model(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tokenizer), n_positions=64, **rates)
              ).save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    model, _ = prm.build_prm(prm.Args(model=str(tmp_path / "gpt2"), max_length=64,
                                      backbone_dropout=backbone_dropout), torch.float32)
    model.train()
    ids, positions = torch.tensor([[5, 6, 7, 8, 9, 10]]), torch.tensor([[2, 5]])
    first, second = model(ids, None, None, positions), model(ids, None, None, positions)
    assert torch.equal(first, second) != backbone_dropout
    prm.save_prm(str(tmp_path / "saved"), model)
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert {name: saved[name] for name in rates} == rates


def test_packing_is_refused_for_a_backbone_that_would_mix_examples():
    torch.manual_seed(0)
    model, _ = prm.build_prm(prm.Args(), torch.float32)
    model.backbone = PositionBlindBackbone(model.backbone)
    model.pack_rows = True
    assert not prm.use_packing(model) and not model.pack_rows


class ShortConvBackbone(torch.nn.Module):
    """A backbone with a width-2 causal convolution after its last layer, as recurrent and convolutional layers
    (LFM2, Mamba) have: each token also reads the token before it, across example boundaries, whatever the mask.
    The leak (1e-3 of the scale) is far too small for the check against each example alone."""

    def __init__(self, backbone):
        super().__init__()
        self.inner, self.config = backbone, backbone.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        hidden = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=use_cache).last_hidden_state  # [R, T, H]
        previous = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)
        return BaseModelOutput(last_hidden_state=hidden + 1e-3 * previous)


def test_packing_is_refused_for_a_backbone_that_carries_state_across_examples():
    torch.manual_seed(0)
    model, _ = prm.build_prm(prm.Args(), torch.float32)
    assert prm.use_packing(model) and model.pack_rows  # the tiny Llama keeps packed examples apart
    model.backbone = ShortConvBackbone(model.backbone)
    assert not prm.use_packing(model) and not model.pack_rows


def test_the_packing_check_feeds_no_special_token():
    """Its made-up examples hold no pad, BOS or EOS id, wherever they lie: with a pad id in its input and no
    attention mask, GPT-2 warns the user to pass an attention mask (the tiny model's vocabulary made the check
    feed EOS, id 2)."""
    torch.manual_seed(0)
    model, _ = prm.build_prm(prm.Args(), torch.float32)
    tokenizer, fed = model.tokenizer, []
    model.backbone.register_forward_pre_hook(lambda module, args, kwargs: fed.append(kwargs["input_ids"]),
                                             with_kwargs=True)
    for pad_id in (None, 7):  # the model's own, then a pad id among the ids the check would take first
        model.backbone.config.pad_token_id = pad_id
        fed.clear()
        assert prm.use_packing(model)
        ids = set(torch.cat([batch.flatten() for batch in fed]).tolist())
        assert fed and ids.isdisjoint({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, 7}
                                      if pad_id else set(tokenizer.all_special_ids)), ids
    model.backbone = ConfigWithoutPadBackbone(model.backbone)  # (CodeGen's and RWKV's configs have no such field)
    assert not hasattr(model.backbone.config, "pad_token_id") and prm.use_packing(model)


class ConfigWithoutPadBackbone(torch.nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.inner, self.config = backbone, SimpleNamespace(vocab_size=backbone.config.vocab_size)

    def forward(self, **kwargs):
        return self.inner(**kwargs)


# ---------------------------------------------------------------------------------------------------------------
# End to end, through the command line


def test_default_run_few_steps(tmp_path):
    out = tmp_path / "run"
    process = run_prm("--output-dir", str(out), *QUICK, "--peak-tflops", "0.25")
    summary = read_summary(out)
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["steps"] == 3 and summary["tokens_per_s"] > 0
    assert summary["peak_memory_mb"] >= max(row["memory_mb"] for row in read_metrics(out))  # a peak over the samples
    assert summary["matmul_tflops_measured"] > 0 and 0 < summary["flop_floor_fraction"] < 1.5  # CPU: vs measured
    # model FLOP/s: 6 per body weight per trained token (full fine-tuning), over the same timed steps as tokens/s
    backbone = prm.build_tiny_backbone(prm.build_tiny_tokenizer())
    body = sum(p.numel() for p in backbone.parameters()) - backbone.get_input_embeddings().weight.numel()
    assert summary["model_tflops_per_s"] == pytest.approx(6 * body * summary["tokens_per_s"] / 1e12, rel=1e-6)
    assert summary["flop_floor_fraction"] == pytest.approx(
        summary["model_tflops_per_s"] / summary["matmul_tflops_measured"], rel=1e-6)
    assert summary["mfu"] == pytest.approx(summary["model_tflops_per_s"] / 0.25, rel=1e-6)  # --peak-tflops 0.25
    assert summary["dropped_steps"] == 0 and summary["dropped_rows"] == 0 and summary["eval_rows"] == 40
    assert 0.0 <= summary["eval_auroc_end"] <= 1.0 and 0.0 <= summary["baseline_position_auroc"] <= 1.0
    metrics = read_metrics(out)
    assert [row["step"] for row in metrics] == [1, 2, 3]
    assert "eval_auroc" in metrics[1] and "eval_auroc" not in metrics[0]  # --eval-every 2
    # the start and final evaluations: rows of their own, the same figures as the summary's
    evaluations = read_eval_rows(out)
    assert [row["step"] for row in evaluations] == [0, 3] and "eval_auroc" not in metrics[2]
    for key in ("eval_step_accuracy", "eval_auroc", "eval_first_error_f1"):
        assert evaluations[0][key] == pytest.approx(summary[f"{key}_start"], nan_ok=True), key
        assert evaluations[1][key] == pytest.approx(summary[f"{key}_end"], nan_ok=True), key
    for key in ("loss", "accuracy", "grad_norm", "learning_rate", "step_time_s", "labelled_steps"):
        assert math.isfinite(metrics[-1][key]), key
    assert "eval at step 0" in process.stdout and "eval at step 3" in process.stdout
    final = out / "final"
    for name in ("config.json", "model.safetensors", "reward_head.safetensors", "prm_config.json", "tokenizer.json"):
        assert (final / name).is_file(), name
    config = json.loads((final / "prm_config.json").read_text())
    assert config == {**config, "base_model": "tiny", "lora": False, "step_separator": "\n", "max_length": 1024,
                      "loss_kind": "bce"}
    assert not (tmp_path / "run" / "final.tmp").exists()


def test_save_reload_and_score_command_give_the_training_scores(tmp_path):
    rows = builtin_rows(6) + [{"prompt": "start 1" * 200 + "\n", "completions": ["1+1=2"]},  # prompt too long
                              {"prompt": "start 3\n", "completions": []},
                              {"prompt": "start 3\n", "completions": ["3+1=4", "4+4=8", "8-1=7"]}]
    # every field of an input row is written back as it was: ids, metadata, labels of any kind
    rows = [{"id": f"row-{k}", **row, "meta": {"k": [k]}} for k, row in enumerate(rows)]
    rows[0]["labels"] = [True] * len(rows[0]["completions"])
    rows[-1]["labels"] = ["+", "+", "-"]  # Math-Shepherd's labels: not needed to score, so not checked
    data = write_rows(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "run"
    run_prm("--output-dir", str(out), *QUICK, "--max-length", "1000", "--score-data-path", str(data))
    trained = read_jsonl(out / "scores.jsonl")
    scored_file = tmp_path / "scores.jsonl"
    process = run_prm("--prm-path", str(out / "final"), "--score-data-path", str(data), "--scores-output",
                      str(scored_file))
    assert "scored" in process.stdout
    reloaded = read_jsonl(scored_file)
    for written in (trained, reloaded):  # compared as JSON text: true must not come back as 1.0
        assert [json.dumps({k: v for k, v in r.items() if k != "scores"}) for r in written] == [
            json.dumps(row) for row in rows]
    assert [len(r["scores"]) for r in reloaded] == [len(r["completions"]) for r in rows[:6]] + [0, 0, 3]
    for a, b in zip(trained, reloaded, strict=True):
        np.testing.assert_allclose(a["scores"], b["scores"], rtol=0, atol=1e-6)
    assert all(0.0 < s < 1.0 for r in reloaded for s in r["scores"])  # bce scores are probabilities
    # and from Python, with the same numbers
    model = prm.load_prm(str(out / "final"), device="cpu")
    scores = prm.score_steps(model, [r["prompt"] for r in rows], [r["completions"] for r in rows], batch_size=4)
    for a, b in zip(scores, reloaded, strict=True):
        np.testing.assert_allclose(a, b["scores"], rtol=0, atol=1e-6)


def test_lora_on_a_saved_and_reloaded_tiny_model(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = prm.build_tiny_tokenizer()
    torch.manual_seed(0)
    causal_lm = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                                             pad_token_id=tokenizer.pad_token_id))
    base = tmp_path / "base"
    causal_lm.save_pretrained(base)
    tokenizer.save_pretrained(base)
    data = write_rows(tmp_path / "rows.jsonl", builtin_rows(5))
    out = tmp_path / "run"
    run_prm("--output-dir", str(out), *QUICK, "--model", str(base), "--lora-r", "4", "--score-data-path", str(data))
    summary = read_summary(out)
    assert 0 < summary["trainable_parameters"] < summary["parameters"] / 5
    final = out / "final"
    assert (final / "adapter_model.safetensors").is_file() and (final / "reward_head.safetensors").is_file()
    assert not (final / "model.safetensors").exists() and not (final / "base").exists()  # the base reloads by path
    config = json.loads((final / "prm_config.json").read_text())
    assert config["lora"] and config["backbone"] == str(base.resolve())
    model = prm.load_prm(str(final), device="cpu")
    scores = prm.score_steps(model, [r["prompt"] for r in builtin_rows(5)], [r["completions"] for r in builtin_rows(5)])
    for a, b in zip(scores, read_jsonl(out / "scores.jsonl"), strict=True):
        np.testing.assert_allclose(a, b["scores"], rtol=0, atol=1e-6)


def test_lora_on_the_tiny_model_saves_its_base(tmp_path):
    rows = builtin_rows(4)
    data = write_rows(tmp_path / "rows.jsonl", rows)
    args = prm.Args(output_dir=str(tmp_path / "run"), total_steps=2, batch_size=8, eval_every=0, num_eval_rows=20,
                    num_val_rows=10, lora_r=4, score_data_path=str(data))
    prm.train(args)
    final = tmp_path / "run" / "final"
    assert (final / "base" / "model.safetensors").is_file() and (final / "adapter_model.safetensors").is_file()
    model = prm.load_prm(str(final), device="cpu")
    scores = prm.score_steps(model, [r["prompt"] for r in rows], [r["completions"] for r in rows])
    for a, b in zip(scores, read_jsonl(tmp_path / "run" / "scores.jsonl"), strict=True):
        np.testing.assert_allclose(a, b["scores"], rtol=0, atol=1e-6)


def test_mse_loss_regresses_the_raw_output(tmp_path):
    out = tmp_path / "run"
    run_prm("--output-dir", str(out), "--loss-kind", "mse", "--total-steps", "25", "--batch-size", "16",
            "--eval-every", "0", "--num-eval-rows", "40", "--num-val-rows", "20", "--warmup-steps", "0")
    losses = [row["loss"] for row in read_metrics(out)]
    # a random head's raw outputs are far from the 0/1 labels: regression brings the squared error well down
    assert np.mean(losses[-5:]) < 0.5 * losses[0]
    assert json.loads((out / "final" / "prm_config.json").read_text())["loss_kind"] == "mse"


def test_soft_labels_are_learned_as_given(tmp_path):
    # every step labelled 0.7: BCE with soft labels drives the mean score to 0.7 (flooring them, as TRL's
    # int() does, would drive it to 0, and rounding to 1)
    rows = [{**row, "labels": [0.7] * len(row["completions"])} for row in builtin_rows(200)]
    data = write_rows(tmp_path / "soft.jsonl", rows)
    out = tmp_path / "run"
    run_prm("--output-dir", str(out), "--data-path", str(data), "--eval-data-path", str(data), "--total-steps",
            "40", "--batch-size", "16", "--learning-rate", "1e-2", "--warmup-steps", "0", "--eval-every", "0")
    metrics = read_metrics(out)
    assert np.mean([row["score_mean"] for row in metrics[-5:]]) == pytest.approx(0.7, abs=0.05)
    assert read_summary(out)["train_rows"] == 180  # a tenth held out for the threshold


def test_bad_row_stops_with_the_line_and_exit_code_2(tmp_path):
    good = {"prompt": "start 1\n", "completions": ["1+1=2"], "labels": [True]}
    data = write_rows(tmp_path / "bad.jsonl", [good, good, {"prompt": "start 1\n", "completions": ["1+1=2"],
                                                            "labels": [True, False]}])
    process = run_prm("--output-dir", str(tmp_path / "run"), "--data-path", str(data), expect_rc=2)
    assert "bad.jsonl:3: 2 labels for 1 steps" in process.stderr and "Traceback" not in process.stderr
    assert not (tmp_path / "run" / "final").exists()


def test_skip_bad_rows_counts_and_skips(tmp_path):
    rows = builtin_rows(40)
    bad = ['{"prompt": "p", "completions": ["a"], "labels": [1, 0]}',
           '{"prompt": "p", "completions": ["a"], "labels": [2]}',
           '{"prompt": "p", "labels": [1]}',
           '{"prompt": "p", "completions": ["a"], "labels": [1]']
    data = write_rows(tmp_path / "rows.jsonl", rows[:10] + bad[:2] + rows[10:] + bad[2:])
    out = tmp_path / "run"
    process = run_prm("--output-dir", str(out), "--data-path", str(data), "--eval-data-path", str(data),
                      "--skip-bad-rows", "--total-steps", "2", "--batch-size", "8", "--eval-every", "0")
    assert all(f"rows.jsonl:{line}:" in process.stderr for line in (11, 12, 43, 44))
    summary = read_summary(out)
    assert summary["skipped_rows"] == 2 * 4 and summary["train_rows"] == 36 and summary["eval_rows"] == 40


@pytest.mark.slow
def test_default_run_learns_to_check_steps(tmp_path):
    out = tmp_path / "run"
    run_prm("--output-dir", str(out), timeout=900)
    summary = read_summary(out)
    assert summary["eval_auroc_start"] < 0.8
    # seeds 1-5 end at AUROC 0.928-1.000 and first-error F1 0.760-0.995 (seed 1, the default: 0.999 and 0.993)
    assert summary["eval_auroc_end"] >= 0.9 and summary["eval_first_error_f1_end"] >= 0.8
    # a scorer blind to step content does clearly worse
    assert summary["baseline_position_auroc"] < 0.85 and summary["baseline_position_first_error_f1"] < 0.5


def test_lr_schedule_by_hand():
    """Linear warm-up to the full rate, then constant or a half cosine over the updates left: 0.5 (1 + cos(pi p)),
    p = (update - warmup) / (total - warmup)."""
    constant = prm.lr_lambda(prm.Args(warmup_steps=2, lr_schedule="constant"), 5)
    assert [constant(u) for u in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]
    cosine = prm.lr_lambda(prm.Args(warmup_steps=1, lr_schedule="cosine"), 5)
    assert [cosine(u) for u in range(5)] == pytest.approx([1.0, 1.0, 0.8535534, 0.5, 0.1464466], abs=1e-7)
    no_warmup = prm.lr_lambda(prm.Args(warmup_steps=0, lr_schedule="cosine"), 4)
    assert [no_warmup(u) for u in range(4)] == pytest.approx([1.0, 0.8535534, 0.5, 0.1464466], abs=1e-7)


def test_step_flops_by_hand():
    # 10 weights, 7 tokens: forward 2 * 10 * 7 = 140; full fine-tuning adds 280 for input and weight gradients,
    # LoRA (frozen weights) only the 140 of the input gradients
    assert prm.step_flops(10, 7, full_finetune=True) == 420
    assert prm.step_flops(10, 7, full_finetune=False) == 280


# ---------------------------------------------------------------------------------------------------------------
# Wiring that a helper's mutation audit found untested: each test fails on the mutation named in its docstring


def test_truncation_drops_every_step_after_one_that_does_not_fit():
    """A shorter step after one that does not fit is dropped too: keeping it would hand it the dropped step's label
    (labels are kept in order, as many as positions)."""
    tokenizer = prm.build_tiny_tokenizer()
    # BOS + "start 7\n" = 9 tokens; step 0 ends at index 14; step 1 (15 tokens) does not fit in 20, step 2 would
    ids, positions = prm.build_prm_example(tokenizer, "start 7\n", ["7+2=9", "9-3=6 and more", "6=6"],
                                           step_separator="\n", max_length=20)
    assert positions == [14] and len(ids) == 15


def test_scores_are_the_raw_output_for_mse_and_its_sigmoid_for_bce():
    for kind, expected in (("mse", 3.0), ("bce", 1 / (1 + math.exp(-3.0)))):
        model, _ = prm.build_prm(prm.Args(loss_kind=kind), torch.float32)
        with torch.no_grad():
            model.head.weight.zero_()
            model.head.bias.fill_(3.0)
        assert prm.score_steps(model, ["start 1\n"], [["1+1=2", "2+1=3"]]) == [[pytest.approx(expected)] * 2], kind


def test_score_steps_uses_the_prms_own_separator():
    """A PRM trained on "\\n\\n"-separated steps is scored at the tokens it was trained on."""
    torch.manual_seed(0)
    model, _ = prm.build_prm(prm.Args(step_separator="\n\n"), torch.float32)
    rows = builtin_rows(4)
    expected = prm.predict(model, prm.encode_rows(model.tokenizer, rows, "\n\n", 1024)[0], 8)
    scored = prm.score_steps(model, [row["prompt"] for row in rows], [row["completions"] for row in rows])
    for got, want in zip(scored, expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_lora_dropout_survives_the_backbone_dropout_switch_off():
    """The backbone's dropout is zeroed before the adapters are added, not after: --lora-dropout stays."""
    model, _ = prm.build_prm(prm.Args(lora_r=4, lora_dropout=0.25), torch.float32)
    rates = [module.p for name, module in model.backbone.named_modules()
             if "lora_dropout" in name and isinstance(module, torch.nn.Dropout)]
    assert rates and set(rates) == {0.25}


def test_attention_dropout_kept_as_a_float_on_the_module_is_off(tmp_path):
    """Llama, Qwen and Mistral apply `self.attention_dropout` (a float from the config) in train mode, not an
    nn.Dropout: training zeroes it too, so two forward passes agree."""
    from transformers import LlamaConfig, LlamaModel

    tokenizer = prm.build_tiny_tokenizer()
    LlamaModel(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, attention_dropout=0.5)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, _ = prm.build_prm(prm.Args(model=str(tmp_path), max_length=64), torch.float32)
    model.train()
    ids, positions = torch.tensor([[5, 6, 7, 8, 9, 10]]), torch.tensor([[2, 5]])
    assert torch.equal(model(ids, None, None, positions), model(ids, None, None, positions))


def test_the_threshold_is_chosen_on_validation_rows_only(monkeypatch):
    """Validation scores .9 / .7 put the threshold at .8 (not the 0.5 used without validation rows); the eval
    rows' (.3 / .2) would pull it to .25, an optimistic F1 measured on the rows it was tuned on."""
    model, _ = prm.build_prm(prm.Args(), torch.float32)
    val = [{"input_ids": [1], "positions": [0], "labels": [y], "all_labels": [y], "split": "val"} for y in (1.0, 0.0)]
    eval_rows = [{**row, "split": "eval"} for row in val]
    table = {"val": {1.0: 0.9, 0.0: 0.7}, "eval": {1.0: 0.3, 0.0: 0.2}}
    monkeypatch.setattr(prm, "predict", lambda _, rows, __: [[table[r["split"]][r["labels"][0]]] for r in rows])
    assert prm.evaluate_prm(model, val, eval_rows, 8)["eval_first_error_threshold"] == pytest.approx(0.8)


def test_confident_scores_do_not_round_to_one():
    """fp32's sigmoid is exactly 1.0 past a logit of 16.6: steps scored 18 and 20 would tie in AUROC and in the
    threshold search. predict takes it in fp64."""
    model, _ = prm.build_prm(prm.Args(), torch.float32)
    for logit in (18.0, 20.0):
        with torch.no_grad():
            model.head.weight.zero_()
            model.head.bias.fill_(logit)
        score = prm.score_steps(model, ["start 1\n"], [["1+1=2"]], 4)[0][0]  # (through predict)
        assert score < 1.0 and score == pytest.approx(1 / (1 + math.exp(-logit)), rel=0, abs=1e-15)


def test_load_prm_is_in_eval_mode(tmp_path):
    model, _ = prm.build_prm(prm.Args(), torch.float32)
    prm.save_prm(str(tmp_path / "prm"), model)
    assert not prm.load_prm(str(tmp_path / "prm"), device="cpu").training


def test_split_steps_drops_blank_steps():
    assert prm.split_steps("a\n  \nb\n", "\n") == ["a", "b"]


def test_score_steps_keeps_to_the_prms_max_length():
    """The prompt "start 7\\n" is 9 tokens with BOS and each step 6: in 18 tokens only the first step is scored."""
    model, _ = prm.build_prm(prm.Args(max_length=18), torch.float32)
    scores = prm.score_steps(model, ["start 7\n", "start 7\n"], [["7+2=9", "9-3=6"], ["7+1=8"]])
    assert [len(row) for row in scores] == [1, 1]
    model.config["max_length"] = 1024
    assert [len(row) for row in prm.score_steps(model, ["start 7\n"], [["7+2=9", "9-3=6"]])] == [2]
