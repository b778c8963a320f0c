"""Abort, duplicate requests and bad input through the real gRPC server: each refused request
gets its status code and leaves weights, optimizer state and the open step untouched."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from pathlib import Path

import grpc
import numpy as np
import pytest

from megatron_hf.checkpoint import load_hf_state_dict
from tests.support.batches import make_batch, split
from tests.support.trainer import TrainerProcess, assert_bit_identical, max_relative_difference
from trainer_refit.errors import MAX_MESSAGE_BYTES
from trainer_refit.reflection import V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME, v1_messages
from trainer_refit.status_details import violated_field
from trainer_refit.v1 import trainer_pb2 as pb
from trainer_svc.client import AsyncTrainerClient, CheckpointInfo, begin_request, microbatch_request
from trainer_svc.domain import (
    AlreadyExists,
    ExportDType,
    FailedPrecondition,
    ForwardOutput,
    LossConfig,
    LossKind,
    OptimizerOverrides,
    ReferenceSource,
    SequenceBatch,
    StaleData,
    StalenessBound,
    VersionSpan,
    span_rows,
)

LOSS = LossConfig(kind=LossKind.PPO, kl_coef=0.05)
OPTIMIZER = OptimizerOverrides(learning_rate=1e-3)
MAX_TOKENS = 256
PASS_TOKENS = 20
"""The batch's sequences of 11, 6 and 19 tokens run in two passes: [11, 6] and [19]."""


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("protocol")
    process = TrainerProcess(
        workdir,
        [
            *("--tp", "2", "--max-microbatch-tokens", str(MAX_TOKENS)),
            *("--pass-token-budget", str(PASS_TOKENS)),
        ],
    )
    process.client.save_checkpoint(workdir / "base")
    process.base_weights = process.export("base")
    process.batch = make_batch(seed=3, lengths=[11, 6, 19], loss=LOSS)
    process.reference = _reference_step(process)
    yield process
    assert process.stop() == 0


def _reference_step(trainer: TrainerProcess) -> dict:
    trainer.client.load_checkpoint(trainer.workdir / "base")
    trainer.client.begin_step("reference", LOSS, OPTIMIZER)
    trainer.client.train_microbatch("reference", "r0", trainer.batch)
    trainer.client.finish_step("reference")
    return trainer.export("reference")


def _refusal(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request)
    assert info.value.details(), "a refusal must say why"
    return info.value


def _code(call, request) -> grpc.StatusCode:
    return _refusal(call, request).code()


def _open_counts(trainer: TrainerProcess) -> pb.StepCounts:
    return trainer.client.status().open_step.accumulated


def _bad_microbatches(
    trainer: TrainerProcess, step_id: str
) -> dict[str, pb.TrainMicrobatchRequest]:
    good = microbatch_request(step_id, "bad", trainer.batch)

    def variant(mutate) -> pb.TrainMicrobatchRequest:
        request = pb.TrainMicrobatchRequest()
        request.CopyFrom(good)
        mutate(request)
        return request

    def set_token(r):
        r.sequences.tokens[4] = 100_000

    def negative_token(r):
        r.sequences.tokens[0] = -1

    def bad_offsets(r):
        r.sequences.offsets[1] = 99

    def short_mask(r):
        del r.loss_mask[-1]

    def long_advantages(r):
        r.advantages.append(0.5)

    def nan_advantage(r):
        r.advantages[5] = math.nan

    def inf_logprob(r):
        r.behaviour_logprobs[5] = -math.inf

    def missing_reference(r):
        del r.reference_logprobs[:]

    def oversize(r):
        r.sequences.tokens.extend([1] * MAX_TOKENS)
        r.sequences.offsets.append(len(r.sequences.tokens))
        for field in (r.loss_mask, r.advantages, r.behaviour_logprobs, r.reference_logprobs):
            field.extend([0] * MAX_TOKENS)

    def first_token_masked(r):
        r.loss_mask[0] = True

    def wrong_step(r):
        r.step_id = "another-step"

    cases = {
        "token outside the vocab": set_token,
        "negative token": negative_token,
        "inconsistent offsets": bad_offsets,
        "loss_mask too short": short_mask,
        "advantages too long": long_advantages,
        "NaN advantage": nan_advantage,
        "infinite behaviour logprob": inf_logprob,
        "missing reference logprobs": missing_reference,
        "oversize microbatch": oversize,
        "first token masked in": first_token_masked,
        "step id mismatch": wrong_step,
    }
    return {name: variant(mutate) for name, mutate in cases.items()}


