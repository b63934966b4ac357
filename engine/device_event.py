"""Stream events with one interface on every backend: a real event on an accelerator, an
already-completed stand-in on the CPU (whose ops run synchronously)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["CompletedEvent", "DeviceEvent", "StreamEvent", "make_event"]


class DeviceEvent(Protocol):
    """The slice of a stream event the FutureMap and KV fences need; the same on every backend."""

    def record(self) -> None: ...

    def wait(self) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class CompletedEvent:
    """CPU stand-in: CPU ops run synchronously, so any recorded point is already reached."""

    def record(self) -> None:
        pass

    def wait(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class StreamEvent:
    """A backend event recorded on / waited from the *current* stream of one device.

    Built from the generic ``torch.Event`` when this torch has it, else from the device module's
    ``Event``. With no stream argument the event takes the current stream of the thread's current
    device in C++; that is only right when the current device is the event's, so otherwise the
    stream is looked up and passed explicitly. (The lookup builds a Python stream object: a few
    microseconds, several times per decode iteration, on the host's critical path.)
    """

    def __init__(self, device: torch.device, blocking: bool = False) -> None:
        self.device = device
        self._module = torch.get_device_module(device)
        self._index = device.index if device.index is not None else self._module.current_device()
        if hasattr(torch, "Event"):
            self._event: Any = torch.Event(device=device, blocking=blocking)
        else:  # older torch: the per-backend class
            self._event = self._module.Event(blocking=blocking)

    def _foreign_stream(self) -> Any:
        """The event device's current stream when the thread's current device is another one."""
        if self._module.current_device() == self._index:
            return None
        return self._module.current_stream(self.device)

    def record(self) -> None:
        stream = self._foreign_stream()
        if stream is None:
            self._event.record()
        else:
            self._event.record(stream)

    def wait(self) -> None:
        stream = self._foreign_stream()
        if stream is None:
            self._event.wait()
        else:
            self._event.wait(stream)

    def query(self) -> bool:
        return bool(self._event.query())

    def synchronize(self) -> None:
        self._event.synchronize()


def make_event(device: torch.device | str, blocking: bool = False) -> DeviceEvent:
    """A completed event on CPU, a real stream event on an accelerator. `blocking`: a thread in
    `synchronize()` sleeps until the event is reached instead of spinning, for events another
    thread waits on while the launching thread keeps launching (a spinning wait competes with the
    launches for the driver)."""
    device = torch.device(device)
    if device.type == "cpu":
        return CompletedEvent()
    return StreamEvent(device, blocking)
