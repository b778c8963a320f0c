"""The RL losses beyond PPO (GSPO, CISPO), dual clip, the entropy bonus and the constant
normalization: `loss_sums` against the papers' formulas written out per sequence and per token
in this file, their gradients (by finite differences where the objective is differentiable as
written, by the formula where it holds a stop-gradient), and the per-sequence terms equal in
the padded and the packed layout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainer_svc.domain import (
    Correction,
    CorrectionLevel,
    InvalidArgument,
    LossConfig,
    LossKind,
    Normalization,
    SequenceBatch,
)
from trainer_svc.runtime.losses import LOG_RATIO_LIMIT, TokenInputs, loss_sums
from trainer_svc.runtime.packing import pack

TOKEN, SEQUENCE, CONSTANT = Normalization.TOKEN, Normalization.SEQUENCE, Normalization.CONSTANT
GSPO = LossConfig(kind=LossKind.GSPO, normalization=SEQUENCE, clip_low=3e-2, clip_high=4e-2)
CISPO = LossConfig(kind=LossKind.CISPO, clip_low=0.2, clip_high=0.28)
DUAL = LossConfig(kind=LossKind.PPO, clip_low=0.2, clip_high=0.2, dual_clip=3.0)


def _case(seed: int, rows: int = 4, width: int = 6, per_sequence_advantage: bool = False):
    rng = np.random.default_rng(seed)
    logprobs = -rng.uniform(0.1, 3.0, size=(rows, width))
    mask = rng.random((rows, width)) < 0.75
    mask[:, 0] = True
    behaviour = logprobs - rng.uniform(-0.5, 0.5, size=(rows, width))
    if per_sequence_advantage:
        advantages = np.repeat(rng.choice([-1.5, -0.5, 0.7, 1.2], size=(rows, 1)), width, axis=1)
    else:
        advantages = rng.choice([-1.0, 1.0], size=(rows, width)) * rng.uniform(
            0.3, 2.0, (rows, width)
        )
    return logprobs, mask, advantages, behaviour


def _inputs(mask, advantages, behaviour) -> TokenInputs:
    return TokenInputs(
        mask=torch.tensor(mask),
        advantages=torch.tensor(advantages),
        behaviour_logprobs=torch.tensor(behaviour),
    )


def _computed(config, logprobs, mask, advantages, behaviour):
    lp = torch.tensor(logprobs, requires_grad=True)
    sums = loss_sums(lp, _inputs(mask, advantages, behaviour), config)
    sums["loss"].backward()
    return {k: float(v) for k, v in sums.items()}, lp.grad.numpy()


def _numeric_gradient(objective, logprobs, mask, step: float) -> np.ndarray:
    """Central differences of `objective` at each trained position."""
    numeric = np.zeros_like(logprobs)
    for index in zip(*np.nonzero(mask), strict=True):
        up, down = logprobs.copy(), logprobs.copy()
        up[index] += step
        down[index] -= step
        numeric[index] = (objective(up) - objective(down)) / (2 * step)
    return numeric


def _clip(x: float, config: LossConfig) -> float:
    return min(max(x, 1.0 - config.clip_low), 1.0 + config.clip_high)


def gspo_objective(config, logprobs, mask, advantages, behaviour) -> float:
    """GSPO as its paper writes it: per sequence s = (pi / pi_old)^(1/|y|) and the loss
    -min(s A, clip(s) A), summed over sequences (each sequence's one advantage)."""
    total = 0.0
    for r in range(logprobs.shape[0]):
        valid = mask[r]
        s = math.exp(float(np.mean((logprobs[r] - behaviour[r])[valid])))
        a = float(advantages[r][valid][0])
        total += -min(s * a, _clip(s, config) * a)
    return total


def test_gspo_with_one_advantage_per_sequence_is_gspo_with_its_gradient() -> None:
    logprobs, mask, advantages, behaviour = _case(1, rows=12, per_sequence_advantage=True)
    sums, grad = _computed(GSPO, logprobs, mask, advantages, behaviour)
    expected = gspo_objective(GSPO, logprobs, mask, advantages, behaviour)
    assert sums["loss"] == pytest.approx(expected, rel=1e-12)
    numeric = _numeric_gradient(
        lambda lp: gspo_objective(GSPO, lp, mask, advantages, behaviour), logprobs, mask, 1e-6
    )
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-9)
    # The ranges are the paper's order of magnitude: some sequences clipped, some not.
    assert 0 < sums["clipped_tokens"] < sums["valid_tokens"]


