"""prm.py's kernels, metrics and tokenisation against naive references, and the model's batching."""

import itertools
import math
import random

import numpy as np
import pytest
import torch

import prm


def naive_loss(logits, labels, mask, kind):
    total, count = 0.0, 0
    for z, y, m in zip(logits.flatten().tolist(), labels.flatten().tolist(), mask.flatten().tolist()):
        if m:
            p = 1 / (1 + math.exp(-z))
            total += -(y * math.log(p) + (1 - y) * math.log(1 - p)) if kind == "bce" else (z - y) ** 2
            count += 1
    return total / max(count, 1)


def random_batch(seed=0, rows=4, steps=5):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, steps, generator=generator) * 3
    labels = torch.rand(rows, steps, generator=generator)  # soft labels
    labels[0] = (labels[0] > 0.5).float()  # and hard ones
    mask = torch.rand(rows, steps, generator=generator) > 0.3
    mask[1] = False  # a row with no steps
    return logits, labels, mask


@pytest.mark.parametrize("kind", ["bce", "mse"])
def test_prm_loss_matches_a_naive_reference(kind):
    logits, labels, mask = random_batch()
    loss, stats = prm.prm_loss(logits, labels, mask, kind)
    assert loss.item() == pytest.approx(naive_loss(logits, labels, mask, kind), rel=1e-5)
    scores = torch.sigmoid(logits) if kind == "bce" else logits
    agree = ((scores >= 0.5) == (labels >= 0.5))[mask]
    assert stats["steps"].item() == mask.sum().item()
    assert stats["accuracy"].item() == pytest.approx(agree.float().mean().item())


@pytest.mark.parametrize("kind", ["bce", "mse"])
def test_micro_batch_losses_with_the_batch_count_sum_to_the_batch_loss_and_gradient(kind):
    logits, labels, mask = random_batch(seed=1, rows=6)
    whole = logits.clone().requires_grad_()
    prm.prm_loss(whole, labels, mask, kind)[0].backward()
    parts = logits.clone().requires_grad_()
    total = sum(
        prm.prm_loss(parts[i : i + 2], labels[i : i + 2], mask[i : i + 2], kind, num_labelled=mask.sum().item())[0]
        for i in range(0, 6, 2)
    )
    total.backward()
    assert total.item() == pytest.approx(prm.prm_loss(logits, labels, mask, kind)[0].item(), rel=1e-6)
    torch.testing.assert_close(parts.grad, whole.grad)


def test_padding_garbage_gets_no_loss_and_no_gradient_and_bf16_is_computed_in_fp32():
    logits, labels, mask = random_batch(seed=2)
    garbage = logits.masked_fill(~mask, float("nan")).requires_grad_()
    loss, _ = prm.prm_loss(garbage, labels.masked_fill(~mask, 7.0), mask)
    loss.backward()
    assert math.isfinite(loss.item()) and (garbage.grad[~mask] == 0).all()
    assert prm.prm_loss(logits, labels, torch.zeros_like(mask))[0].item() == 0.0  # no step at all: 0, not NaN
    bf16_loss, _ = prm.prm_loss(logits.bfloat16(), labels, mask)
    assert bf16_loss.dtype == torch.float32
    with pytest.raises(ValueError, match="bce or mse"):
        prm.prm_loss(logits, labels, mask, "hinge")


def test_step_accuracy_by_hand():
    assert prm.step_accuracy([0.9, 0.4, 0.5, 0.2], [1, 1, 0, 0.0]) == pytest.approx(0.5)
    assert prm.step_accuracy([0.7], [0.5]) == 1.0  # a soft label of 0.5 counts as correct
    assert prm.step_accuracy([0.7, 0.2], [1, 0], threshold=0.8) == 0.5
    assert math.isnan(prm.step_accuracy([], [])) and math.isnan(prm.step_accuracy([float("nan")], [1]))


def pairwise_auroc(scores, labels):
    positives = [s for s, y in zip(scores, labels) if y >= 0.5]
    negatives = [s for s, y in zip(scores, labels) if y < 0.5]
    wins = sum((p > n) + 0.5 * (p == n) for p, n in itertools.product(positives, negatives))
    return wins / (len(positives) * len(negatives))


@pytest.mark.parametrize("seed", range(4))
def test_auroc_matches_the_pairwise_count_with_ties(seed):
    rng = random.Random(seed)
    scores = [rng.choice([0.1, 0.2, 0.5, 0.7, 0.9]) for _ in range(60)]  # many ties
    labels = [rng.choice([0.0, 1.0, 0.3, 0.8]) for _ in range(60)]
    assert prm.auroc(scores, labels) == pytest.approx(pairwise_auroc(scores, labels))


