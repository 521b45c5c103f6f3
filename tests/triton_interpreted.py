"""The Triton kernels of models/hf/triton_attention.py on the CPU, under Triton's interpreter,
against the dense float64 reference (tests/paged_cases.py). Not collected with the suite: Triton
picks its interpreter when a function is decorated, so this module must run in a process that
had TRITON_INTERPRET=1 before triton was first imported. tests/test_paged_attention.py runs it:

    TRITON_INTERPRET=1 python -m pytest -q tests/triton_interpreted.py

Tolerances (relative norm against float64): float32 1e-5, float16 2e-3 (the probabilities are
rounded to float16 before the P.V product, as on the GPU). bfloat16 is not tested here: Triton
3.6's interpreter computes bf16 dot products wrongly (seen: errors of 1e10 on a 16x16 product).
"""

import os

import pytest
import torch
from paged_cases import dense_reference, make_case, relative_error

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (see the docstring)", allow_module_level=True)
pytest.importorskip("triton")

DECODE = dict(seq_lens=[7, 1, 40, 16, 23], q_lens=[1, 1, 1, 1, 1])
MIXED = dict(seq_lens=[9, 33, 1, 20, 12], q_lens=[9, 1, 1, 6, 3])


@pytest.fixture
def kernels(monkeypatch):
    """The kernel module, imported only after the interpreter check above."""
    _loop_bounds_from_loads(monkeypatch)
    from graphplan.models.hf import triton_attention

    return triton_attention


def _loop_bounds_from_loads(monkeypatch) -> None:
    """Triton 3.6's interpreter holds a loaded scalar as a 1-element array, which NumPy >= 2.4 no
    longer converts with int(): a loop bounded by a loaded length then fails. Convert the element
    instead, for these tests only."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None:
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)


@pytest.mark.parametrize(
    "kind, dtype, group, batch",
    [
        ("decode", torch.float32, 1, DECODE),
        ("decode", torch.float16, 4, DECODE),
        ("decode", torch.float16, 2, MIXED),  # decode is right for any batch, only slower
        ("prefill", torch.float32, 4, MIXED),
        ("prefill", torch.float16, 1, MIXED),
        ("prefill", torch.float16, 8, DECODE),
    ],
)
def test_triton_kernels_equal_the_dense_reference(kernels, kind, dtype, group, batch):
    case = make_case(**batch, group=group, dtype=dtype, pad_tokens=2, pad_reqs=1, seed=11)
    # tiles of 16 keys; decode: many programs per (imagined) multiprocessor, so that the longer
    # requests split into several chunks and the combine kernel runs
    extra = dict(programs_per_sm=64, block_n=16) if kind == "decode" else dict(block_n=16)
    out = getattr(kernels, kind)(*case.inputs(), **extra)
    assert out.dtype == dtype
    bound = 1e-5 if dtype == torch.float32 else 2e-3
    assert relative_error(out, dense_reference(case)) < bound
    assert torch.equal(out[case.padded_rows], torch.zeros_like(out[case.padded_rows]))


def test_decode_splits_a_long_request_and_combines_the_parts(kernels):
    """One long request beside short ones: the split length follows the batch's total context,
    so the long one is cut into several parts, merged by their log-sum-exp."""
    case = make_case([150, 3, 5], [1, 1, 1], group=2, seed=2)
    out = kernels.decode(*case.inputs(), programs_per_sm=16, block_n=16, splits=8)
    assert relative_error(out, dense_reference(case)) < 1e-5


def test_the_adapter_picks_decode_for_one_row_per_request_and_prefill_otherwise(kernels):
    """paged_attention's choice is static per shape (T == R) and both answers are right."""
    for batch in (DECODE, MIXED):
        case = make_case(**batch, group=2, seed=4)
        out = kernels.paged_attention(*case.inputs())
        assert relative_error(out, dense_reference(case)) < 1e-5


def test_the_split_length_loop_over_many_requests_keeps_decode_and_combine_in_step(
    kernels, monkeypatch
):
    """The split length sums seq_lens BLOCK_R requests at a time; with a step of 2 over 5
    requests the loop runs 3 times in both kernels, which must agree on it (else a part is lost
    or combined twice)."""
    monkeypatch.setattr(kernels, "BLOCK_R", 2)
    case = make_case([150, 3, 5, 9, 40], [1] * 5, group=2, pad_reqs=1, pad_tokens=1, seed=6)
    out = kernels.decode(*case.inputs(), programs_per_sm=16, block_n=16, splits=8)
    assert relative_error(out, dense_reference(case)) < 1e-5
