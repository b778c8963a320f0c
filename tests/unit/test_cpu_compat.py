"""cpu_compat: CUDA device arguments land on the CPU inside ``active()`` and nowhere else."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from megatron.core.tensor_parallel import random as mp_random

from trainer_svc.runtime import cpu_compat

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="cpu_compat only redirects on machines without CUDA"
)

PATCHED_CUDA = (
    "current_device",
    "set_device",
    "device_count",
    "synchronize",
    "empty_cache",
    "Stream",
    "current_stream",
    "default_stream",
    "stream",
    "manual_seed",
    "manual_seed_all",
)


@pytest.fixture(autouse=True)
def restore_process_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """install() changes process-wide state; put every piece back after each test."""
    for name in PATCHED_CUDA:
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))
    for name in ("_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED"):
        monkeypatch.setattr(mp_random, name, getattr(mp_random, name))
    monkeypatch.setitem(cpu_compat._state, "installed", False)
    outer_rng = torch.random.get_rng_state()
    yield
    torch.random.set_rng_state(outer_rng)


def outcome(action: Callable[[], object]) -> object:
    """What an action gives: its value's description, or its exception type."""
    try:
        value = action()
    except Exception as exc:
        return type(exc)
    return value.device if isinstance(value, torch.Tensor) else value


UNCHANGED_OUTSIDE: dict[str, Callable[[], object]] = {
    "factory": lambda: torch.zeros(1, device="cuda"),
    "cuda()": lambda: torch.zeros(1).cuda(),
    "to(cuda)": lambda: torch.zeros(1).to("cuda"),
    "type()": lambda: torch.zeros(1).type(),
}


def test_needed_without_cuda() -> None:
    assert cpu_compat.needed()


def test_active_maps_cuda_device_arguments_to_the_cpu() -> None:
    with cpu_compat.active():
        assert torch.zeros(1, device="cuda").device.type == "cpu"
        assert torch.ones(2, device="cuda:0").device.type == "cpu"
        assert torch.empty(3, device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.full((2,), 7.0, device=0).tolist() == [7.0, 7.0]
        x = torch.arange(4.0)
        assert x.to("cuda").device.type == "cpu"
        assert x.to(device="cuda").device.type == "cpu"
        assert torch.equal(x.to("cuda"), x)
        assert x.cuda() is x
        assert x.to(torch.float64).dtype == torch.float64, "dtype conversions still apply"


def test_active_reports_the_cuda_type_name() -> None:
    with cpu_compat.active():
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1, dtype=torch.int64).type() == "torch.cuda.LongTensor"
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        converted = torch.zeros(1).type(torch.float64)
        assert isinstance(converted, torch.Tensor)
        assert converted.dtype == torch.float64


def test_behaviour_outside_active_is_unchanged() -> None:
    before = {name: outcome(action) for name, action in UNCHANGED_OUTSIDE.items()}
    with cpu_compat.active():
        pass
    after = {name: outcome(action) for name, action in UNCHANGED_OUTSIDE.items()}
    assert after == before
    assert before["type()"] == "torch.FloatTensor"
    assert isinstance(before["factory"], type) and issubclass(before["factory"], Exception)
    assert isinstance(before["cuda()"], type) and issubclass(before["cuda()"], Exception)


def test_active_is_thread_local() -> None:
    seen: dict[str, object] = {}

    def other_thread() -> None:
        seen["factory"] = outcome(UNCHANGED_OUTSIDE["factory"])
        seen["type()"] = outcome(UNCHANGED_OUTSIDE["type()"])

    with cpu_compat.active():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert seen["type()"] == "torch.FloatTensor"
    assert seen["factory"] != torch.device("cpu")


def test_install_redirects_cuda_helpers_and_is_idempotent() -> None:
    cpu_compat.install()
    tracker = mp_random.get_cuda_rng_tracker()
    stream_class = torch.cuda.Stream
    current_device = torch.cuda.current_device
    assert type(tracker).__name__ == "CpuRNGStatesTracker"
    assert torch.cuda.current_device() == 0
    assert torch.cuda.device_count() == 0
    stream = torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.default_stream())
    with torch.cuda.stream(stream):
        torch.cuda.synchronize()
    tracker.add("kept", 7)

    cpu_compat.install()
    assert mp_random.get_cuda_rng_tracker() is tracker
    assert "kept" in tracker.states_, "a second install must not reset the streams"
    assert torch.cuda.Stream is stream_class
    assert torch.cuda.current_device is current_device


def test_active_installs_on_first_use() -> None:
    assert not cpu_compat.installed()
    with cpu_compat.active():
        assert cpu_compat.installed()
        assert torch.cuda.current_device() == 0


def test_rng_tracker_fork_restores_outer_state_and_advances_its_own() -> None:
    cpu_compat.install()
    tracker = mp_random.get_cuda_rng_tracker()
    torch.manual_seed(123)
    outer = torch.random.get_rng_state()
    tracker.add("model-parallel-rng", 2024)
    assert torch.equal(torch.random.get_rng_state(), outer), "add must not touch the outer RNG"

    with tracker.fork("model-parallel-rng"):
        first = torch.rand(5)
    assert torch.equal(torch.random.get_rng_state(), outer)
    with tracker.fork("model-parallel-rng"):
        second = torch.rand(5)
    assert torch.equal(torch.random.get_rng_state(), outer)

    stream = torch.Generator().manual_seed(2024)
    assert torch.equal(first, torch.rand(5, generator=stream))
    assert torch.equal(second, torch.rand(5, generator=stream)), "the fork continues its stream"
    assert torch.equal(torch.rand(5), torch.rand(5, generator=torch.Generator().manual_seed(123)))


def test_rng_tracker_fork_restores_outer_state_after_an_error() -> None:
    cpu_compat.install()
    tracker = mp_random.get_cuda_rng_tracker()
    tracker.add("s", 5)
    outer = torch.random.get_rng_state()
    with pytest.raises(RuntimeError, match="inside"), tracker.fork("s"):
        torch.rand(3)
        raise RuntimeError("inside")
    assert torch.equal(torch.random.get_rng_state(), outer)


def test_rng_tracker_rejects_duplicates_and_unknown_names() -> None:
    cpu_compat.install()
    tracker = mp_random.get_cuda_rng_tracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1 already exists"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="rng state a already exists"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match="rng state missing is not added"), tracker.fork("missing"):
        pass
