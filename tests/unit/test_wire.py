"""The wire edge: client request builders -> server converters round-trip exactly, server replies
-> client readers round-trip, bad enums are refused by name, and RPC errors become domain errors."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest

from trainer_refit.auth import ClientAuth
from trainer_refit.v1 import trainer_pb2 as pb
from trainer_refit.v1 import trainer_pb2_grpc as pb_grpc
from trainer_svc import client
from trainer_svc.domain import (
    NO_VERSION,
    FailedPrecondition,
    ForwardOutput,
    ForwardResult,
    InvalidArgument,
    LossConfig,
    LossKind,
    LossTerms,
    Normalization,
    OpenStepInfo,
    OptimizerOverrides,
    SequenceBatch,
    StaleData,
    StalenessBound,
    StepCounts,
    StepGradient,
    StepMetrics,
    VersionSpan,
)
from trainer_svc.server import convert
from trainer_svc.validation import check_version_spans

PER_TOKEN = ("loss_mask", "advantages", "behaviour_logprobs", "reference_logprobs")

LOSSES = [
    LossConfig(),
    LossConfig(normalization=Normalization.SEQUENCE, kl_coef=0.01),
    LossConfig(kind=LossKind.PPO, clip_low=0.1, clip_high=0.28),
    LossConfig(kind=LossKind.PPO, normalization=Normalization.SEQUENCE, clip_low=0.0, kl_coef=1.5),
    LossConfig(kind=LossKind.PPO, dual_clip=3.0, entropy_coef=0.01),
    LossConfig(kind=LossKind.GSPO, normalization=Normalization.SEQUENCE, clip_low=3e-4),
    LossConfig(
        kind=LossKind.CISPO,
        normalization=Normalization.CONSTANT,
        normalization_length=4096,
        clip_high=0.28,
    ),
]

OVERRIDES = [
    None,
    OptimizerOverrides(),
    OptimizerOverrides(learning_rate=3e-6),
    OptimizerOverrides(learning_rate=0.0, max_grad_norm=0.0),
    OptimizerOverrides(
        learning_rate=1e-5,
        weight_decay=0.1,
        adam_beta1=0.85,
        adam_beta2=0.95,
        adam_eps=1e-12,
        max_grad_norm=2.5,
    ),
]


def assert_batches_equal(actual: SequenceBatch, expected: SequenceBatch) -> None:
    assert np.array_equal(actual.tokens, expected.tokens)
    assert actual.tokens.dtype == np.int64
    assert np.array_equal(actual.offsets, expected.offsets)
    assert actual.offsets.dtype == np.int64
    for name in PER_TOKEN:
        got, want = getattr(actual, name), getattr(expected, name)
        if want is None:
            assert got is None, name
        else:
            assert got is not None, name
            assert got.dtype == want.dtype, name
            assert np.array_equal(got, want), name


# -- requests: domain -> proto (client) -> domain (server) ---------------------------------


@pytest.mark.parametrize("loss", LOSSES, ids=repr)
@pytest.mark.parametrize("overrides", OVERRIDES, ids=repr)
def test_begin_request_round_trips(loss: LossConfig, overrides: OptimizerOverrides | None) -> None:
    request = client.begin_request("step-7", loss, overrides)
    wire = pb.BeginTrainStepRequest.FromString(request.SerializeToString())
    assert wire.step_id == "step-7"
    assert convert.loss_config(wire.loss) == loss
    assert convert.optimizer_overrides(wire.optimizer) == (overrides or OptimizerOverrides())
    sent = {f.name for f, _ in wire.optimizer.ListFields()}
    assert sent == {k for k, v in vars(overrides or OptimizerOverrides()).items() if v is not None}


def test_loss_config_to_proto_round_trips() -> None:
    for loss in LOSSES:
        assert convert.loss_config(convert.loss_config_to_proto(loss)) == loss


def test_loss_config_defaults_for_absent_optional_fields() -> None:
    message = pb.LossConfig(kind=pb.LOSS_KIND_PPO, normalization=pb.NORMALIZATION_TOKEN)
    assert convert.loss_config(message) == LossConfig(kind=LossKind.PPO)


def test_explicit_zero_clip_is_not_mistaken_for_absent() -> None:
    message = pb.LossConfig(
        kind=pb.LOSS_KIND_PPO, normalization=pb.NORMALIZATION_TOKEN, clip_low=0.0, clip_high=0.0
    )
    assert convert.loss_config(message) == LossConfig(kind=LossKind.PPO, clip_low=0, clip_high=0)


def make_training_batch(loss: LossConfig) -> SequenceBatch:
    rng = np.random.default_rng(0)
    lengths = [4, 1, 6]
    kwargs: dict[str, list[np.ndarray]] = {}
    if loss.needs_policy_inputs:
        kwargs["advantages"] = [rng.normal(size=n) for n in lengths]
        kwargs["behaviour_logprobs"] = [-rng.exponential(size=n) for n in lengths]
    if loss.needs_reference:
        kwargs["reference_logprobs"] = [-rng.exponential(size=n) for n in lengths]
    return SequenceBatch.from_lists(
        [rng.integers(0, 151_000, n).tolist() for n in lengths],
        loss_mask=[[i > 0 and rng.random() < 0.7 for i in range(n)] for n in lengths],
        **kwargs,
    )


@pytest.mark.parametrize("loss", LOSSES, ids=repr)
def test_microbatch_request_round_trips(loss: LossConfig) -> None:
    batch = make_training_batch(loss)
    request = client.microbatch_request("step-1", "req-3", batch)
    wire = pb.TrainMicrobatchRequest.FromString(request.SerializeToString())
    assert (wire.step_id, wire.request_id) == ("step-1", "req-3")
    assert_batches_equal(convert.training_batch(wire), batch)


def test_training_batch_without_a_mask_has_none() -> None:
    batch = SequenceBatch.from_lists([[1, 2, 3]])
    decoded = convert.training_batch(client.microbatch_request("s", "r", batch))
    assert_batches_equal(decoded, batch)
    assert decoded.loss_mask is None


@pytest.mark.parametrize(
    "outputs",
    [
        [ForwardOutput.LOGPROBS],
        [ForwardOutput.TOP_K, ForwardOutput.ENTROPY],
        [ForwardOutput.ENTROPY, ForwardOutput.LOGPROBS, ForwardOutput.TOP_K],
    ],
)
def test_forward_request_round_trips(outputs: list[ForwardOutput]) -> None:
    batch = SequenceBatch.from_lists([[5, 6, 7], [8, 9]])
    request = client.forward_request(batch, outputs, top_k=4)
    wire = pb.ForwardRequest.FromString(request.SerializeToString())
    assert convert.forward_outputs(wire) == frozenset(outputs)
    assert wire.top_k == 4
    assert_batches_equal(convert.sequences(wire.sequences), batch)


# -- bad enum values and other refusals at the edge ------------------------------------------


@pytest.mark.parametrize("value", [pb.LOSS_KIND_UNSPECIFIED, 99])
def test_unknown_loss_kind_is_refused_by_name(value: int) -> None:
    message = pb.LossConfig(kind=value, normalization=pb.NORMALIZATION_TOKEN)
    with pytest.raises(
        InvalidArgument,
        match=(
            r"^loss\.kind must be one of LOSS_KIND_CROSS_ENTROPY, LOSS_KIND_PPO, LOSS_KIND_GSPO, "
            rf"LOSS_KIND_CISPO; got {value}$"
        ),
    ):
        convert.loss_config(message)


@pytest.mark.parametrize("value", [pb.NORMALIZATION_UNSPECIFIED, 5])
def test_unknown_normalization_is_refused_by_name(value: int) -> None:
    message = pb.LossConfig(kind=pb.LOSS_KIND_CROSS_ENTROPY, normalization=value)
    with pytest.raises(
        InvalidArgument,
        match=(
            r"^loss\.normalization must be one of NORMALIZATION_TOKEN, NORMALIZATION_SEQUENCE, "
            rf"NORMALIZATION_CONSTANT; got {value}$"
        ),
    ):
        convert.loss_config(message)


@pytest.mark.parametrize("value", [pb.FORWARD_OUTPUT_UNSPECIFIED, 42])
def test_unknown_forward_output_is_refused_by_name(value: int) -> None:
    message = pb.ForwardRequest(outputs=[pb.FORWARD_OUTPUT_LOGPROBS, value])
    with pytest.raises(
        InvalidArgument,
        match=(
            r"^outputs must be one of FORWARD_OUTPUT_LOGPROBS, FORWARD_OUTPUT_TOP_K, "
            r"FORWARD_OUTPUT_ENTROPY, FORWARD_OUTPUT_REFERENCE_LOGPROBS, "
            rf"FORWARD_OUTPUT_ROUTED_EXPERTS; got {value}$"
        ),
    ):
        convert.forward_outputs(message)


def test_empty_forward_outputs_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="outputs is empty"):
        convert.forward_outputs(pb.ForwardRequest())


def test_out_of_range_loss_values_are_refused_at_the_edge() -> None:
    message = pb.LossConfig(
        kind=pb.LOSS_KIND_PPO, normalization=pb.NORMALIZATION_TOKEN, clip_low=1.5
    )
    with pytest.raises(InvalidArgument, match="clip_low must lie in"):
        convert.loss_config(message)


def test_out_of_range_optimizer_values_are_refused_at_the_edge() -> None:
    with pytest.raises(InvalidArgument, match=r"optimizer\.adam_beta2 must be < 1"):
        convert.optimizer_overrides(pb.OptimizerParams(adam_beta2=1.0))


def test_empty_path_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="path must name a directory"):
        convert.path("", "path")
    assert str(convert.path("/tmp/ckpt", "path")) == "/tmp/ckpt"


# -- replies: domain -> proto (server) -> domain (client) -----------------------------------


def wire_counts() -> StepCounts:
    # Only the fields pb.StepCounts carries.
    return StepCounts(microbatches=3, sequences=17, valid_tokens=412)


@pytest.mark.parametrize("gradient", list(StepGradient))
def test_step_metrics_round_trip(gradient: StepGradient) -> None:
    metrics = StepMetrics(
        loss=0.731,
        terms=LossTerms(policy=0.7, kl=0.031, clip_fraction=0.125, importance_ratio=1.0025),
        grad_norm=3.25,
        learning_rate=1e-6,
        counts=wire_counts(),
        gradient=gradient,
    )
    reply = pb.FinishTrainStepResponse(
        step_id="s", metrics=convert.metrics_to_proto(metrics), weights_version=9
    )
    result = client.step_result(pb.FinishTrainStepResponse.FromString(reply.SerializeToString()))
    assert result.metrics == metrics
    assert result.weights_version == 9


def test_an_answer_without_the_gradient_field_reads_as_unreported() -> None:
    """A server older than StepMetrics.gradient sends no value (UNSPECIFIED on the wire)."""
    reply = pb.FinishTrainStepResponse(step_id="s", metrics=pb.StepMetrics(loss=0.5))
    assert client.step_result(reply).metrics.gradient is StepGradient.UNREPORTED


def test_step_counts_round_trip_keeps_valid_sequences() -> None:
    counts = StepCounts(microbatches=2, sequences=5, valid_tokens=40, valid_sequences=4)
    reply = pb.TrainMicrobatchResponse(accumulated=convert.counts_to_proto(counts))
    assert client._counts(reply.accumulated) == counts


def test_open_step_round_trip() -> None:
    loss = LOSSES[3]
    message = convert.open_step_to_proto(
        OpenStepInfo(step_id="open", loss=loss, counts=wire_counts())
    )
    assert message.step_id == "open"
    assert convert.loss_config(message.loss) == loss
    assert client._counts(message.accumulated) == wire_counts()


@pytest.mark.parametrize("with_top_k", [False, True])
def test_forward_result_round_trip(with_top_k: bool) -> None:
    rng = np.random.default_rng(2)
    n, k = 7, 3
    result = ForwardResult(
        logprobs=-rng.exponential(size=n).astype(np.float32),
        entropy=rng.exponential(size=n).astype(np.float32),
        top_k_token_ids=rng.integers(0, 1000, (n, k)).astype(np.int32) if with_top_k else None,
        top_k_logprobs=-rng.exponential(size=(n, k)).astype(np.float32) if with_top_k else None,
        top_k=k if with_top_k else 0,
        weights_version=11,
    )
    reply = pb.ForwardResponse.FromString(convert.forward_to_proto(result).SerializeToString())
    decoded = client.forward_result(reply, n)
    for name in ("logprobs", "entropy", "top_k_token_ids", "top_k_logprobs"):
        want, got = getattr(result, name), getattr(decoded, name)
        if want is None:
            assert got is None, name
        else:
            assert got is not None and got.dtype == want.dtype, name
            assert np.array_equal(got, want), name
    assert (decoded.top_k, decoded.weights_version) == (result.top_k, 11)


# -- RPC errors -> domain errors (a real server on port 0) ----------------------------------


class RefusingServicer(pb_grpc.TrainerServiceServicer):
    """Aborts AbortTrainStep with the status code named by step_id."""

    def AbortTrainStep(self, request: pb.AbortTrainStepRequest, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]  # noqa: N802
        context.abort(grpc.StatusCode[request.step_id], f"refused with {request.step_id}")


NO_AUTH = ClientAuth(insecure=True)
"""The refusing server below checks no token."""


@pytest.fixture(scope="module")
def target() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_TrainerServiceServicer_to_server(RefusingServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def rpc_error(target: str, code: str) -> grpc.RpcError:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.TrainerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.AbortTrainStep(pb.AbortTrainStepRequest(step_id=code), timeout=10)
    return info.value


@pytest.mark.parametrize(
    ("code", "domain_error"),
    [("INVALID_ARGUMENT", InvalidArgument), ("FAILED_PRECONDITION", FailedPrecondition)],
)
def test_translate_maps_refusals_to_domain_errors(
    target: str, code: str, domain_error: type[Exception]
) -> None:
    error = rpc_error(target, code)
    assert error.code() == grpc.StatusCode[code]
    translated = client._translate(error)
    assert type(translated) is domain_error
    assert str(translated) == f"refused with {code}"


@pytest.mark.parametrize("code", ["NOT_FOUND", "INTERNAL", "UNAVAILABLE"])
def test_translate_passes_other_errors_through(target: str, code: str) -> None:
    error = rpc_error(target, code)
    assert client._translate(error) is error


@pytest.mark.parametrize(
    ("code", "domain_error"),
    [("INVALID_ARGUMENT", InvalidArgument), ("FAILED_PRECONDITION", FailedPrecondition)],
)
def test_client_raises_domain_errors(target: str, code: str, domain_error: type[Exception]) -> None:
    with client.TrainerClient(target, auth=NO_AUTH, timeout=10) as trainer:
        with pytest.raises(domain_error, match=f"^refused with {code}$") as info:
            trainer.abort_step(code)
        assert not isinstance(info.value, grpc.RpcError)
        with pytest.raises(grpc.RpcError) as other:
            trainer.abort_step("NOT_FOUND")
        assert other.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as unimplemented:
            trainer.status()
        assert unimplemented.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_async_client_raises_domain_errors(target: str) -> None:
    async def call() -> None:
        async with client.AsyncTrainerClient(target, auth=NO_AUTH, timeout=10) as trainer:
            await trainer.abort_step("FAILED_PRECONDITION")

    with pytest.raises(FailedPrecondition, match=r"^refused with FAILED_PRECONDITION$"):
        asyncio.run(call())


@pytest.mark.parametrize(
    "bound",
    [None, StalenessBound(max_versions=0), StalenessBound(max_versions=3, stale=StaleData.MASK)],
)
def test_a_staleness_bound_round_trips(bound: StalenessBound | None) -> None:
    wire = client.begin_request("s", LossConfig(), None, bound)
    assert convert.staleness_bound(wire) == bound


def test_weights_versions_travel_per_sequence_and_select_with_their_sequences() -> None:
    batch = SequenceBatch.from_lists([[1, 2, 3], [4, 5], [6]], weights_versions=[7, 9, 8])
    back = convert.training_batch(client.microbatch_request("s", "r", batch))
    assert back.weights_versions is not None
    assert back.weights_versions.tolist() == [7, 9, 8]
    assert back.digest() == batch.digest()
    assert batch.select(np.array([2, 0])).weights_versions.tolist() == [8, 7]
    other = dataclasses.replace(batch, weights_versions=np.array([7, 9, 9]))
    assert other.digest() != batch.digest()


def test_version_spans_travel_and_select_with_their_sequences() -> None:
    spans = [[VersionSpan(1, 2, 4), VersionSpan(2, 3, 5)], [], [VersionSpan(0, 1, 3)]]
    batch = SequenceBatch.from_lists([[1, 2, 3], [4, 5], [6]], version_spans=spans)
    sampled = batch.sampled_versions()
    assert sampled is not None
    assert sampled.tolist() == [NO_VERSION, 4, 5, NO_VERSION, NO_VERSION, 3]
    request = client.microbatch_request("s", "r", batch)
    assert len(request.weights_version_spans) == 3
    back = convert.training_batch(request)
    assert back.version_spans() == batch.version_spans()
    assert back.digest() == batch.digest()
    picked = batch.select(np.array([2, 0]))
    assert picked.version_spans() == [(0, VersionSpan(0, 1, 3)), *[(1, s) for s in spans[0]]]
    # A sequence's version and its spans: each token at the older of the two.
    both = dataclasses.replace(batch, weights_versions=np.array([5, 2, 1]))
    sampled = both.sampled_versions()
    assert sampled is not None and sampled.tolist() == [5, 4, 5, 2, 2, 1]


@pytest.mark.parametrize(
    ("span", "message"),
    [
        ({"sequence": 2, "start": 0, "end": 1, "version": 1}, "names sequence 2"),
        ({"sequence": 0, "start": 1, "end": 4, "version": 1}, "not a non-empty range"),
        ({"sequence": 0, "start": 1, "end": 1, "version": 1}, "not a non-empty range"),
        ({"sequence": 0, "start": 0, "end": 2, "version": 1}, "overlap"),
        ({"sequence": 1, "start": 0, "end": 1, "version": 2**63}, "no version a trainer"),
    ],
)
def test_a_bad_version_span_is_refused_before_anything_is_sized_by_it(
    span: dict[str, int], message: str
) -> None:
    request = client.microbatch_request("s", "r", SequenceBatch.from_lists([[1, 2, 3], [4, 5]]))
    request.weights_version_spans.add(sequence=0, start=1, end=3, version=1)
    request.weights_version_spans.add(**span)
    with pytest.raises(InvalidArgument, match=message) as refused:
        check_version_spans(convert.training_batch(request))
    assert refused.value.field == "weights_version_spans"


def test_a_weights_version_past_int64_is_refused() -> None:
    request = client.microbatch_request("s", "r", SequenceBatch.from_lists([[1, 2]]))
    request.weights_versions.append(2**63)
    with pytest.raises(InvalidArgument, match="weights_versions holds"):
        convert.training_batch(request)