def test_gspo_token_level_advantages_follow_gspo_token() -> None:
    """GSPO-token: each token's ratio has the sequence's value and the token's own gradient,
    loss -min(s A_t, clip(s) A_t) averaged over the sequence's tokens."""
    logprobs, mask, advantages, behaviour = _case(2)
    sums, grad = _computed(GSPO, logprobs, mask, advantages, behaviour)
    loss, expected_grad = 0.0, np.zeros_like(logprobs)
    for r in range(logprobs.shape[0]):
        valid = mask[r]
        n = int(valid.sum())
        s = math.exp(float(np.mean((logprobs[r] - behaviour[r])[valid])))
        for t in np.nonzero(valid)[0]:
            a = advantages[r, t]
            unclipped, clipped = -s * a, -_clip(s, GSPO) * a
            loss += max(unclipped, clipped) / n
            expected_grad[r, t] = (-s * a if unclipped >= clipped else 0.0) / n
    assert sums["loss"] == pytest.approx(loss, rel=1e-12)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-12, atol=1e-15)


def test_cispo_weights_log_pi_by_the_clipped_ratio_held_constant() -> None:
    logprobs, mask, advantages, behaviour = _case(3)
    behaviour = logprobs - np.where(np.arange(6) % 2 == 0, 0.6, -0.6)  # ratios far outside
    sums, grad = _computed(CISPO, logprobs, mask, advantages, behaviour)
    loss, expected_grad, clipped = 0.0, np.zeros_like(logprobs), 0
    for index in zip(*np.nonzero(mask), strict=True):
        r = math.exp(logprobs[index] - behaviour[index])
        w = _clip(r, CISPO)
        loss += -w * advantages[index] * logprobs[index]
        expected_grad[index] = -w * advantages[index]
        clipped += w != r
    assert sums["loss"] == pytest.approx(loss, rel=1e-12)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-12)
    # Every token trains, clipped or not: the point of CISPO against PPO.
    assert sums["clipped_tokens"] == clipped > 0
    assert (grad[mask] != 0).all()


def dual_clip_objective(config, logprobs, mask, advantages, behaviour) -> float:
    """Dual-clip PPO (Ye et al.): for A < 0 the objective max(min(r A, clip(r) A), c A)."""
    total = 0.0
    for index in zip(*np.nonzero(mask), strict=True):
        r, a = math.exp(logprobs[index] - behaviour[index]), advantages[index]
        objective = min(r * a, _clip(r, config) * a)
        if a < 0:
            objective = max(objective, config.dual_clip * a)
        total -= objective
    return total


def test_dual_clip_bounds_negative_advantages_losses() -> None:
    logprobs, mask, advantages, behaviour = _case(4)
    behaviour = logprobs - np.where(np.arange(6) < 3, 1.5, 0.1)  # ratios e^1.5 > 3 and ~1.1
    sums, grad = _computed(DUAL, logprobs, mask, advantages, behaviour)
    expected = dual_clip_objective(DUAL, logprobs, mask, advantages, behaviour)
    assert sums["loss"] == pytest.approx(expected, rel=1e-12)
    numeric = _numeric_gradient(
        lambda lp: dual_clip_objective(DUAL, lp, mask, advantages, behaviour), logprobs, mask, 1e-7
    )
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-9)
    # Tokens with A < 0 and r > 3 are held at 3|A|, with no gradient.
    capped = mask & (advantages < 0) & (np.arange(6) < 3)
    assert capped.any() and not grad[capped].any()
    plain, _ = _computed(
        LossConfig(kind=LossKind.PPO, clip_low=0.2, clip_high=0.2),
        logprobs,
        mask,
        advantages,
        behaviour,
    )
    assert sums["loss"] < plain["loss"]


@pytest.mark.parametrize("normalization", [TOKEN, SEQUENCE])
def test_the_entropy_bonus_is_subtracted_and_reported(normalization: Normalization) -> None:
    config = LossConfig(normalization=normalization, entropy_coef=0.05)
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    entropy = torch.tensor([[2.0, 1.0, 9.0], [0.5, 0.25, 3.0]], dtype=torch.float64)
    entropy.requires_grad_()
    sums = loss_sums(logprobs, TokenInputs(mask=mask), config, entropy)
    weights = (
        mask.double() if normalization is TOKEN else mask.double() / torch.tensor([[2.0], [3.0]])
    )
    policy = float((-logprobs * weights).sum())
    bonus = float((entropy.detach() * weights).sum())
    assert float(sums["loss"]) == pytest.approx(policy - 0.05 * bonus)
    assert float(sums["entropy"]) == pytest.approx(2.0 + 1.0 + 0.5 + 0.25 + 3.0)
    sums["loss"].backward()
    np.testing.assert_allclose(entropy.grad.numpy(), (-0.05 * weights).numpy())
    without = loss_sums(logprobs, TokenInputs(mask=mask), LossConfig(normalization=normalization))
    assert float(without["entropy"]) == 0.0


