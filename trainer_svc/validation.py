"""Checks a request's data before any rank sees it, so a bad request changes nothing."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from trainer_svc.domain import InvalidArgument, LossConfig, SequenceBatch

MAX_ID_CHARS = 256
"""The longest step_id or request_id accepted (ids are kept while their step is open and are
echoed in replies and status)."""


def check_id(value: str, field: str) -> None:
    """A step or request id: not empty, at most MAX_ID_CHARS characters."""
    if not value:
        raise InvalidArgument(f"{field} must not be empty", field=field)
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgument(
            f"{field} has {len(value)} characters; at most {MAX_ID_CHARS} are accepted",
            field=field,
        )


@dataclass(frozen=True, kw_only=True)
class BatchLimits:
    vocab_size: int
    max_sequence_length: int
    max_tokens: int


def check_sequences(batch: SequenceBatch, limits: BatchLimits) -> None:
    tokens, offsets = batch.tokens, batch.offsets
    if len(offsets) < 2:
        raise InvalidArgument(
            "sequences.offsets must hold at least two entries (0 and the end of the first "
            "sequence)",
            field="sequences.offsets",
        )
    if offsets[0] != 0:
        raise InvalidArgument(
            f"sequences.offsets[0] must be 0, got {offsets[0]}", field="sequences.offsets"
        )
    if offsets[-1] != len(tokens):
        raise InvalidArgument(
            f"sequences.offsets[-1] ({offsets[-1]}) must equal the number of tokens "
            f"({len(tokens)})",
            field="sequences.offsets",
        )
    lengths = np.diff(offsets)
    if (lengths <= 0).any():
        index = int(np.argmax(lengths <= 0))
        raise InvalidArgument(
            "sequences.offsets must increase strictly: "
            f"sequence {index} has length {lengths[index]}",
            field="sequences.offsets",
        )
    if len(tokens) > limits.max_tokens:
        raise InvalidArgument(
            f"the request holds {len(tokens)} tokens; this service accepts at most "
            f"{limits.max_tokens} per request (split it into more microbatches)",
            field="sequences.tokens",
        )
    longest = int(lengths.max())
    if longest > limits.max_sequence_length:
        index = int(np.argmax(lengths))
        raise InvalidArgument(
            f"sequence {index} has {longest} tokens; the model accepts at most "
            f"{limits.max_sequence_length}",
            field="sequences.offsets",
        )
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= limits.vocab_size):
        bad = int(np.argmax((tokens < 0) | (tokens >= limits.vocab_size)))
        raise InvalidArgument(
            f"token id {int(tokens[bad])} at flat position {bad} is outside the vocabulary "
            f"[0, {limits.vocab_size})",
            field="sequences.tokens",
        )


def _check_per_token(name: str, values: np.ndarray | None, num_tokens: int) -> None:
    if values is None:
        return
    if len(values) != num_tokens:
        raise InvalidArgument(
            f"{name} has {len(values)} entries; it must have one per token ({num_tokens})",
            field=name,
        )
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        bad = int(np.argmax(~np.isfinite(values)))
        raise InvalidArgument(
            f"{name}[{bad}] is {values[bad]}; every entry must be finite", field=name
        )


def check_training_batch(batch: SequenceBatch, loss: LossConfig, limits: BatchLimits) -> None:
    """Raises InvalidArgument unless the batch is complete and consistent for this loss."""
    check_sequences(batch, limits)
    n = batch.num_tokens
    if batch.loss_mask is None:
        raise InvalidArgument(
            f"loss_mask is required: one entry per token ({n})", field="loss_mask"
        )
    _check_per_token("loss_mask", batch.loss_mask, n)
    starts = batch.offsets[:-1]
    if batch.loss_mask[starts].any():
        index = int(np.argmax(batch.loss_mask[starts]))
        raise InvalidArgument(
            f"loss_mask is set on the first token of sequence {index}; a first token has no "
            "prefix to predict it from, so its mask entry must be false",
            field="loss_mask",
        )
    # With a sampler correction pi_old may come from the step's own weights: behaviour
    # logprobs are then optional.
    optional = {"behaviour_logprobs"} if loss.corrects_sampler else set()
    inputs = {
        "advantages": (batch.advantages, loss.needs_policy_inputs),
        "behaviour_logprobs": (batch.behaviour_logprobs, loss.needs_policy_inputs),
        "reference_logprobs": (batch.reference_logprobs, loss.needs_reference_logprobs),
        "sampler_logprobs": (batch.sampler_logprobs, loss.corrects_sampler),
    }
    for name, (values, required) in inputs.items():
        if required and values is None and name not in optional:
            raise InvalidArgument(
                f"{name} is required by loss {loss.kind.value}"
                + (f" with kl_coef={loss.kl_coef}" if name == "reference_logprobs" else "")
                + (
                    f" with correction {loss.correction.value}"
                    if name == "sampler_logprobs"
                    else ""
                ),
                field=name,
            )
        if not required and values is not None:
            raise InvalidArgument(
                f"{name} was sent but loss {loss.kind.value} (kl_coef={loss.kl_coef}) does not "
                "use it"
                + (" without a correction" if name == "sampler_logprobs" else "")
                + "; leave it empty",
                field=name,
            )
        _check_per_token(name, values, n)
    check_version_spans(batch)
    for name in ("behaviour_logprobs", "reference_logprobs", "sampler_logprobs"):
        values = getattr(batch, name)
        if values is not None and (values[batch.loss_mask] > 0).any():
            raise InvalidArgument(
                f"{name} must be <= 0 (log-probabilities) at masked-in tokens", field=name
            )


def check_version_spans(batch: SequenceBatch) -> None:
    """Each weights version span is a non-empty range of its sequence's tokens, and the spans
    of one sequence do not overlap."""
    if batch.spans is None:
        return
    lengths = batch.lengths()
    ends: dict[int, list[tuple[int, int]]] = {}
    for sequence, start, end, version in batch.spans.tolist():
        if not 0 <= sequence < len(lengths):
            raise InvalidArgument(
                f"a weights version span names sequence {sequence}; the microbatch has "
                f"{len(lengths)}",
                field="weights_version_spans",
            )
        if not 0 <= start < end <= lengths[sequence] or version < 0:
            raise InvalidArgument(
                f"weights version span [{start}, {end}) of sequence {sequence} is not a "
                f"non-empty range of its {lengths[sequence]} tokens with a version >= 0",
                field="weights_version_spans",
            )
        ends.setdefault(sequence, []).append((start, end))
    for sequence, ranges in ends.items():
        ranges.sort()
        for (_, before), (start, end) in itertools.pairwise(ranges):
            if start < before:
                raise InvalidArgument(
                    f"weights version spans of sequence {sequence} overlap at [{start}, {end})",
                    field="weights_version_spans",
                )
