"""Kernel tests for grpo.py: every kernel is checked against a naive reference written here with plain Python
loops over sequences and tokens (never by calling the kernel under test).

Covers grpo_loss (every loss type, both signs of A, clip boundaries and their gradients, eps_low != eps_high,
delta, KL with k1/k2/k3, fully masked rows, micro-batch equivalence, stats), kl_penalty, group_advantages,
token_logprobs, filter_logits, left_pad, the sampler/trainer log-prob alignment of generate and
completion_logprobs on the tiny model, and completion_logprobs with shared prompts against every row encoded.
"""

import copy
import math
import re
import signal
import statistics
import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo import (  # noqa: E402
    Args,
    UserError,
    build_tiny_model,
    answer_reward,
    build_tiny_tokenizer,
    completion_logprobs,
    compute_rewards,
    decode_completions,
    disable_dropout,
    filter_logits,
    final_answer,
    format_reward,
    generate,
    group_advantages,
    grpo_loss,
    guess_peak_tflops,
    kl_penalty,
    left_pad,
    lr_lambda,
    micro_batch_rows,
    prompt_sharing,
    resolve_device,
    step_flops,
    stop_token_ids,
    token_logprobs,
    weight_counts,
)

LOSS_TYPES = ["grpo", "bnpo", "dapo", "dr_grpo"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: on a shared 2-core CPU, intra-op threads only contend (a tiny-model forward pass
    measured ~100x slower with 2 threads than with 1 under load). Restored afterwards for other test modules."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


EPS_LOW, EPS_HIGH = 0.2, 0.28  # deliberately different
MAX_LEN = 9  # the dr_grpo constant (max_completion_length) used throughout


# ---------------------------------------------------------------------------------------------------------------
# Naive references: plain Python floats and loops.


def naive_kl(lp: float, ref: float, estimator: str = "k3") -> float:
    x = ref - lp
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x * x
    return math.exp(x) - x - 1.0


def naive_kl_grad(lp: float, ref: float, estimator: str = "k3") -> float:
    """d KL / d lp."""
    x = ref - lp
    if estimator == "k1":
        return 1.0
    if estimator == "k2":
        return -x
    return 1.0 - math.exp(x)


def naive_token(lp, olp, ref, a, *, eps_low, eps_high, kl_coef, delta, estimator, kl_weighted=False):
    """(loss, d loss / d lp) of one token: l = -min(r'*A, clip(r, 1-el, 1+eh)*A) + kl_coef*KL, r' = min(r, delta),
    KL times r when kl_weighted."""
    r = math.exp(lp - olp)
    capped = delta is not None and r > delta
    r_unclipped = delta if capped else r
    r_clipped = min(max(r, 1.0 - eps_low), 1.0 + eps_high)
    unclipped, clipped = r_unclipped * a, r_clipped * a
    # derivative of -(term) w.r.t. lp: -a * d r / d lp = -a * r, or 0 where the term is a constant
    grad_unclipped = 0.0 if capped else -a * r
    grad_clipped = -a * r if (1.0 - eps_low) < r < (1.0 + eps_high) else 0.0
    if unclipped < clipped:
        loss, grad = -unclipped, grad_unclipped
    elif clipped < unclipped:
        loss, grad = -clipped, grad_clipped
    else:  # equal: inside the clip range both terms are r*A with the same derivative
        loss, grad = -unclipped, grad_unclipped
    if kl_coef and kl_weighted:  # d (r KL) / d lp = r KL + r dKL/dlp, since d r / d lp = r
        loss += kl_coef * r * naive_kl(lp, ref, estimator)
        grad += kl_coef * r * (naive_kl(lp, ref, estimator) + naive_kl_grad(lp, ref, estimator))
    elif kl_coef:
        loss += kl_coef * naive_kl(lp, ref, estimator)
        grad += kl_coef * naive_kl_grad(lp, ref, estimator)
    return loss, grad


def naive_grpo_loss(logp, old_logp, ref_logp, adv, mask, *, loss_type, eps_low=0.2, eps_high=0.2, kl_coef=0.0,
                    delta=None, estimator="k3", kl_weighted=False, max_len=None, total_sequences=None,
                    total_tokens=None):
    """Returns (loss, grad [B][T] of the loss w.r.t. logp) from nested loops."""
    logp, old_logp, mask = logp.tolist(), old_logp.tolist(), mask.tolist()
    ref_logp = ref_logp.tolist() if ref_logp is not None else None
    adv = adv.tolist()
    batch = len(logp)
    n_seq = total_sequences if total_sequences is not None else batch
    n_tok = total_tokens
    if n_tok is None:
        n_tok = 0.0
        for i in range(batch):
            for t in range(len(logp[i])):
                n_tok += mask[i][t]
    total = 0.0
    grads = []
    for i in range(batch):
        row_sum, row_count, row_grads = 0.0, 0.0, []
        for t in range(len(logp[i])):
            ref = ref_logp[i][t] if ref_logp is not None else 0.0
            loss, grad = naive_token(logp[i][t], old_logp[i][t], ref, adv[i], eps_low=eps_low, eps_high=eps_high,
                                     kl_coef=kl_coef, delta=delta, estimator=estimator, kl_weighted=kl_weighted)
            row_sum += loss * mask[i][t]
            row_count += mask[i][t]
            row_grads.append(grad * mask[i][t])
        if loss_type == "grpo":
            weight = (1.0 / row_count / n_seq) if row_count > 0 else 0.0
        elif loss_type in ("bnpo", "dapo"):
            weight = 1.0 / n_tok if n_tok > 0 else 0.0
        elif loss_type == "dr_grpo":
            weight = 1.0 / (n_seq * max_len)
        else:
            raise AssertionError(loss_type)
        total += row_sum * weight
        grads.append([g * weight for g in row_grads])
    return total, grads


def naive_gspo_loss(logp, old_logp, ref_logp, adv, mask, *, loss_type, eps_low, eps_high, kl_coef=0.0, delta=None,
                    kl_weighted=False, max_len=None):
    """naive_grpo_loss with GSPO's sequence-level ratio: s_i = exp(mean of row i's masked log-ratios) stands for
    every token's ratio. Row i's policy term is n_i copies of P(s_i) (naive_token at log s_i), so its gradient on
    token t is weight * dP/dlog s_i * m_it (d log s_i / d logp_it = m_it / n_i). The KL stays per token, weighted
    by the token's own ratio r when kl_weighted (d (r KL) / d logp = r KL + r dKL/dlogp)."""
    logp, old_logp, mask, adv = logp.tolist(), old_logp.tolist(), mask.tolist(), adv.tolist()
    ref_logp = ref_logp.tolist() if ref_logp is not None else None
    n_seq, n_tok = len(logp), sum(map(sum, mask))
    total, grads = 0.0, []
    for i in range(n_seq):
        n_i = sum(mask[i])
        log_s = sum(m * (lp - olp) for lp, olp, m in zip(logp[i], old_logp[i], mask[i])) / max(n_i, 1.0)
        policy, d_policy = naive_token(log_s, 0.0, 0.0, adv[i], eps_low=eps_low, eps_high=eps_high,
                                       kl_coef=0.0, delta=delta, estimator="k3")
        weight = {"grpo": 1.0 / max(n_i, 1.0) / n_seq, "dapo": 1.0 / n_tok,
                  "dr_grpo": 1.0 / (n_seq * max_len) if max_len else None}[loss_type]
        total += weight * n_i * policy
        row = []
        for t in range(len(logp[i])):
            grad = d_policy
            if kl_coef:
                kl, kl_grad = naive_kl(logp[i][t], ref_logp[i][t]), naive_kl_grad(logp[i][t], ref_logp[i][t])
                r = math.exp(logp[i][t] - old_logp[i][t]) if kl_weighted else 1.0
                total += weight * mask[i][t] * kl_coef * r * kl
                grad += kl_coef * r * (kl_grad + (kl if kl_weighted else 0.0))
            row.append(weight * grad * mask[i][t])
        grads.append(row)
    return total, grads


def naive_log_softmax_row(values: list, temperature: float) -> list:
    scaled = [v / temperature for v in values]
    top = max(scaled)
    log_norm = top + math.log(sum(math.exp(v - top) for v in scaled))
    return [v - log_norm for v in scaled]


# ---------------------------------------------------------------------------------------------------------------
# Inputs


def make_batch(seed: int, batch: int = 8, length: int = MAX_LEN, dtype=torch.float64, spread: float = 0.9):
    """Random log-probs whose ratios span inside and outside the clip range, advantages of both signs, and
    prefix masks of different lengths (one row fully masked, one with a hole as when a row is dropped)."""
    g = torch.Generator().manual_seed(seed)
    old_logp = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3.0 - 0.05
    log_ratio = (torch.rand(batch, length, generator=g, dtype=torch.float64) * 2.0 - 1.0) * spread
    # keep ratios away from the clip and delta boundaries, where min/clamp have ties
    ratio = log_ratio.exp()
    for boundary in (1.0 - EPS_LOW, 1.0 + EPS_HIGH, 1.5):
        near = (ratio - boundary).abs() < 2e-3
        ratio = torch.where(near, ratio * 1.01, ratio)
    logp = old_logp + ratio.log()
    ref_logp = logp + (torch.rand(batch, length, generator=g, dtype=torch.float64) * 2.0 - 1.0) * 0.7
    adv = torch.randn(batch, generator=g, dtype=torch.float64)
    adv[0], adv[1] = abs(adv[0]) + 0.1, -abs(adv[1]) - 0.1  # both signs for sure
    adv[2] = 0.0
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.float64)
    mask[3] = 0.0  # a fully masked row
    mask[4, 1] = 0.0  # a hole
    mask[5] = 1.0  # a full-length row
    return [x.to(dtype) for x in (logp, old_logp, ref_logp, adv)] + [mask.to(dtype)]


def run_kernel(logp, old_logp, ref_logp, adv, mask, **kwargs):
    leaf = logp.detach().clone().requires_grad_(True)
    loss, stats = grpo_loss(leaf, old_logp, ref_logp, adv, mask, **kwargs)
    loss.backward()
    return loss, stats, leaf.grad


# ---------------------------------------------------------------------------------------------------------------
# grpo_loss against the naive reference


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("kl_coef,estimator,kl_weighted",
                         [(0.0, "k3", False), (0.1, "k3", False), (0.3, "k1", False), (0.2, "k2", False),
                          (0.2, "k3", True)])
@pytest.mark.parametrize("delta", [None, 1.5])
def test_grpo_loss_matches_naive(loss_type, kl_coef, estimator, kl_weighted, delta):
    logp, old_logp, ref_logp, adv, mask = make_batch(seed=11)
    ref_arg = ref_logp if kl_coef else None  # ref_logp may be None when kl_coef is 0
    ratio = (logp - old_logp).exp()
    # the batch really exercises both clip sides, for both signs of A
    assert ((ratio > 1 + EPS_HIGH) & (adv[:, None] > 0) & (mask > 0)).any()
    assert ((ratio < 1 - EPS_LOW) & (adv[:, None] > 0) & (mask > 0)).any()
    assert ((ratio > 1 + EPS_HIGH) & (adv[:, None] < 0) & (mask > 0)).any()
    assert ((ratio < 1 - EPS_LOW) & (adv[:, None] < 0) & (mask > 0)).any()
    if delta is not None:
        assert ((ratio > delta) & (adv[:, None] < 0) & (mask > 0)).any()

    loss, stats, grad = run_kernel(logp, old_logp, ref_arg, adv, mask, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH,
                                   kl_coef=kl_coef, loss_type=loss_type, max_completion_length=MAX_LEN, delta=delta,
                                   kl_estimator=estimator, kl_ratio_weighted=kl_weighted)
    expected, expected_grad = naive_grpo_loss(logp, old_logp, ref_arg, adv, mask, loss_type=loss_type,
                                              eps_low=EPS_LOW, eps_high=EPS_HIGH, kl_coef=kl_coef, delta=delta,
                                              estimator=estimator, kl_weighted=kl_weighted, max_len=MAX_LEN)
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=grad.dtype), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("kl_coef,delta,kl_weighted", [(0.0, None, False), (0.1, 1.5, False), (0.1, 1.5, True)])
def test_sequence_importance_sampling_matches_naive(loss_type, kl_coef, delta, kl_weighted):
    """GSPO: one ratio per sequence (the geometric mean of its token ratios), clipped as a whole: rows clipped
    above (A > 0), below (A < 0) and held at delta (A < 0), rows inside the range, a fully masked row and a hole."""
    logp, old_logp, ref_logp, adv, mask = make_batch(seed=3, spread=0.9)
    logp = logp + torch.tensor([0.3, 0, 0, 0, 0, 0, 0.45, 0], dtype=logp.dtype)[:, None]  # rows 0 and 6 upwards
    seq_ratio = (((logp - old_logp) * mask).sum(1) / mask.sum(1).clamp(min=1)).exp()  # [B]
    assert ((seq_ratio > 1 + EPS_HIGH) & (adv > 0)).any() and ((seq_ratio < 1 - EPS_LOW) & (adv < 0)).any()
    assert ((seq_ratio > 1.5) & (adv < 0)).any() and ((seq_ratio < 1 + EPS_HIGH) & (seq_ratio > 1 - EPS_LOW) & (
        mask.sum(1) > 0)).any(), seq_ratio
    kwargs = dict(clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, kl_coef=kl_coef, loss_type=loss_type,
                  max_completion_length=MAX_LEN, delta=delta, kl_ratio_weighted=kl_weighted)
    loss, stats, grad = run_kernel(logp, old_logp, ref_logp, adv, mask, importance_sampling="sequence", **kwargs)
    expected, expected_grad = naive_gspo_loss(logp, old_logp, ref_logp, adv, mask, loss_type=loss_type,
                                              eps_low=EPS_LOW, eps_high=EPS_HIGH, kl_coef=kl_coef, delta=delta,
                                              kl_weighted=kl_weighted, max_len=MAX_LEN)
    assert loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=grad.dtype), rtol=1e-10, atol=1e-12)
    token_ratio = (stats["ratio_mean"] * stats["tokens"]).item()
    assert token_ratio == pytest.approx((seq_ratio * mask.sum(1)).sum().item())  # every token carries its row's
    # on-policy (old = logp) a sequence's ratio is 1, as every token's: the same loss and gradient as "token"
    on_policy = [run_kernel(logp, logp.detach(), ref_logp, adv, mask, importance_sampling=level, **kwargs)
                 for level in ("sequence", "token")]
    assert on_policy[0][0].item() == pytest.approx(on_policy[1][0].item(), rel=1e-12)
    torch.testing.assert_close(on_policy[0][2], on_policy[1][2], rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="importance_sampling"):
        grpo_loss(logp, old_logp, None, adv, mask, importance_sampling="tokens")


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_loss_float32(loss_type):
    logp, old_logp, ref_logp, adv, mask = make_batch(seed=5, dtype=torch.float32)
    loss, _, grad = run_kernel(logp, old_logp, ref_logp, adv, mask, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH,
                               kl_coef=0.05, loss_type=loss_type, max_completion_length=MAX_LEN)
    expected, expected_grad = naive_grpo_loss(logp, old_logp, ref_logp, adv, mask, loss_type=loss_type,
                                              eps_low=EPS_LOW, eps_high=EPS_HIGH, kl_coef=0.05, max_len=MAX_LEN)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float32), rtol=1e-4, atol=1e-6)