def test_auroc_by_hand_and_nan_cases():
    # positives {0.9, 0.8}, negatives {0.8, 0.3}: pairs won 1 + 1 + 1, tied 1 -> 3.5 / 4
    assert prm.auroc([0.9, 0.8, 0.8, 0.3], [1, 1, 0, 0]) == pytest.approx(0.875)
    assert math.isnan(prm.auroc([0.1, 0.2], [1, 1])) and math.isnan(prm.auroc([float("nan"), 0.2], [1, 0]))


def test_first_error_f1_by_hand():
    scores = [[0.9, 0.2, 0.1], [0.9, 0.8], [0.9, 0.3], [0.8, 0.9, 0.95]]
    labels = [[1, 0, 0], [1, 1], [1, 1], [1, 1, 0]]
    # erroneous: #0 found at step 1 (hit), #3's error at step 2 missed -> 1/2; correct: #1 kept whole, #2 not -> 1/2
    f1, acc_err, acc_corr = prm.first_error_f1(scores, labels, 0.5)
    assert (acc_err, acc_corr) == (0.5, 0.5) and f1 == pytest.approx(0.5)
    assert math.isnan(prm.first_error_f1([[0.1]], [[0.0]], 0.5)[0])  # no correct solution: acc_corr, F1 NaN
    assert prm.first_error_f1([[0.9], [0.1]], [[0.0], [1.0]], 0.5)[0] == 0.0  # both rates 0


def test_a_first_error_truncated_away_is_a_miss_not_a_correct_solution():
    # labels of 3 steps, scores of the first 2 only (the third truncated away): the error at step 2 cannot be hit
    f1, acc_err, acc_corr = prm.first_error_f1([[0.9, 0.9], [0.9]], [[1, 1, 0], [1]], 0.5)
    assert (acc_err, acc_corr) == (0.0, 1.0) and f1 == 0.0


def best_threshold_by_brute_force(scores, labels):
    values = sorted({s for row in scores for s in row})
    candidates = [values[0] - 1] + [(a + b) / 2 for a, b in zip(values, values[1:])] + [values[-1] + 1]
    f1 = [prm.first_error_f1(scores, labels, t)[0] for t in candidates]
    return max(f1), candidates[f1.index(max(f1))]


@pytest.mark.parametrize("seed", range(5))
def test_choose_threshold_finds_the_best_f1(seed):
    rng = random.Random(seed)
    labels = [prm.make_solution(rng)["labels"] for _ in range(30)]
    scores = [[min(1.0, max(0.0, y * 0.6 + rng.random() * 0.5)) for y in row] for row in labels]
    threshold = prm.choose_threshold(scores, labels)
    best_f1, best_threshold = best_threshold_by_brute_force(scores, labels)
    assert prm.first_error_f1(scores, labels, threshold)[0] == pytest.approx(best_f1)
    assert threshold == pytest.approx(best_threshold)  # ties go to the lowest


def test_choose_threshold_edge_cases():
    assert prm.choose_threshold([[0.9, 0.8]], [[1, 1]]) == 0.5  # one kind of solution: F1 NaN everywhere
    assert prm.choose_threshold([], []) == 0.5 and prm.choose_threshold([[float("nan")]], [[0]]) == 0.5
    low = 0.3
    high = np.nextafter(low, 1.0)  # two scores one float apart: the threshold must still sit above the lower one
    threshold = prm.choose_threshold([[0.9, low], [0.9, high]], [[1, 0], [1, 1]])
    assert low < threshold <= high


@pytest.mark.parametrize(
    "how, expected", [("min", 0.2), ("prod", 0.9 * 0.2 * 0.5), ("last", 0.5), ("mean", (0.9 + 0.2 + 0.5) / 3)]
)
def test_aggregate_scores(how, expected):
    assert prm.aggregate_scores([0.9, 0.2, 0.5], how) == pytest.approx(expected)
    assert prm.aggregate_scores([], how) == 0.0  # no scored step: the score of a surely wrong one


