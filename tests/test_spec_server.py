"""Speculative decoding through graphplan-serve: the official openai client against a saved HF
model with its tokenizer gets the same greedy text (plain and streamed, with a stop string) with
``--speculative-config`` as without, in the engine process, and /metrics counts drafts and
accepted tokens (vLLM's spec_decode series); the flag's bad JSON and a plan of another
decode_query_len exit 2 with a message naming the fix."""

from __future__ import annotations

import httpx
import pytest

from graphplan.server.cli import main
from graphplan.server.core.spec.config import parse_speculative_config

from hf_models import write_model_dir
from served import openai_client, start_server

NGRAM = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}')


def plan(q: int) -> str:
    return (
        f"version: 1\nname: hf-spec\nscheduler: {{max_num_seqs: 4, max_num_batched_tokens: 32, "
        f"decode_query_len: {q}}}\n"
        "cudagraph: {mode: FULL_AND_PIECEWISE, attention_support: ALWAYS, capture_sizes: [1, 2, 3, 4, 6, 8, 12]}\n"
    )


PROMPTS = ["w1 w7 w30 w1 w7 w30 w1 w7", "w4 w2 w4 w2 w4", "w9"]


def _served(tmp_path_factory, model_dir, speculative):
    s = start_server(
        tmp_path_factory,
        model_dir,
        plan(3 if speculative else 1),
        max_model_len=64,
        speculative=speculative,
        processes=True,
    )
    try:
        c = openai_client(s)
        res = c.completions.create(model="m", prompt=PROMPTS, max_tokens=24, temperature=0)
        plain = [(ch.text, ch.token_ids, ch.finish_reason) for ch in res.choices]
        stop = plain[0][0].split()[3] if len(plain[0][0].split()) > 3 else None
        streamed = "".join(
            ch.choices[0].text
            for ch in c.completions.create(
                model="m",
                prompt=PROMPTS[1],
                max_tokens=20,
                temperature=0,
                stream=True,
                stop=[stop] if stop else None,
            )
        )
        text = httpx.get(s.url + "/metrics").text
        return plain, streamed, text, stop
    finally:
        s.stop()


def test_the_openai_client_gets_the_same_text_with_and_without_speculation(tmp_path_factory):
    model_dir = write_model_dir(tmp_path_factory.mktemp("hf") / "m")
    off = _served(tmp_path_factory, model_dir, None)
    on = _served(tmp_path_factory, model_dir, NGRAM)
    assert on[:2] == off[:2]
    assert all(len(ids) == 24 or r == "stop" for _, ids, r in on[0])
    assert "graphplan_spec_decode_num_drafts_total" not in off[2]
    drafts = _sample(on[2], "graphplan_spec_decode_num_draft_tokens_total")
    assert drafts > 0 and drafts % 2 == 0
    assert (
        _sample(on[2], 'graphplan_spec_decode_num_accepted_tokens_per_pos_total{position="1"}') >= 0
    )


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize(
    "config, q, message",
    [
        ("{nope", 3, "--speculative-config: not JSON"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2}',
            1,
            "scheduler.decode_query_len 1: set scheduler.decode_query_len: 3",
        ),
    ],
)
def test_the_flag_s_errors_exit_2(tmp_path, capsys, config, q, message):
    path = tmp_path / "plan.yaml"
    path.write_text(plan(q))
    code = main(
        [
            "--plan",
            str(path),
            "--layers",
            "2",
            "--hidden",
            "64",
            "--vocab-size",
            "128",
            "--max-model-len",
            "48",
            "--speculative-config",
            config,
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