def test_aggregations_by_hand():
    """Two rows, lengths 1 and 3, ratio 1 everywhere so every token's loss is -A."""
    logp = torch.zeros(2, 4, dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.float64)
    # token losses: row 0: -1 (one token); row 1: +2 (three tokens)
    kw = dict(max_completion_length=4)
    grpo, _ = grpo_loss(logp, logp, None, adv, mask, loss_type="grpo", **kw)
    bnpo, _ = grpo_loss(logp, logp, None, adv, mask, loss_type="bnpo", **kw)
    dapo, _ = grpo_loss(logp, logp, None, adv, mask, loss_type="dapo", **kw)
    dr, _ = grpo_loss(logp, logp, None, adv, mask, loss_type="dr_grpo", **kw)
    assert grpo.item() == pytest.approx((-1.0 / 1 + 6.0 / 3) / 2)  # 0.5
    assert bnpo.item() == pytest.approx((-1.0 + 6.0) / 4)  # 1.25
    assert dapo.item() == pytest.approx(1.25)
    assert dr.item() == pytest.approx((-1.0 + 6.0) / (2 * 4))  # 0.625


# ---------------------------------------------------------------------------------------------------------------
# Clip boundaries


RATIOS = [0.5, 0.79, 0.81, 0.95, 1.0, 1.1, 1.27, 1.29, 1.6, 2.5]


def clip_batch():
    ratios = torch.tensor(RATIOS, dtype=torch.float64)
    old_logp = torch.full((3, len(RATIOS)), -1.3, dtype=torch.float64)
    logp = old_logp + ratios.log()[None, :]
    adv = torch.tensor([1.5, -0.7, 0.0], dtype=torch.float64)
    mask = torch.ones(3, len(RATIOS), dtype=torch.float64)
    return logp, old_logp, adv, mask


def test_a_ratio_exactly_at_a_clip_bound_keeps_its_gradient_and_is_not_counted_clipped():
    """At r = 1 - eps_low with A < 0, or r = 1 + eps_high with A > 0, exactly, both terms of the min are equal and
    torch.clamp passes the gradient at its bound: the token keeps the gradient -A r, so it is not counted clipped."""
    logp = torch.tensor([[math.log(0.75)], [math.log(1.25)]], dtype=torch.float64)
    assert torch.exp(logp).flatten().tolist() == [0.75, 1.25]  # the bounds exactly, with old_logp = 0
    adv, mask = torch.tensor([-1.0, 1.0], dtype=torch.float64), torch.ones(2, 1, dtype=torch.float64)
    loss, stats, grad = run_kernel(logp, torch.zeros_like(logp), None, adv, mask, clip_eps_low=0.25,
                                   clip_eps_high=0.25, loss_type="dapo")
    assert loss.item() == pytest.approx((0.75 - 1.25) / 2)  # token losses -r A, averaged over 2 tokens
    assert grad.flatten().tolist() == pytest.approx([0.75 / 2, -1.25 / 2])
    assert stats["clip_frac_low"].item() == 0.0 and stats["clip_frac_high"].item() == 0.0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_clip_gradient_zero_exactly_where_clip_active(loss_type):
    logp, old_logp, adv, mask = clip_batch()
    loss, stats, grad = run_kernel(logp, old_logp, None, adv, mask, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH,
                                   loss_type=loss_type, max_completion_length=MAX_LEN)
    for t, r in enumerate(RATIOS):
        # A > 0: clipped above 1 + eps_high, gradient everywhere else (including r < 1 - eps_low)
        if r > 1 + EPS_HIGH:
            assert grad[0, t].item() == 0.0, r
        else:
            assert grad[0, t].item() < 0.0, r  # descent raises logp of a good token
        # A < 0: clipped below 1 - eps_low; r > 1 + eps_high still has its corrective gradient (no max here)
        if r < 1 - EPS_LOW:
            assert grad[1, t].item() == 0.0, r
        else:
            assert grad[1, t].item() > 0.0, r  # descent lowers logp of a bad token
        assert grad[2, t].item() == 0.0  # A = 0: no policy gradient
    # the corrective gradient for A < 0, r > 1 + eps_high is the unclipped one: d(-r*A)/dlogp / normaliser
    expected, expected_grad = naive_grpo_loss(logp, old_logp, None, adv, mask, loss_type=loss_type,
                                              eps_low=EPS_LOW, eps_high=EPS_HIGH, max_len=MAX_LEN)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=grad.dtype), rtol=1e-12, atol=1e-15)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    # clip fractions count exactly the tokens whose clip is active, over all masked tokens (3 rows x 10)
    n = mask.sum().item()
    assert stats["clip_frac_high"].item() == pytest.approx(sum(r > 1 + EPS_HIGH for r in RATIOS) / n)  # 2/30
    assert stats["clip_frac_low"].item() == pytest.approx(sum(r < 1 - EPS_LOW for r in RATIOS) / n)  # 2/30


def test_negative_advantage_large_ratio_value():
    """A < 0, r = 2.5 > 1 + eps_high: l = -min(2.5*A, 1.28*A) = -2.5*A (the pessimistic, unclipped side)."""
    old = torch.tensor([[0.0]], dtype=torch.float64)
    logp = torch.tensor([[math.log(2.5)]], dtype=torch.float64)
    adv = torch.tensor([-1.0], dtype=torch.float64)
    loss, stats, grad = run_kernel(logp, old, None, adv, torch.ones(1, 1, dtype=torch.float64),
                                   clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, loss_type="bnpo")
    assert loss.item() == pytest.approx(2.5)
    assert grad.item() == pytest.approx(2.5)  # d(-r*A)/dlogp = -r*A
    assert stats["clip_frac_low"].item() == 0.0 and stats["clip_frac_high"].item() == 0.0


def test_clip_fractions_masked_and_signed():
    """Only masked-in tokens count, and only on the side that clips for the row's sign of A."""
    logp, old_logp, ref_logp, adv, mask = make_batch(seed=3)
    _, stats = grpo_loss(logp, old_logp, None, adv, mask, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH)
    low = high = count = 0.0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            r = math.exp(logp[i, t].item() - old_logp[i, t].item())
            count += 1
            low += adv[i].item() < 0 and r < 1 - EPS_LOW
            high += adv[i].item() > 0 and r > 1 + EPS_HIGH
    assert low > 0 and high > 0
    assert stats["clip_frac_low"].item() == pytest.approx(low / count, abs=1e-12)
    assert stats["clip_frac_high"].item() == pytest.approx(high / count, abs=1e-12)


def test_delta_bounds_negative_advantage():
    """INTELLECT-2 two-sided clipping: for A < 0 the loss is capped at -delta*A and has no gradient beyond it."""
    ratios = [1.2, 1.4, 1.6, 3.0]
    old = torch.zeros(1, 4, dtype=torch.float64)
    logp = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    for adv_value in (-1.0, 1.0):
        adv = torch.tensor([adv_value], dtype=torch.float64)
        leaf = logp.clone().requires_grad_(True)
        loss, stats = grpo_loss(leaf, old, None, adv, mask, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, delta=1.5,
                                loss_type="bnpo")
        loss.backward()
        if adv_value < 0:  # token losses |A|*max(min(r, 1.5), clip(r)) = 1.2, 1.4, 1.5, 1.5
            assert loss.item() == pytest.approx((1.2 + 1.4 + 1.5 + 1.5) / 4)
            assert leaf.grad[0].tolist() == pytest.approx([1.2 / 4, 1.4 / 4, 0.0, 0.0])
        else:  # delta > 1 + eps_high changes nothing for A > 0: every token is clipped at 1.28
            assert loss.item() == pytest.approx(-1.2 / 4 - 3 * 1.28 / 4)
            assert leaf.grad[0].tolist() == pytest.approx([-1.2 / 4, 0.0, 0.0, 0.0])
        # the tokens without a gradient are the clipped ones, on the high side of the ratio for either sign
        assert stats["clip_frac_high"].item() == pytest.approx(0.5 if adv_value < 0 else 0.75)
        assert stats["clip_frac_low"].item() == 0.0


# ---------------------------------------------------------------------------------------------------------------
# KL estimators


def test_kl_penalty_hand_values():
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64)
    ref = torch.tensor([-1.0, -1.0, -2.5, -3.5], dtype=torch.float64)
    # x = ref - lp = 0, 1, -2, -0.5
    k1 = kl_penalty(lp, ref, "k1").tolist()
    k2 = kl_penalty(lp, ref, "k2").tolist()
    k3 = kl_penalty(lp, ref, "k3").tolist()
    assert k1 == pytest.approx([0.0, -1.0, 2.0, 0.5])
    assert k2 == pytest.approx([0.0, 0.5, 2.0, 0.125])
    assert k3 == pytest.approx([0.0, 0.718281828459045, 1.135335283236613, 0.106530659712633], rel=1e-12)
    assert kl_penalty(lp, ref).tolist() == k3  # k3 is the default
    assert k3[0] == 0.0  # logp == ref gives exactly 0


def test_k3_nonnegative_and_precise_near_zero():
    lp = torch.zeros(5, dtype=torch.float32)
    x = torch.tensor([1e-7, -1e-7, 1e-4, -1e-4, 0.0], dtype=torch.float32)
    k3 = kl_penalty(lp, lp + x, "k3")
    assert (k3 >= 0).all()
    # k3 ~ x^2/2 for small x; in fp32 the absolute error must stay near ulp(x) (a naive exp(x) - x - 1 in fp32
    # is off by ~1e-7, larger than the value itself)
    for value, xi in zip(k3.tolist(), x.tolist()):
        assert abs(value - xi * xi / 2) < 1e-14 + 1e-3 * xi * xi / 2


