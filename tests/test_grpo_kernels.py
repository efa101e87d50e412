"""Kernel tests for grpo.py: each kernel against a naive reference written here with loops (or fp64 torch for the
log-softmax), never by calling the kernel under test. The model-side tests use the tiny 2-layer Llama."""

import copy
import math
import statistics

import pytest
import torch

from grpo import (
    Args,
    Policy,
    completion_logprobs,
    filter_logits,
    generate,
    group_advantages,
    grpo_loss,
    kl_penalty,
    left_pad,
    load_model,
    token_logprobs,
)

LOSS_TYPES = ["grpo", "bnpo", "dapo", "dr_grpo"]
SCALES = ["group", "batch", "none"]
EPS_LOW, EPS_HIGH, DELTA = 0.2, 0.28, 1.5  # eps_low != eps_high on purpose
MAX_LEN = 9  # completion length of the batches, and dr_grpo's constant
ADV = [1.3, -0.8, 0.0, 0.5, -1.1, 0.9, -0.6, 0.7]  # both signs and 0; row 3 is fully masked
CLIPPED_WITH_KL = dict(
    clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, kl_coef=0.1, max_completion_length=MAX_LEN, delta=DELTA
)
SEQ_RATIOS = {0: 1.6, 1: 0.6, 6: 2.0}  # GSPO rows: clipped high (A > 0), clipped low (A < 0), beyond delta (A < 0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny tensors: on a shared 2-core CPU intra-op threads only contend
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ---------------------------------------------------------------------------------------------------------------
# Naive references


def naive_kl(lp: float, ref: float, estimator: str) -> tuple[float, float]:
    """(KL estimate, its derivative in lp), x = ref - lp."""
    x = ref - lp
    if estimator == "k1":
        return -x, 1.0
    if estimator == "k2":
        return 0.5 * x * x, -x
    return math.exp(x) - x - 1.0, 1.0 - math.exp(x)


def naive_policy(x: float, a: float, eps_low: float, eps_high: float, delta) -> tuple[float, float]:
    """(-min(r' A, clip(r) A), its derivative in x) for r = e^x, r' = min(r, delta)."""
    r = math.exp(x)
    capped = delta is not None and r > delta
    unclipped, clipped = (delta if capped else r) * a, min(max(r, 1.0 - eps_low), 1.0 + eps_high) * a
    if clipped < unclipped:
        return -clipped, (-a * r if 1.0 - eps_low < r < 1.0 + eps_high else 0.0)
    return -unclipped, (0.0 if capped else -a * r)  # a tie has the unclipped term's gradient


def naive_loss(
    batch,
    *,
    clip_eps_low=0.2,
    clip_eps_high=0.2,
    kl_coef=0.0,
    loss_type="grpo",
    max_completion_length=None,
    delta=None,
    importance_sampling="token",
    kl_estimator="k3",
    kl_ratio_weighted=False,
    total_sequences=None,
    total_tokens=None,
):
    """(loss, d loss / d logp as [B][T] lists, stats) of grpo_loss's documented formula, token by token."""
    logp, old_logp, ref_logp, adv, mask = (x.double().tolist() for x in batch)
    n_seq = len(logp) if total_sequences is None else total_sequences
    n_tok = sum(map(sum, mask)) if total_tokens is None else total_tokens
    loss, grads = 0.0, []
    sums = dict(ratio=0.0, low=0.0, high=0.0, pg=0.0, kl=0.0, tokens=0.0)
    for i in range(len(logp)):
        n_i = sum(mask[i])
        weight = {
            "grpo": 1.0 / n_i / n_seq if n_i else 0.0,
            "bnpo": 1.0 / max(n_tok, 1.0),
            "dapo": 1.0 / max(n_tok, 1.0),
            "dr_grpo": 1.0 / (n_seq * (max_completion_length or 1)),
        }[loss_type]
        # GSPO: the row's mean log-ratio stands for every token's; d(sum_t m_t P(mean)) / d logp_t' = P'(mean) m_t'
        row_x = sum(m * (lp - o) for lp, o, m in zip(logp[i], old_logp[i], mask[i])) / max(n_i, 1.0)
        row_grads = []
        for t in range(len(logp[i])):
            m = mask[i][t]
            x = row_x if importance_sampling == "sequence" else logp[i][t] - old_logp[i][t]
            policy, grad = naive_policy(x, adv[i], clip_eps_low, clip_eps_high, delta)
            kl = 0.0
            if kl_coef:
                kl, kl_grad = naive_kl(logp[i][t], ref_logp[i][t], kl_estimator)
                if kl_ratio_weighted:  # d(r KL)/d lp = r KL + r dKL/dlp, r the token's own ratio
                    r = math.exp(logp[i][t] - old_logp[i][t])
                    kl, kl_grad = r * kl, r * (kl + kl_grad)
                grad += kl_coef * kl_grad
            loss += weight * m * (policy + kl_coef * kl)
            row_grads.append(weight * m * grad)
            if m:
                r = math.exp(x)
                sums["ratio"] += r
                sums["low"] += adv[i] < 0 and r < 1.0 - clip_eps_low
                sums["high"] += (adv[i] > 0 and r > 1.0 + clip_eps_high) or (
                    delta is not None and adv[i] < 0 and r > delta
                )
                sums["pg"] += policy
                sums["kl"] += kl
                sums["tokens"] += 1
        grads.append(row_grads)
    count = max(sums["tokens"], 1.0)
    stats = {
        "ratio_mean": sums["ratio"] / count,
        "clip_frac_low": sums["low"] / count,
        "clip_frac_high": sums["high"] / count,
        "pg_loss": sums["pg"] / count,
        "tokens": sums["tokens"],
    }
    if kl_coef:
        stats["kl_mean"] = sums["kl"] / count
    return loss, grads, stats


