"""The Triton kernels of batched LoRA (models/hf/lora_kernels.py) on the CPU under Triton's
interpreter, against the masked-GEMM torch path (lora_slots.py) and a per-token float64 reference:
every sub-projection layout (q|k|v, gate|up, single), ranks below the slots' rank, tokens of the
base model (slot -1) untouched. Run by tests/test_lora.py in a child process:

    TRITON_INTERPRET=1 python -m pytest -q tests/lora_interpreted.py
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (see the docstring)", allow_module_level=True)
pytest.importorskip("triton")


@pytest.mark.parametrize("block_k", [256, 32])  # the input in one chunk, or split in 2 to 4
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_lora_equals_the_torch_path_and_the_per_token_reference(dtype, block_k, monkeypatch):
    from graphplan.models.hf import lora_kernels
    from graphplan.models.hf.lora import MODULES, LoraAdapter
    from graphplan.models.hf.lora_slots import GROUPS, LoraSlots

    from hf_models import small_config

    monkeypatch.setattr(lora_kernels, "BLOCK_K", block_k)
    cfg = small_config("llama", hidden=64, heads=4, kv_heads=2)
    slots = LoraSlots(cfg, max_loras=3, max_rank=8, dtype=dtype, device="cpu")
    gen = torch.Generator().manual_seed(0)
    shapes = slots.shapes
    adapters = []
    for i, (rank, mods) in enumerate(
        [(8, MODULES), (4, ("q_proj", "v_proj", "up_proj")), (2, MODULES)]
    ):
        w = {}
        for layer in range(cfg.num_hidden_layers):
            for m in mods:
                out, inp = shapes[m]
                w[(layer, m)] = (
                    (torch.randn(rank, inp, generator=gen) * 0.3).to(dtype),
                    (torch.randn(out, rank, generator=gen) * 0.3).to(dtype),
                )
        adapters.append(
            LoraAdapter(name=f"a{i}", path="", rank=rank, scale=0.5 + i, modules=mods, weights=w)
        )
        slots.load(i, adapters[-1])
    token_slots = torch.tensor([0, -1, 2, 1, 1, 0, -1])
    t = token_slots.shape[0]
    for group, mods in GROUPS.items():
        inp = shapes[mods[0]][1]
        out = sum(shapes[m][0] for m in mods)
        x = torch.randn(t, inp, generator=gen).to(dtype)
        y0 = torch.randn(t, out, generator=gen).to(dtype)
        slots.kernel = "triton"
        got = slots.step(token_slots).add(y0.clone(), x, 1, group)
        slots.kernel = "torch"
        dense = slots.step(token_slots).add(y0.clone(), x, 1, group)
        ref = y0.double().clone()
        for i, s in enumerate(token_slots.tolist()):
            if s < 0:
                continue
            row = 0
            for m in mods:
                o = shapes[m][0]
                ab = adapters[s].weights.get((1, m))
                if ab is not None:
                    a, b = ab
                    ref[i, row : row + o] += adapters[s].scale * (
                        b.double() @ (a.double() @ x[i].double())
                    )
                row += o
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        scale = ref.abs().max().item()
        assert (got.double() - ref).abs().max().item() <= tol * scale, group
        assert (dense.double() - ref).abs().max().item() <= tol * scale, group
        base = (token_slots < 0).nonzero().flatten()
        assert torch.equal(got[base], y0[base]), group  # the base model's rows untouched
