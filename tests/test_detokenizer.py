"""Incremental detokenization (server/frontend/choices.py): the text a request's tokens add, one
token at a time, adds up to the tokenizer's own decode of all of them, whether the fast path
(tokenizers' DecodeStream, one decode per token) or the windowed one (two decodes of a window per
token) runs, on a word-level tokenizer and on a byte-level BPE whose tokens split UTF-8 characters."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphplan.server.frontend.choices import Detokenizer

CORPUS = [
    "héllo wörld — naïve café ünïcödé",
    "日本語のテキストと絵文字 🙂🚀 mixed with ASCII",
    "tokens split characters: ∑ ∫ √ ≈ ≠ 😀",
] * 20


def _byte_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _word_level(tmp_path_factory):
    from graphplan.models.hf import load_tokenizer

    from hf_models import write_tokenizer

    d = write_tokenizer(tmp_path_factory.mktemp("tok"))
    (d / "config.json").write_text('{"model_type": "qwen3"}')
    return load_tokenizer(str(d))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    return {"bpe": _byte_bpe(), "words": _word_level(tmp_path_factory)}


class Windowed:
    """The same tokenizer seen through the Tokenizer protocol alone (no Rust backend): the
    Detokenizer takes its windowed path."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=False):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text):
        return self.tokenizer.encode(text)


def _stream(tokenizer, ids) -> tuple[list[str], str]:
    d = Detokenizer(tokenizer)
    pieces = [d.add(i) for i in ids]
    return pieces, "".join(pieces) + d.flush()


@settings(max_examples=60, deadline=None)
@given(
    which=st.sampled_from(["bpe", "words"]),
    picks=st.lists(st.integers(0, 10_000), min_size=1, max_size=40),
    cut=st.integers(0, 40),
)
def test_the_increments_add_up_to_the_tokenizers_decode(tokenizers, which, picks, cut):
    tok = tokenizers[which]
    ids = tok.encode(CORPUS[picks[0] % 3])[: max(1, cut)]  # cut anywhere, even mid-character
    ids += [p % len(tok) for p in picks[1:]]  # and arbitrary tokens after
    want = tok.decode(ids, skip_special_tokens=True)
    _, fast_text = _stream(tok, ids)
    _, slow_text = _stream(Windowed(tok), ids)
    assert fast_text == want and slow_text == want


def test_the_fast_path_decodes_each_token_once_and_holds_a_split_character(tokenizers):
    tok = tokenizers["bpe"]
    ids = tok.encode("🙂")
    assert len(ids) > 1  # the emoji's bytes span tokens
    pieces, text = _stream(tok, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🙂" and text == "🙂"
    calls = []

    class Counting(type(tok)):  # type: ignore[misc]
        def decode(self, *a, **k):
            calls.append(a)
            return super().decode(*a, **k)

    tok.__class__ = Counting
    try:
        _stream(tok, tok.encode("naïve café"))
    finally:
        tok.__class__ = Counting.__mro__[1]
    assert calls == []  # DecodeStream alone: no Python decode per token