def naive_advantages(rewards: list, group_size: int, scale: str, eps: float = 1e-4) -> list:
    """Per group: the rewards' mean and Bessel std; equal-reward groups get 0."""
    batch_std = statistics.stdev(rewards)
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((v - mean) ** 2 for v in group) / (len(group) - 1))
        for v in group:
            if len(set(group)) < 2:
                out.append(0.0)
            else:
                out.append((v - mean) / {"group": std + eps, "batch": batch_std + eps, "none": 1.0}[scale])
    return out


def naive_filter(values: list, top_k: int, top_p: float) -> set:
    """Ids kept: the top_k largest, then the smallest prefix by probability (renormalised) reaching top_p."""
    kept = sorted(range(len(values)), key=lambda j: -values[j])[: top_k or None]
    if top_p < 1.0:
        weights = [math.exp(values[j] - values[kept[0]]) for j in kept]
        nucleus, mass = [], 0.0
        for j, w in zip(kept, weights):
            if mass >= top_p:
                break
            nucleus.append(j)
            mass += w / sum(weights)
        kept = nucleus
    return set(kept)


def reference_logp(logits, targets, temperature=1.0, vocab_size=None):
    """fp64 log_softmax(logits / T) at the targets, and the entropy."""
    logp = torch.log_softmax(logits[..., :vocab_size].double() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


# ---------------------------------------------------------------------------------------------------------------
# Inputs


def make_batch(seed: int, dtype=torch.float64):
    """[8, MAX_LEN] log-probs whose token ratios (and GSPO row ratios) lie on both sides of both clip bounds and of
    delta, for both signs of A, kept off the bounds (ties); a fully masked row, a hole, a full-length row."""
    g = torch.Generator().manual_seed(seed)
    batch = len(ADV)
    lengths = torch.randint(2, MAX_LEN + 1, (batch,), generator=g)
    mask = (torch.arange(MAX_LEN)[None, :] < lengths[:, None]).double()
    mask[3], mask[4, 1], mask[5] = 0.0, 0.0, 1.0
    old_logp = -torch.rand(batch, MAX_LEN, generator=g, dtype=torch.float64) * 3.0 - 0.05
    log_ratio = (torch.rand(batch, MAX_LEN, generator=g, dtype=torch.float64) * 2.0 - 1.0) * 0.9
    for row, target in SEQ_RATIOS.items():
        log_ratio[row] += math.log(target) - (log_ratio[row] * mask[row]).sum() / mask[row].sum()
    ratio = log_ratio.exp()
    for bound in (1.0 - EPS_LOW, 1.0 + EPS_HIGH, DELTA):
        ratio = torch.where((ratio - bound).abs() < 2e-3, ratio * 1.01, ratio)
    logp = old_logp + ratio.log()
    ref_logp = logp + (torch.rand(batch, MAX_LEN, generator=g, dtype=torch.float64) * 2.0 - 1.0) * 0.7
    adv = torch.tensor(ADV, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (logp, old_logp, ref_logp, adv, mask))


def ratios(batch, importance_sampling: str) -> torch.Tensor:
    logp, old_logp, _, _, mask = batch
    log_ratio = (logp - old_logp) * mask
    if importance_sampling == "sequence":
        log_ratio = (log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(mask)
    return log_ratio.exp()


def run_loss(batch, **kwargs):
    """grpo_loss on batch: (loss, stats, d loss / d logp)."""
    logp, old_logp, ref_logp, adv, mask = batch
    leaf = logp.detach().clone().requires_grad_(True)
    loss, stats = grpo_loss(leaf, old_logp, ref_logp if kwargs.get("kl_coef") else None, adv, mask, **kwargs)
    loss.backward()
    return loss, stats, leaf.grad


# ---------------------------------------------------------------------------------------------------------------
# group_advantages, kl_penalty


@pytest.mark.parametrize("scale", SCALES)
def test_group_advantages_match_loops(scale):
    g = torch.Generator().manual_seed(4)
    rewards = torch.randn(30, generator=g, dtype=torch.float64)  # 6 groups of 5
    rewards[20:25] = 0.25  # equal rewards
    out = group_advantages(rewards, 5, scale)
    assert out.shape == rewards.shape
    assert out.tolist() == pytest.approx(naive_advantages(rewards.tolist(), 5, scale), rel=1e-10, abs=1e-12)


def test_group_advantages_hand_values():
    # Bessel: [3, 1] has mean 2 and std sqrt(2) (the population std, 1, would give +-1)
    assert group_advantages(torch.tensor([3.0, 1.0]), 2, "group", eps=0.0).tolist() == pytest.approx(
        [1 / math.sqrt(2), -1 / math.sqrt(2)], rel=1e-6
    )
    # squared deviations of 1e30 overflow float32: the advantages must not
    torch.testing.assert_close(
        group_advantages(torch.tensor([0.0, 1e30, 0.0, 1e30]), 2, "group"),
        torch.tensor([-1.0, 1.0, -1.0, 1.0]) / math.sqrt(2),
        rtol=1e-5,
        atol=0,
    )
    as_float = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), 3)
    for rewards in (torch.tensor([1, 0, 0, 1, 1, 1]), torch.tensor([True, False, False, True, True, True])):
        assert torch.equal(group_advantages(rewards, 3), as_float)


