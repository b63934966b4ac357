"""What every rank of a node builds the same way: its model share, KV machinery, sampler and worker."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.algorithm import EngineAlgorithm, EngineParts, slot_future_map
from engine.attention import create_attention_backend
from engine.config import EngineConfig, ModelConfig, mixed_chunk_tokens
from engine.executor import Executor, check_executor, maybe_enable_cuda_graphs
from engine.future_map import FutureMap
from engine.kv_budget import draft_footprint, kv_bytes_per_token, size_kv_cache
from engine.kv_cache import MAX_DECODE_WINDOW, KVCacheConfig, KVCacheManager, KVPool
from engine.loader import load_model, tp_layout
from engine.mixed_graphs import bucket_ceiling
from engine.model_runner import ModelRunner
from engine.parallel.group import TpGroup
from engine.sampler import Sampler


@dataclass
class RankParts:
    """One rank's engine below the scheduler."""

    parts: EngineParts
    executor: Executor
    max_context_len: int


def build_rank(config: EngineConfig, algorithm: EngineAlgorithm, device: torch.device, tp: TpGroup) -> RankParts:
    """Load this rank's share of the target, size the KV pool (every rank the same page count) and
    build the algorithm's worker on it."""
    model, mc = load_model(config.model, config.dtype, device, tp)
    dtype = next(model.parameters()).dtype
    max_context_len = config.max_context_len or mc.max_position_embeddings
    layout = tp_layout(mc, tp)
    tokens = _agree_on_min(_kv_tokens(config, algorithm, mc, dtype, device, tp), tp)
    num_pages = max(2, tokens // config.page_size + 1)  # +1: page 0 reserved
    # the table is wider than the context: a decode step may write a speculative window past
    # the last position before the length check stops the request (two windows: under overlap a
    # request's next window is reserved on the host's upper bound, which may still count the
    # window of the batch in flight)
    width = max_context_len + 2 * MAX_DECODE_WINDOW + config.page_size
    kv = KVCacheManager(KVCacheConfig(num_pages, config.page_size, config.max_running, width), device)
    kv_heads = len(layout.kv_heads)
    pool = KVPool(mc.num_layers, num_pages, config.page_size, kv_heads, mc.head_dim, dtype, device)
    runner = ModelRunner(model, kv, pool, create_attention_backend(config.attention_backend), device)
    sampler = Sampler(mc.vocab_size, config.max_running, device, mc.eos_token_ids)
    parts = EngineParts(config, mc, runner, kv, sampler, device, dtype, tp)
    executor = check_executor(algorithm.create_worker(parts), algorithm.name)
    # graphs for every chunk the policy may mix (its cap: engine/config.py), up to a bucket holding it
    cap = mixed_chunk_tokens(config) if executor.supports_mixed_batches() else None
    mixed = bucket_ceiling(cap) if cap else 0
    maybe_enable_cuda_graphs(
        runner, config.cuda_graph_max_bs, config.cuda_graph_padded_eager, config.cuda_graph_prompt_tokens, mixed
    )
    if executor.kv_tokens_per_decode() > MAX_DECODE_WINDOW:
        raise ValueError(f"a decode step may not write more than {MAX_DECODE_WINDOW} tokens")
    return RankParts(parts, executor, max_context_len)


def build_future_map(
    algorithm: EngineAlgorithm, config: EngineConfig, max_context_len: int, kv: KVCacheManager
) -> FutureMap:
    """A follower rank's own copy of the relay the leader's scheduler builds."""
    table = kv.req_to_token
    return slot_future_map(
        algorithm,
        config.max_running,
        config.chunked_prefill_size,
        max_context_len,
        table.shape[0],
        table.device,
        config.future_map_debug,
    )


def _kv_tokens(
    config: EngineConfig,
    algorithm: EngineAlgorithm,
    mc: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TpGroup,
) -> int:
    """The configured KV capacity, or what the device memory left by the weights holds for the
    target's KV (this rank's KV heads) and a draft's (the draft loads later, so its weights are
    counted up front)."""
    if config.max_total_tokens is not None:
        return config.max_total_tokens
    size = dtype.itemsize
    kv_heads = len(tp_layout(mc, tp).kv_heads)
    draft_per_token, draft_weights = draft_footprint(algorithm.draft_model_dir(), size)
    per_token = kv_bytes_per_token(mc.num_layers, kv_heads, mc.head_dim, size) + draft_per_token
    return size_kv_cache(device, config.mem_fraction_static, config.page_size, per_token, draft_weights)


def _agree_on_min(value: int, tp: TpGroup) -> int:
    """The smallest of every rank's `value`: page ids are shared, so every pool has as many."""
    if tp.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return int(t.item())