def test_kl_estimator_gradients_in_expectation():
    """Averaged over tokens sampled from pi (here: summed over a 7-token vocabulary, weighted by pi), k3 and k2 both
    have KL(pi || ref)'s value or gradient, not both: k3's value is KL(pi || ref) (unbiased) but its gradient as a
    loss term is that of the forward KL(ref || pi); k2's gradient is that of KL(pi || ref). TRL's
    use_bias_correction_kl (its default in 1.16) weights k3 by the ratio pi / pi_old, which on-policy has k2's
    gradient token by token."""
    torch.manual_seed(0)
    logits = torch.randn(7, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(7, dtype=torch.float64).log_softmax(-1)
    logp = logits.log_softmax(-1)
    pi = logp.exp().detach()  # sampling weights: the samples do not move with the parameters

    def grad(loss):
        return torch.autograd.grad(loss, logits, retain_graph=True)[0]

    reverse_kl = (logp.exp() * (logp - ref)).sum()
    forward_kl = (ref.exp() * (ref - logp)).sum()
    assert (pi * kl_penalty(logp, ref, "k3")).sum().item() == pytest.approx(reverse_kl.item(), rel=1e-12)
    k3_grad = grad((pi * kl_penalty(logp, ref, "k3")).sum())
    assert torch.allclose(k3_grad, grad(forward_kl), atol=1e-12)
    assert not torch.allclose(k3_grad, grad(reverse_kl), atol=1e-3)
    assert torch.allclose(grad((pi * kl_penalty(logp, ref, "k2")).sum()), grad(reverse_kl), atol=1e-12)
    ratio = torch.exp(logp - logp.detach())  # 1 on-policy, with the gradient of logp
    for k in range(7):
        assert torch.allclose(grad(ratio[k] * kl_penalty(logp, ref, "k3")[k]), grad(kl_penalty(logp, ref, "k2")[k]),
                              atol=1e-12)


def test_kl_estimator_invalid():
    with pytest.raises(ValueError):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")


def test_kl_in_loss_hand_value():
    """ratio 1 and A = 0: the loss is kl_coef * k3 alone."""
    lp = torch.tensor([[-2.0, -0.5]], dtype=torch.float64)
    ref = torch.tensor([[-1.0, -0.5]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    loss, stats = grpo_loss(lp, lp, ref, torch.zeros(1, dtype=torch.float64), mask, kl_coef=0.5, loss_type="bnpo")
    assert loss.item() == pytest.approx(0.5 * (math.e - 2.0) / 2)
    assert stats["kl_mean"].item() == pytest.approx((math.e - 2.0) / 2)


def test_loss_argument_errors():
    lp = torch.zeros(2, 3)
    adv, mask = torch.zeros(2), torch.ones(2, 3)
    with pytest.raises(ValueError):
        grpo_loss(lp, lp, None, adv, mask, kl_coef=0.1)  # KL needs ref_logp
    with pytest.raises(ValueError):
        grpo_loss(lp, lp, None, adv, mask, loss_type="dr_grpo")  # needs max_completion_length
    with pytest.raises(ValueError):
        grpo_loss(lp, lp, None, adv, mask, loss_type="sum")


# ---------------------------------------------------------------------------------------------------------------
# Masking


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_fully_masked_rows_contribute_nothing(loss_type, kl_coef):
    logp, old_logp, ref_logp, adv, mask = make_batch(seed=21, dtype=torch.float32)
    kw = dict(clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, kl_coef=kl_coef, loss_type=loss_type,
              max_completion_length=MAX_LEN)
    loss_a, stats_a, grad_a = run_kernel(logp, old_logp, ref_logp, adv, mask, **kw)
    # garbage (large but finite) values in the masked row and the masked tail of every row change nothing
    g = torch.Generator().manual_seed(0)
    garbage = lambda: torch.randn(logp.shape, generator=g) * 30.0  # noqa: E731
    off = mask == 0
    logp_b = torch.where(off, -garbage().abs(), logp)
    old_b = torch.where(off, -garbage().abs(), old_logp)
    ref_b = torch.where(off, -garbage().abs(), ref_logp)
    adv_b = adv.clone()
    adv_b[3] = 1e6  # row 3 is fully masked
    loss_b, stats_b, grad_b = run_kernel(logp_b, old_b, ref_b, adv_b, mask, **kw)
    assert torch.isfinite(loss_b) and torch.isfinite(grad_b).all()
    assert loss_b.item() == pytest.approx(loss_a.item(), rel=1e-6, abs=1e-7)
    assert (grad_b[off] == 0).all() and (grad_a[off] == 0).all()
    torch.testing.assert_close(grad_b, grad_a)
    assert stats_b.keys() == stats_a.keys() and ("kl_mean" in stats_a) == (kl_coef > 0)
    for key in ("ratio_mean", "clip_frac_low", "clip_frac_high", "kl_mean")[:4 if kl_coef > 0 else 3]:
        assert torch.isfinite(stats_b[key])
        assert stats_b[key].item() == pytest.approx(stats_a[key].item(), rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("case", ["ratio_overflow", "kl_overflow", "old_logp_neg_inf"])
def test_masked_positions_with_extreme_values_leak_no_nan(case):
    """Masked-out positions must contribute nothing whatever they hold. Values whose ratio exp(logp - old_logp)
    or k3 term exp(ref - logp) overflows fp32 at a masked position (or an old_logp of -inf there) make the
    masked token loss inf, and the mask multiply gives inf * 0 = NaN: loss, gradient and stats become NaN."""
    logp = torch.full((2, 3), -1.0)
    old_logp, ref_logp = logp.clone(), logp.clone()
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # row 0 has a masked tail, row 1 is fully masked
    adv = torch.tensor([-1.0, -1.0])
    off = mask == 0
    if case == "ratio_overflow":
        old_logp[off] = -101.0  # exp(100) overflows fp32
    elif case == "kl_overflow":
        ref_logp[off] = 99.0
    else:
        old_logp[off] = float("-inf")
    failures = []
    for loss_type in LOSS_TYPES:
        loss, stats, grad = run_kernel(logp, old_logp, ref_logp, adv, mask, kl_coef=0.1, loss_type=loss_type,
                                       max_completion_length=3)
        # the masked-in tokens have ratio 1, A = -1 and KL 0: token loss 1
        expected = {"grpo": 1.0 / 2, "bnpo": 1.0, "dapo": 1.0, "dr_grpo": 2.0 / (2 * 3)}[loss_type]
        if not (loss.item() == pytest.approx(expected) and torch.isfinite(grad).all() and (grad[off] == 0).all()
                and all(torch.isfinite(stats[k]) for k in ("ratio_mean", "kl_mean", "pg_loss"))):
            failures.append(f"{loss_type}: loss {loss.item()}, grad finite {bool(torch.isfinite(grad).all())}, "
                            f"ratio_mean {stats['ratio_mean'].item()}, kl_mean {stats['kl_mean'].item()}")
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_masked_batch(loss_type):
    logp, old_logp, ref_logp, adv, _ = make_batch(seed=2, dtype=torch.float32)
    mask = torch.zeros_like(logp)
    loss, stats, grad = run_kernel(logp, old_logp, ref_logp, adv, mask, clip_eps_low=EPS_LOW,
                                   clip_eps_high=EPS_HIGH, kl_coef=0.1, loss_type=loss_type,
                                   max_completion_length=MAX_LEN)
    assert loss.item() == 0.0
    assert (grad == 0).all()
    for key in ("ratio_mean", "clip_frac_low", "clip_frac_high", "kl_mean", "pg_loss"):
        assert torch.isfinite(stats[key]), key
    assert stats["tokens"].item() == 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_bf16_inputs_are_computed_and_counted_in_fp32(loss_type):
    # 501 masked tokens: a bf16 mask sums them to 500 (8 bits of mantissa); the kernel must not compute in bf16
    logp = (torch.randn(2, 1000, generator=torch.Generator().manual_seed(3)) * 0.1 - 3).bfloat16()
    old_logp = (logp.float() + 0.05 * torch.randn(2, 1000, generator=torch.Generator().manual_seed(4))).bfloat16()
    ref_logp = (logp.float() + 0.05).bfloat16()
    mask = torch.ones(2, 1000)
    mask[0, 501:] = 0
    adv = torch.tensor([1.0, -1.0])
    kw = dict(kl_coef=0.1, loss_type=loss_type, max_completion_length=1000)
    expected, expected_stats = grpo_loss(logp.float(), old_logp.float(), ref_logp.float(), adv, mask, **kw)
    loss, stats = grpo_loss(logp, old_logp, ref_logp, adv.bfloat16(), mask.bfloat16(), **kw)
    assert loss.dtype == torch.float32 and stats["tokens"].item() == 1501
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    for key, value in expected_stats.items():
        assert stats[key].item() == pytest.approx(value.item(), rel=1e-6), key


def test_boolean_and_integer_masks():
    logp, old_logp, ref_logp, adv, mask = make_batch(seed=8, dtype=torch.float32)
    kw = dict(clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, kl_coef=0.1, loss_type="grpo")
    expected, _ = grpo_loss(logp, old_logp, ref_logp, adv, mask, **kw)
    for m in (mask.bool(), mask.long()):
        loss, _ = grpo_loss(logp, old_logp, ref_logp, adv, m, **kw)
        assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Micro-batch equivalence


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("split", [4, 3])
def test_micro_batches_sum_to_whole_batch(loss_type, kl_coef, split):
    logp, old_logp, ref_logp, adv, mask = make_batch(seed=31, batch=8)
    kw = dict(clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, kl_coef=kl_coef, loss_type=loss_type,
              max_completion_length=MAX_LEN)
    whole, _, whole_grad = run_kernel(logp, old_logp, ref_logp, adv, mask, **kw)

    leaf = logp.detach().clone().requires_grad_(True)
    total_sequences, total_tokens = logp.shape[0], mask.sum().item()
    summed = 0.0
    for part in (slice(0, split), slice(split, None)):
        loss, _ = grpo_loss(leaf[part], old_logp[part], ref_logp[part], adv[part], mask[part],
                            total_sequences=total_sequences, total_tokens=total_tokens, **kw)
        loss.backward()  # gradients accumulate in leaf.grad, as in gradient accumulation
        summed += loss.item()
    assert summed == pytest.approx(whole.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(leaf.grad, whole_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_parameter_gradients(loss_type):
    """The same through a small model: accumulated parameter gradients of two halves == one batch."""
    torch.manual_seed(0)
    batch, length, vocab, width = 8, MAX_LEN, 7, 5
    features = torch.randn(batch, length, width, dtype=torch.float64)
    targets = torch.randint(0, vocab, (batch, length))
    _, _, ref_logp, adv, mask = make_batch(seed=41, batch=batch)
    net = torch.nn.Linear(width, vocab).double()

    def logp_of(rows):
        return torch.log_softmax(net(features[rows]), -1).gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1)

    with torch.no_grad():  # an old policy some distance away, so that clipping is active
        old_logp = logp_of(slice(None)) + torch.randn(batch, length, dtype=torch.float64) * 0.4
    kw = dict(clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, kl_coef=0.05, loss_type=loss_type,
              max_completion_length=MAX_LEN)
    net.zero_grad()
    whole, _ = grpo_loss(logp_of(slice(None)), old_logp, ref_logp, adv, mask, **kw)
    whole.backward()
    whole_grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    summed = 0.0
    for part in (slice(0, 4), slice(4, None)):
        loss, _ = grpo_loss(logp_of(part), old_logp[part], ref_logp[part], adv[part], mask[part],
                            total_sequences=batch, total_tokens=mask.sum().item(), **kw)
        loss.backward()
        summed += loss.item()
    assert summed == pytest.approx(whole.item(), rel=1e-12)
    for p, g in zip(net.parameters(), whole_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-14)


# ---------------------------------------------------------------------------------------------------------------
# Stats


def test_stats_are_masked_token_means():
    logp, old_logp, ref_logp, adv, mask = make_batch(seed=13)
    _, stats = grpo_loss(logp, old_logp, ref_logp, adv, mask, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH,
                         kl_coef=0.1)
    ratio_sum = kl_sum = pg_sum = count = 0.0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            lp, olp, ref = logp[i, t].item(), old_logp[i, t].item(), ref_logp[i, t].item()
            ratio_sum += math.exp(lp - olp)
            kl_sum += naive_kl(lp, ref, "k3")
            pg_sum += naive_token(lp, olp, ref, adv[i].item(), eps_low=EPS_LOW, eps_high=EPS_HIGH, kl_coef=0.0,
                                  delta=None, estimator="k3")[0]
            count += 1
    assert stats["ratio_mean"].item() == pytest.approx(ratio_sum / count, rel=1e-12)
    assert stats["kl_mean"].item() == pytest.approx(kl_sum / count, rel=1e-12)
    assert stats["pg_loss"].item() == pytest.approx(pg_sum / count, rel=1e-10)
    assert stats["tokens"].item() == count
    for value in stats.values():
        assert not value.requires_grad
    _, no_kl = grpo_loss(logp, old_logp, None, adv, mask)
    assert "kl_mean" not in no_kl and no_kl["ratio_mean"] == stats["ratio_mean"]


# ---------------------------------------------------------------------------------------------------------------
# group_advantages


def test_group_advantages_hand_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    eps = 1e-4
    # group 0: mean 0.25, unbiased std 0.5; group 1: mean 0.5, unbiased std sqrt(1/3)
    s1 = math.sqrt(1.0 / 3.0)
    expected_group = [0.75 / (0.5 + eps)] + [-0.25 / (0.5 + eps)] * 3 + [0.5 / (s1 + eps)] * 2 + [-0.5 / (s1 + eps)] * 2
    assert group_advantages(rewards, 4, "group").tolist() == pytest.approx(expected_group, rel=1e-6)
    # batch std of the 8 rewards: mean 3/8, unbiased variance (3*(5/8)^2 + 5*(3/8)^2)/7 = 15/56
    sb = math.sqrt(15.0 / 56.0)
    centred = [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    assert group_advantages(rewards, 4, "batch").tolist() == pytest.approx([c / (sb + eps) for c in centred], rel=1e-6)
    assert group_advantages(rewards, 4, "none").tolist() == pytest.approx(centred, abs=1e-7)
    # group of two: rewards 3, 1 -> mean 2, unbiased std sqrt(2)
    two = group_advantages(torch.tensor([3.0, 1.0]), 2, "group", eps=0.0).tolist()
    assert two == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], rel=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_loops(scale):
    g = torch.Generator().manual_seed(4)
    group_size, groups = 5, 4
    rewards = torch.randn(groups * group_size, generator=g, dtype=torch.float64)
    values = rewards.tolist()
    batch_std = statistics.stdev(values)  # unbiased
    expected = []
    for k in range(groups):
        group = values[k * group_size:(k + 1) * group_size]
        mean = sum(group) / group_size
        std = math.sqrt(sum((v - mean) ** 2 for v in group) / (group_size - 1))
        for v in group:
            if scale == "group":
                expected.append((v - mean) / (std + 1e-4))
            elif scale == "batch":
                expected.append((v - mean) / (batch_std + 1e-4))
            else:
                expected.append(v - mean)
    out = group_advantages(rewards, group_size, scale)
    assert out.shape == rewards.shape
    assert out.tolist() == pytest.approx(expected, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_variance_groups_exactly_zero(scale):
    rewards = torch.tensor([0.7, 0.7, 0.7, 0.7, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    out = group_advantages(rewards, 4, scale)
    assert out[:4].tolist() == [0.0] * 4 and out[8:].tolist() == [0.0] * 4
    assert (out[4:8] != 0).all()
    same = group_advantages(torch.full((8,), 0.3), 4, scale)  # the whole batch has zero variance
    assert same.tolist() == [0.0] * 8


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_variance_groups_exactly_zero_float32_rewards(scale):
    """The docstring's promise, "a group whose rewards are all equal gets advantage exactly 0 under every
    scale", for fractional float32 rewards (PRM scores, weighted reward sums) at common group sizes. The group
    mean of equal floats is not always bit-equal to them; the residue (~1e-8 relative) is left in the advantage,
    and the "group" scale divides it by (std ~ 1e-8) + eps ~ 1e-4, so every completion of such a group gets
    the same spurious advantage (3e-4 for 0.3 x 8, 0.07 for 100.7 x 8)."""
    failures = []
    for group_size in (3, 6, 7, 8):
        for value in (0.3, 0.9, 100.7):
            other = torch.arange(group_size, dtype=torch.float32)  # a second group with signal (batch std)
            rewards = torch.cat([torch.full((group_size,), value, dtype=torch.float32), other])
            out = group_advantages(rewards, group_size, scale)[:group_size]
            if (out != 0).any():
                failures.append(f"{value} x {group_size}: {out[0].item():.3g}")
    assert not failures, "equal rewards, nonzero advantage: " + "; ".join(failures)


def test_group_advantages_leave_out_failed_rewards():
    """A NaN reward (a failed sample under --reward-errors skip) is left out: its group's mean and std are the other
    samples' (not shrunk by a filled-in value), its own advantage is 0."""
    nan = float("nan")
    # group [1, 0, NaN, 1]: the valid three have mean 2/3 and unbiased std sqrt(1/3)
    s = math.sqrt(1.0 / 3.0)
    out = group_advantages(torch.tensor([1.0, 0.0, nan, 1.0]), 4, "group", eps=0.0).tolist()
    assert out == pytest.approx([(1 / 3) / s, (-2 / 3) / s, 0.0, (1 / 3) / s], rel=1e-6)
    assert out[0] == pytest.approx(0.57735, rel=1e-4)
    # batch: the std is over the valid rewards of the whole batch; a group with one valid reward, or none, gets 0
    rewards = torch.tensor([1.0, 0.0, nan, 1.0, nan, 2.0, nan, nan, nan, nan, nan, nan])
    batch_std = statistics.stdev([1.0, 0.0, 1.0, 2.0])
    out = group_advantages(rewards, 4, "batch", eps=0.0).tolist()
    assert out == pytest.approx([(1 / 3) / batch_std, (-2 / 3) / batch_std, 0.0, (1 / 3) / batch_std] + [0.0] * 8,
                                rel=1e-6)
    assert group_advantages(rewards, 4, "none").tolist() == pytest.approx([1 / 3, -2 / 3, 0, 1 / 3] + [0.0] * 8)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_with_failures_match_loops(scale):
    g = torch.Generator().manual_seed(5)
    group_size, groups = 5, 6
    rewards = torch.randn(groups * group_size, generator=g, dtype=torch.float64)
    rewards[torch.rand(rewards.shape, generator=g) < 0.3] = float("nan")
    values = rewards.tolist()
    valid_values = [v for v in values if not math.isnan(v)]
    batch_std = statistics.stdev(valid_values)
    expected = []
    for k in range(groups):
        group = [v for v in values[k * group_size:(k + 1) * group_size] if not math.isnan(v)]
        mean = sum(group) / len(group) if group else 0.0
        std = math.sqrt(sum((v - mean) ** 2 for v in group) / (len(group) - 1)) if len(group) > 1 else 0.0
        for v in values[k * group_size:(k + 1) * group_size]:
            if math.isnan(v) or len(group) < 2:
                expected.append(0.0)
            elif scale == "group":
                expected.append((v - mean) / (std + 1e-4))
            elif scale == "batch":
                expected.append((v - mean) / (batch_std + 1e-4))
            else:
                expected.append(v - mean)
    assert group_advantages(rewards, group_size, scale).tolist() == pytest.approx(expected, rel=1e-10, abs=1e-12)


def test_group_advantages_of_rewards_whose_squares_overflow_float32():
    """Reward weights of 1e20-1e30 (accepted flags) made every float32 squared deviation inf: all advantages 0."""
    # group: deviations of 5e29 over a std of 1e30 / sqrt(2); batch: over the 4 rewards' std, 1e30 / sqrt(3)
    for scale, size in (("group", 1 / math.sqrt(2)), ("batch", math.sqrt(3) / 2)):
        advantages = group_advantages(torch.tensor([0.0, 1e30, 0.0, 1e30]), 2, scale)
        assert advantages.dtype == torch.float32
        torch.testing.assert_close(advantages, torch.tensor([-1.0, 1.0, -1.0, 1.0]) * size, rtol=1e-5, atol=0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_of_integer_and_boolean_rewards(scale):
    expected = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), 3, scale)
    for rewards in (torch.tensor([1, 0, 0, 1, 1, 1]), torch.tensor([True, False, False, True, True, True])):
        torch.testing.assert_close(group_advantages(rewards, 3, scale), expected, rtol=0, atol=0)


def test_group_advantages_invalid_scale():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(4), 2, "median")


# ---------------------------------------------------------------------------------------------------------------
# token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_naive(temperature):
    g = torch.Generator().manual_seed(7)
    batch, length, vocab = 5, 4, 11
    logits = torch.randn(batch, length, vocab, generator=g) * 3.0
    targets = torch.randint(0, vocab, (batch, length), generator=g)
    logp, entropy = token_logprobs(logits, targets, temperature, with_entropy=True)
    assert logp.dtype == torch.float32 and logp.shape == (batch, length)
    for i in range(batch):
        for t in range(length):
            row = naive_log_softmax_row(logits[i, t].tolist(), temperature)
            assert logp[i, t].item() == pytest.approx(row[targets[i, t].item()], abs=1e-5)
            naive_entropy = -sum(math.exp(v) * v for v in row)
            assert entropy[i, t].item() == pytest.approx(naive_entropy, abs=1e-5)
    plain, none = token_logprobs(logits, targets, temperature)
    assert none is None
    assert torch.equal(plain, logp)


def test_token_logprobs_chunking_identical_and_bf16_in_fp32():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(7, 3, 13, generator=g)
    targets = torch.randint(0, 13, (7, 3), generator=g)
    full, full_entropy = token_logprobs(logits, targets, 0.7, with_entropy=True, rows_per_chunk=16)
    for chunk in (1, 2, 3, 6):
        part, part_entropy = token_logprobs(logits, targets, 0.7, with_entropy=True, rows_per_chunk=chunk)
        assert torch.equal(part, full) and torch.equal(part_entropy, full_entropy)
    half = logits.bfloat16()
    out, _ = token_logprobs(half, targets, 0.7)
    assert out.dtype == torch.float32
    for i in range(7):
        for t in range(3):
            row = naive_log_softmax_row([float(v) for v in half[i, t].float().tolist()], 0.7)
            assert out[i, t].item() == pytest.approx(row[targets[i, t].item()], abs=1e-5)


def test_entropy_with_a_minus_infinity_logit_is_that_of_the_other_tokens():
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(2))
    logits[..., 3] = -math.inf  # a masked id: probability 0, entropy contribution 0 (not 0 * -inf)
    _, entropy = token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), with_entropy=True)
    p = torch.softmax(logits[..., [0, 1, 2, 4]], dim=-1)
    torch.testing.assert_close(entropy, -(p * p.log()).sum(-1))


def test_token_logprobs_over_the_tokenizers_ids_only():
    """vocab_size: the softmax covers the first vocab_size logits, as if the rest were -inf (the padded rows of a
    checkpoint's output layer); the entropy too."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, 9, generator=g) * 2.0
    logits[..., 6:] += 40.0  # padded rows that would take nearly all the mass
    targets = torch.randint(0, 6, (4, 3), generator=g)
    logp, entropy = token_logprobs(logits, targets, 0.7, with_entropy=True, rows_per_chunk=3, vocab_size=6)
    for i in range(4):
        for t in range(3):
            row = naive_log_softmax_row(logits[i, t, :6].tolist(), 0.7)
            assert logp[i, t].item() == pytest.approx(row[targets[i, t].item()], abs=1e-5)
            assert entropy[i, t].item() == pytest.approx(-sum(math.exp(v) * v for v in row), abs=1e-5)
    assert (token_logprobs(logits, targets, 0.7)[0] < -30).all()  # the whole vocabulary: the padded rows win


def test_token_logprobs_gradient():
    """d logp / d logits = (onehot(target) - softmax(logits / T)) / T, row by row."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 2, 6, generator=g, dtype=torch.float64).requires_grad_(True)
    targets = torch.randint(0, 6, (3, 2), generator=g)
    temperature = 0.7
    logp, _ = token_logprobs(logits, targets, temperature, rows_per_chunk=2)
    logp.sum().backward()
    for i in range(3):
        for t in range(2):
            row = naive_log_softmax_row(logits[i, t].tolist(), temperature)
            for v in range(6):
                expected = ((v == targets[i, t].item()) - math.exp(row[v])) / temperature
                assert logits.grad[i, t, v].item() == pytest.approx(expected, abs=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# filter_logits, left_pad


def naive_filter(values: list, top_k: int, top_p: float) -> set:
    """Indices kept: the top_k largest, then the smallest prefix (by probability) whose mass reaches top_p."""
    order = sorted(range(len(values)), key=lambda j: -values[j])
    kept = order[:top_k] if top_k > 0 else order
    if top_p < 1.0:
        top = max(values[j] for j in kept)
        weights = [math.exp(values[j] - top) for j in kept]
        total = sum(weights)
        cumulative, nucleus = 0.0, []
        for j, w in zip(kept, weights):
            if cumulative >= top_p:
                break
            nucleus.append(j)
            cumulative += w / total
        kept = nucleus
    return set(kept)


def test_filter_logits_hand_values():
    probs = [0.05, 0.5, 0.15, 0.3]  # shuffled on purpose: sorted order is 1, 3, 2, 0
    logits = torch.tensor([[math.log(p) for p in probs]])
    def kept(k, p):
        out = filter_logits(logits, k, p)
        return {j for j in range(4) if out[0, j] != float("-inf")}
    assert kept(0, 1.0) == {0, 1, 2, 3}
    assert kept(1, 1.0) == {1}
    assert kept(2, 1.0) == {1, 3}
    assert kept(3, 1.0) == {1, 2, 3}
    assert kept(0, 0.4) == {1}  # the top token alone already passes 0.4
    assert kept(0, 0.7) == {1, 3}  # 0.5 < 0.7, 0.8 >= 0.7: the token that crosses is kept
    assert kept(0, 0.9) == {1, 2, 3}
    assert kept(2, 0.7) == {1, 3}  # top-k first, then top-p renormalised within {1, 3}: 0.625 < 0.7
    assert kept(2, 0.6) == {1}  # 0.5 < 0.6 over all four tokens, but 0.5/0.8 = 0.625 >= 0.6 within the top 2
    out = filter_logits(logits, 2, 1.0)
    assert out[0, 1].item() == logits[0, 1].item() and out[0, 3].item() == logits[0, 3].item()


@pytest.mark.parametrize("tokens, top_p, expected", [(2, 0.5, 1), (4, 0.5, 2), (4, 0.75, 3), (4, 0.25, 1), (4, 0.3, 2)])
def test_filter_logits_stops_at_the_token_whose_mass_reaches_top_p_exactly(tokens, top_p, expected):
    """Equal logits: softmax gives exactly 1/tokens each, so the cumulative mass hits top_p exactly. The nucleus
    is the smallest set that reaches top_p (transformers' TopPLogitsWarper keeps 1 of 2 tokens at 0.5), not one
    token more."""
    out = filter_logits(torch.zeros(1, tokens), 0, top_p)
    assert int((out != float("-inf")).sum()) == expected


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (3, 1.0), (0, 0.5), (0, 0.9), (5, 0.8), (4, 0.3)])
def test_filter_logits_match_naive(top_k, top_p):
    g = torch.Generator().manual_seed(17)
    logits = torch.randn(6, 12, generator=g) * 2.0
    out = filter_logits(logits, top_k, top_p)
    for i in range(6):
        expected = naive_filter(logits[i].tolist(), top_k, top_p)
        got = {j for j in range(12) if out[i, j] != float("-inf")}
        assert got == expected, (i, got, expected)
        for j in got:
            assert out[i, j].item() == logits[i, j].item()


def test_left_pad_layout():
    ids, mask = left_pad([[5, 6, 7], [8], [9, 10]], pad_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert ids.dtype == torch.long and mask.dtype == torch.long


# ---------------------------------------------------------------------------------------------------------------
# Sampler / trainer log-prob alignment on the tiny model


@pytest.fixture(scope="module")
def tiny():
    """The tiny model twice: as built (its random-init logits are nearly flat, so greedy repeats one token), and
    re-drawn with larger weights (std 0.2), whose sharper, more varied logits make greedy paths and early EOS
    differ from row to row."""
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer()
    plain = build_tiny_model(tokenizer).float().eval()
    sharp = build_tiny_model(tokenizer).float().eval()
    with torch.no_grad():
        for parameter in sharp.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.2)
    prompts = ["(12+34)%10=", "7=", "(5+9)%10=", "1+2=", "(99+11)%10="]  # different lengths: left padding
    prompt_lists = [tokenizer(p)["input_ids"] for p in prompts]
    return tokenizer, {"plain": plain, "sharp": sharp}, prompt_lists


class EosBoost(torch.nn.Module):
    """Adds a constant to the EOS logit so that a random-init model ends some completions early. The same
    wrapped model is used by the sampler and the training pass, so alignment is still model vs model."""

    def __init__(self, model, eos_id: int, boost: float):
        super().__init__()
        self.model, self.eos_id, self.boost = model, eos_id, boost

    def forward(self, **kwargs):
        logits = self.model(**kwargs).logits.clone()
        logits[..., self.eos_id] += self.boost
        return types.SimpleNamespace(logits=logits)


def naive_row_logits(model, ids: list) -> torch.Tensor:
    """Full logits [len, V] of one unpadded sequence, plain forward pass without cache or padding."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def naive_expected_mask(tokens: list, eos_id: int) -> list:
    mask, seen = [], False
    for token in tokens:
        mask.append(0 if seen else 1)
        seen = seen or token == eos_id
    return mask


def sample(tokenizer, model, prompt_lists, seed, greedy=False, eos_ids=None, **kwargs):
    """generate() on left-padded prompts: greedy, or sampled with one seeded stream per row."""
    ids, mask = left_pad(prompt_lists, tokenizer.pad_token_id, "cpu")
    generators = None if greedy else [torch.Generator().manual_seed(seed * 1000 + row) for row in range(len(ids))]
    out = generate(model, ids, mask, eos_ids=tokenizer.eos_token_id if eos_ids is None else eos_ids,
                   pad_id=tokenizer.pad_token_id, generators=generators, **kwargs)
    return ids, mask, out


# The sharp model's larger activations leave fp32 rounding gaps of ~1e-5 between the cached (incremental) and the
# full forward pass; in float64 the same check is exact to fp32 rounding of the final log-softmax.
@pytest.mark.parametrize("which,dtype,eos_boost,atol", [("plain", torch.float32, 0.5, 1e-5),
                                                        ("sharp", torch.float32, 0.0, 3e-5),
                                                        ("sharp", torch.float64, 0.0, 1e-6)])
def test_sampler_logprobs_equal_training_logprobs(tiny, which, dtype, eos_boost, atol):
    tokenizer, models, prompt_lists = tiny
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    base = models[which] if dtype == torch.float32 else copy.deepcopy(models[which]).to(dtype)
    model = EosBoost(base, eos, eos_boost)
    rows = prompt_lists * 2  # 10 rows, 5 prompt lengths
    temperature, max_new = 0.7, 8
    ids, mask, (comp, comp_mask, sampler_logp) = sample(tokenizer, model, rows, seed=3, max_new_tokens=max_new,
                                                        temperature=temperature)
    assert comp.shape == comp_mask.shape == sampler_logp.shape
    assert comp.shape[0] == len(rows) and comp.shape[1] <= max_new
    # the batch has both early EOS and rows that run to max_new_tokens, so the mask is really exercised
    has_eos = [eos in row for row in comp.tolist()]
    assert any(has_eos) and not all(has_eos)
    # completion mask: 1 up to and including the first EOS, 0 after, and pad after EOS
    for row_tokens, row_mask in zip(comp.tolist(), comp_mask.tolist()):
        assert row_mask == naive_expected_mask(row_tokens, eos)
        for token, m in zip(row_tokens, row_mask):
            if m == 0:
                assert token == pad
    with torch.no_grad():
        train_logp, entropy = completion_logprobs(model, ids, mask, comp, comp_mask, temperature, with_entropy=True)
    assert train_logp.dtype == torch.float32 and torch.isfinite(train_logp[comp_mask.bool()]).all()
    on = comp_mask.bool()
    torch.testing.assert_close(train_logp[on], sampler_logp[on], atol=atol, rtol=0)
    assert torch.isfinite(entropy[on]).all()
    # temperature really applied: at T = 1 the log-probs differ
    with torch.no_grad():
        plain, _ = completion_logprobs(model, ids, mask, comp, comp_mask, 1.0)
    assert (plain[on] - sampler_logp[on]).abs().max() > 1e-2

    # each left-padded row == that row alone, unpadded: through completion_logprobs and through a naive loop
    for b, prompt in enumerate(rows):
        n = int(comp_mask[b].sum())
        tokens = comp[b, :n].tolist()
        alone_ids, alone_mask = left_pad([prompt], pad, "cpu")
        with torch.no_grad():
            alone, _ = completion_logprobs(model, alone_ids, alone_mask, comp[b:b + 1, :n],
                                           torch.ones(1, n, dtype=torch.long), temperature)
        torch.testing.assert_close(alone[0], train_logp[b, :n], atol=atol, rtol=0)
        logits = naive_row_logits(model, prompt + tokens)
        for t, token in enumerate(tokens):
            row = naive_log_softmax_row(logits[len(prompt) - 1 + t].tolist(), temperature)
            assert sampler_logp[b, t].item() == pytest.approx(row[token], abs=atol)
            assert train_logp[b, t].item() == pytest.approx(row[token], abs=atol)


def test_sampler_logprobs_full_vocab_under_top_k_top_p(tiny):
    """top-k / top-p choose the token; the recorded log-prob is softmax(logits / T) over the full vocabulary."""
    tokenizer, models, prompt_lists = tiny
    model = models["sharp"]
    top_k, top_p, temperature = 4, 0.8, 0.7
    ids, mask, (comp, comp_mask, sampler_logp) = sample(tokenizer, model, prompt_lists * 2, seed=5,
                                                        max_new_tokens=6, temperature=temperature, top_k=top_k,
                                                        top_p=top_p)
    with torch.no_grad():
        train_logp, _ = completion_logprobs(model, ids, mask, comp, comp_mask, temperature)
    on = comp_mask.bool()
    torch.testing.assert_close(train_logp[on], sampler_logp[on], atol=3e-5, rtol=0)
    # every sampled token lies in the top-k / top-p set of its position (naive filter on a plain forward pass)
    for b, prompt in enumerate(prompt_lists * 2):
        n = int(comp_mask[b].sum())
        tokens = comp[b, :n].tolist()
        logits = naive_row_logits(model, prompt + tokens)
        for t, token in enumerate(tokens):
            scaled = [v / temperature for v in logits[len(prompt) - 1 + t].tolist()]
            assert token in naive_filter(scaled, top_k, top_p)
    # the same generator seed gives the same samples
    _, _, (again, again_mask, again_logp) = sample(tokenizer, model, prompt_lists * 2, seed=5, max_new_tokens=6,
                                                   temperature=temperature, top_k=top_k, top_p=top_p)
    assert torch.equal(again, comp) and torch.equal(again_mask, comp_mask)


def naive_greedy(model, prompt: list, max_new: int, eos_id: int) -> list:
    """Greedy decoding one token at a time, full forward each step, no cache, no padding."""
    tokens = []
    for _ in range(max_new):
        logits = naive_row_logits(model, prompt + tokens)[-1].tolist()
        best = max(range(len(logits)), key=lambda j: logits[j])
        tokens.append(best)
        if best == eos_id:
            break
    return tokens


@pytest.mark.parametrize("which", ["plain", "sharp"])
def test_greedy_deterministic_and_matches_naive(tiny, which):
    tokenizer, models, prompt_lists = tiny
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    model = models[which]
    max_new = 8
    _, _, (first, first_mask, _) = sample(tokenizer, model, prompt_lists, seed=1, max_new_tokens=max_new, greedy=True)
    _, _, (second, second_mask, _) = sample(tokenizer, model, prompt_lists, seed=2, max_new_tokens=max_new,
                                            greedy=True)
    assert torch.equal(first, second) and torch.equal(first_mask, second_mask)
    for b, prompt in enumerate(prompt_lists):
        expected = naive_greedy(model, prompt, max_new, eos)
        n = int(first_mask[b].sum())
        assert first[b, :n].tolist() == expected
        assert all(token == pad for token in first[b, n:].tolist())
    # top_k = 1 sampling is greedy (temperature does not change the argmax)
    _, _, (top1, top1_mask, _) = sample(tokenizer, model, prompt_lists, seed=9, max_new_tokens=max_new,
                                        temperature=0.7, top_k=1)
    assert torch.equal(top1, first) and torch.equal(top1_mask, first_mask)


def test_all_rows_finish_early(tiny):
    """When every row has emitted EOS, generation stops: T < max_new_tokens and the mask is still right."""
    tokenizer, models, prompt_lists = tiny
    eos = tokenizer.eos_token_id
    model = EosBoost(models["sharp"], eos, 6.0)  # nearly every token is EOS
    ids, mask, (comp, comp_mask, sampler_logp) = sample(tokenizer, model, prompt_lists, seed=4, max_new_tokens=20,
                                                        temperature=0.7)
    assert comp.shape[1] < 20
    for row_tokens, row_mask in zip(comp.tolist(), comp_mask.tolist()):
        assert eos in row_tokens
        assert row_mask == naive_expected_mask(row_tokens, eos)
    with torch.no_grad():
        train_logp, _ = completion_logprobs(model, ids, mask, comp, comp_mask, 0.7)
    on = comp_mask.bool()
    torch.testing.assert_close(train_logp[on], sampler_logp[on], atol=3e-5, rtol=0)


class FixedLogits(torch.nn.Module):
    """A stand-in model whose next-token logits are always the same vector (enough for generate's contract)."""

    def __init__(self, logits):
        super().__init__()
        self.fixed = logits

    def forward(self, input_ids, **kwargs):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.fixed.expand(input_ids.shape[0], input_ids.shape[1], -1).clone())


def test_gumbel_sampling_matches_the_softmax():
    """Gumbel-max sampling draws from softmax(logits / T): empirical frequencies over 6000 rows, within 4 sigma."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    temperature, rows = 0.8, 6000
    ids = torch.zeros(rows, 1, dtype=torch.long)
    generators = [torch.Generator().manual_seed(i) for i in range(rows)]
    tokens, _, logp = generate(FixedLogits(logits), ids, torch.ones_like(ids), max_new_tokens=1, eos_ids=99,
                               pad_id=98, temperature=temperature, generators=generators)
    expected = torch.softmax(logits / temperature, -1)
    counts = torch.bincount(tokens[:, 0], minlength=5).double() / rows
    sigma = (expected * (1 - expected) / rows).sqrt()
    assert ((counts - expected).abs() <= 4 * sigma).all(), (counts, expected)
    torch.testing.assert_close(logp[:, 0], torch.log(expected)[tokens[:, 0]])


@pytest.mark.parametrize("sampled", [False, True])
def test_generate_draws_only_the_tokenizers_ids(sampled):
    """vocab_size=5 on 7 logits whose last two dominate: no row, greedy or sampled, ever draws id 5 or 6, and the
    sampler's log-probs are those of the softmax over ids 0-4, which the training pass computes."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 30.0, 25.0])
    rows, temperature = 400, 0.8
    ids = torch.zeros(rows, 1, dtype=torch.long)
    generators = [torch.Generator().manual_seed(i) for i in range(rows)] if sampled else None
    tokens, _, logp = generate(FixedLogits(logits), ids, torch.ones_like(ids), max_new_tokens=1, eos_ids=99,
                               pad_id=98, temperature=temperature, generators=generators, vocab_size=5)
    assert tokens.shape == (rows, 1) and (tokens < 5).all()
    assert (set(tokens.flatten().tolist()) == {0, 1, 2, 3, 4}) if sampled else (tokens == 0).all()
    scaled = logits[:5] / (temperature if sampled else 1.0)
    torch.testing.assert_close(logp, torch.log_softmax(scaled, -1)[tokens])
    unrestricted, _, _ = generate(FixedLogits(logits), ids, torch.ones_like(ids), max_new_tokens=1, eos_ids=99,
                                  pad_id=98, temperature=temperature, generators=generators)
    assert (unrestricted >= 5).all()  # (what vocab_size prevents)


def test_prompt_streams_do_not_depend_on_the_split(tiny):
    """A prompt's completions depend on (seed, step, its global index) only: sampling the batch in one piece or
    in two shards (as two processes would) gives the same tokens."""
    from grpo import prompt_generators

    tokenizer, models, prompt_lists = tiny
    model, group = models["sharp"], 3
    prompts = prompt_lists[:4]

    def rollout(indices):
        rows = [prompts[i] for i in indices for _ in range(group)]
        ids, mask = left_pad(rows, tokenizer.pad_token_id, "cpu")
        return generate(model, ids, mask, max_new_tokens=5, eos_ids=tokenizer.eos_token_id,
                        pad_id=tokenizer.pad_token_id, temperature=1.0,
                        generators=prompt_generators(7, 3, indices, "cpu"))[0]

    whole = rollout([0, 1, 2, 3])
    for shard in ([0, 2], [1, 3]):
        part = rollout(shard)
        for position, index in enumerate(shard):
            got = part[position * group:(position + 1) * group]
            want = whole[index * group:(index + 1) * group, :got.shape[1]]
            assert torch.equal(got, want)
    assert not torch.equal(rollout([0]), generate(model, *left_pad([prompts[0]] * group, tokenizer.pad_token_id, "cpu"),
                                                  max_new_tokens=5, eos_ids=tokenizer.eos_token_id,
                                                  pad_id=tokenizer.pad_token_id,
                                                  generators=prompt_generators(7, 4, [0], "cpu"))[0])


def test_shared_prompt_prefill_gives_the_same_rollouts(tiny):
    """group_size > 1 encodes each prompt once and copies its KV cache to the group: same tokens, same log-probs."""
    from grpo import prompt_generators

    tokenizer, models, prompt_lists = tiny
    group = 3
    rows = [prompt for prompt in prompt_lists for _ in range(group)]  # groups of identical, left-padded prompts
    ids, mask = left_pad(rows, tokenizer.pad_token_id, "cpu")
    runs = [generate(models["sharp"], ids, mask, max_new_tokens=6, eos_ids=tokenizer.eos_token_id,
                     pad_id=tokenizer.pad_token_id, temperature=0.9,
                     generators=prompt_generators(1, 0, list(range(len(prompt_lists))), "cpu"), group_size=g)
            for g in (1, group)]
    (tokens, mask_a, logp_a), (shared, mask_b, logp_b) = runs
    assert torch.equal(tokens, shared) and torch.equal(mask_a, mask_b)
    torch.testing.assert_close(logp_a, logp_b, atol=1e-5, rtol=0)


def test_weight_counts_of_tied_and_untied_models():
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    tied = build_tiny_model(tokenizer)  # vocab 23, hidden 128, tied embeddings
    vocab, hidden = tied.config.vocab_size, tied.config.hidden_size
    total = sum(p.numel() for p in tied.parameters())
    assert weight_counts(tied) == (total - vocab * hidden, vocab * hidden)
    untied = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1,
                                          num_attention_heads=4, intermediate_size=64, tie_word_embeddings=False))
    total = sum(p.numel() for p in untied.parameters())
    assert weight_counts(untied) == (total - 2 * vocab * hidden, vocab * hidden)


