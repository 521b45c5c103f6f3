"""bench/tp_scale.py on the CPU: its arguments (bad ones exit 2 with the flag named, no
traceback), the collectives it times for a step, and its report's arithmetic and bars. The ranks
themselves (bench/tp_rank.py) need GPUs: bench/gpu_session.sh steps tp2 and tp4."""

import pytest

import tp_scale


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--tp", "3"], "tensor_parallel_size=3"),  # 32 heads do not split 3 ways
        (["--tp", "0"], "--tp 0"),
        (["--batches", "1,x"], "--batches"),
        (["--batches", "0"], "--batches"),
        (["--layers", "0"], "--layers 0"),
        (["--context", "4095"], "--context 4095"),
        (["--shape", "405b"], "--shape"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        tp_scale.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_arguments_and_the_70b_shape():
    a = tp_scale.parse_args(["--tp", "4", "--shape", "70b", "--layers", "8", "--batches", "64,1"])
    assert (a.tp, a.batches, a.context) == (4, [1, 64], 1024)
    assert tp_scale.shape_of(a) == {
        **tp_scale.SHAPES["70b"],
        "num_hidden_layers": 8,
    }
    full = tp_scale.SHAPES["70b"]
    assert (full["num_hidden_layers"], full["hidden_size"], full["num_attention_heads"]) == (
        80,
        8192,
        64,
    )
    assert (full["num_key_value_heads"], full["intermediate_size"], full["vocab_size"]) == (
        8,
        28672,
        128256,
    )


def test_a_steps_collectives_are_two_all_reduces_per_layer_the_embeddings_and_the_heads_gather():
    cfg = tp_scale.SHAPES["70b"]
    got = tp_scale.step_collectives(cfg, 4, 64)
    assert got == [
        tp_scale.Collective("all_reduce", 161, 64 * 8192),
        tp_scale.Collective("all_gather", 1, 64 * 32064),
    ]
    odd = dict(cfg, vocab_size=10)  # ceil(10 / 4) = 3 rows a rank
    assert tp_scale.step_collectives(odd, 4, 2)[1] == tp_scale.Collective("all_gather", 1, 6)
    assert tp_scale.step_collectives(cfg, 1, 64) == []


def _r0(step1, step64, tp1=None, capture=3.0):
    rows = [
        {"batch": 1, "step": step1, "floor": 0.010, "comm": 0.003, "comm_symm": 0.002},
        {
            "batch": 64,
            "step": step64,
            "floor": "floor K/V (9.0 GiB) does not fit",
            "comm": 0.004,
            "comm_symm": "unavailable",
        },
    ]
    r = {"load_s": 1.0, "rows": rows, "capture": {"plan": "p", "graphs": 5, "seconds": capture}}
    if tp1 is not None:
        r["tp1_step"] = tp1
    return r


def test_the_report_adds_the_comm_to_the_floor_and_checks_the_70b_bars():
    a = tp_scale.parse_args(["--tp", "4", "--shape", "70b"])
    text, ok = tp_scale.report(a, "GPU", _r0(0.0138, 0.020))
    assert "| 1 | 13.800 | 10.000 | 3.000 | 2.000 | 12.000 | 1.15x | <= 1.15x met | 72 |" in text
    assert (
        "| 64 | 20.000 | floor K/V (9.0 GiB) does not fit | 4.000 | unavailable | - | - |  | 3200 |"
        in text
    )
    assert "5 graphs in 3.00 s on rank 0 (bar: <= 10 s, met)" in text
    assert ok
    text, ok = tp_scale.report(a, "GPU", _r0(0.0139, 0.020))
    assert "1.16x | <= 1.15x MISSED" in text and not ok
    assert not tp_scale.report(a, "GPU", _r0(0.0138, 0.020, capture=10.5))[1]


def test_the_report_compares_tp2_with_tp1_at_batch_1():
    a = tp_scale.parse_args(["--tp", "2", "--tp1"])
    text, ok = tp_scale.report(a, "GPU", _r0(0.0062, 0.02, tp1=0.010))
    assert "= 0.62x (<= 0.62x met)" in text and ok
    assert "the model's all-reduce: nccl;" in text
    a = tp_scale.parse_args(["--tp", "2", "--allreduce", "symm"])
    assert "all-reduce: symm (unavailable: NCCL);" in tp_scale.report(a, "GPU", _r0(1.0, 1.0))[0]
    assert (
        "| 1 | 6.200 | 10.000 | 3.000 | 2.000 | 12.000 | 0.52x |  |" in text
    )  # no floor bar at 8B
    text, ok = tp_scale.report(a, "GPU", _r0(0.0063, 0.02, tp1=0.010))
    assert "= 0.63x (<= 0.62x MISSED)" in text and not ok


def _symm_agreement_worker(rank, world, have):
    """symm_reducer(agree=...) on a rank that can allocate (have[rank]) or cannot; the
    exchange itself is a stand-in that records it ran (no GPU here)."""
    import torch.distributed as dist

    from graphplan.models.hf import tp_symm

    tp_symm._allocate = lambda device, limit: "buf" if have[rank] else None
    tp_symm.SymmAllReduce = lambda group, buf, algo: f"exchanged {buf} {algo}"
    got = tp_symm.symm_reducer(dist.group.WORLD, "cuda:0", 1 << 20, agree=dist.group.WORLD)
    return repr(got)


@pytest.mark.parametrize(
    "have, expect",
    [([True, True], "'exchanged buf auto'"), ([True, False], "None"), ([False, True], "None")],
)
def test_the_ranks_use_symmetric_memory_all_together_or_not_at_all(tmp_path, have, expect):
    """The server's ranks (tp_worker.tp_group) agree over Gloo before the exchange: one rank
    without symmetric memory turns it off for all, instead of leaving its peers waiting."""
    from test_dp import _spawn

    assert _spawn(_symm_agreement_worker, 2, tmp_path, have) == [expect, expect]


def test_symmetric_memory_is_off_on_the_cpu_and_its_size_limit_comes_from_the_environment():
    import torch

    from graphplan.models.hf import tp_symm
    from graphplan.models.hf.tp import TPGroup

    assert tp_symm.symm_reducer(object(), "cpu", 1 << 20) is None
    env = tp_symm.MAX_BYTES_ENV
    assert tp_symm.max_bytes_from_env({}) == tp_symm.DEFAULT_MAX_BYTES == 8 << 20
    assert tp_symm.max_bytes_from_env({env: "4096"}) == 4096
    for bad in ("-1", "1MiB"):
        with pytest.raises(ValueError, match=f"{env}={bad!r}: a non-negative integer"):
            tp_symm.max_bytes_from_env({env: bad})
    assert tp_symm.algo_from_env({}) == "auto"
    assert tp_symm.algo_from_env({tp_symm.ALGO_ENV: "one_shot"}) == "one_shot"
    with pytest.raises(
        ValueError, match="GRAPHPLAN_TP_SYMM_ALGO='three': one of auto, one_shot, two_shot"
    ):
        tp_symm.algo_from_env({tp_symm.ALGO_ENV: "three"})

    class Stub:  # what TPGroup hands to symmetric memory: the messages it takes, nothing else
        def takes(self, x):
            return x.numel() <= 2

        def all_reduce_(self, x):
            return x.mul_(10)

    group = TPGroup(0, 2, None, Stub())
    assert group.all_reduce_(torch.ones(2)).tolist() == [10.0, 10.0]
    assert TPGroup(0, 1, None, Stub()).all_reduce_(torch.ones(2)).tolist() == [1.0, 1.0]


def test_the_gemv_probe_gives_a_rank_the_shards_of_the_fused_decoder():
    """bench/gemv_probe.py's weights of one rank of the 8B shape (on the meta device): q|k|v and
    gate|up fused, o_proj and down_proj split by their input, the head by vocabulary rows."""
    from gemv_probe import rank_weights

    from llama_shapes import SHAPES

    shapes = {
        tp: [[tuple(w.shape) for w in layer] for layer in rank_weights(SHAPES["8b"], tp, "meta")]
        for tp in (1, 2, 4)
    }
    assert len(shapes[2]) == 33 and shapes[2][-1] == [(64128, 4096)]
    assert shapes[1][0] == [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    assert shapes[2][0] == [(3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168)]
    assert shapes[4][0] == [(1536, 4096), (4096, 1024), (7168, 4096), (4096, 3584)]


def test_the_gemv_probe_refuses_triton_configs_it_cannot_run(capsys, monkeypatch):
    """--triton needs ROWSxCOLSxWARPS configs, and a CUDA device (or Triton's interpreter)."""
    from gemv_probe import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = ["--device", "cpu", "--shape", "tiny", "--tps", "2", "--batches", "1"]
    for configs in ("8x64x4", "8x64"):
        assert main([*argv, "--triton", configs]) == 2
        assert "--triton takes ROWSxCOLSxWARPS configs and a CUDA device" in capsys.readouterr().err