def test_constant_normalization_sums_tokens_like_token_normalization() -> None:
    # The constant (length times sequences) divides at FinishTrainStep; per microbatch the
    # sums are the token sums.
    config = LossConfig(normalization=CONSTANT, normalization_length=64)
    logprobs = torch.tensor([[-1.0, -3.0], [-2.0, -5.0]])
    mask = torch.tensor([[True, True], [True, False]])
    sums = loss_sums(logprobs, TokenInputs(mask=mask), config)
    assert float(sums["loss"]) == pytest.approx(6.0)


def test_gspo_sequence_terms_are_the_same_in_both_layouts() -> None:
    rng = np.random.default_rng(5)
    lengths = [7, 3, 1, 9, 5]
    batch = SequenceBatch.from_lists(
        [rng.integers(0, 50, n).tolist() for n in lengths],
        loss_mask=[rng.random(n) < 0.8 for n in lengths],
        advantages=[np.full(n, rng.normal()) for n in lengths],
        behaviour_logprobs=[-rng.uniform(0.5, 2.0, n) for n in lengths],
    )
    cpu = torch.device("cpu")
    padded, packed = pack(batch, cpu), pack(batch, cpu, packed=True)
    assert padded is not None and packed is not None
    valid = padded.positions < torch.as_tensor(padded.target_counts)[:, None]
    values = -torch.tensor(rng.uniform(0.5, 2.0, int(valid.sum())), dtype=torch.float32)
    results = []
    for laid_out, where in ((padded, valid), (packed, torch.ones_like(packed.targets, dtype=bool))):
        logprobs = torch.zeros(laid_out.targets.shape, dtype=torch.float32)
        logprobs[where] = values
        logprobs.requires_grad_()
        sums = loss_sums(logprobs, laid_out.token_inputs, GSPO)
        sums["loss"].backward()
        results.append((sums, logprobs.grad[where]))
    (a, grad_a), (b, grad_b) = results
    for field in ("loss", "clipped_tokens", "ratio", "valid_tokens"):
        assert float(a[field]) == pytest.approx(float(b[field]), rel=1e-6), field
    torch.testing.assert_close(grad_a, grad_b, rtol=1e-6, atol=1e-7)


def test_gspo_ratios_past_the_limit_stay_finite() -> None:
    logprobs = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    inputs = _inputs(np.ones((1, 2), bool), np.array([[1.0, 1.0]]), np.array([[-90.0, -90.0]]))
    sums = loss_sums(logprobs, inputs, GSPO)
    assert float(sums["ratio"]) == pytest.approx(2 * math.exp(LOG_RATIO_LIMIT))
    sums["loss"].backward()
    assert torch.isfinite(logprobs.grad).all()


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (dict(kind=LossKind.GSPO, normalization=TOKEN), "loss.normalization"),
        (dict(kind=LossKind.PPO, dual_clip=1.0), "loss.dual_clip"),
        (dict(kind=LossKind.CISPO, dual_clip=3.0), "loss.dual_clip"),
        (dict(entropy_coef=-0.1), "loss.entropy_coef"),
        (dict(normalization=CONSTANT), "loss.normalization_length"),
        (dict(normalization=TOKEN, normalization_length=8), "loss.normalization_length"),
    ],
)
def test_inconsistent_loss_configs_are_refused_naming_the_field(options, field) -> None:
    with pytest.raises(InvalidArgument) as refused:
        LossConfig(**options)
    assert refused.value.field == field


def _corrected(config, logprobs, mask, advantages, sampler, *, behaviour=None):
    lp = torch.tensor(logprobs, requires_grad=True)
    inputs = TokenInputs(
        mask=torch.tensor(mask),
        advantages=torch.tensor(advantages),
        behaviour_logprobs=None if behaviour is None else torch.tensor(behaviour),
        sampler_logprobs=torch.tensor(sampler),
    )
    sums = loss_sums(lp, inputs, config)
    sums["loss"].backward()
    return {k: float(v) for k, v in sums.items()}, lp.grad.numpy()


TIS = LossConfig(kind=LossKind.PPO, correction=Correction.TIS, tis_cap=2.0)
ICEPOP = LossConfig(
    kind=LossKind.PPO, correction=Correction.ICEPOP, icepop_low=0.5, icepop_high=5.0
)


