"""bench/copy_model.py: a stock LlamaForCausalLM whose hand-set weights copy. Under transformers' own
forward (Llama-3's RoPE: theta 500000 with its llama3 scaling), greedy decoding of X + X[:m] goes on
with X[m:] exactly, untied and tied; in bfloat16 at a mid-size shape over a context of 1090 tokens
every copied token is the argmax by a wide margin; served through the engine with n-gram
speculation, every draft is accepted and the tokens are those without speculation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_async_scheduling import run
from test_spec_engine import NGRAM, K, _engine, plan

from graphplan.server.core.hf_model import HFSpec
from graphplan.server.requests import GREEDY

from copy_model import build_copy_model, layout, main

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama3_config(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, vocab=1000, tied=False):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=LLAMA3_ROPE, tie_word_embeddings=tied,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


@pytest.fixture(scope="module")
def models():
    return {
        tied: build_copy_model(llama3_config(tied=tied), max_positions=256)
        for tied in (False, True)
    }


def distinct(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:n].tolist()


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(3, 48), data=st.data())
def test_greedy_generation_continues_the_repeated_sequence(models, seed, n, data):
    m = data.draw(st.integers(1, n - 1), label="m")
    tied = data.draw(st.booleans(), label="tied")
    x = distinct(seed, n, 1000)
    out = models[tied].generate(
        torch.tensor([x + x[:m]]), max_new_tokens=n - m, do_sample=False, attention_mask=None
    )
    assert out[0, n + m :].tolist() == x[m:]


def test_bfloat16_copies_over_a_1090_token_context_by_a_wide_margin():
    """The shape of the GPU bench in small (head_dim 128, 2 KV heads, 4 induction layers, vocab
    32000): teacher-forced X + X[:540] for |X| = 550, each of the 539 copied positions' argmax is
    the next token of X, at least 10 logits above any other."""
    cfg = llama3_config(hidden=1024, layers=8, heads=8, kv_heads=2, head_dim=128, vocab=32000)
    model = build_copy_model(cfg, torch.bfloat16, max_positions=2048)
    assert layout(cfg, 2048).n == 8
    x = torch.tensor(distinct(0, 550, 32000))
    with torch.no_grad():
        logits = model(torch.cat([x, x[:540]])[None]).logits[0, 550:1089].float()
    want = x[1:540]
    assert torch.equal(logits.argmax(-1), want)
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) >= 10.0


def test_shapes_without_room_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="at least 2 layers"):
        layout(llama3_config(layers=1), 256)
    from transformers import LlamaConfig

    fast = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, num_hidden_layers=2, rope_theta=10000.0)  # fmt: skip
    with pytest.raises(ValueError, match="lower --max-positions"):
        layout(fast, 100000)


def test_the_cli_writes_a_directory_and_refuses_a_full_one(tmp_path, capsys):
    out = tmp_path / "copy"
    assert main(["--shape", "tiny", "--out", str(out), "--max-positions", "128"]) == 0
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    with pytest.raises(SystemExit) as e:
        main(["--shape", "tiny", "--out", str(out)])
    assert e.value.code == 2 and "not empty" in capsys.readouterr().err


def test_ngram_speculation_accepts_every_draft_and_changes_no_token(tmp_path):
    """X + X[:m] served greedily, three requests at once: both engines give X[m:]; with n-gram
    prompt lookup every draft token is accepted (the model copies, so the tokens after the last
    n-gram's earlier occurrence are the model's), so each verification step keeps 1 + k tokens
    but the last; the drafts are at least k per full step."""
    model_dir = tmp_path / "copy"
    build_copy_model(llama3_config(), max_positions=256).save_pretrained(model_dir)
    spec = HFSpec(model=str(model_dir), max_model_len=128)
    cases = [
        (distinct(10 + i, n, 1000), m) for i, (n, m) in enumerate([(30, 1), (25, 9), (20, 13)])
    ]
    waves = [[(x + x[:m], len(x) - m, (), GREEDY) for x, m in cases]]
    want = {i: (x[m:], "length") for i, (x, m) in enumerate(cases)}
    got = {}
    for speculative in (None, NGRAM):
        e = _engine(spec, plan(1 + K if speculative else 1), speculative)
        try:
            got[speculative is not None] = run(e, waves)
            if speculative:
                value = e.metrics.value
                drafted = value("graphplan_spec_decode_num_draft_tokens_total")
                accepted = value("graphplan_spec_decode_num_accepted_tokens_total")
        finally:
            e.stop(5)
    assert got[False] == want and got[True] == want
    assert accepted == drafted >= sum(K * ((len(x) - m - 1) // (1 + K)) for x, m in cases)