@pytest.mark.parametrize("scale", SCALES)
def test_equal_rewards_get_exactly_zero(scale):
    # the mean of equal fractional rewards can miss them by an ulp, which / (std + eps) would blow up
    for dtype in (torch.float32, torch.float64):
        for group_size in (3, 6, 7, 8):
            for value in (0.1, 0.3, 0.9, 100.7):
                equal = torch.full((group_size,), value, dtype=dtype)
                rewards = torch.cat([equal, torch.arange(group_size, dtype=dtype)])  # a second group with signal
                out = group_advantages(rewards, group_size, scale)
                assert (out[:group_size] == 0).all() and (out[group_size:] != 0).any(), (dtype, group_size, value)
    assert (group_advantages(torch.full((8,), 0.3), 4, scale) == 0).all()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_matches_naive(estimator):
    g = torch.Generator().manual_seed(6)
    lp = -torch.rand(50, generator=g, dtype=torch.float64) * 4
    ref = lp + torch.randn(50, generator=g, dtype=torch.float64) * 2
    expected = [naive_kl(a, b, estimator)[0] for a, b in zip(lp.tolist(), ref.tolist())]
    assert kl_penalty(lp, ref, estimator).tolist() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    if estimator == "k3":
        assert kl_penalty(lp, ref).tolist() == kl_penalty(lp, ref, "k3").tolist()  # the default
        assert (kl_penalty(lp, ref) >= 0).all()
        # near 0 in fp32, k3 ~ x^2 / 2 to relative precision (exp(x) - x - 1 computed naively is off by ~1e-7)
        x = torch.tensor([1e-7, -1e-7, 1e-4, -1e-4, 0.0])
        k3 = kl_penalty(torch.zeros(5), x)
        assert (k3 >= 0).all() and k3.tolist() == pytest.approx((x.double() ** 2 / 2).tolist(), rel=1e-3, abs=1e-14)


# ---------------------------------------------------------------------------------------------------------------
# grpo_loss


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
@pytest.mark.parametrize(
    "kl_coef,kl_estimator,kl_ratio_weighted",
    [(0.0, "k3", False), (0.1, "k3", False), (0.3, "k1", False), (0.2, "k2", False), (0.2, "k3", True)],
)
@pytest.mark.parametrize("delta", [None, DELTA])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grpo_loss_matches_naive(
    loss_type, importance_sampling, kl_coef, kl_estimator, kl_ratio_weighted, delta, dtype
):
    batch = make_batch(seed=11, dtype=dtype)
    r, adv, on = ratios(batch, importance_sampling), batch[3][:, None], batch[4] > 0
    # the batch really has every case: each clip side for each sign of A, beyond delta, inside, and no ties
    for case in (
        (adv > 0) & (r > 1 + EPS_HIGH),
        (adv < 0) & (r < 1 - EPS_LOW),
        (adv < 0) & (r > DELTA),
        ((r > 1 - EPS_LOW) & (r < 1 + EPS_HIGH)),
    ):
        assert (case & on).any()
    if importance_sampling == "token":
        assert ((adv > 0) & (r < 1 - EPS_LOW) & on).any() and ((adv < 0) & (r > 1 + EPS_HIGH) & (r < DELTA) & on).any()
    assert min((r[on] - bound).abs().min().item() for bound in (1 - EPS_LOW, 1 + EPS_HIGH, DELTA)) > 1e-3
    kwargs = dict(
        clip_eps_low=EPS_LOW,
        clip_eps_high=EPS_HIGH,
        kl_coef=kl_coef,
        loss_type=loss_type,
        max_completion_length=MAX_LEN,
        delta=delta,
        importance_sampling=importance_sampling,
        kl_estimator=kl_estimator,
        kl_ratio_weighted=kl_ratio_weighted,
    )
    loss, stats, grad = run_loss(batch, **kwargs)
    expected, expected_grad, expected_stats = naive_loss(batch, **kwargs)
    rel = 1e-10 if dtype == torch.float64 else 1e-5
    assert loss.dim() == 0 and loss.dtype == dtype
    assert loss.item() == pytest.approx(expected, rel=rel, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=dtype), rtol=rel, atol=1e-12)
    # stats: masked token means; the clip fractions count only the side that clips for the row's sign of A
    assert expected_stats.keys() <= stats.keys() and ("kl_mean" in stats) == bool(kl_coef)  # no KL without a ref
    for key, value in expected_stats.items():
        assert not stats[key].requires_grad
        if key != "kl_mean" or not kl_ratio_weighted:
            assert stats[key].item() == pytest.approx(value, rel=rel, abs=1e-12), key


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gspo_on_policy_equals_token_level(loss_type):
    # on-policy every ratio, per token or per sequence, is 1: the same loss and gradient
    logp, _, ref_logp, adv, mask = make_batch(seed=3)
    batch = (logp, logp.clone(), ref_logp, adv, mask)
    kwargs = dict(kl_coef=0.1, loss_type=loss_type, max_completion_length=MAX_LEN, delta=DELTA)
    (seq_loss, _, seq_grad), (token_loss, _, token_grad) = (
        run_loss(batch, importance_sampling=level, **kwargs) for level in ("sequence", "token")
    )
    assert seq_loss.item() == pytest.approx(token_loss.item(), rel=1e-12)
    torch.testing.assert_close(seq_grad, token_grad, rtol=1e-12, atol=1e-15)


def test_aggregations_by_hand():
    # ratio 1 everywhere: token losses -A, i.e. row 0: -1 (1 token), row 1: +2 (3 tokens)
    logp = torch.zeros(2, 4, dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.float64)
    expected = {"grpo": (-1.0 + 6.0 / 3) / 2, "bnpo": 5.0 / 4, "dapo": 5.0 / 4, "dr_grpo": 5.0 / (2 * 4)}
    for loss_type, value in expected.items():
        loss, _ = grpo_loss(logp, logp, None, adv, mask, loss_type=loss_type, max_completion_length=4)
        assert loss.item() == pytest.approx(value), loss_type


