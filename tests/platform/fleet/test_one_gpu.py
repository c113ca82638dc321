"""Each local executor sees only its own GPU, renumbered as cuda:0."""

from __future__ import annotations

from retouch.functions.wire.executor import DeviceMemory, ExecutorState
from retouch.platform.fleet.providers import one_gpu


def test_each_executor_sees_only_its_gpu() -> None:
    assert one_gpu("cuda:2", {})[0]["CUDA_VISIBLE_DEVICES"] == "2"
    assert one_gpu("cuda:2", {})[1] == "cuda:0"
    env, device = one_gpu("cuda:1", {"CUDA_VISIBLE_DEVICES": "4,6,7", "X": "y"})
    assert (env["CUDA_VISIBLE_DEVICES"], device, env["X"]) == ("6", "cuda:0", "y")
    assert one_gpu("cpu", {"A": "b"}) == ({"A": "b"}, "cpu")


def test_gpu_memory_travels_in_the_executor_state() -> None:
    state = ExecutorState(
        name="e",
        pid=1,
        device="cuda:0",
        gpu_memory=DeviceMemory(total=80, free=20, allocated=50, reserved=55),
    )
    back = ExecutorState.from_wire(state.to_wire())
    assert back.gpu_memory == DeviceMemory(total=80, free=20, allocated=50, reserved=55)
    assert ExecutorState.from_wire({"name": "e", "pid": 1, "device": "cpu"}).gpu_memory.total == 0
