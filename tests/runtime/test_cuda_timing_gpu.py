"""Queued timing on an NVIDIA GPU (tiledispatch.cuda.QueuedTimer / time_queued, what tuning and the sweep use): the
delay kernel holds the stream for the time asked, a batch queued behind it is timed by the GPU alone (a kernel
shorter than the host's launch measures shorter than at the host's pace; a long one measures the same), and a host
that cannot queue a batch within the delay is reported as behind.

Marked gpu; skipped without torch + CUDA. Needs no bundle: the timed work is torch's own kernels.
"""
from __future__ import annotations

import statistics
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from tiledispatch import cuda  # noqa: E402

pytestmark = pytest.mark.gpu


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def test_the_delay_kernel_holds_the_stream_for_the_time_asked():
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cuda.delay(0.1, stream())  # loads the module: out of the timed part
    for ms in (0.2, 1.0, 5.0):
        start.record()
        cuda.delay(ms, stream())
        stop.record()
        stop.synchronize()
        assert ms <= start.elapsed_time(stop) < 1.2 * ms + 0.02


def paced_ms(fn, batch_ms: float) -> float:
    """Per call of back-to-back calls between events, each queued at the host's pace (no delay in front)."""
    return statistics.median(cuda.time_paced(fn, stream=stream(), batch_ms=batch_ms))


def test_a_kernel_shorter_than_its_launch_is_timed_by_the_gpu():
    x = torch.zeros(1, device="cuda")
    fn = lambda: x.add_(1)  # noqa: E731  (a microsecond on the GPU, several on the host)
    queued = statistics.median(cuda.time_queued(fn, stream=stream(), batch_ms=0.5))
    assert queued < 0.8 * paced_ms(fn, 0.5)


def test_a_long_kernel_times_the_same_queued_or_paced():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    out = torch.empty_like(a)
    fn = lambda: torch.mm(a, a, out=out)  # noqa: E731
    queued = statistics.median(cuda.time_queued(fn, stream=stream(), batch_ms=2.0))
    assert 0.9 < queued / paced_ms(fn, 2.0) < 1.1


def test_a_host_slower_than_the_delay_is_reported_behind():
    x = torch.zeros(1, device="cuda")

    def slow():  # the host takes 0.2 ms per call: far over the first guess of its pace
        time.sleep(2e-4)
        x.add_(1)

    timer = cuda.QueuedTimer(stream())
    assert timer.batch(slow, 20)[1]  # sized from the first guess: behind
    assert not timer.batch(slow, 20)[1]  # sized from the pace just measured
