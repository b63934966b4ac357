"""Stream events on a GPU: recorded on and waited from the current stream of the event's device,
including from a thread whose current device is another GPU."""

from __future__ import annotations

import pytest
import torch

from engine.device_event import CompletedEvent, make_event

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_cpu_events_are_already_complete():
    ev = make_event("cpu")
    assert isinstance(ev, CompletedEvent)
    ev.record(), ev.wait(), ev.synchronize()
    assert ev.query()


@gpu
@needs_cuda
def test_wait_orders_a_side_stream_after_the_recorded_work():
    dev = torch.device("cuda", 0)
    x = torch.zeros(1 << 22, device=dev)
    ev, side = make_event(dev), torch.cuda.Stream(dev)
    for _ in range(20):  # long enough that an unordered read would see zeros
        x.add_(1.0)
    ev.record()  # on the current (default) stream
    with torch.cuda.stream(side):
        ev.wait()
        y = x.sum()
    side.synchronize()
    assert y.item() == 20.0 * x.numel()


@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_an_event_of_the_second_gpu_works_while_the_first_is_current():
    torch.cuda.set_device(0)
    dev1 = torch.device("cuda", 1)
    x = torch.ones(1 << 20, device=dev1)
    ev = make_event(dev1)
    x.mul_(3.0)
    ev.record()  # must use cuda:1's stream although cuda:0 is current
    ev.wait()
    ev.synchronize()
    assert ev.query() and x[0].item() == 3.0


@gpu
@needs_cuda
def test_a_blocking_event_is_waited_on_from_another_thread():
    import threading

    dev = torch.device("cuda", 0)
    x = torch.zeros(1 << 22, device=dev)
    for _ in range(20):
        x.add_(1.0)
    ev = make_event(dev, blocking=True)
    ev.record()
    waiter = threading.Thread(target=ev.synchronize)
    waiter.start()
    waiter.join(30)
    assert not waiter.is_alive() and ev.query()
    assert x[0].item() == 20.0