def test_tis_weights_each_token_by_its_truncated_sampler_ratio() -> None:
    """With pi_old the step's own weights, PPO's ratio is 1 and its gradient -A; TIS scales
    it by min(pi_old / mu, 2): the constructed mismatch (ratios 0.5, 1.5, 4, 12) gives weights
    0.5, 1.5, 2, 2, and a sampler far below the policy moves the gradient no more than twice."""
    logprobs = np.array([[-1.0, -1.0, -1.0, -1.0]])
    sampler = logprobs - np.log([[0.5, 1.5, 4.0, 12.0]])
    advantages = np.array([[1.0, -1.0, 1.0, 2.0]])
    mask = np.ones((1, 4), bool)
    sums, grad = _corrected(TIS, logprobs, mask, advantages, sampler)
    np.testing.assert_allclose(grad, [[-0.5, 1.5, -2.0, -4.0]], rtol=1e-12)
    _, plain = _corrected(
        LossConfig(
            kind=LossKind.PPO, correction=Correction.ICEPOP, icepop_low=0.0, icepop_high=1e9
        ),
        logprobs,
        mask,
        advantages,
        sampler,
    )
    np.testing.assert_allclose(plain, -advantages)  # a band that keeps all: no correction
    assert sums["corrected_tokens"] == 2.0
    assert sums["sampler_ratio"] == pytest.approx(0.5 + 1.5 + 4.0 + 12.0)
    assert sums["sampler_ratio_max"] == pytest.approx(12.0)
    assert -sums["sampler_ratio_neg_min"] == pytest.approx(0.5)
    k3 = sum(r - 1 - math.log(r) for r in (0.5, 1.5, 4.0, 12.0))
    assert sums["mismatch_kl"] == pytest.approx(k3)


def test_icepop_drops_exactly_the_tokens_outside_its_band() -> None:
    logprobs = -np.full((2, 4), 2.0)
    ratios = np.array([[0.49, 0.51, 4.99, 5.01], [1.0, 0.1, 20.0, 2.0]])
    sampler = logprobs - np.log(ratios)
    advantages = np.ones((2, 4))
    mask = np.array([[True, True, True, True], [True, True, False, True]])
    sums, grad = _corrected(ICEPOP, logprobs, mask, advantages, sampler)
    kept = (ratios >= 0.5) & (ratios <= 5.0) & mask
    np.testing.assert_allclose(grad, np.where(kept, -1.0, 0.0), rtol=1e-12)
    assert sums["corrected_tokens"] == 3.0  # 0.49, 5.01, 0.1; the unmasked 20 is not counted


def test_sequence_level_corrections_use_the_sequences_ratio() -> None:
    logprobs = -np.ones((2, 3))
    ratios = np.array([[1.5, 1.5, 1.5], [0.9, 1.1, 1.0]])  # products 3.375 and 0.99
    sampler = logprobs - np.log(ratios)
    advantages = np.ones((2, 3))
    mask = np.ones((2, 3), bool)
    tis = LossConfig(
        kind=LossKind.PPO, correction=Correction.TIS, correction_level=CorrectionLevel.SEQUENCE
    )
    _, grad = _corrected(tis, logprobs, mask, advantages, sampler)
    np.testing.assert_allclose(grad, [[-2.0] * 3, [-0.99] * 3], rtol=1e-12)
    icepop = LossConfig(
        kind=LossKind.PPO,
        correction=Correction.ICEPOP,
        correction_level=CorrectionLevel.SEQUENCE,
        icepop_low=0.8,
        icepop_high=1.2,
    )
    # Geometric means 1.5 (outside the band: the whole sequence dropped) and ~1.0 (kept).
    sums, grad = _corrected(icepop, logprobs, mask, advantages, sampler)
    np.testing.assert_allclose(grad, [[0.0] * 3, [-1.0] * 3], rtol=1e-12)
    assert sums["corrected_tokens"] == 3.0


def test_a_correction_multiplies_the_ppo_term_against_the_behaviour_logprobs() -> None:
    logprobs = np.array([[-1.0, -2.0]])
    behaviour = np.array([[-1.1, -1.9]])
    sampler = behaviour - np.log([[3.0, 0.5]])  # pi_old / mu = 3 and 0.5
    advantages = np.array([[1.0, 1.0]])
    sums, grad = _corrected(
        TIS, logprobs, np.ones((1, 2), bool), advantages, sampler, behaviour=behaviour
    )
    ratios = np.exp(logprobs - behaviour)  # 1.105 and 0.905: inside the clip range
    np.testing.assert_allclose(grad, -ratios * np.array([[2.0, 0.5]]), rtol=1e-12)
    assert sums["corrected_tokens"] == 1.0


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (dict(correction=Correction.TIS), "loss.correction"),  # cross-entropy
        (dict(kind=LossKind.PPO, correction=Correction.TIS, tis_cap=0.5), "loss.tis_cap"),
        (dict(kind=LossKind.PPO, icepop_low=1.5), "loss.icepop_low"),
    ],
)
def test_inconsistent_corrections_are_refused(options, field) -> None:
    with pytest.raises(InvalidArgument) as refused:
        LossConfig(**options)
    assert refused.value.field == field
