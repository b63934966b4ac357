"""The process environment NIXL and UCX read when a backend is created, set for one creation only.

NIXL takes its UCX SGL switch, and UCX its device list, from the environment at the moment a UCX
backend (its UCP context and worker) is created; both are per transport here. The environment
belongs to the process, so each creation sets what it needs under one lock and puts back what
was there, and no setting leaks into another agent of the process.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger(__name__)
SGL_ENV = "NIXL_UCX_SGL_ENABLE"  # NIXL reads it when a UCX backend is created
NET_DEVICES_ENV = "UCX_NET_DEVICES"  # UCX reads it when NIXL creates its context (the backend)
_ENV_LOCK = threading.Lock()  # the environment is the process's: one backend creation at a time


def create_backend(agent: Any, backend: str, params: dict[str, str], sgl: bool, net_devices: str | None = None) -> None:
    """Create `backend` with the environment NIXL and UCX read at its creation set for this
    creation only, so the transport's settings decide, not whatever the process inherited, and
    nothing leaks into another agent: NIXL's UCX SGL switch from `sgl`, and UCX_NET_DEVICES from
    `net_devices` (engine.kv_transfer.interfaces; an operator's own UCX_NET_DEVICES wins)."""
    env = {SGL_ENV: "1" if sgl else "0"}
    if net_devices is not None:
        if NET_DEVICES_ENV in os.environ:
            log.info("%s=%s is set: UCX uses it, not %s", NET_DEVICES_ENV, os.environ[NET_DEVICES_ENV], net_devices)
        else:
            env[NET_DEVICES_ENV] = net_devices
    with _ENV_LOCK:
        before = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            agent.create_backend(backend, params)
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