def test_lr_schedule_by_hand():
    """Linear warm-up to the full rate, then constant or a half cosine over the updates left: 0.5 (1 + cos(pi p)),
    p = (update - warmup) / (total - warmup)."""
    constant = lr_lambda(Args(warmup_steps=2, lr_schedule="constant"), 5)
    assert [constant(u) for u in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]
    cosine = lr_lambda(Args(warmup_steps=1, lr_schedule="cosine"), 5)
    assert [cosine(u) for u in range(5)] == pytest.approx([1.0, 1.0, 0.8535534, 0.5, 0.1464466], abs=1e-7)
    no_warmup = lr_lambda(Args(warmup_steps=0, lr_schedule="cosine"), 4)
    assert [no_warmup(u) for u in range(4)] == pytest.approx([1.0, 0.8535534, 0.5, 0.1464466], abs=1e-7)


def test_step_flops_by_hand():
    # body 10 weights, head 3; 4 rows of 1 prompt token each (1 distinct prompt token), 5 completion tokens. Each
    # row's last completion token is only a target, never fed: a pass over every row processes 4 + 5 - 4 positions,
    # 2 * (10 * 5 + 3 * 5) = 130; the rollout prefills 1 and feeds back 5 - 4: 2 * 10 * 2 + 2 * 3 * 5 = 70
    common = dict(unique_prompt_tokens=1, reference_prompt_tokens=4, update_prompt_tokens=4, completion_tokens=5,
                  rows=4)
    assert step_flops(10, 3, **common, reference=False, iterations=1, full_finetune=True) == 70 + 3 * 130
    assert step_flops(10, 3, **common, reference=True, iterations=1, full_finetune=True) == 70 + 4 * 130
    assert step_flops(10, 3, **common, reference=True, iterations=2, full_finetune=False) == 70 + 5 * 130
    # shared prompts: a pass that encodes 2 prompt tokens costs 2 * (10 * (2 + 5 - 4) + 3 * 5) = 90
    shared = dict(common, reference_prompt_tokens=2)
    assert step_flops(10, 3, **shared, reference=True, iterations=1, full_finetune=True) == 70 + 90 + 3 * 130
    shared = dict(common, reference_prompt_tokens=2, update_prompt_tokens=2)
    assert step_flops(10, 3, **shared, reference=True, iterations=1, full_finetune=False) == 70 + 90 + 2 * 90
    shared = dict(common, update_prompt_tokens=2)  # the reference pass and the updates: not mixed up
    assert step_flops(10, 3, **shared, reference=True, iterations=1, full_finetune=True) == 70 + 130 + 3 * 90
    # --num-minibatches above 1: the later minibatches' rollout log-probs take one more forward, here over 1 row of
    # 1 prompt token and 2 completion tokens: 2 * (10 * (1 + 2 - 1) + 3 * 2) = 52
    assert step_flops(10, 3, **shared, reference=True, iterations=2, full_finetune=True, old_prompt_tokens=1,
                      old_completion_tokens=2, old_rows=1) == 70 + 130 + 6 * 90 + 52


