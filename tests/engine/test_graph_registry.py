"""The process's record of captured CUDA graphs: a device's graphs are released at once (before a
tensor-parallel rank tears down the communicator their collectives captured)."""

from __future__ import annotations

import pytest
import torch

from engine.graph_registry import new_graph, release_graphs_on


def test_a_cpu_device_has_no_graphs() -> None:
    assert release_graphs_on(torch.device("cpu")) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_release_frees_the_devices_graphs_and_only_once() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    release_graphs_on(device)  # what engines of earlier tests in this process left behind
    x = torch.ones(4, device=device)
    stream = torch.cuda.Stream(device)
    graphs = []
    for _ in range(2):
        graph = new_graph(device)
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            x.add_(1)
        graphs.append(graph)
    graphs[0].replay()
    torch.cuda.synchronize()
    assert release_graphs_on(device) == 2
    assert release_graphs_on(device) == 0
    with pytest.raises(RuntimeError):
        graphs[1].replay()  # reset: nothing left to launch