RATIOS = [0.5, 0.79, 0.81, 0.95, 1.0, 1.1, 1.27, 1.29, 1.6, 2.5]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_clip_gradient_zero_exactly_where_clip_active(loss_type):
    old_logp = torch.full((3, len(RATIOS)), -1.3, dtype=torch.float64)
    logp = old_logp + torch.tensor(RATIOS, dtype=torch.float64).log()
    adv, mask = torch.tensor([1.5, -0.7, 0.0], dtype=torch.float64), torch.ones_like(logp)
    batch = (logp, old_logp, None, adv, mask)
    kwargs = dict(clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, loss_type=loss_type, max_completion_length=MAX_LEN)
    loss, stats, grad = run_loss(batch, **kwargs)
    for t, r in enumerate(RATIOS):
        # A > 0: no gradient above 1 + eps_high only; descent raises a good token's logp
        assert (grad[0, t].item() == 0.0) if r > 1 + EPS_HIGH else (grad[0, t].item() < 0.0), r
        # A < 0: no gradient below 1 - eps_low only; above 1 + eps_high it keeps its corrective gradient
        assert (grad[1, t].item() == 0.0) if r < 1 - EPS_LOW else (grad[1, t].item() > 0.0), r
    assert (grad[2] == 0).all()
    expected, expected_grad, _ = naive_loss((logp, old_logp, logp, adv, mask), **kwargs)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=grad.dtype), rtol=1e-12, atol=1e-15)
    assert stats["clip_frac_high"].item() == pytest.approx(sum(r > 1 + EPS_HIGH for r in RATIOS) / 30)
    assert stats["clip_frac_low"].item() == pytest.approx(sum(r < 1 - EPS_LOW for r in RATIOS) / 30)


def test_ppo_min_keeps_the_corrective_gradient_for_negative_advantage():
    # A = -1, r = 2.5: PPO's -min(r A, clip(r) A) = 2.5 with gradient 2.5; Atropos's max would give 1.28 and none
    logp = torch.tensor([[math.log(2.5)]], dtype=torch.float64)
    batch = (logp, torch.zeros_like(logp), None, torch.tensor([-1.0], dtype=torch.float64), torch.ones_like(logp))
    loss, stats, grad = run_loss(batch, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, loss_type="bnpo")
    assert loss.item() == pytest.approx(2.5) and grad.item() == pytest.approx(2.5)
    assert stats["clip_frac_low"].item() == 0.0 and stats["clip_frac_high"].item() == 0.0


def test_a_ratio_exactly_at_a_clip_bound_keeps_its_gradient_and_is_not_counted_clipped():
    logp = torch.tensor([[math.log(0.75)], [math.log(1.25)]], dtype=torch.float64)
    assert torch.exp(logp).flatten().tolist() == [0.75, 1.25]  # exactly at the bounds of eps = 0.25
    batch = (logp, torch.zeros_like(logp), None, torch.tensor([-1.0, 1.0], dtype=torch.float64), torch.ones_like(logp))
    loss, stats, grad = run_loss(batch, clip_eps_low=0.25, clip_eps_high=0.25, loss_type="dapo")
    assert loss.item() == pytest.approx((0.75 - 1.25) / 2)
    assert grad.flatten().tolist() == pytest.approx([0.75 / 2, -1.25 / 2])
    assert stats["clip_frac_low"].item() == 0.0 and stats["clip_frac_high"].item() == 0.0


def test_delta_bounds_negative_advantage():
    # INTELLECT-2: for A < 0 the token loss stops at -delta A, without gradient beyond; A > 0 is unchanged
    logp = torch.tensor([[math.log(r) for r in (1.2, 1.4, 1.6, 3.0)]], dtype=torch.float64)
    old, mask = torch.zeros_like(logp), torch.ones_like(logp)
    for a, value, gradient, high in (
        (-1.0, 1.2 + 1.4 + 1.5 + 1.5, [1.2, 1.4, 0, 0], 0.5),
        (1.0, -1.2 - 3 * 1.28, [-1.2, 0, 0, 0], 0.75),
    ):
        batch = (logp, old, None, torch.tensor([a], dtype=torch.float64), mask)
        loss, stats, grad = run_loss(batch, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, delta=DELTA, loss_type="bnpo")
        assert loss.item() == pytest.approx(value / 4) and grad[0].tolist() == pytest.approx([g / 4 for g in gradient])
        assert stats["clip_frac_high"].item() == pytest.approx(high) and stats["clip_frac_low"].item() == 0.0


