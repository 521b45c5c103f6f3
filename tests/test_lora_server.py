"""LoRA adapters served: ``--lora-modules`` at start, the request's ``model`` picking the adapter
through the official ``openai`` client (greedy tokens equal transformers' generate with the adapter
merged into the weights), ``/v1/models`` listing adapters with their parent, unknown names 404,
and ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` behind the admin token, under load."""

import http.client
import json
import threading

import openai
import pytest
from lora_adapters import merged_model, write_adapter

from graphplan.compiler.errors import GraphplanError
from graphplan.models.hf import load_model
from graphplan.server.core import lora_serving
from graphplan.server.core.hf_model import HFSpec
from graphplan.server.errors import RequestError

from hf_models import generated, reference_model, small_config, write_tokenizer
from served import openai_client

NAME = "tiny-llama"
TOKEN = "lora-admin-token-0123456789"
PLAN = (
    "version: 1\nname: lora-serve\nscheduler: {max_num_seqs: 4, max_num_batched_tokens: 32}\n"
    "cudagraph: {mode: FULL_AND_PIECEWISE, attention_support: ALWAYS, splitting_ops: [attention], "
    "capture_sizes: [1, 2, 4, 8, 16, 32]}\nlora: {enabled: true, max_loras: 2}\n"
)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    cfg = small_config("llama")
    model = load_model(cfg, seed=0, attn_implementation="eager", random_weights=True)
    model.save_pretrained(root / NAME)
    write_tokenizer(root / NAME)
    adapters = {
        n: write_adapter(root / n, cfg, rank=r, seed=s, std=0.1)
        for n, r, s in (("a", 4, 1), ("b", 8, 2), ("c", 2, 3))
    }
    bad = write_adapter(root / "bad", cfg, rank=32)
    return root / NAME, adapters, bad


@pytest.fixture(scope="module")
def server(dirs, tmp_path_factory):
    from graphplan.server import Server

    model_dir, adapters, _ = dirs
    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    path.write_text(PLAN)
    spec = HFSpec(
        model=str(model_dir),
        max_model_len=32,
        lora_modules=(("a", str(adapters["a"])), ("b", str(adapters["b"]))),
    )
    s = Server(path, spec=spec, progress=False, admin_token=TOKEN).start()
    assert s.wait_ready(60), s.engine.error
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def reference(server, dirs):
    base = reference_model(server.engine.model)
    refs = {n: merged_model(base, d) for n, d in dirs[1].items()} | {NAME: base}
    return lambda model, prompt, n: generated(refs[model], prompt, n)


def post(server, path, body, token=TOKEN):
    host, port = server.address
    c = http.client.HTTPConnection(host, port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    c.request("POST", path, json.dumps(body), headers)
    try:
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


PROMPTS = [[5, 9, 2, 77], [100, 3], [3] * 7]


def test_models_lists_the_adapters_with_the_base_model_as_parent(client):
    data = client.models.list().data
    assert [(m.id, m.parent) for m in data] == [(NAME, None), ("a", NAME), ("b", NAME)]
    assert client.models.retrieve("b").parent == NAME


def test_model_picks_the_adapter_and_gives_the_merged_models_greedy_tokens(client, reference):
    out = {}

    def ask(model):  # concurrently: the steps mix both adapters and the base model
        res = client.completions.create(model=model, prompt=PROMPTS, max_tokens=6, temperature=0)
        out[model] = (res.model, [c.token_ids for c in res.choices])

    threads = [threading.Thread(target=ask, args=(m,)) for m in ("a", "b", NAME)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for model in ("a", "b", NAME):
        assert out[model] == (model, [reference(model, p, 6) for p in PROMPTS]), model
    assert out["a"][1] != out[NAME][1] and out["b"][1] != out[NAME][1]  # adapters change tokens


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="model 'zzz' does not exist"):
        client.completions.create(model="zzz", prompt=[1, 2], max_tokens=2)


def test_load_and_unload_need_the_admin_token(server):
    assert (
        post(server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "/x"}, None)[0] == 401
    )
    assert (
        post(server, "/v1/unload_lora_adapter", {"lora_name": "a"}, "wrong-token-wrong-token")[0]
        == 401
    )


def test_hostile_adapters_are_refused_with_the_files_reason(server, dirs):
    status, body = post(
        server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(dirs[2])}
    )
    assert status == 400 and "rank r=32 is over the limit of 16" in body
    status, body = post(server, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and "lora_path" in body
    status, body = post(
        server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(dirs[1]["c"])}
    )
    assert status == 409 and "already loaded" in body


