"""loss_sums against a naive per-token reference written with loops, its gradients, and the
split invariance that lets a step stream its batch in any number of microbatches."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from trainer_svc.domain import LossConfig, LossKind, Normalization, SequenceBatch
from trainer_svc.runtime.losses import (
    LOG_RATIO_LIMIT,
    MAX_FIELDS,
    SUM_FIELDS,
    TokenInputs,
    loss_sums,
)
from trainer_svc.runtime.packing import pack

TOKEN, SEQUENCE = Normalization.TOKEN, Normalization.SEQUENCE
PPO = LossKind.PPO

CONFIGS = {
    "ce_token": LossConfig(),
    "ce_sequence": LossConfig(normalization=SEQUENCE),
    "ce_kl_sequence": LossConfig(normalization=SEQUENCE, kl_coef=0.3),
    "ppo_token": LossConfig(kind=PPO, clip_low=0.2, clip_high=0.3),
    "ppo_sequence": LossConfig(kind=PPO, normalization=SEQUENCE, clip_low=0.2, clip_high=0.3),
    "ppo_kl_token": LossConfig(kind=PPO, clip_low=0.1, clip_high=0.4, kl_coef=0.5),
    "ppo_kl_sequence": LossConfig(kind=PPO, normalization=SEQUENCE, clip_high=0.3, kl_coef=0.5),
}

# Log importance ratios, each at least 0.04 away from log(1 - clip_low) and log(1 + clip_high)
# of every config above, so finite differences never straddle a clipping kink.
LOG_RATIOS = np.array([-0.7, -0.4, -0.05, 0.0, 0.12, 0.45, 0.8])


@dataclass
class Case:
    logprobs: np.ndarray
    mask: np.ndarray
    advantages: np.ndarray
    behaviour: np.ndarray
    reference: np.ndarray

    def inputs(self, config: LossConfig, rows: np.ndarray | slice = slice(None)) -> TokenInputs:
        def t(values: np.ndarray) -> torch.Tensor:
            return torch.tensor(values[rows], dtype=torch.float64)

        return TokenInputs(
            mask=torch.tensor(self.mask[rows]),
            advantages=t(self.advantages) if config.needs_policy_inputs else None,
            behaviour_logprobs=t(self.behaviour) if config.needs_policy_inputs else None,
            reference_logprobs=t(self.reference) if config.needs_reference else None,
        )


def make_case(seed: int = 0, rows: int = 5, width: int = 7) -> Case:
    rng = np.random.default_rng(seed)
    logprobs = -rng.uniform(0.05, 4.0, size=(rows, width))
    mask = rng.random((rows, width)) < 0.7
    mask[1] = False  # a row without valid tokens (right padding of a one-token sequence)
    mask[2, 0] = True
    behaviour = logprobs - rng.choice(LOG_RATIOS, size=(rows, width))
    signs = rng.choice([-1.0, 1.0], size=(rows, width))
    advantages = signs * rng.uniform(0.3, 2.0, size=(rows, width))
    reference = logprobs + rng.normal(scale=0.5, size=(rows, width))
    return Case(logprobs, mask, advantages, behaviour, reference)


def reference_sums(case: Case, config: LossConfig, logprobs: np.ndarray) -> dict[str, float]:
    """The loss written token by token, as in the PPO paper: -min(r A, clip(r) A) + beta * k3."""
    out = dict.fromkeys(SUM_FIELDS, 0.0)
    rows, width = logprobs.shape
    for r in range(rows):
        valid = sum(bool(case.mask[r, p]) for p in range(width))
        for p in range(width):
            if not case.mask[r, p]:
                continue
            weight = 1.0 if config.normalization is TOKEN else 1.0 / valid
            lp = float(logprobs[r, p])
            if config.kind is PPO:
                ratio = math.exp(lp - case.behaviour[r, p])
                clipped_ratio = min(max(ratio, 1.0 - config.clip_low), 1.0 + config.clip_high)
                a = float(case.advantages[r, p])
                policy = -min(ratio * a, clipped_ratio * a)
                clipped = clipped_ratio * a < ratio * a
            else:
                ratio, policy, clipped = 0.0, -lp, False
            kl = 0.0
            if config.kl_coef > 0:
                log_r = case.reference[r, p] - lp
                kl = math.exp(log_r) - log_r - 1.0
            out["loss"] += weight * (policy + config.kl_coef * kl)
            out["policy"] += weight * policy
            out["kl"] += weight * kl
            out["clipped_tokens"] += float(clipped)
            out["ratio"] += ratio
            out["valid_tokens"] += 1.0
    return out


def reference_gradient(case: Case, config: LossConfig) -> np.ndarray:
    """d loss / d logprobs, derived by hand."""
    grad = np.zeros_like(case.logprobs)
    rows, width = grad.shape
    for r in range(rows):
        valid = int(case.mask[r].sum())
        for p in range(width):
            if not case.mask[r, p]:
                continue
            weight = 1.0 if config.normalization is TOKEN else 1.0 / valid
            lp = case.logprobs[r, p]
            if config.kind is PPO:
                ratio = math.exp(lp - case.behaviour[r, p])
                clipped_ratio = min(max(ratio, 1.0 - config.clip_low), 1.0 + config.clip_high)
                a = case.advantages[r, p]
                # The clipped branch is constant in lp; it only wins when strictly smaller.
                g = 0.0 if clipped_ratio * a < ratio * a else -a * ratio
            else:
                g = -1.0
            if config.kl_coef > 0:
                g += config.kl_coef * (1.0 - math.exp(case.reference[r, p] - lp))
            grad[r, p] = weight * g
    return grad


def finite_difference(case: Case, config: LossConfig, h: float = 1e-6) -> np.ndarray:
    grad = np.zeros_like(case.logprobs)
    for index in np.ndindex(*grad.shape):
        up, down = case.logprobs.copy(), case.logprobs.copy()
        up[index] += h
        down[index] -= h
        loss_up = reference_sums(case, config, up)["loss"]
        loss_down = reference_sums(case, config, down)["loss"]
        grad[index] = (loss_up - loss_down) / (2 * h)
    return grad


def computed(case: Case, config: LossConfig) -> tuple[dict[str, float], np.ndarray]:
    logprobs = torch.tensor(case.logprobs, requires_grad=True)
    sums = loss_sums(logprobs, case.inputs(config), config)
    sums["loss"].backward()
    assert logprobs.grad is not None
    return {k: float(v) for k, v in sums.items()}, logprobs.grad.numpy()


def test_case_covers_every_clipping_regime() -> None:
    # Guards the test data: both advantage signs above and below the clip range, and inside it.
    case = make_case()
    log_ratio = (case.logprobs - case.behaviour)[case.mask]
    sign = np.sign(case.advantages[case.mask])
    low, high = math.log(0.8), math.log(1.3)
    for s in (-1, 1):
        assert ((log_ratio < low) & (sign == s)).any()
        assert ((log_ratio > high) & (sign == s)).any()
        assert ((log_ratio > low) & (log_ratio < high) & (sign == s)).any()


@pytest.mark.parametrize("name", CONFIGS)
def test_loss_sums_match_the_reference(name: str) -> None:
    config = CONFIGS[name]
    case = make_case()
    sums, _ = computed(case, config)
    expected = reference_sums(case, config, case.logprobs)
    assert set(sums) == {*SUM_FIELDS, *MAX_FIELDS}
    for field in SUM_FIELDS:
        assert sums[field] == pytest.approx(expected[field], rel=1e-12, abs=1e-12), field
    if config.kind is PPO:
        assert 0 < sums["clipped_tokens"] < sums["valid_tokens"]
    if config.needs_reference:
        assert sums["kl"] > 0


@pytest.mark.parametrize("name", CONFIGS)
def test_loss_gradient_matches_analytic_and_finite_differences(name: str) -> None:
    config = CONFIGS[name]
    case = make_case()
    _, grad = computed(case, config)
    analytic = reference_gradient(case, config)
    numeric = finite_difference(case, config)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(grad, analytic, rtol=1e-12, atol=1e-14)
    assert not grad[~case.mask].any(), "masked-out positions must get no gradient"


def test_only_loss_carries_a_gradient() -> None:
    config = CONFIGS["ppo_kl_token"]
    case = make_case()
    sums = loss_sums(torch.tensor(case.logprobs, requires_grad=True), case.inputs(config), config)
    assert sums["loss"].requires_grad
    assert not any(sums[k].requires_grad for k in SUM_FIELDS if k != "loss")


def test_ppo_asymmetric_clipping_hand_checked() -> None:
    # clip range [0.9, 1.5]; ratios 2 and 0.5 with advantages +1 and -1.
    config = LossConfig(kind=PPO, clip_low=0.1, clip_high=0.5)
    ratios = torch.tensor([[2.0, 0.5, 0.5, 2.0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    behaviour = torch.full_like(ratios, -1.0)
    logprobs = (behaviour + ratios.log()).requires_grad_()
    inputs = TokenInputs(
        mask=torch.ones_like(ratios, dtype=torch.bool),
        advantages=advantages,
        behaviour_logprobs=behaviour,
    )
    sums = loss_sums(logprobs, inputs, config)
    # A>0, r=2: clipped to 1.5 -> 1.5 (clipped). A>0, r=0.5: -0.5 (not clipped; low clip
    # never helps a positive advantage). A<0, r=0.5: clipped to 0.9 -> +0.9 (clipped).
    # A<0, r=2: +2 (not clipped).
    assert float(sums["policy"]) == pytest.approx(-1.5 - 0.5 + 0.9 + 2.0)
    assert float(sums["clipped_tokens"]) == 2.0
    assert float(sums["ratio"]) == pytest.approx(5.0)
    sums["loss"].backward()
    assert logprobs.grad is not None
    np.testing.assert_allclose(logprobs.grad.numpy(), [[0.0, -0.5, 0.0, 2.0]])


def test_k3_kl_hand_checked() -> None:
    config = LossConfig(kl_coef=2.0)
    logprobs = torch.tensor([[-1.0, -1.0, -3.0]], dtype=torch.float64)
    reference = torch.tensor([[-1.0, -2.0, -1.0]], dtype=torch.float64)
    inputs = TokenInputs(mask=torch.tensor([[True, True, True]]), reference_logprobs=reference)
    sums = loss_sums(logprobs, inputs, config)
    # k3 = exp(d) - d - 1 with d = ref - lp: 0, e^-1, e^2 - 3.
    kl = 0.0 + math.exp(-1.0) + (math.exp(2.0) - 3.0)
    assert float(sums["kl"]) == pytest.approx(kl)
    assert float(sums["policy"]) == pytest.approx(5.0)
    assert float(sums["loss"]) == pytest.approx(5.0 + 2.0 * kl)


def test_sequence_normalization_sums_row_means() -> None:
    logprobs = torch.tensor([[-1.0, -3.0, -7.0], [-2.0, 0.0, 0.0], [-5.0, -5.0, -5.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    token = loss_sums(logprobs, TokenInputs(mask=mask), LossConfig())
    sequence = loss_sums(logprobs, TokenInputs(mask=mask), LossConfig(normalization=SEQUENCE))
    assert float(token["loss"]) == pytest.approx(1 + 3 + 2)
    assert float(sequence["loss"]) == pytest.approx((1 + 3) / 2 + 2)
    assert float(sequence["valid_tokens"]) == 3.0


def test_extreme_importance_ratios_give_finite_clipped_losses() -> None:
    # Valid float32 inputs whose log-ratios (+-95) would overflow exp: each is clamped to
    # +-LOG_RATIO_LIMIT, then clipped as usual; no gradient flows through a clamped ratio.
    config = LossConfig(kind=PPO, clip_low=0.2, clip_high=0.2)
    logprobs = torch.tensor([[-5.0, -5.0, -100.0, -100.0]], requires_grad=True)
    inputs = TokenInputs(
        mask=torch.ones(1, 4, dtype=torch.bool),
        advantages=torch.tensor([[-1.0, 1.0, -1.0, 1.0]]),
        behaviour_logprobs=torch.tensor([[-100.0, -100.0, -5.0, -5.0]]),
    )
    sums = loss_sums(logprobs, inputs, config)
    big, small = math.exp(LOG_RATIO_LIMIT), math.exp(-LOG_RATIO_LIMIT)
    # A<0, r=e^20: unclipped +e^20 wins. A>0, r=e^20: clipped to -1.2. A<0, r=e^-20: clipped
    # to +0.8. A>0, r=e^-20: unclipped -e^-20.
    assert float(sums["policy"]) == pytest.approx(big - 1.2 + 0.8 - small, rel=1e-6)
    assert float(sums["clipped_tokens"]) == 2.0
    assert float(sums["ratio"]) == pytest.approx(2 * big, rel=1e-6)
    assert all(math.isfinite(float(v)) for v in sums.values())
    sums["loss"].backward()
    assert logprobs.grad is not None
    assert torch.equal(logprobs.grad, torch.zeros_like(logprobs))


def test_extreme_kl_log_ratio_is_clamped_above_only() -> None:
    config = LossConfig(kl_coef=1.0)
    logprobs = torch.tensor([[-100.0, -1.0]], requires_grad=True)
    reference = torch.tensor([[0.0, -100.0]])
    inputs = TokenInputs(mask=torch.ones(1, 2, dtype=torch.bool), reference_logprobs=reference)
    sums = loss_sums(logprobs, inputs, config)
    # d = ref - lp: 100 is clamped to 20; -99 is exact (exp cannot overflow below).
    expected = (math.exp(20.0) - 21.0) + (math.exp(-99.0) + 99.0 - 1.0)
    assert float(sums["kl"]) == pytest.approx(expected, rel=1e-6)
    sums["loss"].backward()
    assert logprobs.grad is not None
    grad = logprobs.grad[0].tolist()
    assert grad[0] == pytest.approx(-1.0)  # cross-entropy only: the KL term is clamped
    assert grad[1] == pytest.approx(-1.0 + 1.0 - math.exp(-99.0))


@pytest.mark.parametrize("log_ratio", [-19.5, -3.0, 0.3, 19.5])
def test_log_ratios_inside_the_limit_are_exact(log_ratio: float) -> None:
    config = LossConfig(kind=PPO, clip_high=0.3, kl_coef=0.5)
    case = Case(
        logprobs=np.array([[-30.0]]),
        mask=np.array([[True]]),
        advantages=np.array([[-1.5]]),
        behaviour=np.array([[-30.0 - log_ratio]]),
        reference=np.array([[-30.0 + log_ratio]]),
    )
    sums, grad = computed(case, config)
    expected = reference_sums(case, config, case.logprobs)
    for field in SUM_FIELDS:
        assert sums[field] == pytest.approx(expected[field], rel=1e-12), field
    np.testing.assert_allclose(grad, reference_gradient(case, config), rtol=1e-12)


SPLITS = [
    [[0], [1], [2], [3], [4]],
    [[0, 1], [2, 3, 4]],
    [[4, 0], [2], [3, 1]],
    [[1], [0, 2, 3, 4]],
]


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_sums_over_any_split_of_rows_equal_the_whole(name: str, split: list[list[int]]) -> None:
    config = CONFIGS[name]
    case = make_case(seed=3)
    whole_lp = torch.tensor(case.logprobs, requires_grad=True)
    whole = loss_sums(whole_lp, case.inputs(config), config)
    whole["loss"].backward()

    parts_lp = torch.tensor(case.logprobs, requires_grad=True)
    totals = dict.fromkeys(SUM_FIELDS, 0.0)
    for rows in split:
        index = np.array(rows)
        part = loss_sums(parts_lp[index], case.inputs(config, index), config)
        part["loss"].backward()
        for field in SUM_FIELDS:
            totals[field] += float(part[field])
    for field in SUM_FIELDS:
        assert totals[field] == pytest.approx(float(whole[field]), rel=1e-12, abs=1e-12), field
    assert whole_lp.grad is not None and parts_lp.grad is not None
    np.testing.assert_allclose(parts_lp.grad.numpy(), whole_lp.grad.numpy(), rtol=1e-12)


def bigram_logprobs(table: torch.Tensor, batch: SequenceBatch) -> tuple[torch.Tensor, TokenInputs]:
    """A stand-in model whose logits at a position depend only on the input token there."""
    packed = pack(batch, torch.device("cpu"))
    assert packed is not None
    logits = table[packed.inputs]
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, packed.targets.unsqueeze(-1))
    return logprobs.squeeze(-1), packed.token_inputs


@pytest.mark.parametrize("normalization", [TOKEN, SEQUENCE])
def test_split_microbatches_through_pack_equal_the_whole_batch(
    normalization: Normalization,
) -> None:
    # Sub-batches pack to different widths; sums and parameter gradients must not notice.
    vocab = 11
    config = LossConfig(kind=PPO, normalization=normalization, clip_high=0.3, kl_coef=0.2)
    rng = np.random.default_rng(5)
    lengths = [6, 2, 9, 1, 4, 7]
    batch = SequenceBatch.from_lists(
        [rng.integers(0, vocab, n).tolist() for n in lengths],
        loss_mask=[[i >= 1 and rng.random() < 0.8 for i in range(n)] for n in lengths],
        advantages=[rng.normal(size=n) for n in lengths],
        behaviour_logprobs=[-rng.uniform(1.0, 4.0, size=n) for n in lengths],
        reference_logprobs=[-rng.uniform(1.0, 4.0, size=n) for n in lengths],
    )
    weights = torch.tensor(rng.normal(size=(vocab, vocab)), dtype=torch.float32)

    def run(parts: list[SequenceBatch]) -> tuple[dict[str, float], torch.Tensor]:
        table = weights.clone().requires_grad_()
        totals = dict.fromkeys(SUM_FIELDS, 0.0)
        for part in parts:
            logprobs, inputs = bigram_logprobs(table, part)
            sums = loss_sums(logprobs, inputs, config)
            sums["loss"].backward()
            for field in SUM_FIELDS:
                totals[field] += float(sums[field])
        assert table.grad is not None
        return totals, table.grad

    whole, whole_grad = run([batch])
    pieces = [np.array([0, 1]), np.array([2]), np.array([3, 4, 5])]
    split, split_grad = run([batch.select(p) for p in pieces])
    assert whole["valid_tokens"] == batch.valid_tokens_per_sequence().sum()
    for field in SUM_FIELDS:
        assert split[field] == pytest.approx(whole[field], rel=1e-5, abs=1e-6), field
    torch.testing.assert_close(split_grad, whole_grad, rtol=1e-5, atol=1e-6)
    assert whole_grad.abs().sum() > 0