# micro-batch boundaries; "two processes": rows 0-3 and 4-7 each in two micro-batches, their losses summed
SPLITS = {"halves": [0, 4, 8], "uneven": [0, 3, 8], "two_processes": [0, 1, 4, 7, 8]}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
@pytest.mark.parametrize("split", SPLITS)
def test_parts_sum_to_the_whole_batch(loss_type, importance_sampling, split):
    logp, old_logp, ref_logp, adv, mask = make_batch(seed=31)
    kwargs = dict(CLIPPED_WITH_KL, loss_type=loss_type, importance_sampling=importance_sampling)
    whole, _, whole_grad = run_loss((logp, old_logp, ref_logp, adv, mask), **kwargs)
    leaf, summed = logp.clone().requires_grad_(True), 0.0
    bounds = SPLITS[split]
    for start, end in zip(bounds, bounds[1:]):
        part = slice(start, end)
        loss, _ = grpo_loss(
            leaf[part],
            old_logp[part],
            ref_logp[part],
            adv[part],
            mask[part],
            total_sequences=len(adv),
            total_tokens=mask.sum().item(),
            **kwargs,
        )
        loss.backward()  # accumulates into leaf.grad, as gradient accumulation and the all-reduce sum do
        summed += loss.item()
    assert summed == pytest.approx(whole.item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(leaf.grad, whole_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_masked_positions_contribute_nothing(loss_type):
    batch = make_batch(seed=21, dtype=torch.float32)
    kwargs = dict(CLIPPED_WITH_KL, loss_type=loss_type)
    clean_loss, clean_stats, clean_grad = run_loss(batch, **kwargs)
    logp, old_logp, ref_logp, adv, mask = batch
    off = mask == 0
    # whatever masked positions hold: exp overflows in the ratio or in k3, -inf, garbage, a huge A on the empty row
    for fill in ({"old": -101.0}, {"ref": 99.0}, {"old": -math.inf}, {"logp": -40.0, "old": -7.0, "ref": -60.0}):
        dirty = (
            logp.masked_fill(off, fill.get("logp", -1.0)),
            old_logp.masked_fill(off, fill.get("old", -1.0)),
            ref_logp.masked_fill(off, fill.get("ref", -1.0)),
            adv.clone().index_fill_(0, torch.tensor([3]), 1e6),
            mask,
        )
        loss, stats, grad = run_loss(dirty, **kwargs)
        assert loss.item() == pytest.approx(clean_loss.item(), rel=1e-6), fill
        assert torch.isfinite(grad).all() and (grad[off] == 0).all(), fill
        torch.testing.assert_close(grad, clean_grad)
        for key, value in clean_stats.items():
            assert stats[key].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-7), (fill, key)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_masked_batch(loss_type):
    logp, old_logp, ref_logp, adv, mask = make_batch(seed=2, dtype=torch.float32)
    loss, stats, grad = run_loss(
        (logp, old_logp, ref_logp, adv, torch.zeros_like(mask)),
        kl_coef=0.1,
        loss_type=loss_type,
        max_completion_length=MAX_LEN,
    )
    assert loss.item() == 0.0 and (grad == 0).all()
    assert all(torch.isfinite(value) for value in stats.values()) and stats["tokens"].item() == 0


def test_low_precision_inputs_and_mask_dtypes():
    # 1501 tokens: a bf16 mask sums them to 1500, so the arithmetic must run in fp32 at least
    g = torch.Generator().manual_seed(3)
    logp = (torch.randn(2, 1000, generator=g) * 0.1 - 3).bfloat16()
    old_logp = (logp.float() + 0.05 * torch.randn(2, 1000, generator=g)).bfloat16()
    ref_logp, adv, mask = (logp.float() + 0.05).bfloat16(), torch.tensor([1.0, -1.0]), torch.ones(2, 1000)
    mask[0, 501:] = 0
    for loss_type in LOSS_TYPES:
        kwargs = dict(kl_coef=0.1, loss_type=loss_type, max_completion_length=1000)
        expected, expected_stats = grpo_loss(logp.float(), old_logp.float(), ref_logp.float(), adv, mask, **kwargs)
        loss, stats = grpo_loss(logp, old_logp, ref_logp, adv.bfloat16(), mask.bfloat16(), **kwargs)
        assert loss.dtype == torch.float32 and stats["tokens"].item() == 1501
        assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
        for key, value in expected_stats.items():
            assert stats[key].item() == pytest.approx(value.item(), rel=1e-6), key
        for m in (mask.bool(), mask.long()):
            assert grpo_loss(logp.float(), old_logp.float(), ref_logp.float(), adv, m, **kwargs)[0].item() == (
                pytest.approx(expected.item(), rel=1e-6)
            )


@pytest.mark.parametrize(
    "call",
    [
        lambda z: group_advantages(z[0], 2, "median"),
        lambda z: kl_penalty(z[0], z[0], "k4"),
        lambda z: grpo_loss(*z, loss_type="sum"),
        lambda z: grpo_loss(*z, importance_sampling="tokens"),
        lambda z: grpo_loss(*z, kl_coef=0.1),  # KL without ref_logp
        lambda z: grpo_loss(*z, loss_type="dr_grpo"),  # without max_completion_length
    ],
    ids=["scale", "estimator", "loss_type", "importance_sampling", "no_ref", "no_max_len"],
)
def test_unknown_choices_raise(call):
    logp = torch.zeros(2, 2)
    with pytest.raises((ValueError, KeyError, AttributeError, TypeError)):  # Python's own errors, not silence
        call((logp, logp, None, torch.zeros(2), torch.ones(2, 2)))


# ---------------------------------------------------------------------------------------------------------------
# token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab_size", [None, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_match_fp64_reference(temperature, vocab_size, dtype):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 4, 9, generator=g) * 3.0
    logits[..., 6:] += 40.0  # padded output rows past the tokenizer's ids: they would take all the mass
    logits = logits.to(dtype).requires_grad_(True)
    targets = torch.randint(0, 6, (5, 4), generator=g)
    logp, entropy = token_logprobs(
        logits, targets, temperature, with_entropy=True, rows_per_chunk=2, vocab_size=vocab_size
    )
    expected, expected_entropy = reference_logp(logits.detach(), targets, temperature, vocab_size)
    assert logp.dtype == torch.float32 and logp.shape == targets.shape
    torch.testing.assert_close(logp.double(), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), expected_entropy, rtol=0, atol=1e-5)
    assert token_logprobs(logits, targets, temperature, vocab_size=vocab_size)[1] is None
    logp.sum().backward()
    # d logp / d logits = (onehot(target) - softmax(logits / T)) / T over the kept ids, 0 past them
    probs = torch.softmax(logits.detach()[..., :vocab_size].double() / temperature, -1)
    onehot = torch.nn.functional.one_hot(targets, probs.shape[-1]).double()
    expected_grad = torch.zeros(logits.shape, dtype=torch.float64)
    expected_grad[..., : probs.shape[-1]] = (onehot - probs) / temperature
    atol = 2e-6 if dtype == torch.float32 else 1e-2  # bf16 gradients: 8 bits of mantissa
    torch.testing.assert_close(logits.grad.double(), expected_grad, rtol=0, atol=atol)