def test_prompt_sharing_plans():
    # 2 prompts x group 8, prompts 5 positions wide: sharing skips 14 x 5 = 70 < 128 positions, not worth it
    two_groups = [0] * 8 + [1] * 8
    assert prompt_sharing(two_groups, 5, "auto") is None
    assert prompt_sharing(two_groups, 10, "auto") == [0] * 8 + [1] * 8  # skips 140
    assert prompt_sharing(two_groups, 100, "never") is None
    # a micro-batch that cuts groups: the end of prompt 1, all of 2 (group 4), the start of 3; numbered from 0
    assert prompt_sharing([1, 1, 2, 2, 2, 2, 3, 3], 1, "always") == [0, 0, 1, 1, 1, 1, 2, 2]
    # rows of like length from several groups, in any order: numbered in order of first appearance
    assert prompt_sharing([5, 2, 5, 7, 2], 1, "always") == [0, 1, 0, 2, 1]
    assert prompt_sharing([0], 1000, "auto") is None  # one row: nothing to share
    assert prompt_sharing([0], 1, "always") == [0]


def naive_positions(micro_batches, completion_lengths, prompt_lengths, group_size, share_mode):
    """Prompt and completion positions the passes process, written out: each micro-batch is cut to its longest
    prompt and completion; its prompts are encoded once each when the plan shares them, else once per row."""
    total = 0
    for rows in micro_batches:
        prompts = [row // group_size for row in rows]
        width = max(prompt_lengths[p] for p in prompts)
        skipped = (len(rows) - len(set(prompts))) * width
        shared = share_mode == "always" or (share_mode == "auto" and skipped >= 128)
        total += (len(set(prompts)) if shared else len(rows)) * width
        total += len(rows) * max(completion_lengths[row] for row in rows)
    return total


def test_micro_batch_rows_groups_completions_of_like_length_within_each_minibatch():
    # 2 minibatches of 8 rows (2 prompts x group 4 each), micro-batches of 3: 3 + 3 + 2 rows per minibatch
    lengths = [5, 1, 9, 1, 9, 2, 2, 7] + [3, 3, 3, 3, 8, 1, 8, 1]
    prompt_lengths = [4, 4, 4, 4]
    in_order = [[[0, 1, 2], [3, 4, 5], [6, 7]], [[8, 9, 10], [11, 12, 13], [14, 15]]]
    assert micro_batch_rows(lengths, prompt_lengths, 4, 8, 3, "never", by_length=False) == in_order
    by_length = micro_batch_rows(lengths, prompt_lengths, 4, 8, 3, "never", by_length=True)
    # longest first, ties in row order, never across the minibatch boundary
    assert by_length == [[[2, 4, 7], [0, 5, 6], [1, 3]], [[12, 14, 8], [9, 10, 11], [13, 15]]]
    for chosen, consecutive in zip(by_length, in_order):
        assert (naive_positions(chosen, lengths, prompt_lengths, 4, "never")
                < naive_positions(consecutive, lengths, prompt_lengths, 4, "never"))
    # micro-batches as large as the minibatch: nothing to arrange
    assert micro_batch_rows(lengths, prompt_lengths, 4, 8, 8, "never", by_length=True) == [
        [list(range(8))], [list(range(8, 16))]]


def test_micro_batch_rows_keeps_groups_together_where_shared_prompts_save_more():
    # 4 prompts of 100 tokens x group 4, micro-batches of 4, one minibatch: consecutive rows are one group each,
    # whose prompt is encoded once (skips 300 >= 128 positions); sorted by length they would mix the prompts
    lengths = [8, 1, 1, 1, 8, 1, 1, 1, 8, 1, 1, 1, 8, 1, 1, 1]
    prompt_lengths = [100, 100, 100, 100]
    consecutive = [[list(range(start, start + 4)) for start in range(0, 16, 4)]]
    sorted_rows = [[[0, 4, 8, 12], [1, 2, 3, 5], [6, 7, 9, 10], [11, 13, 14, 15]]]
    for mode, expected in (("auto", consecutive), ("always", consecutive), ("never", sorted_rows)):
        chosen = micro_batch_rows(lengths, prompt_lengths, 4, 16, 4, mode, by_length=True)
        assert chosen == expected, mode
        other = sorted_rows if expected == consecutive else consecutive
        assert (naive_positions(chosen[0], lengths, prompt_lengths, 4, mode)
                < naive_positions(other[0], lengths, prompt_lengths, 4, mode)), mode
    # equal cost (every completion equally long): consecutive rows, the cheaper view
    assert micro_batch_rows([3] * 16, prompt_lengths, 4, 16, 4, "never", by_length=True) == consecutive


@pytest.mark.parametrize("rows,num_completion", [(list(range(12)), 6), (list(range(2, 10)), 6), (list(range(12)), 1),
                                                 ([9, 2, 6, 0, 11, 5, 3, 8], 6)])
def test_shared_prompts_equal_every_row_encoded(tiny, rows, num_completion):
    """Encoding each prompt once and indexing its keys and values out to its rows gives the log-probs, entropies
    and weight gradients of encoding every row's prompt: with left padding (3 prompt lengths), early EOS, a
    micro-batch that cuts groups (rows 2 .. 9), one completion token (no second pass), and rows of the three
    prompts interleaved (as --group-by-length orders them)."""
    tokenizer, models, prompt_lists = tiny
    group = 4
    model = copy.deepcopy(models["sharp"]).train()
    prompts = [p for p in prompt_lists[:3] for _ in range(group)]  # 12 rows, 3 groups
    ids, mask, (comp, comp_mask, _) = sample(tokenizer, EosBoost(model, tokenizer.eos_token_id, 1.0), prompts,
                                             seed=5, max_new_tokens=num_completion)
    ids, mask, comp, comp_mask = ids[rows], mask[rows], comp[rows], comp_mask[rows]
    on = comp_mask.bool()
    assert num_completion == 1 or (~on).any()  # some completion ended early: masked positions are exercised
    prompt_of_row = prompt_sharing([row // group for row in rows], ids.shape[1], "always")

    def run(plan):
        model.zero_grad(set_to_none=True)
        logp, entropy = completion_logprobs(model, ids, mask, comp, comp_mask, 0.7, with_entropy=True,
                                            prompt_of_row=plan)
        (logp * comp_mask).sum().backward()
        return logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    every_logp, every_entropy, every_grads = run(None)
    shared_logp, shared_entropy, shared_grads = run(prompt_of_row)
    torch.testing.assert_close(shared_logp[on], every_logp[on], atol=1e-5, rtol=0)
    torch.testing.assert_close(shared_entropy[on], every_entropy[on], atol=1e-5, rtol=0)
    for name, grad in every_grads.items():  # sums of many terms in another order: fp32 rounding of the largest
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5 * grad.abs().max().item(), rtol=1e-4,
                                   msg=name)
    # the check can fail: giving every row the first row's prompt changes the log-probs
    wrong_logp, _, _ = run([0] * len(prompt_of_row))
    assert (wrong_logp[on] - every_logp[on]).abs().max() > 1e-2


def test_shared_prompts_refuse_a_model_that_drops_the_cache(tiny):
    """transformers drops the cache in gradient-checkpointed layers: the completions would then be scored without
    their prompt, so completion_logprobs stops with a message instead (train() never shares there)."""
    tokenizer, models, prompt_lists = tiny
    model = copy.deepcopy(models["plain"])
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids, mask = left_pad([prompt_lists[0]] * 2, tokenizer.pad_token_id, "cpu")
    completion = torch.tensor([[5, 6, 7], [5, 8, 9]])
    with pytest.raises(UserError, match="did not fill the KV cache"):
        completion_logprobs(model, ids, mask, completion, torch.ones_like(completion), 1.0, prompt_of_row=[0, 0])


class IgnoresCache(torch.nn.Module):
    """A model that does not read the cache argument: as a transformers release before 5.24 did with `cache=`
    (it took `past_key_values`), silently."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, cache=None, **kwargs):
        return self.model(**kwargs)


def test_sampling_refuses_a_model_that_ignores_the_cache(tiny):
    # every token after the first would be sampled from itself alone, without the prompt or the tokens before it
    tokenizer, models, prompt_lists = tiny
    with pytest.raises(UserError, match="did not fill the KV cache it was given as `cache=`.*upgrade transformers"):
        sample(tokenizer, IgnoresCache(models["plain"]), prompt_lists, seed=1, max_new_tokens=4)


def test_any_of_several_eos_ids_ends_a_completion(tiny):
    """Chat models list several EOS ids in their generation config (the end of a turn and the end of text): any of
    them ends a completion, is kept in its mask (trained on) and left out of its text, as with the tokenizer's."""
    tokenizer, models, prompt_lists = tiny
    end_of_turn = tokenizer.convert_tokens_to_ids("7")  # plays a chat model's second EOS
    model = copy.deepcopy(models["plain"])
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, end_of_turn]
    eos_ids = stop_token_ids(model, tokenizer)
    assert eos_ids == sorted([tokenizer.eos_token_id, end_of_turn])
    model.generation_config.eos_token_id = None
    assert stop_token_ids(model, tokenizer) == [tokenizer.eos_token_id]

    boosted = EosBoost(EosBoost(models["plain"], end_of_turn, 1.5), tokenizer.eos_token_id, 0.5)
    _, _, (comp, comp_mask, _) = sample(tokenizer, boosted, prompt_lists * 4, seed=1, max_new_tokens=8,
                                        eos_ids=eos_ids)
    comp = comp.tolist()
    ended_by = [next((t for t in row if t in eos_ids), None) for row in comp]
    assert end_of_turn in ended_by and tokenizer.eos_token_id in ended_by  # both kinds of ending happen
    for row, mask in zip(comp, comp_mask.tolist()):
        expected, seen = [], False
        for token in row:
            expected.append(0 if seen else 1)
            seen = seen or token in eos_ids
        assert mask == expected
    texts = decode_completions(tokenizer, torch.tensor(comp), comp_mask, eos_ids)
    for row, mask, text in zip(comp, comp_mask.tolist(), texts):
        kept = row[:sum(mask)]
        if kept[-1] in eos_ids:
            kept = kept[:-1]
        assert text == tokenizer.decode(kept, skip_special_tokens=False)


def test_generate_never_feeds_back_the_last_token():
    """T new tokens need the prefill and T - 1 decoding passes: the last sampled token is never fed back."""
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer).eval()
    calls = []
    model.register_forward_hook(lambda module, args, output: calls.append(1))
    ids, mask = left_pad([[1, 5, 6], [1, 7]], tokenizer.pad_token_id, "cpu")
    completion_ids, _, _ = generate(model, ids, mask, max_new_tokens=4, eos_ids=-1, pad_id=tokenizer.pad_token_id)
    assert completion_ids.shape == (2, 4) and len(calls) == 1 + 3


