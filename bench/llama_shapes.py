"""The Llama shapes the real-scale benches build from a config (random weights, no download):
Llama-3-8B, Llama-3.2-1B and a tiny one for CPU smoke runs, as ``LlamaConfig`` keyword arguments."""

LLAMA3 = dict(
    vocab_size=128256,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rope_theta=500000.0,
)
SHAPES = {
    "8b": dict(
        LLAMA3,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        tie_word_embeddings=False,
    ),
    "1b": dict(
        LLAMA3,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        tie_word_embeddings=True,
        head_dim=64,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
    ),
}
SHAPES["70b"] = dict(
    LLAMA3,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    tie_word_embeddings=False,
)
"""Llama-3-70B (80 layers, hidden 8192, 64 heads, 8 KV heads): a tensor-parallel shape (tp_scale)."""