def test_token_logprobs_chunking_is_exact():
    g = torch.Generator().manual_seed(9)
    logits, targets = torch.randn(7, 3, 13, generator=g), torch.randint(0, 13, (7, 3), generator=g)
    whole = token_logprobs(logits, targets, 0.7, with_entropy=True, rows_per_chunk=16)
    for chunk in (1, 2, 3, 6):
        part = token_logprobs(logits, targets, 0.7, with_entropy=True, rows_per_chunk=chunk)
        assert torch.equal(part[0], whole[0]) and torch.equal(part[1], whole[1]), chunk


def test_entropy_with_a_minus_infinity_logit_is_that_of_the_other_tokens():
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(2))
    logits[..., 3] = -math.inf  # probability 0 adds 0 to the entropy, not 0 * -inf = NaN
    _, entropy = token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), with_entropy=True)
    p = torch.softmax(logits[..., [0, 1, 2, 4]], dim=-1)
    torch.testing.assert_close(entropy, -(p * p.log()).sum(-1))


# ---------------------------------------------------------------------------------------------------------------
# filter_logits, left_pad


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (3, 1.0), (0, 0.5), (0, 0.9), (5, 0.8), (4, 0.3)])
def test_filter_logits_match_naive(top_k, top_p):
    logits = torch.randn(6, 12, generator=torch.Generator().manual_seed(17)) * 2.0
    out = filter_logits(logits, top_k, top_p)
    for i in range(6):
        kept = {j for j in range(12) if out[i, j] != -math.inf}
        assert kept == naive_filter(logits[i].tolist(), top_k, top_p), i
        assert all(out[i, j].item() == logits[i, j].item() for j in kept)  # kept logits unchanged


def test_filter_logits_hand_values():
    logits = torch.tensor([[math.log(p) for p in (0.05, 0.5, 0.15, 0.3)]])  # sorted: ids 1, 3, 2, 0

    def kept(top_k, top_p):
        return {j for j in range(4) if filter_logits(logits, top_k, top_p)[0, j] != -math.inf}

    assert kept(0, 1.0) == {0, 1, 2, 3} and kept(2, 1.0) == {1, 3}
    assert kept(0, 0.4) == {1}  # the top token is always kept
    assert kept(0, 0.7) == {1, 3}  # 0.5 < 0.7 <= 0.8: the token that crosses top_p is kept
    assert kept(2, 0.6) == {1}  # top-k first, then top-p within it: 0.5 / 0.8 >= 0.6
    # equal logits hit top_p exactly: the smallest set that reaches it, not one token more
    for tokens, top_p, size in ((2, 0.5, 1), (4, 0.5, 2), (4, 0.75, 3), (4, 0.25, 1), (4, 0.3, 2)):
        assert int((filter_logits(torch.zeros(1, tokens), 0, top_p) != -math.inf).sum()) == size, (tokens, top_p)


def test_left_pad_layout():
    ids, mask = left_pad([[5, 6, 7], [8], [9, 10]], pad_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert ids.dtype == torch.long and mask.dtype == torch.long


# ---------------------------------------------------------------------------------------------------------------
# generate and completion_logprobs on the tiny model


@pytest.fixture(scope="module")
def tiny():
    """The tiny model as built (nearly flat logits) and re-drawn sharper (std 0.2), whose greedy paths and early
    EOS differ from row to row; prompts of 5 lengths, so left padding is exercised."""
    (plain, tokenizer), (sharp, _) = load_model("tiny", torch.float32, 0), load_model("tiny", torch.float32, 1)
    plain, sharp = plain.eval(), sharp.eval()
    with torch.no_grad():
        for parameter in sharp.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.2)
    prompts = [tokenizer(p)["input_ids"] for p in ("(12+34)%10=", "7=", "(5+9)%10=", "1+2=", "(99+11)%10=")]
    return tokenizer, {"plain": plain, "sharp": sharp}, prompts


def hooked(model, change):
    """A copy of model whose logits go through change: still the real model, with its cache and config."""
    model = copy.deepcopy(model)

    def hook(module, args, output):
        output.logits = change(output.logits)

    model.register_forward_hook(hook)
    return model


def boosted(model, boosts: dict):
    """Adds boosts[id] to those ids' logits: a random-init model then ends some completions early."""
    extra = torch.zeros(model.config.vocab_size)
    for token, boost in boosts.items():
        extra[token] = boost
    return hooked(model, lambda logits: logits + extra.to(logits.dtype))


