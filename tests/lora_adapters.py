"""PEFT LoRA adapter directories written the way PEFT saves them (adapter_config.json and
adapter_model.safetensors with PEFT's tensor names), random A/B of a known rank, and the reference:
transformers' model with each adapter merged into its weights (W + scale * B @ A)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from graphplan.models.hf.lora import MODULES, projection_shapes, tensor_name


def write_adapter(
    path: Path,
    config,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    modules=MODULES,
    seed: int = 0,
    rslora: bool = False,
    std: float = 0.05,
    drop: str | None = None,
    shapes: dict | None = None,
    extra: dict | None = None,
) -> Path:
    """An adapter of ``config``'s model in ``path``. ``drop``: a tensor name left out; ``shapes``:
    tensor name -> a shape to write instead; ``extra``: adapter_config.json keys to set."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    dims = projection_shapes(config)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for m in modules:
            out, inp = dims[m]
            for ab, shape in (("A", (rank, inp)), ("B", (out, rank))):
                name = tensor_name(layer, m, ab)
                shape = (shapes or {}).get(name, shape)
                tensors[name] = torch.randn(*shape, generator=gen) * std
    if drop is not None:
        del tensors[drop]
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(modules),
        "use_rslora": rslora,
        "bias": "none",
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        **(extra or {}),
    }
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


@torch.no_grad()
def merged_model(ref, adapter_dir: Path | None):
    """A copy of transformers' model ``ref`` with the PEFT adapter in ``adapter_dir`` merged into
    its weights, read with safetensors directly (not graphplan's reader); None: ``ref`` itself."""
    if adapter_dir is None:
        return ref
    from safetensors.torch import load_file

    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    r = cfg["r"]
    scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    merged = copy.deepcopy(ref)
    for layer in range(merged.config.num_hidden_layers):
        for m in cfg["target_modules"]:
            a = tensors[tensor_name(layer, m, "A")].double()
            b = tensors[tensor_name(layer, m, "B")].double()
            block = merged.model.layers[layer]
            lin = getattr(
                block.self_attn if m in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp, m
            )
            delta = (scale * b @ a).to(lin.weight.device)  # the adapter's tensors load on the CPU
            lin.weight.copy_((lin.weight.double() + delta).to(lin.weight.dtype))
    return merged


# ---- a continuous batch mixing three adapters and the base model ----------------------------
LENS = (12, 12, 10, 12)  # seat i: adapter ADAPTERS[i]; seat 3 the base model
STEPS = [
    [(0, 5), (1, 4), (3, 3)],  # prefill chunks of three
    [(0, 4), (1, 5), (2, 6), (3, 4)],  # the rest of the prompts, a whole one
    [(0, 1), (1, 1), (2, 1), (3, 1)],  # uniform decode: 3 adapters + base
    [(3, 1)],  # the base model alone: LoRA case 0 where the plan separates it
    [(2, 1), (0, 1)],  # two adapters
    [(1, 1), (3, 1)],  # one adapter and the base
    [(0, 1), (1, 1), (2, 2), (3, 2)],  # mixed
]


def plan(mode: str, **lora) -> dict:
    cudagraph = {"mode": mode, "attention_support": "ALWAYS", "capture_sizes": [1, 2, 4, 8, 16, 32]}
    if mode == "FULL_AND_PIECEWISE":
        cudagraph["splitting_ops"] = ["attention"]
    return {
        "version": 1,
        "name": "lora-test",
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 32},
        "cudagraph": cudagraph,
        "lora": {"enabled": True, "max_loras": 3, **lora},
    }


@torch.no_grad()
def run_mixed(model, runner, table, seqs):
    """The schedule, seat i on adapter 'abc'[i] (seat 3: none); per request its logits, and per
    step (the graph id routing names, replays counted by the runner per graph id)."""
    for seat, name in enumerate(["a", "b", "c", None]):
        model.release(seat)
        model.lora.bind(seat, name)
    done, rows, seen = [0] * 4, [[] for _ in seqs], []
    for step in STEPS:
        reqs = [(i, done[i], seqs[i][done[i] : done[i] + n]) for i, n in step]
        for i, n in step:
            done[i] += n
        active = model.num_active_loras(reqs)
        mql = max(n for _, n in step)
        want = table.route(sum(n for _, n in step), len(reqs), mql, active).to_json()["graph_id"]
        before = list(runner._stats.replays)
        out = runner.step(model.make_batch(reqs), len(reqs), mql, num_active_loras=active)
        after = runner._stats.replays
        seen.append((want, [g for g in range(len(after)) if after[g] != before[g]], active))
        first = 0
        for i, n in step:
            rows[i].append(out[first : first + n].clone())
            first += n
    return [torch.cat(r) for r in rows], seen