# ---------------------------------------------------------------------------------------------------------------
# rewards: the answer a completion states, its format, failures

# the answer field of a GSM8K row: the worked solution, its last line "#### <answer>"
GSM8K_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                "altogether in April and May.\n#### 72")


@pytest.mark.parametrize("completion, answer, expected", [
    ("so the sum is 12", "12", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("total 1,234,567 apples", "1234567", 1.0),
    ("The candidates are 1,2", "12", 0.0),  # a list, not 12 written with a thousands separator
    ("The candidates are 1,2", "2", 1.0),
    ("#### .5", "0.5", 1.0),
    ("it costs $7.50", "7.5", 1.0),
    ("x = -3/4", "-0.75", 1.0),
    ("x = -3", "3", 0.0),  # the sign is part of the number
    ("x = 3", "-3", 0.0),
    ("\\boxed{3}, no: \\boxed{5}", "5", 1.0),  # the last box is the answer
    ("\\boxed{3}, no: \\boxed{5}", "3", 0.0),
    ("#### 3 wait #### 5", "5", 1.0),  # and the last ####
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # nested braces: not the last number, 2
    ("so \\boxed{\\frac{1}{2}}", "2", 0.0),
    ("\\boxed{-\\dfrac{3}{4}}", "-0.75", 1.0),
    ("\\boxed{2\\frac{1}{2}}", "2.5", 1.0),  # a mixed number, not 21/2
    ("\\boxed{2\\frac{1}{2}}", "10.5", 0.0),
    ("\\boxed{-1 \\tfrac{3}{4}}", "-1.75", 1.0),
    ("\\boxed{x^2\\frac{1}{2}}", "2.5", 0.0),  # an exponent is no whole part
    ("\\boxed{1\\frac{\u00b2}{2}}", "2", 0.0),  # "²" is a digit to isdigit, not to int(): text, no crash
    ("\\boxed{7} then 8", "7", 1.0),  # the boxed answer wins over a later number
    ("#### 5 \\boxed{6}", "5", 1.0),
    ("no number here", "3", 0.0),
    ("the answer is blue", "blue", 0.0),  # no number and no #### or \\boxed: nothing is stated
    ("#### blue", "blue", 1.0),
    ("The answer is...5", "5", 1.0),  # not .5
    ("12.05.2023", "2023", 1.0),
    ("Paris", "Paris", 1.0),  # no marker and no number: the whole completion is the stated answer, as text
    ("  Paris\n", "Paris", 1.0),
    ("The capital is Paris", "Paris", 0.0),
    ("42", "Paris", 0.0),
    # a Markdown heading is no GSM8K marker: only a `####` on the last line is (its first number was the answer)
    ("#### Step 1: add\n5 + 7 = 12\n#### Step 2: double\n12 * 2 = 24\nso \\boxed{24}", "24", 1.0),
    ("#### Step 1: add\n5 + 7 = 12\n#### Step 2: double\n12 * 2 = 24\nso \\boxed{24}", "2", 0.0),
    ("#### 72 dollars", "72", 1.0),
    # a boxed text that is not a number is compared as text, not by its first number
    ("\\boxed{\\sqrt{2}}", "2", 0.0), ("\\boxed{x^2}", "2", 0.0), ("\\boxed{(1, 2)}", "1", 0.0),
    ("\\boxed{2\\sqrt{3}}", "2", 0.0), ("\\boxed{2}", "2\\sqrt{3}", 0.0), ("\\boxed{2 \\sqrt{3}}", "2\\sqrt{3}", 1.0),
    # LaTeX thousands separators, \\frac outside a box, exponents, a Unicode minus, % and $
    ("\\boxed{1{,}000}", "1000", 1.0), ("\\boxed{1{,}000}", "1", 0.0), ("\\boxed{10}", "10,\\!000", 0.0),
    ("#### \\frac{1}{2}", "0.5", 1.0), ("#### \\frac{1}{2}", "1", 0.0), ("so it is \\(\\frac{1}{2}\\)", "2", 0.0),
    ("#### 1e3", "1000", 1.0), ("#### 1e3", "1", 0.0), ("The answer is 1", "1e-5", 0.0), ("#### 1.5", "1.5e-3", 0.0),
    ("The answer is \u22125", "-5", 1.0), ("The answer is \u22125", "5", 0.0), ("\\boxed{18\\%}", "18", 1.0),
    # a hyphen after a digit or word is no minus sign
    ("x = 8-3", "3", 1.0), ("x = 8-3", "-3", 0.0), ("ages 5-7", "7", 1.0),
    # a plus sign, under the same rule ("3+5" states 5, not +5 after a digit)
    ("\\boxed{+5}", "5", 1.0), ("\\boxed{+5}", "-5", 0.0), ("x = +5", "5", 1.0), ("3+5", "5", 1.0),
    ("\\boxed{5}", "+5", 1.0), ("#### +2.5", "2.5", 1.0),
    # a unit that ends the statement is no part of the number, in the completion or the answer
    ("\\boxed{18\\text{ cm}}", "18", 1.0), ("\\boxed{18 \\text{dollars}}", "18", 1.0),
    ("\\boxed{18\\,\\mbox{cm}}", "18", 1.0), ("\\boxed{17\\text{ cm}}", "18", 0.0),
    ("\\boxed{90^\\circ}", "90", 1.0), ("\\boxed{90^{\\circ}}", "90", 1.0), ("\\boxed{90°}", "90", 1.0),
    ("\\boxed{18}", "18\\text{ cm}", 1.0), ("\\boxed{\\frac{1}{2}\\text{ cup}}", "0.5", 1.0),
    ("the angle is $45^\\circ$.", "45", 1.0),
    # a unit followed by more is not a final unit: the box holds more than a number
    ("\\boxed{5\\text{ and }7}", "5", 0.0), ("\\boxed{2\\text{ and }x}", "2x", 0.0),
    ("\\boxed{18\\text{ cm}^2}", "18", 0.0), ("\\boxed{18\\text{ cm}^2}", "18^2", 0.0),
    ("\\boxed{\\text{(A)}}", "\\text{(A)}", 1.0),
    # only one word is a unit: not a value (\\mathrm{i}), a scale, several words or a congruence
    ("\\boxed{3\\mathrm{i}}", "3", 0.0), ("\\boxed{2\\mathrm{e}}", "2", 0.0), ("\\boxed{5\\text{ million}}", "5", 0.0),
    ("\\boxed{2\\text{ and a half}}", "2", 0.0), ("\\boxed{1\\text{ (mod 7)}}", "1", 0.0),
    ("\\boxed{5\\text{ dollars.}}", "5", 1.0),
    # a reference that is a worked solution states its answer as a completion does (GSM8K's answer field, MATH's)
    ("#### 72", GSM8K_ANSWER, 1.0), ("\\boxed{72}", GSM8K_ANSWER, 1.0), ("72", GSM8K_ANSWER, 1.0),
    ("#### 71", GSM8K_ANSWER, 0.0), ("#### 24", GSM8K_ANSWER, 0.0), ("\\boxed{5}", "\\boxed{5}", 1.0),
    ("\\boxed{0.5}", "so it is $\\boxed{\\frac{1}{2}}$.", 1.0), ("\\boxed{x^2}", "\\boxed{x^2}", 1.0),
    # a #### stating no number, or not on the last line, makes no worked solution: the text is the reference
    ("3", "3 #### is the answer", 0.0), ("is the answer", "3 #### is the answer", 0.0),
    ("72", "She had 48.\n#### 72\nNote: 5", 0.0), ("5", "She had 48.\n#### 72\nNote: 5", 0.0),
    # \\frac12: one-digit parts without braces
    ("\\boxed{\\frac12}", "1/2", 1.0), ("\\boxed{\\dfrac 3 4}", "0.75", 1.0), ("\\boxed{\\frac12}", "12", 0.0),
    # a decimal over a whole number (Fraction reads no "1.5/2"), and over zero (no value: compared as text)
    ("\\boxed{\\frac{1.5}{2}}", "0.75", 1.0), ("#### 1.5/2", "0.75", 1.0), ("#### 1.5/2", "1.5", 0.0),
    ("#### 1,500/2", "750", 1.0), ("\\boxed{1.5/0}", "1.5", 0.0),
    # a denominator written as a numerator is, decimal or with thousands separators: all of it, not its start
    ("#### 1.5/2.5", "0.6", 1.0), ("#### 1.5/2.5", "0.75", 0.0), ("#### 3/1.5", "2", 1.0), ("#### 3/1.5", "3", 0.0),
    ("#### 1,500/2,000", "0.75", 1.0), ("#### 1,500/2,000", "750", 0.0), ("#### 1/.5", "2", 1.0),
    # \\frac{a}{b} as text: a sum over, or a product under, the bar is bracketed, or x+1/2 would be (x+1)/2
    ("\\boxed{x+\\frac{1}{2}}", "\\frac{x+1}{2}", 0.0), ("\\boxed{\\frac{x+1}{2}}", "\\frac{x+1}{2}", 1.0),
    ("\\boxed{\\frac{1}{2}x}", "\\frac{1}{2x}", 0.0), ("\\boxed{\\frac{1}{2}\\pi}", "\\frac{1}{2\\pi}", 0.0),
    ("\\boxed{\\frac{a}{b+c}}", "\\frac{a}{b}+c", 0.0), ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2", 1.0),
    ("\\boxed{\\frac{2x}{3}}", "2x/3", 1.0), ("\\boxed{\\frac{1,500}{2,000}}", "0.75", 1.0),
    ("\\boxed{\\frac{x+1}{2}}", "(x+1)/2", 1.0),
    # and no more than that: a bracketed or raised part is already whole, a power binds before "/"
    ("\\boxed{n(n+1)/2}", "\\frac{n(n+1)}{2}", 1.0), ("\\boxed{1/x^2}", "\\frac{1}{x^2}", 1.0),
    ("\\boxed{1/n!}", "\\frac{1}{n!}", 1.0), ("\\boxed{1/\\sqrt3}", "\\frac{1}{\\sqrt3}", 1.0),
    ("\\boxed{k/(k+1)}", "\\frac{k}{k+1}", 1.0), ("\\boxed{\\frac{1}{\\pi}r}", "\\frac{1}{\\pi r}", 0.0),
    # a fraction raised to a power, or divided into, is bracketed whole
    ("\\boxed{\\frac{a}{b}^2}", "\\frac{a}{b^2}", 0.0), ("\\boxed{a/\\frac{b}{c}}", "\\frac{a}{b}/c", 0.0),
    # the number after a #### is no answer when an expression goes on from it, or leads to it (as in a box)
    ("#### 2\\sqrt{3}", "2", 0.0), ("#### 5^2", "5", 0.0), ("#### 5 \\times 10^3", "5", 0.0), ("#### (1, 2)", "1", 0.0),
    ("#### 5 million", "5", 0.0), ("#### 5\\text{ million}", "5", 0.0), ("#### \\frac{1}{2}x", "0.5", 0.0),
    ("#### 10 - 3 = 7", "10", 0.0), ("#### \\pm 5", "5", 0.0), ("#### - 5", "5", 0.0), ("#### 3,5", "3", 0.0),
    ("#### 5\u00b2", "5", 0.0), ("#### Final Answer: $\\boxed{2\\sqrt{3}}$", "2", 0.0),
    ("#### 2\\sqrt{3}", "2\\sqrt{3}", 1.0), ("#### 72 dollars", "72", 1.0), ("#### **72**", "72", 1.0),
    ("#### x = 72", "72", 1.0), ("#### 72, the total", "72", 1.0), ("#### 72.", "72", 1.0),
    # a mixed number or a fraction after a digit that is no whole part: bracketed and kept apart
    ("\\boxed{3\\frac{x+1}{2}}", "3x+\\frac{1}{2}", 0.0), ("\\boxed{1.5\\frac{1}{2}}", "0.755", 0.0),
    ("the value is x^2\\frac{1}{2}", "10.5", 0.0),
    # scales are no units, in any case; a dash before a number is its minus
    ("\\boxed{5\\text{ trillion}}", "5", 0.0), ("\\boxed{5\\text{ Million}}", "5", 0.0),
    ("\\boxed{5\\text{ dozen}}", "5", 0.0), ("\\boxed{3\\text{ i}}", "3", 0.0), ("\\boxed{5\\text{ m}}", "5", 1.0),
    ("#### \u20135", "5", 0.0), ("#### \u20135", "-5", 1.0), ("#### \uff0d5", "5", 0.0), ("ages 5\u20137", "7", 1.0),
    ("price \u20105", "5", 1.0),  # (a hyphen is no minus)
    # a number wrapped in brackets, math delimiters or emphasis is still that number; a glued word is a unit
    ("#### (72)", "72", 1.0), ("#### \\(72\\)", "72", 1.0), ("#### \\[72\\]", "72", 1.0), ("#### *72*", "72", 1.0),
    ("#### \\textbf{72}", "72", 1.0), ("#### (-3)", "-3", 1.0), ("#### (1, 2)", "1", 0.0), ("#### 72km", "72", 1.0),
    ("#### 3rd", "3", 1.0), ("#### 72 - the total", "72", 1.0), ("#### 72 \u2013 the total", "72", 1.0),
    # and Unicode or plain-word operators, powers, roots and scales go on from it
    ("#### \u221a72", "72", 0.0), ("#### 72\u03c0", "72", 0.0), ("#### 72\u2074", "72", 0.0),
    ("#### 72 \u2153", "72", 0.0), ("#### 72 \u22c5 2", "72", 0.0), ("#### 72**2", "72", 0.0),
    ("#### 72 \u00b1 3", "72", 0.0), ("#### 5 x 3", "5", 0.0),
    ("#### 2 pi", "2", 0.0), ("#### 2 sqrt(3)", "2", 0.0), ("#### 5 squared", "5", 0.0), ("#### 5 K", "5", 0.0),
    ("#### 5 bn", "5", 0.0), ("#### 5 hundredths", "5", 0.0), ("#### 72 - 3", "72", 0.0), ("#### 2 pieces", "2", 1.0),
    # numbers apart are not one number when compared as text; groups of three are
    ("#### 3 1/2", "31/2", 0.0), ("#### 7 2", "72", 0.0), ("#### 1 200", "1200", 1.0),
    ("\\boxed{\\frac{1}{n}!}", "\\frac{1}{n!}", 0.0),  # (1/n)! is no 1/n!
    # a space after a sign or around "/" joins no numbers; the same text, spaces aside, is the answer
    ("\\boxed{- \\frac{1}{2}}", "-\\frac{1}{2}", 1.0), ("#### - 5", "-5", 1.0), ("\\boxed{1 / 2}", "1/2", 1.0),
    ("\\boxed{1\u202f200}", "1200", 1.0), ("\\boxed{- 1 200}", "-1200", 1.0), ("#### 3 1/2", "3 1/2", 1.0),
    # glued letters are algebra unless a unit; a dash before an operand is an operator, an M of M&Ms no scale
    ("#### 2xy", "2", 0.0), ("#### 2sin(x)", "2", 0.0), ("#### 5km^2", "5", 1.0), ("#### 6xy", "6xy", 1.0),
    ("#### 72pieces", "72", 0.0), ("#### 10am", "10", 1.0), ("#### 2 - pi", "2", 0.0), ("#### 4 - sqrt(2)", "4", 0.0),
    ("#### 5 - -3", "5", 0.0), ("#### 5 - .5", "5", 0.0), ("#### 5 - xy", "5", 0.0), ("#### 72 M&Ms", "72", 1.0),
    ("#### 5 K.", "5", 0.0), ("#### 5\u20111", "5", 0.0), ("#### 3h^2", "3", 0.0),
    # a spaced dash is prose, a dash after a label word too; \quad and \approx lead to the number; "=" follows it
    ("#### \u2013 72", "72", 1.0), ("#### \u2013 72", "-72", 0.0), ("The answer is \u201372", "-72", 1.0),
    ("#### Answer - 72", "72", 1.0), ("#### \\approx 72", "72", 1.0), ("#### 72 = 8 * 9", "72", 1.0),
    ("#### 72 -", "72", 1.0), ("#### 72h", "72", 1.0),
    # a time, a ratio, a range, a product or a quantity in two units or numbers is no first number
    ("#### 10:30", "10", 0.0), ("#### 3:2", "3", 0.0), ("#### 4 hours and 30 minutes", "4", 0.0),
    ("#### 1 hour 30 minutes", "1", 0.0), ("#### 4 hours, 30 minutes", "4", 0.0),
    ("#### 5 and 7", "5", 0.0), ("#### 5 to 7", "5", 0.0), ("#### 12 in 3 boxes", "12", 1.0),
    ("#### 4\u20146", "4", 0.0), ("#### 2h 45m", "2", 0.0), ("#### 5 ft 6 in", "5", 0.0),
    ("#### 4 hours and a half", "4", 0.0),
    # ... but an explanation or a restatement after it is no second quantity (and only the first number is read)
    ("#### 18 because 9 x 2 = 18", "18", 1.0), ("#### 18 dollars. 9 eggs x 2 = 18", "18", 1.0),
    ("#### 18 dollars, 2 more than yesterday", "18", 1.0), ("#### 18 total, 9 each", "18", 1.0),
    ("#### 3/8 or 0.375", "0.375", 1.0), ("#### 1500 or 1,500", "1500", 1.0), ("#### 5 or 6", "5", 1.0),
    ("#### 5 or 6", "6", 0.0), ("#### 2 hours, 120 minutes", "2", 1.0), ("#### 240 minutes, 4 hours", "240", 1.0),
    ("#### 5 dollars, 500 cents", "5", 1.0), ("#### 18 m and 2 s", "18", 1.0), ("#### 12 in 2 days", "12", 1.0),
    ("#### 9 and three quarters", "9", 0.0), ("#### 5 m 20 cm", "5", 0.0), ("#### 3 feet (36 inches)", "3", 1.0),
    ("#### 3 boxes of 12", "3", 1.0), ("#### 18 and", "18", 1.0), ("#### 72 dollars.", "72", 1.0),
    ("#### 8 and a half", "8", 0.0), ("#### 3 times 4", "3", 0.0), ("#### 72 divided by 8", "72", 0.0),
    ("#### 3 times", "3", 1.0), ("#### 3 times a week", "3", 1.0), ("#### 12 (6 + 6)", "12", 1.0),
    # no marker: a last number under a root, a power or a symbol's bar, or a coefficient, is no answer
    ("the final answer is $2\\sqrt{3}$", "3", 0.0), ("the answer is \\sqrt 3", "3", 0.0),
    ("the answer is 2^{10}", "10", 0.0), ("so it is 3x", "3", 0.0), ("so it is 3\\pi", "3", 0.0),
    ("it is \\pi/2", "2", 0.0), ("v = 3i + 4j", "4", 0.0), ("f(x) = 4^x", "4", 0.0),
    ("The answer is \\(72\\).", "72", 1.0), ("The answer is **72**.", "72", 1.0), ("answer is (72)", "72", 1.0),
    ("it is 10am", "10", 1.0), ("so she has 72 apples.", "72", 1.0), ("the answer is 5\\text{ cm}", "5", 1.0),
    ("So $\\frac{\\sqrt{3}}{2}$.", "2", 0.0), ("the roots are x_1 and x_2", "2", 0.0),
    ("The answer is 3 \u00d7 4", "4", 0.0), ("The answer is 3 * 4", "4", 0.0), ("The answer is *72*.", "72", 1.0),
    ("He is 5yo.", "5", 1.0), ("It takes 100ms.", "100", 1.0), ("about 3pcs", "3", 1.0),
    # ... but a glued unit, Markdown emphasis or a unit's power is no expression
    ("The train arrives at 8PM.", "8", 1.0), ("It will take 18days.", "18", 1.0),
    ("The board is 18in long.", "18", 1.0), ("The answer is _18_.", "18", 1.0), ("The answer is __18__.", "18", 1.0),
    ("The answer is 18 ^_^", "18", 1.0),
    ("The area is 49 cm^2.", "49", 1.0), ("The area is 49m^{2}.", "49", 1.0), ("The area is 49 cm^2.", "2", 0.0),
    ("The area is $49\\text{ cm}^2$.", "49", 1.0),
])
def test_answer_reward(completion, answer, expected):
    assert answer_reward(completion, answer) == expected


def test_answer_reward_of_a_fraction_past_ints_digit_limit_is_0_not_an_error():
    """int() refuses more than 4,300 digits: a degenerate completion scores 0 (a raise would stop the run, or
    crash the evaluation, which has no --reward-errors)."""
    assert answer_reward("2\\frac{1}{" + "1" * 4400 + "}", "2") == 0.0
    assert answer_reward("\\boxed{" + "7" * 4400 + "\\frac{1}{2}}", "7.5") == 0.0


def test_json_number_answers_keep_their_value(tmp_path):
    """A JSON number answer becomes text in positional notation: str(5e-05) is "5e-05", read back as 5."""
    from grpo import load_jsonl_prompts

    path = tmp_path / "rows.jsonl"
    # digits past a float's 17 as written, not rounded (0.333333333333333333 is not 0.3333333333333333); the others
    # as a float spells them, as before (2.50 -> 2.5, 1e3 -> 1000.0): the data's fingerprint, which a resume
    # checks, is unchanged
    written = ["5e-05", "1e20", "3", "2.5", "-0.125", "0.333333333333333333", "12345678901234567890.0", "2.50", "1e3",
               "1e400"]  # (past a float's range: as written)
    path.write_text("".join(f'{{"prompt": "p", "answer": {a}}}\n' for a in written))
    answers = [row["answer"] for row in load_jsonl_prompts(str(path))]
    assert answers == ["0.00005", "100000000000000000000", "3", "2.5", "-0.125", "0.333333333333333333",
                       "12345678901234567890.0", "2.5", "1000.0", "1" + "0" * 400]
    assert answer_reward("0.00005", answers[0]) == 1.0 and answer_reward("5", answers[0]) == 0.0
    assert answer_reward("12345678901234567890", answers[6]) == 1.0


@pytest.mark.parametrize("content, message", [
    (b'\x1f\x8b\x08\x00', "rows.jsonl is gzip-compressed; decompress it"),
    (b"PAR1\x15\x04", "rows.jsonl is a Parquet file"),
    (b'[\n  {"prompt": "1+2=", "answer": "3"}\n]\n', "rows.jsonl holds a JSON array, not JSON lines"),
    (b'{"prompt": "1+2=\\ud800", "answer": "3"}\n', "rows.jsonl:1: the prompt holds a lone surrogate"),
    (b'{"prompt": " ", "answer": "3"}\n', "rows.jsonl:1: the prompt is empty"),
    (b'{"prompt": [{"role": "user", "content": "1+2="}], "answer": "3"}\n', "rows.jsonl:1: the prompt is a list"),
    (b'{"prompt": "1+2=", "solution": "\\\\boxed{3}"}\n', 'rename that field to "answer"'),
    (b'{"prompt": "1+2=", "answer": ' + b"9" * 5000 + b"}\n", "rows.jsonl:1: invalid JSON (a number too long or too"),
    (b'{"prompt": "1+2=", "answer": 1e-999999999999999999999}\n', "rows.jsonl:1: invalid JSON (a number too long"),
    (b'{"prompt": "1+2=", "answer": 1e-99999999}\n', "rows.jsonl:1: the answer 1E-99999999 has over 4,300 digits"),
    (b'{"a": ' * 100000 + b"1" + b"}" * 100000 + b"\n", "rows.jsonl:1: invalid JSON (nested too deeply)"),
    (b'{"prompt": "1+2=", "answer": 1e999999}\n', "rows.jsonl:1: the answer 1E+999999 has over 4,300 digits when"),
    (b'{"prompt": "1+2=", "answer": NaN}\n', "rows.jsonl:1: the answer is nan, which no completion can equal"),
])
def test_data_files_that_are_no_jsonl_of_prompts_are_named(tmp_path, content, message):
    from grpo import load_jsonl_prompts

    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError, match=re.escape(message)):
        load_jsonl_prompts(str(path))