def row_logits(model, ids: list) -> torch.Tensor:
    """[len, V] logits of one unpadded sequence, a full forward without cache: of a prompt and n tokens, rows
    [P-1:-1] predict the n."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def seeded(count: int, seed: int) -> list:
    return [torch.Generator().manual_seed(seed * 1000 + i) for i in range(count)]


def run_generate(tokenizer, model, prompts, eos_ids=None, vocab_size=None, generators=None, group_size=1, **kwargs):
    """generate's completion ids, mask and sampler log-probs; kwargs: Args' sampling flags."""
    eos_ids = [tokenizer.eos_token_id] if eos_ids is None else eos_ids
    policy = Policy(model, tokenizer, eos_ids, vocab_size, torch.device("cpu"), bf16=False)
    batch = generate(policy, prompts, Args(**kwargs), generators, group_size)
    return batch.completion_ids, batch.completion_mask, batch.sampler_logp


def expected_mask(tokens: list, eos_ids: list) -> list:
    """1 up to and including the first EOS, 0 after."""
    mask, ended = [], False
    for token in tokens:
        mask.append(0 if ended else 1)
        ended = ended or token in eos_ids
    return mask


@pytest.mark.parametrize("which", ["plain", "sharp"])
def test_greedy_generation_matches_a_no_cache_loop(tiny, which):
    tokenizer, models, prompts = tiny
    model, eos, pad = models[which], tokenizer.eos_token_id, tokenizer.pad_token_id
    tokens, mask, _ = run_generate(tokenizer, model, prompts, max_new_tokens=8)
    for b, prompt in enumerate(prompts):
        expected = []  # one full forward per new token, no cache, no padding
        while len(expected) < 8 and eos not in expected:
            expected.append(int(row_logits(model, prompt + expected)[-1].argmax()))
        n = int(mask[b].sum())
        assert tokens[b, :n].tolist() == expected and tokens[b, n:].tolist() == [pad] * (tokens.shape[1] - n)
    again = run_generate(tokenizer, model, prompts, max_new_tokens=8)
    assert torch.equal(again[0], tokens) and torch.equal(again[1], mask)
    # top_k = 1 sampling is greedy whatever the temperature
    top1 = run_generate(
        tokenizer, model, prompts, max_new_tokens=8, temperature=0.7, top_k=1, generators=seeded(len(prompts), 9)
    )
    assert torch.equal(top1[0], tokens) and torch.equal(top1[1], mask)


@pytest.mark.parametrize(
    "which,dtype,boosts,max_new,atol",
    [
        ("plain", torch.float32, {"<eos>": 0.5}, 8, 1e-5),
        ("sharp", torch.float64, {}, 8, 1e-6),
        ("sharp", torch.float32, {"<eos>": 3.0, "7": 3.0}, 20, 3e-5),  # "7" a second EOS id; every row ends early
    ],
    ids=["plain", "sharp_fp64", "two_eos_ids"],
)
def test_sampler_mask_and_logprobs(tiny, which, dtype, boosts, max_new, atol):
    tokenizer, models, prompts = tiny
    boosts = {tokenizer.convert_tokens_to_ids(token): boost for token, boost in boosts.items()}
    eos_ids = sorted(boosts) if len(boosts) > 1 else [tokenizer.eos_token_id]
    model = boosted(models[which], boosts).to(dtype)  # (a copy: the fixture's model stays fp32)
    rows, temperature = prompts * 2, 0.7
    tokens, mask, sampler_logp = run_generate(
        tokenizer,
        model,
        rows,
        eos_ids=eos_ids,
        max_new_tokens=max_new,
        temperature=temperature,
        generators=seeded(len(rows), 3),
    )
    assert tokens.shape == mask.shape == sampler_logp.shape and tokens.shape[0] == len(rows)
    ended = [bool(set(row) & set(eos_ids)) for row in tokens.tolist()]
    if len(eos_ids) > 1:  # every row ended, so generation stopped early; each EOS id ended some row
        assert all(ended) and tokens.shape[1] < max_new
        assert {next(t for t in row if t in eos_ids) for row in tokens.tolist()} == set(eos_ids)
    else:
        assert any(ended) and not all(ended) and tokens.shape[1] == max_new
    for b, prompt in enumerate(rows):
        row = tokens[b].tolist()
        assert mask[b].tolist() == expected_mask(row, eos_ids)
        n = int(mask[b].sum())
        assert row[n:] == [tokenizer.pad_token_id] * (len(row) - n)
        logits = row_logits(model, prompt + row[:n])[len(prompt) - 1 : -1]
        expected, _ = reference_logp(logits, tokens[b, :n], temperature)
        torch.testing.assert_close(sampler_logp[b, :n].double(), expected, rtol=0, atol=atol)
        if b == 0:  # the temperature is applied
            assert (reference_logp(logits, tokens[b, :n])[0] - expected).abs().max() > 1e-2


def test_sampling_is_reproducible_and_draws_within_top_k_top_p(tiny):
    tokenizer, models, prompts = tiny
    model, rows = models["sharp"], prompts * 2
    kwargs = dict(max_new_tokens=6, temperature=0.7, top_k=4, top_p=0.8)
    tokens, mask, sampler_logp = run_generate(tokenizer, model, rows, generators=seeded(10, 5), **kwargs)
    again = run_generate(tokenizer, model, rows, generators=seeded(10, 5), **kwargs)
    assert torch.equal(again[0], tokens) and torch.equal(again[1], mask)
    assert not torch.equal(run_generate(tokenizer, model, rows, generators=seeded(10, 6), **kwargs)[0], tokens)
    for b, prompt in enumerate(rows):
        n = int(mask[b].sum())
        logits = row_logits(model, prompt + tokens[b, :n].tolist())[len(prompt) - 1 : -1]
        for t in range(n):
            assert tokens[b, t].item() in naive_filter((logits[t] / 0.7).tolist(), 4, 0.8)
        # the recorded log-prob is the full softmax's at T, not the filtered one's
        torch.testing.assert_close(
            sampler_logp[b, :n].double(), reference_logp(logits, tokens[b, :n], 0.7)[0], rtol=0, atol=3e-5
        )


def test_group_size_prefill_equals_repeated_rows(tiny):
    # each prompt encoded once and its cache repeated to its group: the same rollouts as every row encoded
    tokenizer, models, prompts = tiny
    rows = [prompt for prompt in prompts for _ in range(3)]
    kwargs = dict(max_new_tokens=6, temperature=0.9)
    single = run_generate(tokenizer, models["sharp"], rows, generators=seeded(len(prompts), 1), **kwargs)
    grouped = run_generate(tokenizer, models["sharp"], rows, generators=seeded(len(prompts), 1), group_size=3, **kwargs)
    assert torch.equal(grouped[0], single[0]) and torch.equal(grouped[1], single[1])
    assert len({tuple(row) for row in single[0].tolist()}) > len(prompts)  # the rows of a group differ
    torch.testing.assert_close(grouped[2], single[2], rtol=0, atol=1e-5)


@pytest.mark.parametrize("sampled", [False, True])
def test_vocab_size_restricts_what_generate_draws(tiny, sampled):
    # ids 20-22 play an output layer padded past the tokenizer: their logits dominate but are never drawn
    tokenizer, models, _ = tiny
    fixed = torch.linspace(1.0, -1.0, 23)
    fixed[20:] = 30.0
    model = hooked(models["plain"], lambda logits: fixed.expand_as(logits).clone())
    rows = [[1]] * 300
    kwargs = dict(max_new_tokens=1, eos_ids=[2], temperature=0.8, generators=seeded(300, 2) if sampled else None)
    tokens, _, logp = run_generate(tokenizer, model, rows, vocab_size=20, **kwargs)
    assert (tokens < 20).all() and (len(set(tokens.flatten().tolist())) > 5 if sampled else (tokens == 0).all())
    if sampled:
        torch.testing.assert_close(logp, torch.log_softmax(fixed[:20] / 0.8, -1)[tokens])
    assert (run_generate(tokenizer, model, rows, **kwargs)[0] >= 20).all()  # what vocab_size prevents


def test_gumbel_sampling_draws_from_the_softmax(tiny):
    # empirical frequencies of 6000 one-token draws within 4 sigma of softmax(logits / T)
    tokenizer, models, _ = tiny
    fixed = torch.randn(23, generator=torch.Generator().manual_seed(0))
    model = hooked(models["plain"], lambda logits: fixed.expand_as(logits).clone())
    rows = 6000
    tokens, _, logp = run_generate(
        tokenizer, model, [[1]] * rows, eos_ids=[2], max_new_tokens=1, temperature=0.8, generators=seeded(rows, 4)
    )
    expected = torch.softmax(fixed.double() / 0.8, -1)
    frequencies = torch.bincount(tokens[:, 0], minlength=23).double() / rows
    assert ((frequencies - expected).abs() <= 4 * (expected * (1 - expected) / rows).sqrt() + 1e-12).all()
    torch.testing.assert_close(logp[:, 0].double(), expected.log()[tokens[:, 0]], rtol=0, atol=1e-5)


def random_completions(seed: int, rows: int, length: int, vocab: int = 20):
    """Random completion ids and masks of ones then zeros (lengths 1 .. length, some shorter than length)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, length), generator=g)
    lengths = torch.randint(1, length + 1, (rows,), generator=g)
    lengths[0] = length
    lengths[-1] = max(1, length - 2)
    return ids, (torch.arange(length)[None, :] < lengths[:, None]).long()


