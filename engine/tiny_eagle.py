"""Writes tiny EAGLE / EAGLE-3 draft heads in their published HF layouts, for tests and demos.

`mode="random"` gives a head that mostly disagrees with its target. `mode="repeat"` (EAGLE only)
builds a head whose output is its input feature, so it predicts what the target predicted one
position earlier: on a target stuck in a loop it is right, elsewhere wrong, which exercises
every accepted length deterministically.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_tiny_eagle_head(path: str | Path, target_dir: str | Path, fmt: str = "eagle", *,
                          mode: str = "random", seed: int = 0, draft_vocab_size: int | None = None,
                          intermediate_size: int = 128) -> Path:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    hidden, heads, kv_heads = tcfg["hidden_size"], tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    head_dim = tcfg.get("head_dim") or hidden // heads
    vocab = tcfg["vocab_size"]
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    in_attn = hidden if fmt == "eagle" else 2 * hidden
    w: dict[str, torch.Tensor] = {}
    prefix = "layers.0." if fmt == "eagle" else "midlayer."
    w.update({prefix + "self_attn.q_proj.weight": rnd(heads * head_dim, in_attn),
              prefix + "self_attn.k_proj.weight": rnd(kv_heads * head_dim, in_attn),
              prefix + "self_attn.v_proj.weight": rnd(kv_heads * head_dim, in_attn),
              prefix + "self_attn.o_proj.weight": rnd(hidden, heads * head_dim),
              prefix + "mlp.gate_proj.weight": rnd(intermediate_size, hidden),
              prefix + "mlp.up_proj.weight": rnd(intermediate_size, hidden),
              prefix + "mlp.down_proj.weight": rnd(hidden, intermediate_size),
              prefix + "post_attention_layernorm.weight": 1 + rnd(hidden, std=0.1)})
    arch = "LlamaForCausalLMEagle"
    extra: dict[str, object] = {}
    if fmt == "eagle":
        w["fc.weight"], w["fc.bias"] = rnd(hidden, 2 * hidden), rnd(hidden, std=0.01)
        if mode == "repeat":  # output = feature: fc picks the feature half; attention/MLP add 0
            w["fc.weight"] = torch.cat((torch.zeros(hidden, hidden), torch.eye(hidden)), dim=1)
            w["fc.bias"] = torch.zeros(hidden)
            w[prefix + "self_attn.o_proj.weight"].zero_()
            w[prefix + "mlp.down_proj.weight"].zero_()
    elif fmt == "eagle3":
        arch = "LlamaForCausalLMEagle3"
        dv = draft_vocab_size or vocab
        w.update({"fc.weight": rnd(hidden, 3 * hidden), "norm.weight": 1 + rnd(hidden, std=0.1),
                  prefix + "input_layernorm.weight": 1 + rnd(hidden, std=0.1),
                  prefix + "hidden_norm.weight": 1 + rnd(hidden, std=0.1),
                  "lm_head.weight": rnd(dv, hidden, std=0.5)})
        # the draft vocabulary: a sorted subset of target ids, stored as offsets
        target_ids = torch.sort(torch.randperm(vocab, generator=gen)[:dv]).values
        w["d2t"] = target_ids - torch.arange(dv)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[target_ids] = True
        w["t2d"] = t2d
        extra["draft_vocab_size"] = dv
    else:
        raise ValueError(f"unknown head format {fmt!r}")
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    cfg = {"architectures": [arch], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": intermediate_size, "num_hidden_layers": 1, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
           "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-6), "rope_theta": tcfg.get("rope_theta", 10000.0),
           "max_position_embeddings": tcfg.get("max_position_embeddings", 512),
           "torch_dtype": tcfg.get("torch_dtype", "float32"), **extra}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
