"""grpo.py's flags reach what they control: each test runs train() in this process on the tiny model for 1-3 steps,
spies on the kernel or library call a flag is meant to change (calling through), and checks the behaviour, so that a
flag that stopped being passed on inside train() fails here even though the kernels' own tests still pass."""

import json
import math
import statistics
import types

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_pre_hook

import grpo
from test_grpo_reliability import distinct_accuracies, run_main
from test_grpo_runs import QUICK, read_all_metrics, read_metrics, read_summary, save_tiny

# one step of 4 prompts x 4 completions, no held-out evaluation (so reward functions only see training samples)
ONE_STEP = [*QUICK, "--total-steps", "1", "--num-eval-prompts", "0"]


@pytest.fixture(autouse=True)
def no_matmul_benchmark(monkeypatch):
    """The summary times square matmuls for half a second at the end of every run; nothing here reads it."""
    monkeypatch.setattr(grpo, "matmul_flops_per_s", lambda *args, **kwargs: 1e12)


def train_in_process(out, argv, capsys):
    code, err = run_main(["--output-dir", str(out), *argv], capsys)
    assert code == 0, err[-3000:]
    return read_metrics(out)


def spy_on(monkeypatch, name: str, record):
    """Replace grpo.<name> by a wrapper that calls through and hands (args, kwargs, result) to record."""
    real = getattr(grpo, name)

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        record(args, kwargs, result)
        return result

    monkeypatch.setattr(grpo, name, spy)


# ---------------------------------------------------------------------------------------------------------------
# 1. --mask-truncated-completions


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_mask_truncated_completions_leaves_them_out_of_the_normaliser(mask_truncated, tmp_path, capsys, monkeypatch):
    """With --max-new-tokens 1 a completion is one token: EOS (ended) or anything else (truncated). The loss's token
    normaliser (grpo_loss's total_tokens, dapo's M) and its mask count only EOS-ended completions with the flag, every
    completion without it; truncated_frac is the fraction of non-EOS completions either way."""
    rollouts, losses = [], []
    spy_on(monkeypatch, "generate", lambda args, kwargs, result: rollouts.append((result[0].clone(), kwargs["eos_ids"]))
           if kwargs.get("generators") is not None else None)  # sampled rollouts only, not greedy evaluation
    spy_on(monkeypatch, "grpo_loss", lambda args, kwargs, result: losses.append(
        (kwargs["total_tokens"], args[4].detach().clone())))
    # 3 steps of 8 x 8 completions: about 1 in 20 is EOS on the random-init model, so both kinds occur
    flags = [*QUICK, "--prompts-per-step", "8", "--group-size", "8", "--num-eval-prompts", "0", "--max-new-tokens", "1",
             "--kl-coef", "0"]
    if mask_truncated:
        flags.append("--mask-truncated-completions")
    metrics = train_in_process(tmp_path / "run", flags, capsys)
    assert len(rollouts) == len(losses) == len(metrics) == 3  # one micro-batch, one iteration per step
    all_ended = 0
    for (ids, eos_ids), (total_tokens, mask), row in zip(rollouts, losses, metrics):
        assert ids.shape == (64, 1)
        ended = torch.isin(ids[:, 0], torch.tensor(eos_ids))  # [B]
        all_ended += int(ended.sum())
        assert row["truncated_frac"] == pytest.approx(1.0 - ended.float().mean().item())
        expected_mask = ended.float() if mask_truncated else torch.ones(64)
        assert total_tokens == expected_mask.sum().item(), (
            f"grpo_loss normalised by {total_tokens} tokens; expected {expected_mask.sum().item()} "
            f"({'only EOS-ended' if mask_truncated else 'every'} completion)")
        assert torch.equal(mask[:, 0].float(), expected_mask)
    # the run must have both kinds of completion, or the test would not tell the two settings apart
    assert 0 < all_ended < 3 * 64


# ---------------------------------------------------------------------------------------------------------------
# 2. frac_zero_std_groups


