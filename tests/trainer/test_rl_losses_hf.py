"""Each RL loss the trainer offers, against its paper's formula written out here on the HF
model: one SGD step of learning rate 1 (no clipping, no momentum yet, no weight decay) moves
the trainer's weights by exactly the gradient of its loss, so `before - after` is compared with
the gradient transformers' autograd gives for the formula below (float64), per parameter,
within 1e-5 of its scale plus float32's resolution of the weights. One trainer serves every
case (each step starts from the saved initial weights). Layout equality and split invariance
of the same losses: test_split_step."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_hf.spec import ModelFamily
from megatron_hf.tiny import write_tiny_checkpoint
from tests.support.batches import make_batch
from tests.support.trainer import TrainerProcess
from trainer_svc.domain import (
    Correction,
    CorrectionLevel,
    ForwardOutput,
    LossConfig,
    LossKind,
    Normalization,
    OptimizerOverrides,
    ReferenceSource,
)

LENGTHS = [9, 17, 5, 12]
CASES = {
    "gspo": LossConfig(
        kind=LossKind.GSPO, normalization=Normalization.SEQUENCE, clip_low=0.03, clip_high=0.04
    ),
    "cispo": LossConfig(kind=LossKind.CISPO, clip_low=0.1, clip_high=0.1),
    "ppo-dual-clip-entropy": LossConfig(
        kind=LossKind.PPO, clip_low=0.1, clip_high=0.1, dual_clip=1.5, entropy_coef=0.05
    ),
    "drgrpo-constant": LossConfig(
        kind=LossKind.PPO, normalization=Normalization.CONSTANT, normalization_length=24
    ),
    # pi_old from the step's own weights (no behaviour logprobs sent), TIS against the sampler.
    "ppo-tis-own-weights": LossConfig(kind=LossKind.PPO, correction=Correction.TIS, tis_cap=1.5),
    "cispo-icepop-sequence": LossConfig(
        kind=LossKind.CISPO,
        correction=Correction.ICEPOP,
        correction_level=CorrectionLevel.SEQUENCE,
        icepop_low=0.8,
        icepop_high=1.25,
    ),
}
OWN_WEIGHTS = {"ppo-tis-own-weights"}
SGD = OptimizerOverrides(learning_rate=1.0, max_grad_norm=0.0)
EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainerProcess]:
    workdir = tmp_path_factory.mktemp("rl-losses")
    model_dir = write_tiny_checkpoint(workdir / "model", ModelFamily.LLAMA, seed=9)
    process = TrainerProcess(
        workdir,
        [
            "--model",
            str(model_dir),
            "--optimizer",
            "sgd",
            "--reference-policy",
            "initial",
            "--reference-placement",
            "host",
        ],
    )
    process.model_dir = model_dir
    process.client.save_checkpoint(workdir / "base")
    process.base = process.export("base")
    yield process
    assert process.stop() == 0


def _clip(ratio: torch.Tensor, loss: LossConfig) -> torch.Tensor:
    return ratio.clamp(1.0 - loss.clip_low, 1.0 + loss.clip_high)


def formula_loss(
    model, batch, loss: LossConfig, entropies: list[torch.Tensor], corrections: list[float]
) -> torch.Tensor:
    """The step's loss, sequence by sequence, as the papers define it; each sequence's
    entropies at the trained positions go into `entropies`."""
    terms: list[torch.Tensor] = []
    for start, end in zip(batch.offsets[:-1], batch.offsets[1:], strict=True):
        ids = torch.as_tensor(batch.tokens[start:end])[None]
        logits = model(ids).logits[0, :-1].float()
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, ids[0, 1:, None])[:, 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        mask = torch.as_tensor(batch.loss_mask[start + 1 : end])
        adv = torch.as_tensor(batch.advantages[start + 1 : end]).double()[mask]
        lp, ent = logp.double()[mask], entropy.double()[mask]
        if batch.behaviour_logprobs is None:  # pi_old: the weights the step began with
            old = lp.detach()
        else:
            old = torch.as_tensor(batch.behaviour_logprobs[start + 1 : end]).double()[mask]
        entropies.append(ent.detach())
        if loss.kind is LossKind.GSPO:
            # GSPO-token: s_i = exp(mean log r) as the value, each token's gradient its own.
            s = (lp - old).mean().detach().exp()
            ratio = s * (lp - lp.detach()).exp()
            per_token = -torch.minimum(ratio * adv, _clip(ratio, loss) * adv)
        elif loss.kind is LossKind.CISPO:
            # CISPO: sg(clip(r)) * A * log pi.
            per_token = -_clip((lp - old).exp(), loss).detach() * adv * lp
        else:
            ratio = (lp - old).exp()
            objective = torch.minimum(ratio * adv, _clip(ratio, loss) * adv)
            if loss.dual_clip:  # Ye et al.: max(., c A) for A < 0
                objective = torch.where(
                    adv < 0, torch.maximum(objective, loss.dual_clip * adv), objective
                )
            per_token = -objective
        if loss.corrects_sampler:
            sampler = torch.as_tensor(batch.sampler_logprobs[start + 1 : end]).double()[mask]
            rho = old.detach() - sampler  # log(pi_old / mu)
            if loss.correction_level is CorrectionLevel.SEQUENCE:
                # TIS: the product of ratios; IcePop: their geometric mean.
                rho = rho.sum() if loss.correction is Correction.TIS else rho.mean()
            measured = rho.exp().expand_as(per_token)
            if loss.correction is Correction.TIS:
                weight = measured.clamp(max=loss.tis_cap)
            else:
                band = (measured >= loss.icepop_low) & (measured <= loss.icepop_high)
                weight = band.double()
            per_token = per_token * weight
            corrections.append(
                float(
                    (weight != measured).sum()
                    if loss.correction is Correction.TIS
                    else (~band).sum()
                )
            )
        per_token = per_token - loss.entropy_coef * ent
        if loss.normalization is Normalization.SEQUENCE:
            terms.append(per_token.mean() if len(per_token) else per_token.sum())
        else:
            terms.append(per_token.sum())
    total = torch.stack(terms).sum()
    if loss.normalization is Normalization.TOKEN:
        return total / int(batch.loss_mask.sum() - batch.loss_mask[batch.offsets[:-1]].sum())
    if loss.normalization is Normalization.CONSTANT:
        return total / (loss.normalization_length * batch.num_sequences)
    return total / len(LENGTHS)


@pytest.mark.parametrize("name", list(CASES))
def test_one_sgd_step_moves_the_weights_by_the_formulas_gradient(trainer, name: str) -> None:
    loss = CASES[name]
    batch = make_batch(seed=13, lengths=LENGTHS, loss=loss, vocab_size=100)
    if name in OWN_WEIGHTS:
        batch = dataclasses.replace(batch, behaviour_logprobs=None)
    trainer.client.load_checkpoint(trainer.workdir / "base")
    trainer.client.begin_step(name, loss, SGD)
    trainer.client.train_microbatch(name, f"{name}-0", batch)
    terms = trainer.client.finish_step(name).metrics.terms
    after = trainer.export(name)
    model = AutoModelForCausalLM.from_pretrained(trainer.model_dir, dtype=torch.float64)
    entropies: list[torch.Tensor] = []
    corrections: list[float] = []
    formula_loss(model, batch, loss, entropies, corrections).backward()
    if loss.corrects_sampler:
        assert terms.sampler is not None
        trained = len(torch.cat(entropies))
        assert 0 < sum(corrections) < trained, "the case should correct some tokens, not all"
        assert terms.sampler.corrected_fraction == pytest.approx(sum(corrections) / trained)
    else:
        assert terms.sampler is None
    # The step reports the mean entropy of the trained tokens with an entropy bonus or a
    # sampler correction.
    reported = loss.entropy_coef or loss.corrects_sampler
    mean_entropy = float(torch.cat(entropies).mean()) if reported else 0.0
    assert terms.entropy == pytest.approx(mean_entropy, rel=1e-5)
    grads = dict(model.named_parameters())
    for hf_name, before in trainer.base.items():
        moved = before.astype(np.float64) - after[hf_name].astype(np.float64)
        expected = grads[hf_name].grad
        expected = np.zeros_like(moved) if expected is None else expected.numpy()
        # 1e-5 of the gradient's scale, plus what float32 weights resolve of a step: the
        # norms' weights are near 1, where a float32 step is exact only to ~1e-7.
        allowed = 1e-5 * np.abs(expected).max() + 4 * EPS32 * np.abs(before).max()
        gap = np.abs(moved - expected).max()
        assert gap <= allowed, f"{name}: {hf_name} moved off the formula's gradient by {gap:.2e}"


def test_an_sgd_checkpoint_saved_before_any_step_loads_after_steps(trainer) -> None:
    """SGD's momentum buffers exist from the start (zero, which its first step turns into the
    gradient), so the checkpoint taken before the first step holds every key a later one does
    and loads once steps have created them."""
    loss = CASES["cispo"]
    batch = make_batch(seed=3, lengths=LENGTHS, loss=loss, vocab_size=100)
    trainer.client.begin_step("away", loss, SGD)
    trainer.client.train_microbatch("away", "away-0", batch)
    trainer.client.finish_step("away")
    trainer.client.load_checkpoint(trainer.workdir / "base")
    back = trainer.export("back")
    assert all(np.array_equal(back[k], v) for k, v in trainer.base.items())


def test_the_services_reference_equals_the_clients_forward_at_the_initial_weights(trainer):
    """With --reference-policy initial the KL term's reference logprobs come from the weights
    the service started with (the saved base here): a step from weights moved away from them
    equals, to 1e-6, the same step with reference logprobs sent by the client from a Forward
    at the base weights."""
    status = trainer.client.status()
    assert (status.reference_policy, status.reference_placement) == ("initial", "host")
    client_side = LossConfig(kind=LossKind.PPO, kl_coef=0.5)
    service_side = dataclasses.replace(client_side, reference_source=ReferenceSource.SERVICE)
    batch = make_batch(seed=21, lengths=LENGTHS, loss=client_side, vocab_size=100)
    trainer.client.load_checkpoint(trainer.workdir / "base")
    at_base = trainer.client.forward(batch, (ForwardOutput.LOGPROBS,)).logprobs
    away = CASES["cispo"]
    trainer.client.begin_step("away", away, SGD)
    trainer.client.train_microbatch(
        "away", "away-0", make_batch(seed=5, lengths=LENGTHS, loss=away, vocab_size=100)
    )
    trainer.client.finish_step("away")
    trainer.client.save_checkpoint(trainer.workdir / "away")
    # Forward gives the same reference logprobs from the moved weights.
    both = (ForwardOutput.LOGPROBS, ForwardOutput.REFERENCE_LOGPROBS)
    moved = trainer.client.forward(batch, both)
    assert moved.reference_logprobs is not None and moved.logprobs is not None
    assert np.array_equal(moved.reference_logprobs, at_base)
    assert np.abs(moved.logprobs - at_base).max() > 1e-4
    results = {}
    for name, loss, sent in (
        ("service", service_side, dataclasses.replace(batch, reference_logprobs=None)),
        ("client", client_side, dataclasses.replace(batch, reference_logprobs=at_base)),
    ):
        trainer.client.load_checkpoint(trainer.workdir / "away")
        trainer.client.begin_step(name, loss, SGD)
        trainer.client.train_microbatch(name, f"{name}-0", sent)
        terms = trainer.client.finish_step(name).metrics.terms
        results[name] = (terms.kl, trainer.export(name))
    (kl_service, service), (kl_client, client) = results["service"], results["client"]
    assert kl_client > 1e-4  # the weights moved: the KL term is not trivially zero
    assert kl_service == pytest.approx(kl_client, rel=1e-6)
    for hf_name, value in client.items():
        gap = np.abs(service[hf_name] - value).max()
        assert gap <= 1e-6 * max(np.abs(value).max(), 1.0), hf_name


def test_set_reference_makes_the_current_weights_the_reference(trainer):
    """A reference reset: after SetReference, Forward's reference logprobs are the current
    weights' logprobs, bit for bit, and the call answers with their version."""
    batch = make_batch(seed=23, lengths=LENGTHS, loss=LossConfig(), vocab_size=100)
    trainer.client.load_checkpoint(trainer.workdir / "base")
    away = CASES["cispo"]
    trainer.client.begin_step("reset", away, SGD)
    trainer.client.train_microbatch(
        "reset", "reset-0", make_batch(seed=6, lengths=LENGTHS, loss=away, vocab_size=100)
    )
    version = trainer.client.finish_step("reset").weights_version
    both = (ForwardOutput.LOGPROBS, ForwardOutput.REFERENCE_LOGPROBS)
    before = trainer.client.forward(batch, both)
    assert not np.array_equal(before.reference_logprobs, before.logprobs)
    assert trainer.client.set_reference() == version
    after = trainer.client.forward(batch, both)
    assert np.array_equal(after.reference_logprobs, after.logprobs)
    assert np.array_equal(after.logprobs, before.logprobs)  # the weights did not move
