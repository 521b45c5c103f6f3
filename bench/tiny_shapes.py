"""The tiny Llama's shapes the benches share (keyword arguments of ``TinyLlamaConfig``):
``BENCH`` the measured size (8 layers, hidden 1024), ``QUICK`` the ``--quick`` smoke size. A bench
that needs another value says so with ``dict(BENCH, key=value)``."""

BENCH = dict(
    vocab_size=4096,
    hidden=1024,
    layers=8,
    heads=16,
    kv_heads=4,
    intermediate=2816,
    max_model_len=256,
    num_cache_rows=512,
)
QUICK = dict(
    vocab_size=256,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    intermediate=128,
    max_model_len=64,
    num_cache_rows=512,
)