def test_equal_rewards_make_every_group_zero_std_and_no_gradient(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(grpo, "answer_reward", lambda completion, answer: 1.0)
    monkeypatch.setattr(grpo, "format_reward", lambda completion, answer: 0.5)
    advantages = []
    spy_on(monkeypatch, "group_advantages", lambda args, kwargs, result: advantages.append(result.clone()))
    metrics = train_in_process(tmp_path / "run", [*QUICK, "--total-steps", "2", "--num-eval-prompts", "0",
                                                  "--kl-coef", "0"], capsys)
    assert len(advantages) == 2 and all(torch.equal(a, torch.zeros(16)) for a in advantages)
    for row in metrics:
        assert row["frac_zero_std_groups"] == 1.0
        assert row["reward"] == pytest.approx(1.05) and row["reward_std"] == 0.0
        assert row["loss"] == 0.0 and row["grad_norm"] == 0.0  # no advantage, no KL: nothing to learn


def test_rewards_that_differ_in_every_group_make_no_zero_std_group(tmp_path, capsys, monkeypatch):
    calls = {"n": 0}

    def alternating(completion: str, answer: str) -> float:  # 0, 1, 0, 1 within every group of 4
        calls["n"] += 1
        return float(calls["n"] % 2)

    monkeypatch.setattr(grpo, "answer_reward", alternating)
    metrics = train_in_process(tmp_path / "run", [*QUICK, "--total-steps", "2", "--num-eval-prompts", "0",
                                                  "--format-reward-weight", "0", "--kl-coef", "0"], capsys)
    assert calls["n"] == 32
    for row in metrics:
        assert row["frac_zero_std_groups"] == 0.0 and row["reward"] == 0.5
        assert row["grad_norm"] > 0.0


def test_frac_zero_std_groups_counts_only_the_equal_groups(tmp_path, capsys, monkeypatch):
    """Two groups of four with equal rewards, two with differing ones: 0.5."""
    pattern = [1, 1, 1, 1, 0, 1, 0, 0, 2, 2, 2, 2, 0, 0, 0, 3]
    calls = {"n": 0}

    def patterned(completion: str, answer: str) -> float:
        calls["n"] += 1
        return float(pattern[(calls["n"] - 1) % 16])

    monkeypatch.setattr(grpo, "answer_reward", patterned)
    (row,) = train_in_process(tmp_path / "run", [*ONE_STEP, "--format-reward-weight", "0", "--kl-coef", "0"], capsys)
    assert row["frac_zero_std_groups"] == 0.5


# ---------------------------------------------------------------------------------------------------------------
# 3. --max-grad-norm


def grad_norms_seen_by_the_optimiser(run):
    """Run `run()` while a global optimizer step pre-hook records the norm of every gradient the step is given."""
    norms = []

    def hook(optimizer, args, kwargs):
        grads = [p.grad.detach().double().reshape(-1) for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        norms.append(torch.cat(grads).norm().item())

    handle = register_optimizer_step_pre_hook(hook)
    try:
        run()
    finally:
        handle.remove()
    return norms


@pytest.mark.parametrize("limit", ["1e-3", "0", "1e9"])
def test_max_grad_norm_clips_what_the_optimiser_steps_on(limit, tmp_path, capsys):
    out = tmp_path / "run"
    norms = grad_norms_seen_by_the_optimiser(lambda: train_in_process(
        out, [*QUICK, "--total-steps", "2", "--num-eval-prompts", "0", "--max-grad-norm", limit], capsys))
    metrics = read_metrics(out)
    assert len(norms) == len(metrics) == 2
    for norm, row in zip(norms, metrics):
        assert row["grad_norm"] > 1e-2  # the norm before clipping (logged), far above the tiny limit
        if limit == "1e-3":
            assert norm <= 1e-3 * (1 + 1e-4), (f"the optimiser stepped on a gradient of norm {norm} > "
                                               "--max-grad-norm 1e-3")
            assert norm == pytest.approx(1e-3, rel=1e-3)  # scaled down to the limit, not zeroed
        else:  # 0 = off, and a limit above the norm: the gradient is left as it is
            assert norm == pytest.approx(row["grad_norm"], rel=1e-4)


def gradients_held_at_each_backward(run) -> list[int]:
    """Run `run()` and count, at every backward pass after the first update, the gradients of earlier updates that
    something still holds. Each is as large as its weight: one set held over doubles the gradient memory at the
    peak, where the next backward allocates its own."""
    applied, held = [], []

    def record(optimizer, args, kwargs):
        applied.extend(StorageWeakRef(p.grad.untyped_storage()) for group in optimizer.param_groups
                       for p in group["params"] if p.grad is not None)

    real_backward = torch.Tensor.backward

    def backward(self, *args, **kwargs):
        if applied:
            held.append(sum(not ref.expired() for ref in applied))
        return real_backward(self, *args, **kwargs)

    handle = register_optimizer_step_pre_hook(record)
    torch.Tensor.backward = backward
    try:
        run()
    finally:
        torch.Tensor.backward = real_backward
        handle.remove()
    return held


@pytest.mark.parametrize("micro_batch", ["0", "4"])
def test_no_gradient_outlives_its_update(micro_batch, tmp_path, capsys):
    held = gradients_held_at_each_backward(lambda: train_in_process(
        tmp_path / "run", [*QUICK, "--total-steps", "3", "--num-eval-prompts", "0", "--micro-batch-size",
                           micro_batch], capsys))
    assert len(held) >= 2  # the backward passes of steps 2 and 3 (each micro-batch's)
    assert held == [0] * len(held), f"gradients of an earlier update still held at each later backward: {held}"


# ---------------------------------------------------------------------------------------------------------------
# 4. sampling flags, the KL estimator and reward scaling, end to end


@pytest.mark.parametrize("sampling", [["--temperature", "0.7", "--top-k", "5"],
                                      ["--temperature", "1.3", "--top-p", "0.9"]])
def test_sampling_temperature_reaches_the_training_and_reference_passes(sampling, tmp_path, capsys, monkeypatch):
    """At step 1, with one iteration, the training pass, the sampler and the reference policy are the same weights: if
    every pass divides the logits by the same temperature, their log-probs agree. A training (or reference) pass that
    forgot the temperature shows as a log-prob gap (or a KL) far above rounding."""
    seen = []
    spy_on(monkeypatch, "generate", lambda args, kwargs, result: seen.append(kwargs)
           if kwargs.get("generators") is not None else None)
    (row,) = train_in_process(tmp_path / "run", [*ONE_STEP, "--kl-coef", "0.05", *sampling], capsys)
    assert row["logp_gap_max"] < 1e-4, f"training and sampler log-probs differ by {row['logp_gap_max']}"
    assert row["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert row["kl_mean"] == pytest.approx(0.0, abs=1e-6), f"policy and reference differ at step 1: {row['kl_mean']}"
    flags = dict(zip(sampling[::2], sampling[1::2]))
    (kwargs,) = seen
    assert kwargs["temperature"] == float(flags["--temperature"])
    assert kwargs["top_k"] == int(flags.get("--top-k", 0)) and kwargs["top_p"] == float(flags.get("--top-p", 1.0))


@pytest.mark.parametrize("sampling", [[], ["--top-k", "1"], ["--top-p", "0.01"]])
def test_top_k_1_and_a_tiny_top_p_sample_greedily(sampling, tmp_path, capsys, monkeypatch):
    """top-k 1, or a nucleus smaller than the most likely token's probability, leaves one token to draw: every
    completion of a group is the same, and equal to greedy decoding; plain sampling gives different ones."""
    texts = []
    spy_on(monkeypatch, "decode_completions", lambda args, kwargs, result: texts.append(result))
    (row,) = train_in_process(tmp_path / "run", [*ONE_STEP, "--max-new-tokens", "3", *sampling], capsys)
    (completions,) = texts
    groups = [completions[i:i + 4] for i in range(0, 16, 4)]
    if sampling:
        assert all(len(set(group)) == 1 for group in groups), groups
        assert row["frac_zero_std_groups"] == 1.0
    else:
        assert all(len(set(group)) > 1 for group in groups), groups


@pytest.mark.parametrize("estimator", ["k1", "k2"])
def test_kl_estimator_reaches_the_loss(estimator, tmp_path, capsys, monkeypatch):
    """At step 2 the policy has moved away from its reference; the logged kl_mean is the chosen estimator's masked
    mean of the log-probs grpo_loss was given, and not k3's."""
    calls = []
    spy_on(monkeypatch, "grpo_loss", lambda args, kwargs, result: calls.append(
        (args[0].detach().double(), args[2].double(), args[4].double(), result[1]["kl_mean"].item())))
    metrics = train_in_process(tmp_path / "run", [*QUICK, "--total-steps", "2", "--num-eval-prompts", "0",
                                                  "--kl-coef", "0.05", "--learning-rate", "1e-2",
                                                  "--kl-estimator", estimator], capsys)
    logp, ref_logp, mask, kl_mean = calls[-1]
    x = (ref_logp - logp) * mask
    naive = {"k1": -x, "k2": 0.5 * x**2, "k3": torch.expm1(x) - x}
    means = {name: ((value * mask).sum() / mask.sum()).item() for name, value in naive.items()}
    assert abs(means[estimator] - means["k3"]) > 1e-4  # the step moved the policy enough to tell them apart
    assert kl_mean == pytest.approx(means[estimator], rel=1e-4, abs=1e-7), (estimator, kl_mean, means)
    assert metrics[1]["kl_mean"] == pytest.approx(means[estimator], rel=1e-4, abs=1e-7)


def test_kl_ratio_weighted_reaches_the_loss(tmp_path, capsys, monkeypatch):
    """With --kl-ratio-weighted, the second iteration over a batch (ratio != 1) logs mean(r * k3), r = pi / pi_old,
    from the log-probs grpo_loss was given."""
    calls = []
    spy_on(monkeypatch, "grpo_loss", lambda args, kwargs, result: calls.append(
        ([a.detach().double() for a in args[:3]], args[4].double(), result[1]["kl_mean"].item())))
    metrics = train_in_process(tmp_path / "run", [*QUICK, "--total-steps", "2", "--num-eval-prompts", "0",
                                                  "--kl-coef", "0.05", "--learning-rate", "1e-2", "--num-iterations",
                                                  "2", "--kl-ratio-weighted"], capsys)
    (logp, old_logp, ref_logp), mask, kl_mean = calls[-1]
    x, ratio = (ref_logp - logp) * mask, torch.exp((logp - old_logp) * mask)
    weighted, plain = [((value * mask).sum() / mask.sum()).item() for value in (ratio * (torch.expm1(x) - x),
                                                                                 torch.expm1(x) - x)]
    assert abs(weighted - plain) > 0.1 * plain  # the first iteration's update moved the ratio off 1
    assert kl_mean == pytest.approx(weighted, rel=1e-4, abs=1e-8)
    assert metrics[1]["kl_mean"] == pytest.approx(weighted, rel=1e-4, abs=1e-8)


def test_sequence_importance_sampling_reaches_the_loss(tmp_path, capsys, monkeypatch):
    """--importance-sampling sequence: in the second iteration over a batch the logged ratio_mean is the token-
    weighted mean of each completion's geometric-mean ratio, not of the token ratios."""
    calls = []
    spy_on(monkeypatch, "grpo_loss", lambda args, kwargs, result: calls.append(
        ([a.detach().double() for a in args[:2]], args[4].double(), result[1]["ratio_mean"].item())))
    code, err = run_main(["--output-dir", str(tmp_path / "run"), *QUICK, "--total-steps", "1", "--num-eval-prompts",
                          "0", "--learning-rate", "1e-2", "--num-iterations", "2", "--importance-sampling", "sequence"],
                         capsys)
    assert code == 0 and "warning: --importance-sampling sequence with --loss-type dapo weights each" in err, err
    metrics = read_metrics(tmp_path / "run")
    (logp, old_logp), mask, ratio_mean = calls[-1]
    log_ratio = (logp - old_logp) * mask
    per_sequence = (log_ratio.sum(1) / mask.sum(1).clamp(min=1)).exp()  # [B]
    sequence_mean = ((per_sequence * mask.sum(1)).sum() / mask.sum()).item()
    token_mean = ((log_ratio.exp() * mask).sum() / mask.sum()).item()
    assert abs(sequence_mean - token_mean) > 1e-4  # the first iteration's update moved the ratios apart
    assert ratio_mean == pytest.approx(sequence_mean, rel=1e-5)
    assert metrics[0]["ratio_mean"] == pytest.approx(sequence_mean, rel=1e-5)


def test_model_flops_per_second_are_over_the_timed_steps(tmp_path, capsys, monkeypatch):
    """The summary's model FLOP/s: the FLOPs step_flops counted for steps 2 and 3 over those steps' logged times
    (the first step pays for warm-up and is left out of both), the FLOP-floor fraction against the measured
    matmul rate, and the MFU against --peak-tflops (on any device)."""
    counted = []
    spy_on(monkeypatch, "step_flops", lambda args, kwargs, result: counted.append(result))
    metrics = train_in_process(tmp_path / "run", [*QUICK, "--total-steps", "3", "--num-eval-prompts", "0",
                                                  "--peak-tflops", "0.25"], capsys)
    summary = read_summary(tmp_path / "run")
    assert len(counted) == 3 and counted[0] != counted[1]  # the steps' completions differ in length
    expected = sum(counted[1:]) / sum(row["step_time_s"] for row in metrics[1:])
    assert summary["model_tflops_per_s"] == pytest.approx(expected / 1e12, rel=1e-6)
    assert summary["flop_floor_fraction"] == pytest.approx(expected / 1e12 / summary["matmul_tflops_measured"],
                                                           rel=1e-6)
    assert summary["mfu"] == pytest.approx(expected / 0.25e12, rel=1e-6)


def naive_advantages(rewards: list[float], group_size: int, scale: str, eps: float = 1e-4) -> list[float]:
    groups = [rewards[i:i + group_size] for i in range(0, len(rewards), group_size)]
    batch_std = statistics.stdev(rewards)
    out = []
    for group in groups:
        mean = sum(group) / len(group)
        std = {"group": statistics.stdev(group), "batch": batch_std, "none": None}[scale]
        for r in group:
            if max(group) == min(group):
                out.append(0.0)
            else:
                out.append((r - mean) / (std + eps) if std is not None else r - mean)
    return out


# groups of four: two different scales, one all-equal group, one with a single outlier
REWARD_PATTERN = [0, 1, 0, 1, 0, 3, 3, 6, 2, 2, 2, 2, 0.5, -1, 4, 0]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_scale_rewards_reaches_the_advantages_and_the_loss(scale, tmp_path, capsys, monkeypatch):
    calls = {"n": 0}

    def patterned(completion: str, answer: str) -> float:
        calls["n"] += 1
        return float(REWARD_PATTERN[(calls["n"] - 1) % 16])

    monkeypatch.setattr(grpo, "answer_reward", patterned)
    seen, loss_advantages = [], []
    spy_on(monkeypatch, "group_advantages", lambda args, kwargs, result: seen.append((args, kwargs, result.clone())))
    spy_on(monkeypatch, "grpo_loss", lambda args, kwargs, result: loss_advantages.append(args[3].clone()))
    train_in_process(tmp_path / "run", [*ONE_STEP, "--format-reward-weight", "0", "--scale-rewards", scale], capsys)
    (((rewards, group_size, *rest), kwargs, advantages),) = seen
    assert rewards.tolist() == REWARD_PATTERN and group_size == 4
    assert (rest[0] if rest else kwargs.get("scale")) == scale
    expected = naive_advantages([float(r) for r in REWARD_PATTERN], 4, scale)
    assert advantages.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    (given,) = loss_advantages
    assert given.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)  # what the loss was given


def test_the_three_scalings_give_different_advantages():
    """The recomputation above would not catch a mixed-up scale if the pattern made two of them agree."""
    results = [naive_advantages([float(r) for r in REWARD_PATTERN], 4, s) for s in ("group", "batch", "none")]
    for i in range(3):
        for j in range(i + 1, 3):
            assert max(abs(a - b) for a, b in zip(results[i], results[j])) > 0.1


# ---------------------------------------------------------------------------------------------------------------
# 5. the reference policy: a frozen copy only for full fine-tuning with KL


@pytest.mark.parametrize("flags, copies", [
    (["--lora-r", "4", "--kl-coef", "0.05"], 0),  # the base model with the adapter switched off
    (["--lora-r", "0", "--kl-coef", "0"], 0),  # no reference at all
    (["--lora-r", "0", "--kl-coef", "0.05"], 1),  # one frozen copy
])
def test_reference_policy_is_copied_only_when_needed(flags, copies, tmp_path, capsys, monkeypatch):
    model_dir = save_tiny(tmp_path / "tiny-saved")  # not --model tiny: its LoRA runs keep a copy of the base to save
    copied = []

    def counting_deepcopy(obj, *args, **kwargs):
        copied.append(type(obj).__name__)
        return copy_module.deepcopy(obj, *args, **kwargs)

    copy_module = grpo.copy
    # only grpo's own `copy` name: transformers and peft deep-copy configs through the real module
    monkeypatch.setattr(grpo, "copy", types.SimpleNamespace(deepcopy=counting_deepcopy))
    metrics = train_in_process(tmp_path / "run", [*QUICK, "--total-steps", "2", "--num-eval-prompts", "0",
                                                  "--model", str(model_dir), "--learning-rate", "1e-2", *flags], capsys)
    assert len(copied) == copies, copied
    if "0.05" in flags:  # there is a reference, and it is not the moving policy
        assert metrics[0]["kl_mean"] == pytest.approx(0.0, abs=1e-6) and metrics[1]["kl_mean"] > 1e-6
    else:
        assert not any("kl_mean" in row for row in metrics)  # no reference: no KL to report


@pytest.mark.parametrize("share_prompts, max_new_tokens, flags", [
    ("always", 1, []), ("always", 2, []), ("never", 1, []), ("never", 2, []),
    ("always", 2, ["--gradient-checkpointing"]), ("always", 2, ["--gradient-checkpointing", "--lora-r", "8"])])
def test_with_equal_rewards_the_kl_to_an_identical_reference_is_exactly_zero(share_prompts, max_new_tokens, flags,
                                                                           tmp_path, capsys, monkeypatch):
    """Equal rewards everywhere and a reference equal to the policy: the true gradient is 0, so no weight may move.
    A frozen reference copy took another matmul kernel for the logits_to_keep slice, 1 ulp off the policy: KL
    noise of ~1e-9 that AdamW scaled up to steps of ~lr, 3e-2 of gradient norm by step 3. Under
    --gradient-checkpointing the reference pass shared prompts where the training pass could not: KL 0.1 by step 3
    (the copy's and LoRA's base model alike)."""
    monkeypatch.setattr(grpo, "answer_reward", lambda completion, answer: 0.0)
    initial = {}
    real_disable_dropout = grpo.disable_dropout

    def keeping_the_initial_weights(model):  # called once, on the policy, before training
        initial.update({name.replace(".default.", "."): w.detach().clone()  # (peft saves adapters without it)
                        for name, w in model.state_dict().items()})
        return real_disable_dropout(model)

    monkeypatch.setattr(grpo, "disable_dropout", keeping_the_initial_weights)
    out = tmp_path / "run"
    metrics = train_in_process(out, [*QUICK, "--num-eval-prompts", "0", "--kl-coef", "0.02", "--lora-r", "0",
                                     "--share-prompts", share_prompts, "--max-new-tokens", str(max_new_tokens),
                                     "--format-reward-weight", "0", "--learning-rate", "1e-2", *flags], capsys)
    assert [(row["kl_mean"], row["grad_norm"]) for row in metrics] == [(0.0, 0.0)] * 3
    from safetensors.torch import load_file

    final = load_file(next((out / "final").glob("*.safetensors")))  # the model, or LoRA's adapter
    assert final.keys() <= initial.keys() and all(torch.equal(initial[name], final[name]) for name in final)


def test_bf16_micro_batch_gradients_are_added_in_fp32(tmp_path, capsys, monkeypatch):
    """bf16 weights, 8 micro-batches of 2: each micro-batch's (bf16) gradient, captured by a hook, summed in fp64,
    is what AdamW gets, to fp32 rounding. Added in bf16 p.grad, they were 3e-3 off (twice one bf16 rounding)."""
    captured, params, checked = {}, [], []
    real_disable_dropout = grpo.disable_dropout

    def hooking_disable_dropout(model):  # called once, on the policy: hook each trainable weight's gradient
        for p in model.parameters():
            if p.requires_grad:
                params.append(p)
                p.register_hook(lambda g, p=p: captured.__setitem__(id(p), captured.get(id(p), 0) + g.double()))
        return real_disable_dropout(model)

    real_clip = torch.nn.utils.clip_grad_norm_

    def checking_clip(master, *args, **kwargs):
        master = list(master)
        difference = sum(float((m.grad.double() - captured[id(p)]).square().sum()) for p, m in zip(params, master))
        exact = sum(float(captured[id(p)].square().sum()) for p in params)
        checked.append((difference / exact) ** 0.5)
        captured.clear()
        return real_clip(master, *args, **kwargs)

    monkeypatch.setattr(grpo, "disable_dropout", hooking_disable_dropout)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", checking_clip)
    train_in_process(tmp_path / "run", [*QUICK, "--total-steps", "2", "--num-eval-prompts", "0", "--dtype", "bfloat16",
                                        "--micro-batch-size", "2", "--kl-coef", "0.05"], capsys)
    assert len(checked) == 2 and all(error < 1e-6 for error in checked), checked


# ---------------------------------------------------------------------------------------------------------------
# 6. --eval-every


def test_eval_every_logs_eval_accuracy_before_the_last_step(tmp_path, capsys, monkeypatch):
    """README: `eval_accuracy` every --eval-every steps, in the training rows before the last; the evaluations at
    the start and after the last step get rows of their own (and are in summary.json). The held-out evaluation runs
    at the start, after steps 1 and 2, and at the end: once each."""
    accuracies = distinct_accuracies(monkeypatch)
    out = tmp_path / "run"
    metrics = train_in_process(out, [*QUICK, "--total-steps", "3", "--eval-every", "1", "--num-eval-prompts", "8"],
                               capsys)
    assert accuracies == [0.125, 0.25, 0.375, 0.5]
    assert [row["step"] for row in metrics] == [1, 2, 3]
    assert [row.get("eval_accuracy") for row in metrics[:2]] == accuracies[1:3]
    assert "eval_accuracy" not in metrics[2]
    assert read_all_metrics(out) == [{"step": 0, "eval_accuracy": accuracies[0]}, *metrics,
                                     {"step": 3, "eval_accuracy": accuracies[3]}]
    summary = read_summary(out)
    assert summary["eval_accuracy_start"] == accuracies[0] and summary["eval_accuracy_end"] == accuracies[3]


# ---------------------------------------------------------------------------------------------------------------
# 7. wandb failing to start


def test_wandb_that_cannot_start_is_a_warning(tmp_path, capsys, monkeypatch):
    wandb = pytest.importorskip("wandb")

    def failing_init(*args, **kwargs):
        raise RuntimeError("no network in this test")

    monkeypatch.setattr(wandb, "init", failing_init)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out = tmp_path / "run"
    code, err = run_main(["--output-dir", str(out), *ONE_STEP, "--track"], capsys)
    assert code == 0, err[-3000:]
    assert ("WARNING: wandb could not start (RuntimeError: no network in this test); continuing without it."
            in err), err[-3000:]
    assert len(read_metrics(out)) == 1 and json.loads((out / "summary.json").read_text())["steps"] == 1


# ---------------------------------------------------------------------------------------------------------------
# 8. --num-minibatches


@pytest.mark.parametrize("micro_batch, dtype, sampler_tolerance", [("0", "float32", 1e-5), ("3", "bfloat16", 0.1)])
def test_each_minibatch_is_an_update_scored_against_the_rollout_policy(micro_batch, dtype, sampler_tolerance,
                                                                        tmp_path, capsys, monkeypatch):
    """--num-minibatches 2 --num-iterations 2: four updates in the step, alternating between the two halves of the
    batch (whole groups, in order; micro-batches of 3 rows cut at the half: 3 + 3 + 2), each normalised by its own
    half's counts. Every update's old log-probs are the rollout policy's (the first half's from its first update's
    forward, the second's from a pass before any step): not the sampler's (shifted here), and the second half's
    ratios already move at its first update, which the first one's step moved. Logged: the last iteration's loss
    and gradient norm as means over its updates, its token statistics over both halves, and the last update's
    learning rate."""
    sampled, calls, flops_calls = [], [], []
    real_generate = grpo.generate

    def generate_with_shifted_logp(*args, **kwargs):  # train must not take the sampler's log-probs for the old ones
        completion_ids, completion_mask, logp = real_generate(*args, **kwargs)
        sampled.append((completion_ids, completion_mask, logp))
        return completion_ids, completion_mask, logp + 0.5  # (they only feed the logged gap)

    monkeypatch.setattr(grpo, "generate", generate_with_shifted_logp)
    spy_on(monkeypatch, "grpo_loss", lambda args, kwargs, result: calls.append((args, kwargs, result)))
    spy_on(monkeypatch, "step_flops", lambda args, kwargs, result: flops_calls.append(kwargs))
    norms = grad_norms_seen_by_the_optimiser(lambda: train_in_process(
        tmp_path / "run", [*ONE_STEP, "--num-minibatches", "2", "--num-iterations", "2", "--kl-coef", "0.05",
                           "--learning-rate", "1e-2", "--micro-batch-size", micro_batch, "--dtype", dtype,
                           "--max-grad-norm", "0", "--lr-schedule", "cosine",
                           "--no-group-by-length"], capsys))  # (rows in order: see section 9 for the other)
    _, completion_mask, sampler_logp = sampled[0]  # [16, T]: 4 prompts x 4 completions
    calls_per_update = len(calls) // 4
    assert len(norms) == 4 and calls_per_update == (1 if micro_batch == "0" else 3)
    moved, update_losses, stats_of_last_iteration = [], [0.0] * 4, []
    for call, ((logp, old_logp, _, _, mask), kwargs, (loss, stats)) in enumerate(calls):
        update, part = divmod(call, calls_per_update)
        first_row = 8 * (update % 2) + (0 if part == 0 else 3 * part)
        rows = slice(first_row, first_row + logp.shape[0])
        assert rows.stop <= 8 * (update % 2) + 8  # within this update's half
        width = logp.shape[1]
        assert torch.equal(mask, completion_mask[rows, :width].to(mask.dtype))
        half = slice(8 * (update % 2), 8 * (update % 2) + 8)
        assert kwargs["total_sequences"] == 8 and kwargs["total_tokens"] == float(completion_mask[half].sum())
        assert ((old_logp - sampler_logp[rows, :width]) * mask).abs().max() < sampler_tolerance
        moved.append(((logp.detach() - old_logp) * mask).abs().max().item())
        update_losses[update] += loss.item()
        if update >= 2:  # (train pops the token count from stats: the mask's)
            stats_of_last_iteration.append((stats["ratio_mean"].item(), mask.sum().item()))
    assert rows.stop == 16  # every row of the second half
    assert max(moved[:calls_per_update]) < 1e-6  # the first update: the weights that sampled the batch
    assert min(moved[calls_per_update:]) > 1e-3, moved  # each later one: weights that earlier updates moved
    row = read_metrics(tmp_path / "run")[0]
    assert row["logp_gap_mean"] == pytest.approx(0.5, abs=sampler_tolerance)
    assert row["loss"] == pytest.approx((update_losses[2] + update_losses[3]) / 2, rel=1e-5)
    assert row["grad_norm"] == pytest.approx((norms[2] + norms[3]) / 2, rel=1e-4)  # (unclipped: --max-grad-norm 0)
    tokens = sum(n for _, n in stats_of_last_iteration)
    assert tokens == completion_mask.sum()  # both halves
    assert row["ratio_mean"] == pytest.approx(sum(r * n for r, n in stats_of_last_iteration) / tokens, rel=1e-6)
    assert row["learning_rate"] == pytest.approx(1e-2 * 0.5 * (1 + math.cos(math.pi * 3 / 4)), rel=1e-9)
    # the old log-prob pass: over the second half alone (the first half's come from its first update)
    assert flops_calls[0]["old_completion_tokens"] == completion_mask[8:].sum() and flops_calls[0]["iterations"] == 2
    assert 0 < flops_calls[0]["old_prompt_tokens"] < flops_calls[0]["update_prompt_tokens"]


def test_the_schedule_counts_every_minibatch_update(tmp_path, capsys):
    """The learning-rate schedule runs over total steps x iterations x minibatches updates: with 2 steps of 2
    minibatches the cosine is at 0, 1/4, 1/2 and 3/4 of its half period at the four updates."""
    rates = []
    handle = register_optimizer_step_pre_hook(lambda optimizer, *_: rates.append(optimizer.param_groups[0]["lr"]))
    try:
        train_in_process(tmp_path / "run", [*QUICK, "--total-steps", "2", "--num-eval-prompts", "0",
                                            "--num-minibatches", "2", "--lr-schedule", "cosine",
                                            "--learning-rate", "1e-3"], capsys)
    finally:
        handle.remove()
    assert rates == pytest.approx([1e-3 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)], rel=1e-9)


# ---------------------------------------------------------------------------------------------------------------
# 9. --group-by-length


@pytest.mark.parametrize("share_prompts", ["auto", "always"])  # (always: prompts encoded once, in any row order)
def test_micro_batches_of_like_length_make_the_update_of_consecutive_rows(share_prompts, tmp_path, capsys,
                                                                          monkeypatch):
    """--group-by-length (the default) changes which rows share a micro-batch, not the update: two minibatches of 8
    completions of up to 8 tokens in micro-batches of 3 give the metrics and weights of --no-group-by-length. The
    rows were really rearranged (longest first, within a minibatch, where that saves positions), and each
    micro-batch's loss saw its own rows' masks, cut to their longest completion."""
    from safetensors.torch import load_file

    masks_sampled, arrangements, loss_masks = [], [], []
    spy_on(monkeypatch, "generate", lambda args, kwargs, result: masks_sampled.append(result[1].clone())
           if kwargs.get("generators") is not None else None)
    spy_on(monkeypatch, "micro_batch_rows", lambda args, kwargs, result: arrangements.append(result))
    spy_on(monkeypatch, "grpo_loss", lambda args, kwargs, result: loss_masks.append(args[4].detach().clone()))
    flags = [*ONE_STEP, "--max-new-tokens", "8", "--micro-batch-size", "3", "--num-minibatches", "2",
             "--kl-coef", "0.05", "--learning-rate", "1e-3", "--share-prompts", share_prompts]
    grouped = train_in_process(tmp_path / "grouped", flags, capsys)
    consecutive = train_in_process(tmp_path / "consecutive", [*flags, "--no-group-by-length"], capsys)
    completion_mask = masks_sampled[0]  # [16, T]
    assert torch.equal(masks_sampled[1], completion_mask)  # the same samples in both runs
    assert arrangements[1] == [[[0, 1, 2], [3, 4, 5], [6, 7]], [[8, 9, 10], [11, 12, 13], [14, 15]]]
    assert arrangements[0] != arrangements[1]  # (else the test would compare a run with itself)
    lengths = completion_mask.sum(1).tolist()
    for minibatch, micro_batches in enumerate(arrangements[0]):  # each either as it was or longest first
        rows = [row for micro_batch in micro_batches for row in micro_batch]
        assert sorted(rows) == list(range(8 * minibatch, 8 * minibatch + 8))
        if micro_batches != arrangements[1][minibatch]:
            assert [lengths[row] for row in rows] == sorted(lengths[8 * minibatch:8 * minibatch + 8], reverse=True)
    grouped_calls = [rows for micro_batches in arrangements[0] for rows in micro_batches]
    for loss_mask, rows in zip(loss_masks, grouped_calls, strict=False):  # the grouped run's calls come first
        width = max(lengths[row] for row in rows)
        assert torch.equal(loss_mask, completion_mask[rows, :width].to(loss_mask.dtype))
    for a, b in zip(grouped, consecutive, strict=True):
        for key, value in b.items():
            if not key.endswith("time_s") and not key.startswith("memory"):
                assert a[key] == pytest.approx(value, rel=1e-5, abs=1e-7, nan_ok=True), key
    weights = [load_file(next((tmp_path / run / "final").glob("*.safetensors"))) for run in ("grouped", "consecutive")]
    assert max((weights[0][name] - weights[1][name]).abs().max().item() for name in weights[0]) < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# Wiring that a helper's mutation audit found untested: each test fails on the mutation named in its docstring


def write_prompt_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_lora_resume_continues_the_adapter(tmp_path, capsys):
    """The checkpoint's adapter is loaded, not a fresh one (whose shapes the optimiser state would fit too)."""
    from safetensors.torch import load_file

    flags = [*QUICK, "--total-steps", "2", "--save-every", "1", "--lora-r", "4", "--learning-rate", "1e-2",
             "--num-eval-prompts", "0"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_main(["--output-dir", str(straight), *flags], capsys)[0] == 0
    assert run_main(["--output-dir", str(resumed), *flags, "--resume-from", str(straight / "checkpoint-1")],
                    capsys)[0] == 0
    a, b = (load_file(out / "final" / "adapter_model.safetensors") for out in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_each_row_is_sampled_and_scored_with_its_own_prompt_and_answer(tmp_path, capsys, monkeypatch):
    """Rows come in groups of --group-size copies of one prompt (repeat_interleave, not repeat), and each is scored
    against that prompt's answer."""
    rows = [{"prompt": f"({n}+7)%10=", "answer": str(n)} for n in range(100, 108)]  # the answer names the prompt
    seen, real_generate, real_rewards = {}, grpo.generate, grpo.compute_rewards

    def spy_generate(model, prompt_ids, prompt_mask, **kwargs):
        if kwargs.get("generators") is not None:  # the rollout, not the greedy evaluation
            seen["ids"] = [[t for t, m in zip(r, mr) if m] for r, mr in zip(prompt_ids.tolist(), prompt_mask.tolist())]
        return real_generate(model, prompt_ids, prompt_mask, **kwargs)

    def spy_rewards(prompts, completions, answers, *args, **kwargs):
        seen["prompts"], seen["answers"] = list(prompts), list(answers)
        return real_rewards(prompts, completions, answers, *args, **kwargs)

    monkeypatch.setattr(grpo, "generate", spy_generate)
    monkeypatch.setattr(grpo, "compute_rewards", spy_rewards)
    argv = ["--output-dir", str(tmp_path / "run"), "--data-path", write_prompt_rows(tmp_path / "rows.jsonl", rows),
            "--no-chat-template", "--total-steps", "1", "--prompts-per-step", "4", "--group-size", "4",
            "--eval-every", "0"]
    assert run_main(argv, capsys)[0] == 0
    tokenizer, answer_of = grpo.build_tiny_tokenizer(), {row["prompt"]: row["answer"] for row in rows}
    assert len(seen["ids"]) == len(seen["prompts"]) == 16
    for i, (ids, prompt, answer) in enumerate(zip(seen["ids"], seen["prompts"], seen["answers"], strict=True)):
        assert tokenizer.decode(ids, skip_special_tokens=True) == prompt, i
        assert answer == answer_of[prompt], i
        assert prompt == seen["prompts"][i - i % 4], i


def test_builtin_task_holds_out_disjoint_prompts():
    train, held_out = grpo.builtin_task(1, 200)
    assert len(train) == 700 and len(held_out) == 200
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in held_out}
    assert grpo.builtin_task(1, 200) == (train, held_out) and grpo.builtin_task(2, 200)[1] != held_out


def test_each_epoch_visits_every_prompt_once_in_a_fresh_order(tmp_path, capsys, monkeypatch):
    rows = [{"prompt": f"({n}+7)%10=", "answer": "1"} for n in range(100, 108)]
    steps, real_rewards = [], grpo.compute_rewards
    monkeypatch.setattr(grpo, "compute_rewards", lambda prompts, *args, **kwargs: steps.append(prompts[::2]) or
                        real_rewards(prompts, *args, **kwargs))
    argv = ["--output-dir", str(tmp_path / "run"), "--data-path", write_prompt_rows(tmp_path / "rows.jsonl", rows),
            "--no-chat-template", "--total-steps", "4", "--prompts-per-step", "4", "--group-size", "2",
            "--eval-every", "0"]
    assert run_main(argv, capsys)[0] == 0
    epochs = [steps[0] + steps[1], steps[2] + steps[3]]
    assert all(sorted(epoch) == sorted(row["prompt"] for row in rows) for epoch in epochs)
    assert epochs[0] != epochs[1]


def test_prompt_streams_are_keyed_by_prompt_index():
    """Each prompt's completions draw their own noise: prompts of one step are not sampled with the same noise."""
    a, b = grpo.prompt_generators(1, 0, [0, 1], "cpu")
    assert not torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))