@pytest.mark.parametrize("vocab_size", [None, 20])
def test_completion_logprobs_match_full_forward(tiny, vocab_size):
    tokenizer, models, prompts = tiny
    model, rows = models["sharp"], prompts * 2
    ids, mask = left_pad(rows, tokenizer.pad_token_id, "cpu")
    completion, completion_mask = random_completions(1, len(rows), 6)
    with torch.no_grad():
        logp, entropy = completion_logprobs(
            model, ids, mask, completion, completion_mask, 0.7, with_entropy=True, vocab_size=vocab_size
        )
    assert logp.shape == completion.shape and logp.dtype == torch.float32
    for b, prompt in enumerate(rows):
        n = int(completion_mask[b].sum())
        logits = row_logits(model, prompt + completion[b, :n].tolist())[len(prompt) - 1 : -1]
        expected, expected_entropy = reference_logp(logits, completion[b, :n], 0.7, vocab_size)
        torch.testing.assert_close(logp[b, :n].double(), expected, rtol=0, atol=3e-5)
        torch.testing.assert_close(entropy[b, :n].double(), expected_entropy, rtol=0, atol=3e-5)


@pytest.mark.parametrize(
    "rows,length",
    [(list(range(2, 10)), 6), ([9, 2, 6, 0, 11, 5, 3, 8], 6), (list(range(12)), 1)],
    ids=["cut_groups", "interleaved", "one_token"],
)
def test_prompt_of_row_equals_every_row_encoded(tiny, rows, length):
    """Each prompt encoded once, its KV cache indexed out to its rows: the same log-probs, entropies and weight
    gradients as every row's prompt encoded, for a micro-batch that cuts groups, rows of several prompts
    interleaved, and a single completion token."""
    tokenizer, models, prompts = tiny
    model = copy.deepcopy(models["sharp"]).train()
    group_rows = [prompts[row // 4] for row in rows]  # 3 prompts x group 4
    ids, mask = left_pad(group_rows, tokenizer.pad_token_id, "cpu")
    completion, completion_mask = random_completions(2, len(rows), length)
    first_seen = {}
    prompt_of_row = [first_seen.setdefault(row // 4, len(first_seen)) for row in rows]
    on = completion_mask.bool()

    def run(plan):
        model.zero_grad(set_to_none=True)
        logp, entropy = completion_logprobs(
            model, ids, mask, completion, completion_mask, 0.7, with_entropy=True, prompt_of_row=plan
        )
        (logp * completion_mask).sum().backward()
        return logp.detach()[on], entropy[on], {name: p.grad.clone() for name, p in model.named_parameters()}

    every_logp, every_entropy, every_grads = run(None)
    shared_logp, shared_entropy, shared_grads = run(prompt_of_row)
    torch.testing.assert_close(shared_logp, every_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(shared_entropy, every_entropy, rtol=0, atol=1e-5)
    for name, grad in every_grads.items():  # sums in another order: fp32 rounding relative to the largest
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item(), msg=name)
    # the comparison can fail: every row given the first row's prompt changes the log-probs
    assert (run([0] * len(rows))[0] - every_logp).abs().max() > 1e-2
