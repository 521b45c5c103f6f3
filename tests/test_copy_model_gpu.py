"""bench/copy_model.py on the GPU: the 8B shape's width, heads and vocabulary (4 of its 32 layers,
the rest only repeat zero layers), built on the device in bfloat16; under transformers' forward a
1024-token context of a 256-token document four times over, then 255 more tokens of it (teacher
forced), has every next document token as the argmax, at least 20 logits above any other."""

import pytest
import torch

from copy_model import build_copy_model
from llama_shapes import SHAPES

pytestmark = pytest.mark.gpu


def test_the_8b_shape_copies_a_1024_token_context_in_bfloat16():
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{**SHAPES["8b"], "num_hidden_layers": 4, "max_position_embeddings": 2048})
    model = build_copy_model(cfg, torch.bfloat16, "cuda", max_positions=2048)
    doc = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:256]
    ids = doc.repeat(5)[: 1024 + 255].cuda()
    with torch.no_grad():
        logits = model(ids[None]).logits[0, 1023:-1].float()
    assert torch.equal(logits.argmax(-1), ids[1024:])
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) >= 20.0