def test_the_builtin_task_labels_steps_before_the_first_error_and_keeps_held_out_rows_apart():
    rows = [prm.make_solution(random.Random(seed)) for seed in range(200)]
    for row in rows:
        value, correct = int(row["prompt"].split()[1]), True
        for step, label in zip(row["completions"], row["labels"]):
            correct = correct and int(step[0]) == value  # wrong from the first misstated value on
            assert label == float(correct) and eval(step.replace("=", "==")) is True  # its own arithmetic holds
            value = int(step.split("=")[1])
    train, val, held_out = prm.builtin_task(3, 20, 30)

    def keys(rows):
        return {(r["prompt"], *r["completions"]) for r in rows}

    assert len(keys(train)) == len(train) and not keys(train) & (keys(val) | keys(held_out))
    assert len(val) == 20 and len(held_out) == 30 and not keys(val) & keys(held_out)
    assert prm.builtin_task(3, 50, 100)[0] == train  # the held-out pool never changes the training rows


def merging_bpe_tokenizer(with_bos: bool = True):
    """A BPE trained without a pre-tokenizer on text where newlines are mostly followed by 'The': its merges cross
    the end of a step ('.\\n', '\\nThe', '\\n\\n')."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["The cat sat.\nThe dog ran.\nThe end.\n\nThe sum is 12.\nThe cat ate.\n"] * 200
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.decoder = decoders.Fuse()
    bpe.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<pad>", "<s>", "<unk>"], show_progress=False)
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", unk_token="<unk>", bos_token="<s>" if with_bos else None
    )


@pytest.mark.parametrize("separator", ["\n", "\n\n"])
def test_step_boundaries_hold_with_a_bpe_whose_merges_cross_them(separator):
    tokenizer = merging_bpe_tokenizer()
    prompt, steps = "The sum.\n", ["The cat sat.", "The dog ran.", "The end."]
    joined = prompt + "".join(step + separator for step in steps)
    ends = list(itertools.accumulate([len(prompt)] + [len(step + separator) for step in steps]))[1:]
    offsets = tokenizer._tokenizer.encode(joined, add_special_tokens=False).offsets
    assert any(start < end < stop for start, stop in offsets for end in ends[:-1])  # the joined text merges across
    ids, positions = prm.build_prm_example(tokenizer, prompt, steps, step_separator=separator, max_length=500)
    assert ids[0] == tokenizer.bos_token_id and len(positions) == len(steps)
    for k, position in enumerate(positions):
        assert tokenizer.decode(ids[: position + 1], skip_special_tokens=True) == joined[: ends[k]]
        assert tokenizer.decode(ids[position]).endswith(separator[-1])  # the label token ends the separator
    texts = [prompt] + [step + separator for step in steps]
    pieces = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    assert ids == [tokenizer.bos_token_id] + [i for piece in pieces for i in piece]


def test_truncation_drops_whole_steps_with_a_bpe_without_bos():
    tokenizer = merging_bpe_tokenizer(with_bos=False)
    prompt, steps = "The sum.\n", ["The cat sat.", "The dog ran.", "The end."]
    full_ids, full_positions = prm.build_prm_example(tokenizer, prompt, steps, step_separator="\n", max_length=500)
    assert tokenizer.bos_token_id is None and full_ids[0] != tokenizer.pad_token_id
    ids, positions = prm.build_prm_example(
        tokenizer, prompt, steps, step_separator="\n", max_length=full_positions[1]
    )  # one token short of step 1's end
    assert positions == full_positions[:1] and ids == full_ids[: positions[0] + 1]
    assert tokenizer.decode(ids) == prompt + steps[0] + "\n"
    ids, positions = prm.build_prm_example(tokenizer, prompt * 50, steps, step_separator="\n", max_length=20)
    assert positions == [] and len(ids) == 20  # the prompt alone does not fit: no step kept


def test_the_tiny_tokenizer_puts_one_label_on_each_separator():
    tokenizer = prm.build_tiny_tokenizer()
    ids, positions = prm.build_prm_example(
        tokenizer, "start 3\n", ["3+1=4", "4-2=2"], step_separator="\n", max_length=100
    )
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 1 + 8 + 6 + 6
    assert positions == [14, 20] and all(tokenizer.decode([ids[p]]) == "\n" for p in positions)
    assert prm.build_prm_example(tokenizer, "start 3\n", ["3+1=4", "4-2=2"], step_separator="\n", max_length=19)[1] == [
        14
    ]


def test_a_step_that_is_no_token_at_all_is_an_error():
    with pytest.raises(ValueError, match="step 1 .* is no token at all"):
        prm.build_prm_example(prm.build_tiny_tokenizer(), "start 3\n", ["3+1=4", ""], step_separator="", max_length=100)


def test_encode_rows_keeps_every_label_and_only_the_kept_steps_labels():
    rows = [{"prompt": "start 3\n", "completions": ["3+1=4", "4-2=2", "2+2=4"], "labels": [1.0, 0.0, 0.0]}]
    (example,) = prm.encode_rows(prm.build_tiny_tokenizer(), rows, "\n", 17)
    assert example["positions"] == [14] and example["labels"] == [1.0] and example["all_labels"] == [1.0, 0.0, 0.0]


def test_collate_pads_right_or_packs_rows_end_to_end():
    examples = [
        {"input_ids": [1, 5, 6, 7], "positions": [1, 3], "labels": [1.0, 0.0]},
        {"input_ids": [1, 8], "positions": [1], "labels": None},
        {"input_ids": [1, 9, 9], "positions": [2], "labels": [0.5]},
    ]
    batch = prm.collate(examples, 0, "cpu")
    assert batch["input_ids"].tolist() == [[1, 5, 6, 7], [1, 8, 0, 0], [1, 9, 9, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 0, 0], [0, 1, 2, 0]]
    assert batch["positions"].tolist() == [[1, 3], [1, 0], [2, 0]]
    assert batch["labels"].tolist() == [[1.0, 0.0], [0.0, -1.0], [0.5, -1.0]]  # -1: no step
    packed = prm.collate(examples, 0, "cpu", pack=True)  # 9 tokens / (2 x longest 4): 2 rows, each to the shorter
    assert packed["input_ids"].tolist() == [[1, 5, 6, 7, 0], [1, 9, 9, 1, 8]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    assert packed["positions"].tolist() == [[1, 3], [2, 4]]
    assert packed["labels"].tolist() == [[1.0, 0.0], [0.5, 0.0]]


def test_packed_rows_give_the_loss_and_gradients_of_padded_ones():
    torch.manual_seed(0)
    model, _ = prm.build_prm(prm.Args(), torch.float32)
    rows = prm.builtin_task(2, 0, 0, 300)[0][:24]
    examples = prm.encode_rows(model.tokenizer, rows, "\n", 1024)
    results = []
    for pack in (False, True):
        batch = prm.collate(examples, 0, "cpu", pack)
        model.zero_grad()
        logits = model(batch["input_ids"], batch["position_ids"], batch["positions"])
        loss, _ = prm.prm_loss(logits, batch["labels"], batch["labels"] >= 0)
        loss.backward()
        results.append((batch["input_ids"].shape, loss.item(), [p.grad.clone() for p in model.parameters()]))
    (padded_shape, padded_loss, padded_grads), (packed_shape, packed_loss, packed_grads) = results
    assert packed_shape[0] < padded_shape[0] and packed_shape.numel() < padded_shape.numel()
    assert packed_loss == pytest.approx(padded_loss, rel=1e-6)
    for padded_grad, packed_grad in zip(padded_grads, packed_grads):
        torch.testing.assert_close(packed_grad, padded_grad, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_prm():
    torch.manual_seed(0)
    model, _ = prm.build_prm(prm.Args(), torch.float32)
    return model.eval()


def test_scores_do_not_depend_on_batching_or_padding(tiny_prm):
    rng = random.Random(0)
    rows = [prm.make_solution(rng) for _ in range(9)]
    prompts, steps = [r["prompt"] for r in rows], [r["completions"] for r in rows]
    alone = [prm.score_steps(tiny_prm, [p], [s])[0] for p, s in zip(prompts, steps)]
    together = prm.score_steps(tiny_prm, prompts, steps, batch_size=4)
    for one, other in zip(alone, together):
        assert one == pytest.approx(other, abs=1e-6) and len(one) == len(other)


def test_score_steps_keeps_to_the_prms_separator_and_max_length(tiny_prm):
    long_solution = ["3+1=4"] * 300  # past max_length 1024
    (scores,) = prm.score_steps(tiny_prm, ["start 3\n"], [long_solution])
    assert len(scores) == (1024 - 9) // 6 and all(0 < s < 1 for s in scores)
    with torch.no_grad():
        ids, positions = prm.build_prm_example(
            tiny_prm.tokenizer, "start 3\n", ["3+1=4"], step_separator="\n", max_length=1024
        )
        logit = tiny_prm(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([positions]))
    assert prm.score_steps(tiny_prm, ["start 3\n"], [["3+1=4"]])[0][0] == pytest.approx(torch.sigmoid(logit).item())


def test_lora_trains_only_the_adapters_and_the_head():
    model, base = prm.build_prm(prm.Args(lora_r=4, lora_target_modules="q_proj,v_proj"), torch.float32)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name or name.startswith("head.") for name in trained)
    assert {"head.weight", "head.bias"} <= trained and base is not None  # the tiny base, to save beside the adapter
    assert not any("lora_" in name for name, _ in base.named_parameters())