def test_bad_requests_are_refused_and_change_nothing(trainer):
    stub, client = trainer.stub, trainer.client
    client.load_checkpoint(trainer.workdir / "base")

    early = microbatch_request("s1", "early", trainer.batch)
    assert _code(stub.TrainMicrobatch, early) == grpc.StatusCode.FAILED_PRECONDITION
    assert _code(stub.FinishTrainStep, pb.FinishTrainStepRequest(step_id="s1")) == (
        grpc.StatusCode.FAILED_PRECONDITION
    )
    unknown_loss = begin_request("s1", LOSS, OPTIMIZER)
    unknown_loss.loss.kind = 99
    bad_clip = begin_request("s1", LOSS, OPTIMIZER)
    bad_clip.loss.clip_low = 1.5
    unspecified = begin_request("s1", LOSS, OPTIMIZER)
    unspecified.loss.normalization = pb.NORMALIZATION_UNSPECIFIED
    no_id = begin_request("", LOSS, OPTIMIZER)
    long_id = begin_request("s" * 257, LOSS, OPTIMIZER)
    for request, field in [
        (unknown_loss, "loss.kind"),
        (bad_clip, "loss.clip_low"),
        (unspecified, "loss.normalization"),
        (no_id, "step_id"),
        (long_id, "step_id"),
    ]:
        error = _refusal(stub.BeginTrainStep, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert violated_field(error) == field
    assert not client.status().HasField("open_step")

    client.begin_step("s1", LOSS, OPTIMIZER)
    client.train_microbatch("s1", "r0", trainer.batch)
    before = _open_counts(trainer)
    expected = {"step id mismatch": grpc.StatusCode.FAILED_PRECONDITION}
    fields = {
        "token outside the vocab": "sequences.tokens",
        "negative token": "sequences.tokens",
        "inconsistent offsets": "sequences.offsets",
        "loss_mask too short": "loss_mask",
        "advantages too long": "advantages",
        "NaN advantage": "advantages",
        "infinite behaviour logprob": "behaviour_logprobs",
        "missing reference logprobs": "reference_logprobs",
        "oversize microbatch": "sequences.tokens",
        "first token masked in": "loss_mask",
        "step id mismatch": None,
    }
    for name, request in _bad_microbatches(trainer, "s1").items():
        error = _refusal(stub.TrainMicrobatch, request)
        assert error.code() == expected.get(name, grpc.StatusCode.INVALID_ARGUMENT), name
        assert violated_field(error) == fields[name], name
        assert _open_counts(trainer) == before, name

    again = begin_request("s2", LOSS, OPTIMIZER)
    assert _code(stub.BeginTrainStep, again) == grpc.StatusCode.FAILED_PRECONDITION
    wrong_finish = pb.FinishTrainStepRequest(step_id="s2")
    assert _code(stub.FinishTrainStep, wrong_finish) == grpc.StatusCode.FAILED_PRECONDITION
    bad_forward = pb.ForwardRequest(
        sequences=pb.Sequences(tokens=[1, 2, 3], offsets=[0, 3]),
        outputs=[pb.FORWARD_OUTPUT_TOP_K],
        top_k=0,
    )
    assert _code(stub.Forward, bad_forward) == grpc.StatusCode.INVALID_ARGUMENT
    client.forward(trainer.batch, [ForwardOutput.LOGPROBS, ForwardOutput.ENTROPY])
    assert _open_counts(trainer) == before

    client.finish_step("s1")
    assert_bit_identical(trainer.export("after-bad-requests"), trainer.reference)


def test_abort_leaves_weights_and_optimizer_bit_identical(trainer):
    client = trainer.client
    client.load_checkpoint(trainer.workdir / "base")
    client.begin_step("doomed", LOSS, OPTIMIZER)
    client.train_microbatch("doomed", "r0", trainer.batch)
    assert client.abort_step("doomed") is True
    assert client.abort_step("doomed") is False
    assert client.abort_step("never-begun") is False  # no step is open: idempotent
    assert not client.status().HasField("open_step")
    assert_bit_identical(trainer.export("after-abort"), trainer.base_weights)

    client.begin_step("next", LOSS, OPTIMIZER)
    client.train_microbatch("next", "r0", trainer.batch)
    # Answered once the update is applied rather than queued: the same step, the same weights.
    before = client.status().weights_version
    assert client.finish_step("next", wait_for_update=True).weights_version == before + 1
    assert_bit_identical(trainer.export("after-abort-then-step"), trainer.reference)


def test_abort_of_another_step_is_refused(trainer):
    client = trainer.client
    client.begin_step("open", LOSS, OPTIMIZER)
    with pytest.raises(FailedPrecondition, match="open step is 'open'"):
        client.abort_step("other")
    assert client.abort_step("open") is True


def test_duplicate_request_id_is_applied_once(trainer):
    client = trainer.client
    client.load_checkpoint(trainer.workdir / "base")
    client.begin_step("dup", LOSS, OPTIMIZER)
    first = client.train_microbatch("dup", "same-id", trainer.batch)
    second = client.train_microbatch("dup", "same-id", trainer.batch)
    assert not first.duplicate and second.duplicate
    assert second.accumulated == first.accumulated
    counts = _open_counts(trainer)
    other = microbatch_request("dup", "same-id", trainer.batch)
    other.advantages[4] += 0.5
    assert _code(trainer.stub.TrainMicrobatch, other) == grpc.StatusCode.ALREADY_EXISTS
    tokens = trainer.batch.tokens.copy()
    tokens[1] = (tokens[1] + 1) % 100
    with pytest.raises(AlreadyExists, match="same-id"):
        client.train_microbatch("dup", "same-id", dataclasses.replace(trainer.batch, tokens=tokens))
    assert _open_counts(trainer) == counts
    result = client.finish_step("dup")
    assert result.metrics.counts.microbatches == 1
    assert_bit_identical(trainer.export("after-duplicate"), trainer.reference)


def test_health_and_reflection_are_served(trainer):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    health = health_pb2_grpc.HealthStub(trainer.channel)
    for service in ("", "trainer_refit.v1.TrainerService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(trainer.channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    reply = next(iter(reflection.ServerReflectionInfo(iter([request]))))
    names = {s.name for s in reply.list_services_response.service}
    assert "trainer_refit.v1.TrainerService" in names
    assert "grpc.health.v1.Health" in names
    assert {V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME} <= names

    request_v1, response_v1 = v1_messages()
    reflect_v1 = trainer.channel.stream_stream(
        f"/{V1_SERVICE_NAME}/ServerReflectionInfo",
        request_serializer=request_v1.SerializeToString,
        response_deserializer=response_v1.FromString,
    )
    requests = [
        request_v1(list_services=""),
        request_v1(file_containing_symbol="trainer_refit.v1.TrainerService"),
    ]
    listed, described = reflect_v1(iter(requests), timeout=30)
    assert {s.name for s in listed.list_services_response.service} == names
    assert described.file_descriptor_response.file_descriptor_proto


def test_undecodable_bodies_and_huge_ids_are_refused_cleanly(trainer):
    """Unparseable bodies are INVALID_ARGUMENT without a traceback in the log; a refusal that
    echoes a 20 KB step id keeps its code (its message is bounded)."""
    for method in ("BeginTrainStep", "TrainMicrobatch", "Forward", "GetStatus"):
        call = trainer.channel.unary_unary(f"/trainer_refit.v1.TrainerService/{method}")
        error = _refusal(call, b"\x0a\x10\xff")
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert error.details().startswith("request body is not a valid trainer_refit.v1."), method
    huge = pb.FinishTrainStepRequest(step_id="é" * 20_000)
    error = _refusal(trainer.stub.FinishTrainStep, huge)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert len(error.details().encode()) <= MAX_MESSAGE_BYTES
    assert "(20000 characters)" in error.details()
    assert "Traceback" not in trainer.log_path.read_text(errors="replace")


def test_a_request_over_the_pass_budget_trains_like_its_passes_sent_as_microbatches(trainer):
    """The reference step sent the batch in one request; the service ran it in two passes
    (GetStatus reports the budget). The same passes sent as two microbatches give the same
    weights bit for bit, and a Forward of the whole batch equals Forwards of its parts."""
    status = trainer.client.status()
    assert status.pass_token_budget == PASS_TOKENS
    # SDPA attention keeps auto: each pass packed where its padding would cost more.
    assert status.sequence_layout == "auto"
    assert (status.reference_policy, status.reference_placement) == ("none", "")
    trainer.client.load_checkpoint(trainer.workdir / "base")
    trainer.client.begin_step("passes", LOSS, OPTIMIZER)
    for i, part in enumerate(split(trainer.batch, [2, 1])):
        trainer.client.train_microbatch("passes", f"p{i}", part)
    trainer.client.finish_step("passes")
    assert_bit_identical(trainer.export("passes"), trainer.reference)
    outputs = (ForwardOutput.LOGPROBS, ForwardOutput.ENTROPY, ForwardOutput.TOP_K)
    whole = trainer.client.forward(trainer.batch, outputs, top_k=3)
    parts = [trainer.client.forward(p, outputs, top_k=3) for p in split(trainer.batch, [2, 1])]
    for field in ("logprobs", "entropy", "top_k_token_ids", "top_k_logprobs"):
        joined = np.concatenate([getattr(p, field) for p in parts])
        assert np.array_equal(getattr(whole, field), joined), field


def _versions(trainer: TrainerProcess, behind: list[int]) -> SequenceBatch:
    """The protocol batch naming, per sequence, a version `behind` the trainer's current."""
    current = trainer.client.status().weights_version
    versions = np.array([current - b for b in behind], dtype=np.int64)
    return dataclasses.replace(trainer.batch, weights_versions=versions)


def test_a_microbatch_past_the_staleness_bound_is_refused_and_changes_nothing(trainer):
    trainer.client.load_checkpoint(trainer.workdir / "base")
    bound = StalenessBound(max_versions=0)
    trainer.client.begin_step("stale", LOSS, OPTIMIZER, staleness=bound)
    stale = microbatch_request("stale", "old", _versions(trainer, [0, 1, 0]))
    error = _refusal(trainer.stub.TrainMicrobatch, stale)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "sequence 1 was sampled with weights version" in error.details()
    assert "past its max_staleness of 0" in error.details()
    assert _open_counts(trainer).microbatches == 0
    # Versions are required under a bound, one per sequence, none after the step's own.
    bad = {
        "absent": trainer.batch,
        "short": dataclasses.replace(trainer.batch, weights_versions=np.array([0, 0])),
        "future": _versions(trainer, [0, -1, 0]),
    }
    for name, batch in bad.items():
        request = microbatch_request("stale", f"bad-{name}", batch)
        refused = _refusal(trainer.stub.TrainMicrobatch, request)
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert violated_field(refused) == "weights_versions", name
    trainer.client.train_microbatch("stale", "fresh", _versions(trainer, [0, 0, 0]))
    result = trainer.client.finish_step("stale")
    assert result.metrics.staleness == ((0, 3),)
    assert_bit_identical(trainer.export("stale"), trainer.reference)


def test_stale_sequences_are_masked_when_the_step_says_so(trainer):
    """MASK trains the microbatch with its stale sequences' loss mask cleared: the same
    weights as sending them masked, and the histogram counts them."""
    trainer.client.load_checkpoint(trainer.workdir / "base")
    dropped = np.array([False, True, False])
    masked = trainer.batch.without_sequences(dropped)
    trainer.client.begin_step("masked-by-hand", LOSS, OPTIMIZER)
    trainer.client.train_microbatch("masked-by-hand", "m", masked)
    trainer.client.finish_step("masked-by-hand")
    by_hand = trainer.export("masked-by-hand")
    assert max_relative_difference(by_hand, trainer.reference) > 0  # the mask mattered
    trainer.client.load_checkpoint(trainer.workdir / "base")
    bound = StalenessBound(max_versions=1, stale=StaleData.MASK)
    trainer.client.begin_step("masked", LOSS, OPTIMIZER, staleness=bound)
    trainer.client.train_microbatch("masked", "m", _versions(trainer, [1, 2, 0]))
    result = trainer.client.finish_step("masked")
    assert result.metrics.staleness == ((0, 1), (1, 1), (2, 1))
    assert_bit_identical(trainer.export("masked"), by_hand)


def test_stale_token_spans_are_masked_alone_or_refused(trainer):
    """Sequence 0 is a completion that crossed two refits: its first span was sampled two
    versions back, the rest with the current weights. MASK clears the loss mask on that span
    only (the same weights as sending that mask by hand) and counts the sequence at its
    oldest token; REFUSE refuses the microbatch; a trained token no span names is refused."""
    trainer.client.load_checkpoint(trainer.workdir / "base")
    current = trainer.client.status().weights_version
    assert current >= 2
    n0, n1, n2 = trainer.batch.lengths().tolist()
    half = n0 // 2
    spans = [
        [VersionSpan(1, half, current - 2), VersionSpan(half, n0, current)],
        [VersionSpan(1, n1, current - 1)],
        [VersionSpan(1, n2, current)],
    ]
    spanned = dataclasses.replace(
        trainer.batch, spans=span_rows((i, s) for i, row in enumerate(spans) for s in row)
    )
    stale = np.zeros(trainer.batch.num_tokens, dtype=bool)
    stale[1:half] = True
    trainer.client.begin_step("span-by-hand", LOSS, OPTIMIZER)
    trainer.client.train_microbatch("span-by-hand", "m", trainer.batch.without_tokens(stale))
    trainer.client.finish_step("span-by-hand")
    by_hand = trainer.export("span-by-hand")
    assert max_relative_difference(by_hand, trainer.reference) > 0

    trainer.client.load_checkpoint(trainer.workdir / "base")
    current = trainer.client.status().weights_version
    assert spanned.spans is not None
    two_on = spanned.spans + np.array([0, 0, 0, 2])  # two versions on
    spanned = dataclasses.replace(spanned, spans=two_on)
    refusing = StalenessBound(max_versions=1)
    trainer.client.begin_step("span-refused", LOSS, OPTIMIZER, staleness=refusing)
    error = _refusal(trainer.stub.TrainMicrobatch, microbatch_request("span-refused", "m", spanned))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    trained = trainer.batch.loss_mask
    first = int(np.argmax(stale & trained))
    assert f"sequence 0 was sampled with weights version {current - 2} (at token {first})" in (
        error.details()
    )
    unnamed = dataclasses.replace(spanned, spans=two_on[:1])  # the stale span alone
    error = _refusal(trainer.stub.TrainMicrobatch, microbatch_request("span-refused", "u", unnamed))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violated_field(error) == "weights_version_spans"
    first = int(np.argmax(~stale & trained))
    assert f"token {first} of sequence 0 trains but no weights version names it" in (
        error.details()
    )
    assert _open_counts(trainer).microbatches == 0
    trainer.client.abort_step("span-refused")

    masking = StalenessBound(max_versions=1, stale=StaleData.MASK)
    trainer.client.begin_step("span-masked", LOSS, OPTIMIZER, staleness=masking)
    trainer.client.train_microbatch("span-masked", "m", spanned)
    result = trainer.client.finish_step("span-masked")
    assert result.metrics.staleness == ((0, 1), (1, 1), (2, 1))
    assert_bit_identical(trainer.export("span-masked"), by_hand)


def test_a_step_asking_for_the_services_reference_is_refused_without_one(trainer):
    loss = LossConfig(kind=LossKind.PPO, kl_coef=0.1, reference_source=ReferenceSource.SERVICE)
    with pytest.raises(FailedPrecondition, match="--reference-policy initial"):
        trainer.client.begin_step("no-reference", loss, OPTIMIZER)
    assert trainer.client.status().HasField("open_step") is False
    with pytest.raises(FailedPrecondition, match="--reference-policy initial"):
        trainer.client.forward(trainer.batch, (ForwardOutput.REFERENCE_LOGPROBS,))
    with pytest.raises(FailedPrecondition, match="--reference-policy initial"):
        trainer.client.set_reference()


def test_the_async_client_saves_loads_exports_and_is_refused_alike(trainer):
    """AsyncTrainerClient's checkpoint, export and reference calls reach the service as the
    blocking client's do: a saved checkpoint loads back to the same weights, the export
    holds them, and SetReference is refused the same way without a reference policy."""
    trainer.client.load_checkpoint(trainer.workdir / "base")
    expected = trainer.export("before-async")

    async def calls() -> tuple[CheckpointInfo, CheckpointInfo, Path]:
        async with AsyncTrainerClient(trainer.target, auth=trainer.auth, timeout=120) as aio:
            saved = await aio.save_checkpoint("async-checkpoint")
            loaded = await aio.load_checkpoint("async-checkpoint")
            exported = await aio.export_hf("async-export", dtype=ExportDType.PARAMS)
            with pytest.raises(FailedPrecondition, match="--reference-policy initial"):
                await aio.set_reference()
            return saved, loaded, Path(exported.path)

    saved, loaded, exported = asyncio.run(calls())
    assert loaded.weights_version > saved.weights_version
    assert loaded.optimizer_step == saved.optimizer_step
    weights = {k: v.numpy() for k, v in load_hf_state_dict(exported).items()}
    assert_bit_identical(weights, expected)


def test_a_dense_model_refuses_routing(trainer):
    """routed_experts and the ROUTED_EXPERTS output are for a mixture-of-experts model."""
    with pytest.raises(FailedPrecondition, match="this model has no experts"):
        trainer.client.forward(trainer.batch, (ForwardOutput.ROUTED_EXPERTS,))
    routed = np.zeros((trainer.batch.num_tokens, 2), dtype=np.int64)
    with pytest.raises(FailedPrecondition, match="this model has no experts"):
        trainer.client.forward(dataclasses.replace(trainer.batch, routed_experts=routed))