def test_lines_ended_by_a_lone_cr_are_lines_and_placeholder_answers_are_warned_about(tmp_path, capsys):
    from grpo import load_jsonl_prompts

    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"prompt": "1+2=", "answer": "3"}\r{"prompt": "2+2=", "answer": "None"}\r'
                     b'{"prompt": "3+2=", "answer": "n/a"}\r')
    assert [row["where"] for row in load_jsonl_prompts(str(path))] == [f"{path}:{n}" for n in (1, 2, 3)]
    # with LFs, lines end at them: a CR before one, or inside a row, is JSON whitespace (Windows' \r\r\n too)
    path.write_bytes(b'{"prompt": "1+2=",\r"answer": "3"}\r\r\n{"prompt": "2+2=", "answer": "4"}\r\n')
    assert [row["where"] for row in load_jsonl_prompts(str(path))] == [f"{path}:{n}" for n in (1, 2)]
    assert (f"warning: 2 answers are None, null, nan or N/A (the first at {path}:2): missing values written as "
            "text?") in capsys.readouterr().err


def test_a_byte_order_mark_is_not_part_of_the_first_row(tmp_path):
    """Files saved by Windows tools start with a UTF-8 byte-order mark, which json rejects."""
    from grpo import load_jsonl_prompts

    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "1+2=", "answer": "3"}\n{"prompt": "2+2=", "answer": "4"}\n')
    assert [row["prompt"] for row in load_jsonl_prompts(str(path))] == ["1+2=", "2+2="]