def test_a_non_finite_gradient_with_a_finite_loss_skips_the_update(tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file

    real_loss = grpo.grpo_loss

    def nan_gradient(logp, *args, **kwargs):
        loss, stats = real_loss(logp, *args, **kwargs)
        return loss + torch.sqrt(logp.sum() * 0.0), stats  # the same value, a NaN gradient (d sqrt(0))

    monkeypatch.setattr(grpo, "grpo_loss", nan_gradient)
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *QUICK, "--total-steps", "2", "--num-eval-prompts", "0"], capsys)
    assert code == 0 and err.count("update skipped") == 2, err
    assert all(torch.isfinite(w).all() for w in load_file(out / "final" / "model.safetensors").values())


def nan_loss_on_calls(monkeypatch, bad_calls: set):
    """grpo_loss returning NaN on the given (1-based) calls: one call per step with QUICK's single micro-batch."""
    real_loss, calls = grpo.grpo_loss, {"n": 0}

    def patched(*args, **kwargs):
        calls["n"] += 1
        loss, stats = real_loss(*args, **kwargs)
        return (loss * float("nan") if calls["n"] in bad_calls else loss), stats

    monkeypatch.setattr(grpo, "grpo_loss", patched)


def test_max_bad_steps_counts_consecutive_updates_only(tmp_path, capsys, monkeypatch):
    nan_loss_on_calls(monkeypatch, {1, 3})
    out = tmp_path / "out"
    code, err = run_main(["--output-dir", str(out), *QUICK, "--total-steps", "4", "--max-bad-steps", "2",
                          "--num-eval-prompts", "0"], capsys)
    assert code == 0, err
    assert read_summary(out)["skipped_updates"] == 2


