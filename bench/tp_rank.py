"""One rank of bench/tp_scale.py (GPU only): its shard of the model, the plan's decode graphs,
the timed steps, its floor and the step's collectives in a graph; rank 0 also TP=1 (``--tp1``)."""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from decode_baselines import floor_step

from graphplan.compiler import compile_plan
from graphplan.models.hf import PagedCausalLM
from graphplan.runtime import GraphRunner

from timing import graph_time_per_call, sync, time_per_call
from tp_scale import shape_of, step_collectives


def load(a, cfg, seats: int, tp):
    from transformers import LlamaConfig

    config = LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    t0 = time.perf_counter()
    model = PagedCausalLM.load(
        config,
        max_num_seqs=seats,
        max_model_len=a.max_model_len,
        block_size=a.block_size,
        dtype=torch.bfloat16,
        device="cuda",
        random_weights=True,
        kv_cache_tokens=max(a.batches) * (a.context + 2 * a.block_size) + a.max_model_len,
        tp=tp,
    )
    return model, time.perf_counter() - t0


def captured(model, table, device) -> tuple[GraphRunner, float]:
    runner = GraphRunner(model, table, model.static_inputs(), device=device, progress=False)
    sync(device)
    t0 = time.perf_counter()
    runner.capture()
    sync(device)
    return runner, time.perf_counter() - t0


def decode_steps(model, a, device, batches) -> dict[int, float]:
    from real_scale import decode_plan

    runner, _ = captured(model, compile_plan(decode_plan(batches, a.max_model_len)), device)
    out = {}
    for b in batches:
        batch = model.make_batch([(seat, a.context, [1 + seat]) for seat in range(b)])
        with torch.no_grad():
            out[b] = time_per_call(lambda: runner.step(batch, b, 1), device, a.iters, a.repeats)
        for seat in range(b):
            model.release(seat)
    runner.release()
    return out


def comm_time(cfg, a, batch: int, device, symm: bool = False) -> float | str:
    """The step's collectives of ``batch`` tokens (step_collectives), one CUDA graph, replayed;
    ``symm``: the all-reduces by symmetric memory (tp_symm, a buffer of their size)."""
    reducer = None
    if symm:
        from graphplan.models.hf.tp_symm import symm_reducer

        elements = step_collectives(cfg, a.tp, batch)[0].elements
        reducer = symm_reducer(dist.group.WORLD, device, 2 * elements)
        if reducer is None:
            return "unavailable"
    tensors = []
    for c in step_collectives(cfg, a.tp, batch):
        x = torch.randn(c.elements, device=device, dtype=torch.bfloat16)
        out = x.new_empty(a.tp * c.elements) if c.op == "all_gather" else None
        tensors.append((c, x, out))

    def body():
        for c, x, out in tensors:
            for _ in range(c.count):
                if out is None and reducer is not None:
                    reducer.all_reduce_(x)
                elif out is None:
                    dist.all_reduce(x)
                else:
                    dist.all_gather_into_tensor(out, x)

    return graph_time_per_call(body, device, a.iters, a.repeats)


def rank_worker(rank: int, world: int, a, out_dir: str) -> None:
    from graphplan.compiler.cli.inputs import parse_overrides
    from graphplan.models.hf.tp import TPGroup

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=a.init, rank=rank, world_size=world, device_id=device
    )
    cfg = shape_of(a)
    table = None
    if a.capture_plan:
        table = compile_plan(a.capture_plan, parse_overrides(["cudagraph.mode=FULL_DECODE_ONLY"]))
    seats = max(max(a.batches), table.max_num_seqs if table else 0)
    symm = None
    if a.allreduce == "symm":
        from graphplan.models.hf.tp_symm import symm_reducer

        symm = symm_reducer(dist.group.WORLD, device)
    model, load_s = load(a, cfg, seats, TPGroup(rank, world, dist.group.WORLD, symm))
    result: dict = {"load_s": load_s, "symm": symm is not None}
    if table is not None:  # first: it includes the attention kernels' first compile
        runner, seconds = captured(model, table, device)
        runner.release()
        result["capture"] = {
            "plan": table.settings.name,
            "graphs": len(table.graphs),
            "seconds": seconds,
        }
    steps = decode_steps(model, a, device, a.batches)
    result["rows"] = []
    for b in a.batches:
        floor = floor_step(model.hf, a, device, b, a.context)
        comm = comm_time(cfg, a, b, device)
        comm_symm = comm_time(cfg, a, b, device, symm=True)
        result["rows"].append(
            {"batch": b, "step": steps[b], "floor": floor, "comm": comm, "comm_symm": comm_symm}
        )
    del model
    gc.collect()
    torch.cuda.empty_cache()
    dist.barrier()
    if a.tp1 and rank == 0:  # the whole model alone on this GPU
        one, _ = load(a, cfg, max(a.batches), None)
        result["tp1_step"] = decode_steps(one, a, device, [1])[1]
        del one
    dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
