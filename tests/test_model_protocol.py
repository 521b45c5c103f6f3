"""The seam between runtime and models (DESIGN.md): both models implement ``graphplan.models.Model``
member by member, both server specs implement ``graphplan.server.ServingSpec``, the server tells
them apart by neither ``hasattr`` nor ``isinstance``, and the runtime never imports a model."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from graphplan.compiler import compile_plan
from graphplan.models import BlockPool, Model, ModelLimits, TinyLlama, TinyLlamaConfig, Tokenizer
from graphplan.server import ModelSpec, ServingSpec
from graphplan.server.core.hf_model import HFSpec

from hf_models import small_config, write_model_dir

if TYPE_CHECKING:  # a type checker holds both models and both specs to the protocols, statically
    from graphplan.models.hf import PagedCausalLM

    def _typed(
        t: TinyLlama, p: PagedCausalLM, m: ModelSpec, h: HFSpec
    ) -> tuple[Model, Model, ServingSpec, ServingSpec]:
        return t, p, m, h


ROOT = Path(__file__).resolve().parents[1]
TABLE = compile_plan(
    {
        "version": 1,
        "name": "protocol",
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 32},
        "cudagraph": {"mode": "NONE"},
    }
)
REQS = [(0, 0, [5, 6, 7]), (2, 0, [8])]  # seats 0 and 2: four tokens of two requests


def tiny() -> TinyLlama:
    return TinyLlama(
        TinyLlamaConfig.sized(
            hidden=64, layers=1, vocab_size=128, max_model_len=32, num_cache_rows=4
        )
    )


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = write_model_dir(tmp_path_factory.mktemp("hf") / "tiny-qwen3")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return path


@pytest.fixture(scope="module", params=["tiny_llama", "hf"])
def model(request, hf_dir):
    if request.param == "tiny_llama":
        return tiny()
    from graphplan.models.hf import PagedCausalLM

    return PagedCausalLM.load(hf_dir, max_num_seqs=4, max_model_len=32, block_size=4)


def protocol_members(protocol) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_") or n == "__call__"}


EXERCISED = {
    "__call__",
    "logits",
    "cfg",
    "device",
    "kv_cache",
    "tokenizer",
    "static_inputs",
    "make_batch",
    "release",
    "stop_token_ids",
    "kv_pool",
}


def test_the_member_test_below_exercises_every_member_of_the_protocol():
    assert protocol_members(Model) == EXERCISED


def is_model(x) -> bool:
    """``x`` has every member of ``Model``. Not ``isinstance``: since Python 3.12 a protocol's
    isinstance finds members only statically, and an ``nn.Module``'s buffers (TinyLlama's
    ``kv_cache``) live in its ``_buffers``, reached through ``__getattr__``; the server never
    checks a model by isinstance (test_the_server_never_probes_a_model_or_a_spec)."""
    return all(hasattr(x, m) for m in protocol_members(Model))


def test_both_models_are_models(model):
    assert is_model(model) and isinstance(model.cfg, ModelLimits)
    assert not is_model(model.cfg)


@torch.no_grad()
def test_every_protocol_member_works_on_both_models(model):
    cfg = model.cfg
    assert (cfg.vocab_size, cfg.max_model_len, cfg.num_cache_rows) == (128, 32, 4)
    inputs = model.static_inputs()
    batch = model.make_batch(REQS)
    assert list(batch) == [i.name for i in inputs]  # forward's keywords, in order
    for spec in inputs:
        t = batch[spec.name]
        assert t.dtype == spec.dtype and t.device == model.device
        assert t.shape[0] == spec.rows(4, len(REQS)), spec.name
    before = model.kv_cache.clone()
    logits = model(**batch)
    assert logits.shape == (4, cfg.vocab_size) and logits.dtype == torch.float32
    rows = torch.tensor([3, 0], device=model.device)
    assert torch.equal(model.logits(logits, rows), logits[[3, 0]])
    into = torch.empty(2, cfg.vocab_size)
    assert model.logits(logits, rows, into=into) is into and torch.equal(into, logits[[3, 0]])
    assert not torch.equal(model.kv_cache, before)  # the step wrote its K/V into the cache
    assert model.kv_cache.device == model.device
    model.release(2)
    pool = model.kv_pool
    if isinstance(model, TinyLlama):
        assert pool is None  # a row per seat at max_model_len
    else:  # 4 seats x 8 blocks of 4; REQS hold blocks, seat 2's went back
        assert isinstance(pool, BlockPool) and pool.block_size == 4
        held = sum(-(-(start + len(toks)) // 4) for seat, start, toks in REQS if seat != 2)
        assert pool.num_free() == 4 * 8 - held
    stop = model.stop_token_ids()
    assert isinstance(stop, tuple) and all(isinstance(t, int) for t in stop)
    tok = model.tokenizer
    if isinstance(model, TinyLlama):
        assert tok is None and stop == ()
    else:  # the checkpoint's tokenizer and generation_config.json
        assert isinstance(tok, Tokenizer)
        assert tok.decode(tok.encode("w3 w4"), skip_special_tokens=True) == "w3 w4"
        assert stop == (1, 3)


def test_a_model_built_from_a_config_has_no_tokenizer_and_the_configs_eos():
    from graphplan.models.hf import PagedCausalLM

    cfg = small_config("llama")
    cfg.eos_token_id = 7
    m = PagedCausalLM.load(cfg, max_num_seqs=2, max_model_len=16, block_size=4, random_weights=True)
    assert m.tokenizer is None and m.stop_token_ids() == (7,)


# -- the server's specs --------------------------------------------------------------------


@pytest.fixture(params=["tiny_llama", "hf"])
def spec(request, hf_dir):
    if request.param == "tiny_llama":
        return ModelSpec(layers=1, hidden=64, vocab_size=128, max_model_len=32)
    return HFSpec(model=str(hf_dir), max_model_len=32)


def test_every_serving_spec_member_works_on_both_specs(spec):
    assert protocol_members(ServingSpec) == {
        "name",
        "compile",
        "limits",
        "stop_token_ids",
        "check",
        "load_tokenizer",
        "chat_template",
        "build",
    }
    assert isinstance(spec.name, str) and spec.name
    assert spec.compile == ""
    assert spec.limits() == {"vocab_size": 128, "max_model_len": 32}
    spec.check()
    tok = spec.load_tokenizer()
    assert spec.chat_template() is None  # neither test model has one
    model = spec.build(TABLE, "cpu")
    assert is_model(model)
    assert (model.cfg.vocab_size, model.cfg.max_model_len) == (128, 32)
    assert model.cfg.num_cache_rows == TABLE.max_num_seqs
    assert spec.stop_token_ids() == model.stop_token_ids()  # one rule, before and after loading
    assert (tok is None) == (model.tokenizer is None)


# -- the server probes nothing; the runtime imports no model ----------------------------------

SPEC_AND_MODEL_CLASSES = {"ModelSpec", "HFSpec", "TinyLlama", "PagedCausalLM"}


def probes(source: str, where: str = "<src>") -> list[str]:
    """``hasattr(...)`` calls, and ``isinstance``/``issubclass`` against a spec or model class."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        name = node.func.id
        if name == "hasattr":
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif name in ("isinstance", "issubclass") and len(node.args) == 2:
            classes = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            if classes & SPEC_AND_MODEL_CLASSES:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_server_never_probes_a_model_or_a_spec():
    found = []
    for path in sorted((ROOT / "server").rglob("*.py")):
        found += probes(path.read_text("utf-8"), str(path.relative_to(ROOT)))
    assert found == []


def test_the_probe_finder_finds_probes():
    src = (
        "if hasattr(model, 'make_batch'): pass\n"
        "ok = isinstance(spec, (ModelSpec, int))\n"
        "fine = isinstance(x, dict)\n"
    )
    assert probes(src) == [
        "<src>:1: hasattr(model, 'make_batch')",
        "<src>:2: isinstance(spec, (ModelSpec, int))",
    ]


def test_the_runtime_imports_no_model():
    """Not even inside a function: the runner takes any callable over named inputs."""
    found = []
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        package = ["graphplan", *rel.parts[:-1]]  # what a relative import counts up from
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                up = package[: len(package) - node.level + 1] if node.level else []
                base = ".".join(up + ([node.module] if node.module else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {n}"
                for n in names
                if n == "graphplan.models" or n.startswith("graphplan.models.")
            ]
    assert found == []