def test_resume_keeps_the_skipped_update_count(tmp_path, capsys, monkeypatch):
    nan_loss_on_calls(monkeypatch, {1})  # the first run's only step; the resumed run's calls are 2 and on
    flags = ["--output-dir", str(tmp_path / "out"), *QUICK, "--save-every", "1", "--num-eval-prompts", "0"]
    assert run_main([*flags, "--total-steps", "1"], capsys)[0] == 0
    assert run_main([*flags, "--total-steps", "2", "--resume-from", "latest"], capsys)[0] == 0
    assert read_summary(tmp_path / "out")["skipped_updates"] == 1


def test_resume_keeps_the_schedules_position(tmp_path, capsys):
    """The first update after a resume uses the schedule's rate there (cosine), not the base rate."""
    flags = [*QUICK, "--total-steps", "4", "--save-every", "2", "--lr-schedule", "cosine", "--num-eval-prompts", "0"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_main(["--output-dir", str(straight), *flags], capsys)[0] == 0
    assert run_main(["--output-dir", str(resumed), *flags, "--resume-from", str(straight / "checkpoint-2")],
                    capsys)[0] == 0
    rates = [row["learning_rate"] for row in read_metrics(straight)]
    assert rates[2] < rates[0] and [row["learning_rate"] for row in read_metrics(resumed)] == rates[2:]


OTHER_SETTINGS = {"model": "other", "lora_r": 4, "lora_alpha": 8, "lora_target_modules":
                  "q_proj", "chat_template": False, "system_prompt": "Answer briefly.", "prompts_per_step": 8,
                  "group_size": 8, "num_iterations": 2,
                  "num_minibatches": 2, "loss_type": "grpo", "importance_sampling": "sequence", "kl_coef": 0.5,
                  "seed": 2, "fsdp": True}  # not read from RESUME_MUST_MATCH (the data: its content, tested apart)


@pytest.mark.parametrize("key", OTHER_SETTINGS)
def test_every_setting_a_resume_must_match_is_checked(key, tmp_path, capsys):
    other = OTHER_SETTINGS[key]
    checkpoint = tmp_path / "checkpoint-1"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.pt").write_bytes(b"")
    (checkpoint / "args.json").write_text(json.dumps({"script": "grpo.py", **vars(grpo.Args(**{key: other}))}))
    code, err = run_main(["--output-dir", str(tmp_path / "out"), *QUICK, "--resume-from", str(checkpoint)], capsys)
    assert code == 2 and f"--{key.replace('_', '-')} {other!r} there" in err


def test_latest_prefers_a_final_model_newer_than_the_checkpoints(tmp_path):
    for name in ("checkpoint-2", "final"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.pt").write_bytes(b"")
        (tmp_path / name / "args.json").write_text(json.dumps({"script": "grpo.py",
                                                               **vars(grpo.Args(total_steps=3))}))
    assert grpo.resolve_resume(grpo.Args(resume_from="latest"), str(tmp_path)).endswith("final")


def test_num_eval_prompts_caps_an_eval_file(tmp_path, capsys, monkeypatch):
    rows = [{"prompt": f"({n}+7)%10=", "answer": str((n + 7) % 10)} for n in range(100, 108)]
    evaluated, real_evaluate = [], grpo.evaluate
    monkeypatch.setattr(grpo, "evaluate", lambda model, tokenizer, eval_rows, *args, **kwargs: evaluated.append(
        len(eval_rows)) or real_evaluate(model, tokenizer, eval_rows, *args, **kwargs))
    argv = ["--output-dir", str(tmp_path / "run"), *QUICK, "--total-steps", "1", "--eval-data-path",
            write_prompt_rows(tmp_path / "eval.jsonl", rows), "--num-eval-prompts", "3"]
    assert run_main(argv, capsys)[0] == 0
    assert evaluated == [3, 3]  # at the start and at the end