def test_final_answer_reads_fractions_and_unclosed_boxes():
    assert final_answer("\\boxed{\\frac{10}{4}}") == "10/4"
    assert final_answer("\\boxed{42") == "42"  # never closed: the last number
    assert final_answer("1,2345") == "2345"  # "1,234" followed by a digit is not a thousands group


@pytest.mark.parametrize("completion, expected", [
    ("42", 1.0), ("-3.5", 1.0), ("07", 0.0), ("4 2", 0.0), ("so #### 12", 1.0), ("so #### -3", 1.0),
    ("#### 12 ok", 0.0), ("#### 5,,,,", 0.0), ("#### 1.2.3.4", 0.0), ("#### 1,234", 1.0),
    ("so \\boxed{\\frac{1}{2}}", 1.0), ("so \\boxed{}", 0.0), ("\\boxed{3} more", 0.0),
    # closing marks after the statement: math mode, a full stop (a bare number stays strict)
    ("so $\\boxed{5}$.", 1.0), ("so \\(\\boxed{5}\\)", 1.0), ("\\[\\boxed{5}\\]", 1.0), ("#### 5.", 1.0),
    ("5.", 0.0), ("\\boxed{3} more.", 0.0), ("#### 1.2.3.", 0.0), ("so $.", 0.0),
    # one closing mark and one full stop: not a junk tail of them
    ("#### 5$$$$$$$$", 0.0), ("\\boxed{5}.........\\]\\]\\)$", 0.0), ("#### 5 . . . . $ $", 0.0),
    ("$$\\boxed{5}$$", 1.0),
])
def test_format_reward(completion, expected):
    assert format_reward(completion, "") == expected


def test_format_reward_of_a_long_run_of_blanks_takes_no_time():
    """A run of blanks mid-text (a degenerate completion) made the end-of-statement regex backtrack in cubic time:
    8,000 newlines took minutes, in a reward that is on by default."""
    def out_of_time(signum, frame):
        raise TimeoutError("format_reward backtracks")

    saved = signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(10)
    try:
        assert format_reward("#### 5" + "\n" * 8000 + "x", "5") == 0.0
        assert format_reward("so " + " " * 8000 + "\\boxed{5}$.", "5") == 1.0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, saved)


def test_rewards_of_degenerate_completions_take_linear_time():
    """A run of `#` before the last word made format_reward's `####\\s*(\\S+)$` search scan to the end from each
    `#` (40,000: 6 s); thousands of \\frac{}{} made answer_reward copy the text once per fraction (200,000
    characters: 5 s)."""
    def out_of_time(signum, frame):
        raise TimeoutError("a reward takes super-linear time")

    saved = signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(10)
    try:
        assert format_reward("#" * 200_000 + " x", "5") == 0.0
        assert format_reward("#" * 200_000 + " 5", "5") == 1.0  # (the last "####" before the blanks marks the 5)
        assert answer_reward("\U0001F600" + "\\frac12 " * 25_000, "1/2") == 1.0
        assert answer_reward("72", "\U0001F600" + "\\frac{x+1}{2x}" * 14_000) == 0.0
        assert answer_reward(("^ {" + " " * 1000 + "x") * 200 + "5", "5") == 1.0  # (blank runs after powers)
        assert answer_reward("#### 5" + " " * 200_000 + "hours", "5") == 1.0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, saved)


def test_marked_token_is_the_regex_capture():
    from grpo import marked_token

    for text in ["#### 5", "#####  5", "######5", "####", "a ####", "x #### 5 6", "#### \u3000 7", "5", "",
                 "####\x1c5", "## ## 5", "#### #### 5"]:
        match = re.search(r"####\s*(\S+)$", text)
        assert marked_token(text) == (match.group(1) if match else None), text


def test_a_failing_batched_reward_is_reported_or_skipped(capsys):
    """The PRM reward scores the whole batch in one call: an exception there follows --reward-errors too."""
    def broken_prm(prompts, completions):
        raise RuntimeError("PRM out of memory")

    fns = [("answer", answer_reward, 1.0), ("prm", broken_prm, 0.5)]
    with pytest.raises(UserError, match="PRM out of memory.*--reward-errors skip"):
        compute_rewards(["p", "p"], ["1", "2"], ["1", "1"], fns, "raise")
    totals, per_fn = compute_rewards(["p", "p"], ["1", "2"], ["1", "1"], fns, "skip")
    assert torch.isnan(totals).all() and torch.isnan(per_fn["prm"]).all()
    assert per_fn["answer"].tolist() == [1.0, 0.0]
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 1 and "PRM out of memory" in warnings[0]  # one failure, not one "returned nan" a sample


def test_a_raising_reward_is_reported_once_and_an_overflowing_one_is_a_failure(capsys):
    """Under skip a reward that raised was warned of twice (then as the NaN it had become); a finite value beyond
    float32's range became inf in the rewards tensor, past the finiteness check, and made the advantages NaN."""
    def raising_on_two(completion, answer):
        if completion == "2":
            raise ValueError("cannot parse")
        return 1e39 if completion == "3" else 1.0

    totals, _ = compute_rewards(["p"] * 3, ["1", "2", "3"], ["1"] * 3, [("answer", raising_on_two, 1.0)], "skip")
    assert totals[0] == 1.0 and torch.isnan(totals[1:]).all()
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 2 and "sample 1 " in warnings[0] and "cannot parse" in warnings[0]
    assert "sample 2 " in warnings[1] and "returned 1e+39" in warnings[1]


def test_a_failed_reward_names_the_sample_by_its_index_in_the_whole_batch(capsys):
    """Under torchrun each process scores its own share of the step's samples: a failure names the sample by its
    index among all of them (sample_indices), not by its index in the share."""
    def nan_on_two(completion, answer):
        return float("nan") if completion == "2" else 1.0

    with pytest.raises(UserError, match="reward answer failed on sample 33 .completion '2', answer '1'.: returned nan"):
        compute_rewards(["p", "p", "p"], ["1", "2", "3"], ["1", "1", "1"], [("answer", nan_on_two, 1.0)], "raise",
                        sample_indices=[32, 33, 34])
    totals, _ = compute_rewards(["p", "p"], ["2", "3"], ["1", "1"], [("answer", nan_on_two, 1.0)], "skip",
                                sample_indices=[8, 9])
    assert torch.isnan(totals[0]) and totals[1] == 1.0
    assert "reward answer failed on sample 8 " in capsys.readouterr().err
    compute_rewards(["p", "p"], ["3", "2"], ["1", "1"], [("answer", nan_on_two, 1.0)], "skip")
    assert "reward answer failed on sample 1 " in capsys.readouterr().err  # one process: the index in the batch


# ---------------------------------------------------------------------------------------------------------------
# disable_dropout


def test_disable_dropout_covers_attention_and_adapter_dropout():
    """Attention layers apply their config's attention_dropout themselves (no nn.Dropout module) and peft's
    adapter dropout is an nn.Dropout added after the model was built: with both on, two training-mode passes
    differ; after disable_dropout they are identical."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, attention_dropout=0.5)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_dropout=0.5, target_modules=["q_proj"]))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, which would hide the adapter's dropout
            torch.nn.init.normal_(parameter)
    model.train()
    ids = torch.randint(0, 50, (2, 12))
    assert (model(ids).logits - model(ids).logits).abs().max() > 1e-3
    disable_dropout(model)
    assert torch.equal(model(ids).logits, model(ids).logits)
    assert model.config.attention_dropout == 0.0


def test_resolve_device(monkeypatch):
    """torch.cuda.set_device needs an index: a bare `cuda` is this process's GPU (LOCAL_RANK under torchrun); a GPU
    that is not there, or a name torch does not know, is one error line."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device("cuda", 3) == torch.device("cuda", 3)
    assert resolve_device("cuda:1", 3) == torch.device("cuda", 1)
    assert resolve_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(UserError, match="there is no cuda:5 here"):
        resolve_device("cuda:5", 0)
    with pytest.raises(UserError, match="--device 'gpu0' is not a device"):
        resolve_device("gpu0", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", 0) == torch.device("cpu")
    # torchrun with 2 processes on this machine: a bare cuda gives each its own GPU, cuda:N would put both on N
    assert resolve_device("cuda", 1, local_processes=2) == torch.device("cuda", 1)
    with pytest.raises(UserError, match="--device cuda:1 puts every one of the 2 processes on this machine on"):
        resolve_device("cuda:1", 1, local_processes=2)
    assert resolve_device("cuda:1", 0, local_processes=1) == torch.device("cuda", 1)  # one process: any GPU


def test_lora_targets_any_layer_peft_adapts():
    """peft adapts GPT-2's Conv1D layers by name (c_attn), and ignores names that match nothing when others do:
    a typo among the targets is an error, not a silently smaller adapter."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from grpo import Args, apply_lora

    def gpt2():
        return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, bos_token_id=0,
                                          eos_token_id=0))

    adapted = apply_lora(gpt2(), Args(lora_r=4, lora_target_modules="c_attn,attn.c_proj")).targeted_module_names
    assert adapted == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj"]
    for targets in ("c_attn,c_atn", "q_proj"):
        with pytest.raises(UserError, match="no layer is named (c_atn|q_proj); this model's include c_attn"):
            apply_lora(gpt2(), Args(lora_r=4, lora_target_modules=targets))


def test_an_adapter_as_large_as_its_layer_gets_a_note():
    """r (in + out) >= in x out: the adapter holds as many weights as full fine-tuning of the layer would train. GPT-2
    at width 32: c_attn is 32 -> 96 (r >= 32 x 96 / 128 = 24), attn.c_proj 32 -> 32 (r >= 32 x 32 / 64 = 16)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from grpo import Args, apply_lora, oversized_lora_note

    def adapted(rank):
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, bos_token_id=0,
                                           eos_token_id=0))
        return apply_lora(model, Args(lora_r=rank, lora_target_modules="c_attn,attn.c_proj"))

    assert oversized_lora_note(adapted(15), 15) is None
    note = oversized_lora_note(adapted(16), 16)
    assert "with --lora-r 16, 1 adapters" in note and "transformer.h.0.attn.c_proj, in 32, out 32" in note
    assert "--lora-r 15 or less" in note
    note = oversized_lora_note(adapted(24), 24)
    assert "2 adapters" in note and "attn.c_proj, in 32, out 32" in note  # (the smallest layer is named)


# ---------------------------------------------------------------------------------------------------------------
# guess_peak_tflops


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 362.0), ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0),
    ("NVIDIA H20", 148.0), ("NVIDIA A10G", 70.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA H800 PCIe", 756.0),
    ("NVIDIA GeForce RTX 4090 D", 147.0), ("Tesla V100-SXM2-16GB", 0.0),  # no bf16: auto runs fp32 there
    ("NVIDIA RTX A1000", 0.0),  # not an A100: names match as whole words
    ("Some Future GPU", 0.0),  # unknown: MFU is NaN and a warning asks for --peak-tflops
])
def test_guess_peak_tflops(name, tflops):
    assert guess_peak_tflops(name) == tflops