def test_loading_and_unloading_under_load_loses_no_request(server, client, reference, dirs):
    results, errors = [], []

    def load_traffic(model):
        try:
            for _ in range(3):
                res = client.completions.create(
                    model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0
                )
                results.append((model, res.choices[0].token_ids))
        except Exception as e:  # recorded, asserted below
            errors.append(e)

    threads = [threading.Thread(target=load_traffic, args=(m,)) for m in ("a", NAME, "b", "a")]
    for t in threads:
        t.start()
    for _ in range(3):
        status, body = post(
            server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(dirs[1]["c"])}
        )
        assert status == 200 and "added successfully" in body
        res = client.completions.create(model="c", prompt=PROMPTS[1], max_tokens=6, temperature=0)
        assert res.choices[0].token_ids == reference("c", PROMPTS[1], 6)
        assert res.choices[0].token_ids != reference(NAME, PROMPTS[1], 6)
        status, body = post(server, "/v1/unload_lora_adapter", {"lora_name": "c"})
        assert status == 200, body
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 12
    for model, toks in results:
        assert toks == reference(model, PROMPTS[0], 8), model
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt=[1], max_tokens=1)
    assert [m.id for m in client.models.list().data] == [NAME, "a", "b"]


def test_unloading_an_adapter_in_use_is_refused_with_409(server):
    model = server.engine.model
    with pytest.raises(RequestError, match="in use by 2 queued or running") as e:
        lora_serving.unload(model, "a", users=2)
    assert e.value.status == 409 and "a" in model.lora.adapters
    with pytest.raises(RequestError, match="'q' is not loaded"):
        lora_serving.unload(model, "q", users=0)


def test_flags_are_checked_against_the_plans_lora_block():
    from graphplan.compiler import compile_plan

    off = compile_plan({"version": 1, "name": "p", "scheduler": {"max_num_seqs": 4}})
    with pytest.raises(GraphplanError, match="--lora-modules: the plan 'p' has lora.enabled false"):
        lora_serving.settings(off, (("a", "/x"),), None, None)
    on = compile_plan(
        {
            "version": 1,
            "name": "p",
            "scheduler": {"max_num_seqs": 4},
            "lora": {"enabled": True, "max_loras": 3},
        }
    )
    with pytest.raises(GraphplanError, match="--max-loras 5 is above the plan's lora.max_loras 3"):
        lora_serving.settings(on, (), 5, None)
    assert lora_serving.settings(on, (), None, None) == lora_serving.LoraSettings(3, 16)
    assert lora_serving.settings(on, (), 2, 64) == lora_serving.LoraSettings(2, 64)
    assert lora_serving.settings(off, (), None, None) is None


def test_the_adapter_travels_to_the_engine_process(dirs, tmp_path_factory):
    """With the engine in its own process: the request's adapter rides the wire (Add), and loads
    and unloads are engine calls (Call) answered with their status."""
    from graphplan.server import Server

    model_dir, adapters, bad = dirs
    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    path.write_text(PLAN)
    spec = HFSpec(model=str(model_dir), max_model_len=32, lora_modules=(("a", str(adapters["a"])),))
    s = Server(path, spec=spec, progress=False, admin_token=TOKEN, processes=True).start()
    try:
        assert s.wait_ready(120)
        client = openai_client(s)
        base = load_model(model_dir, attn_implementation="eager")
        for model, ref in (("a", merged_model(base, adapters["a"])), (NAME, base)):
            res = client.completions.create(
                model=model, prompt=PROMPTS[2], max_tokens=6, temperature=0
            )
            assert res.choices[0].token_ids == generated(ref, PROMPTS[2], 6), model
        status, body = post(s, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(bad)})
        assert status == 400 and "rank r=32 is over the limit of 16" in body
        assert (
            post(s, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["c"])})[0]
            == 200
        )
        res = client.completions.create(model="c", prompt=PROMPTS[1], max_tokens=6, temperature=0)
        assert res.choices[0].token_ids == generated(
            merged_model(base, adapters["c"]), PROMPTS[1], 6
        )
        assert post(s, "/v1/unload_lora_adapter", {"lora_name": "c"})[0] == 200
        assert post(s, "/v1/unload_lora_adapter", {"lora_name": "c"})[0] == 404
    finally:
        s.stop()


def test_cli_refuses_lora_flags_the_plan_cannot_serve_and_hostile_adapters(dirs, tmp_path, capsys):
    from graphplan.server.cli import main

    model_dir, adapters, bad = dirs
    off = tmp_path / "off.yaml"
    off.write_text(PLAN.replace("lora: {enabled: true, max_loras: 2}\n", ""))
    on = tmp_path / "on.yaml"
    on.write_text(PLAN)
    common = ["--model", str(model_dir), "--port", "0", "--device", "cpu", "--single-process"]
    assert main([*common, "--plan", str(off), "--lora-modules", f"a={adapters['a']}"]) == 1
    err = capsys.readouterr().err
    assert "--lora-modules: the plan 'lora-serve' has lora.enabled false" in err
    assert "Traceback" not in err
    assert main([*common, "--plan", str(on), "--max-loras", "3"]) == 1
    assert "--max-loras 3 is above the plan's lora.max_loras 2" in capsys.readouterr().err
    assert main([*common, "--plan", str(on), "--lora-modules", f"x={bad}"]) == 1
    err = capsys.readouterr().err
    assert "rank r=32 is over the limit of 16; serve with --max-lora-rank 32" in err
    assert "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["--plan", str(on), "--lora-modules", f"a={adapters['a']}"])
    assert "--lora-modules applies to --model" in capsys.readouterr().err
