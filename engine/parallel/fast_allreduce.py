"""All-reduce of small messages over symmetric memory: PyTorch's one-shot kernel, each rank reading
every peer's buffer directly over NVLink (CUDA IPC), inside CUDA graphs as NCCL's all-reduce is.

On two H100s the all-reduce of batch 1's hidden state (8 KiB) took 16-21 us with NCCL inside a CUDA
graph and 8.2-8.5 us with this kernel (bench/gpu/tp.py), and a decode step of the 8B shape runs 64
of them. Messages larger than the buffer, and CPU tensors, keep NCCL (or gloo). Chosen with
`--tp-allreduce one-shot`; NCCL stays the default until the engine's own figures with it are measured.
"""

from __future__ import annotations

import torch

BUFFER_BYTES = 1 << 20  # batch 128's hidden states at 4,096 x bf16; larger messages go to NCCL

# PyTorch numbers symmetric-memory rendezvous per process (a static sequence in its store keys), so
# a process that already joined one waits forever on ranks that count from zero: a freshly spawned
# follower always does. One one-shot group per process, then.
_joined_in_this_process = False


def check_one_shot_available() -> None:
    """Raise, before any rank starts, if this process cannot join another one-shot group."""
    if _joined_in_this_process:
        raise RuntimeError(
            "--tp-allreduce one-shot: this process already joined a symmetric-memory group, and "
            "PyTorch numbers those per process, so new ranks would never meet it; start the engine "
            "in a new process, or use --tp-allreduce nccl"
        )


class OneShotAllReduce:
    """A symmetric buffer every rank registered; sums a tensor that fits it across the ranks."""

    def __init__(self, group_name: str, device: torch.device, max_bytes: int = BUFFER_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        global _joined_in_this_process
        check_one_shot_available()
        _joined_in_this_process = True
        # bytes, viewed as each message's dtype: the kernel finds the allocation by its address
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, group_name)  # collective: every rank, at start-up
        self.group_name = group_name

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return x.is_cuda and x.is_contiguous() and nbytes <= self.buffer.numel() and nbytes % 16 == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks into `x`, in place. The kernel's closing barrier lets the next call
        overwrite the buffer: no rank still reads it then."""
        staged = self.buffer.view(x.dtype)[: x.numel()].view_as(x)
        staged.copy_(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, x)
        return x
