"""Small random transformers configs of each supported family, and a schedule runner that drives
continuous batches (prefill chunks and decodes mixed) through a GraphRunner; shared by test_hf.py,
test_hf_gpu.py and the server tests."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3")
# three requests (prompts of 9, 5 and 3 tokens, then decodes); seat i holds request i
LENS = (15, 9, 8)
STEPS = [
    [(0, 6), (1, 5)],  # a prefill chunk and a whole prompt        (eager)
    [(1, 1), (0, 3), (2, 3)],  # a decode, the rest of a prompt, a prompt  (eager)
    [(0, 1), (1, 1), (2, 1)],  # uniform decode of 3 -> FULL graph of 4
    [(0, 1), (1, 1), (2, 1)],
    [(2, 1), (0, 1), (1, 1)],  # batch order differs from seat order
    [(0, 1), (2, 1)],  # FULL graph of 2
    [(0, 1)],  # FULL graph of 1
    [(0, 1), (2, 1)],
]


def small_config(
    family: str,
    *,
    vocab: int = 128,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    tied: bool | None = None,
    **extra,
):
    """Llama untied; Qwen2 biased qkv and tied embeddings; Qwen3 q/k norms, explicit head_dim."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if family == "llama":
        cfg = LlamaConfig(tie_word_embeddings=bool(tied), **common, **extra)
        cfg.architectures = ["LlamaForCausalLM"]
    elif family == "qwen2":
        cfg = Qwen2Config(tie_word_embeddings=True if tied is None else tied, **common, **extra)
        cfg.architectures = ["Qwen2ForCausalLM"]
    elif family == "qwen3":
        cfg = Qwen3Config(
            tie_word_embeddings=bool(tied), head_dim=2 * hidden // heads, **common, **extra
        )
        cfg.architectures = ["Qwen3ForCausalLM"]
    else:
        raise ValueError(family)
    return cfg


def reference_model(paged, attn: str = "eager"):
    """The same weights under transformers' own attention (``attn``: "eager" or "sdpa"), no
    graphplan in the way."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(paged.hf.config)
    ref = AutoModelForCausalLM.from_config(
        cfg, attn_implementation=attn, dtype=paged.cache.kv.dtype
    )
    ref.load_state_dict(paged.hf.state_dict())
    return ref.to(paged.device).eval().requires_grad_(False)


@torch.no_grad()
def sharpen_attention(hf_model, qk: float = 8.0, vo: float = 10.0):
    """Scale every layer's attention projections (q, k by ``qk``: peaked scores; v, o by ``vo``: a
    large share of the residual), so that random weights give logits the context moves (a token
    20 positions back moves later logits by ~0.1 of 0.6 and half their argmaxes), not only the
    last token: a kernel that drops or misplaces keys then fails."""
    for layer in hf_model.model.layers:
        for proj, scale in (("q_proj", qk), ("k_proj", qk), ("v_proj", vo), ("o_proj", vo)):
            getattr(layer.self_attn, proj).weight.mul_(scale)
    return hf_model


@torch.no_grad()
def reference_logits(ref, tokens: list[int]) -> torch.Tensor:
    """The model's own forward over the whole sequence, no cache: [len, vocab] float32."""
    ids = torch.tensor([tokens], device=ref.device)
    return ref(input_ids=ids, use_cache=False).logits[0].float()


def bf16_errors(
    model, got: list, seqs: list, attn: str = "eager"
) -> list[tuple[float, float, float, float]]:
    """Per request, against transformers' float32 forward of the same bf16-rounded weights:
    (graphplan's max |logit error|, transformers' own bf16 error, the bound: twice that or 2% of
    the largest logit, the largest logit). ``attn``: transformers' attention for both forwards."""
    ref16, ref32 = reference_model(model, attn), reference_model(model, attn).float()
    out = []
    for logits, seq in zip(got, seqs):
        truth = reference_logits(ref32, seq)
        top = truth.abs().max().item()
        err_hf = (reference_logits(ref16, seq) - truth).abs().max().item()
        out.append(((logits - truth).abs().max().item(), err_hf, max(2 * err_hf, 0.02 * top), top))
    return out


def plan(max_num_seqs: int = 4, max_tokens: int = 32, sizes=(1, 2, 4)) -> dict:
    """FULL graphs for uniform decode, mixed batches eager (PIECEWISE comes later)."""
    return {
        "version": 1,
        "name": "hf-test",
        "scheduler": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_tokens},
        "cudagraph": {
            "mode": "FULL_DECODE_ONLY",
            "attention_support": "ALWAYS",
            "capture_sizes": list(sizes),
        },
    }


class AllRows:
    """A runner over a ``PagedCausalLM(logits="rows")`` whose step returns every token row's
    logits through ``model.logits`` (what ``run_schedule`` reads); ``shapes``: the steps' own
    outputs' shapes (the hidden states)."""

    def __init__(self, runner, model):
        self.runner, self.model, self.shapes = runner, model, []

    def step(self, batch, num_reqs, max_query_len):
        out = self.runner.step(batch, num_reqs=num_reqs, max_query_len=max_query_len)
        self.shapes.append(tuple(out.shape))
        return self.model.logits(out, torch.arange(out.shape[0], device=out.device))


@torch.no_grad()
def run_schedule(model, runner, seqs: list[list[int]], steps) -> list[torch.Tensor]:
    """Teacher-forced continuous batching. ``steps``: per step, ``(request, num_tokens)`` pairs;
    a request's next ``num_tokens`` tokens of ``seqs[request]`` join the batch (request i sits in
    seat i). Returns each request's logits at every position it ran, [len(seq), vocab]."""
    done = [0] * len(seqs)
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in steps:
        reqs = []
        for i, n in step:
            reqs.append((i, done[i], seqs[i][done[i] : done[i] + n]))
            done[i] += n
        batch = model.make_batch(reqs)
        logits = runner.step(batch, num_reqs=len(reqs), max_query_len=max(n for _, n in step))
        first = 0
        for i, n in step:
            rows[i].append(logits[first : first + n].clone())
            first += n
    return [torch.cat(r) for r in rows]


@torch.no_grad()
def serve_greedy(model, runner, batcher, prompts: list[list[int]], new_tokens: int) -> None:
    """Prompt i as request i, each for ``new_tokens`` greedy tokens, through ``batcher``
    (server/core/batching.py) over ``runner`` until every request finished (``batcher.finished``)."""
    for i, p in enumerate(prompts):
        batcher.add(i, p, max_new_tokens=new_tokens)
    while batcher.has_work():
        batch = batcher.schedule()
        if batch is None:
            continue
        logits = runner.step(model.make_batch(batch.reqs), batch.num_reqs, batch.max_query_len)
        batcher.commit(batch, logits)


def generated(ref, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy ``generate``: the ``new_tokens`` tokens after ``prompt``."""
    out = ref.generate(
        torch.tensor([prompt]),
        max_new_tokens=new_tokens,
        do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


def tokens(n: int, seed: int, vocab: int = 128) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def write_model_dir(path: Path, *, seed: int = 0, **config) -> Path:
    """A Qwen3 checkpoint as save_pretrained writes it (config.json, generation_config.json,
    model.safetensors: the weights ``init_random`` draws from ``seed``) + ``write_tokenizer``."""
    from graphplan.models.hf import load_model

    path.mkdir(parents=True, exist_ok=True)
    model = load_model(
        small_config("qwen3", **config), seed=seed, attn_implementation="eager", random_weights=True
    )
    model.save_pretrained(path)  # its auto tokenizer reads tokenizer.json as is
    return write_tokenizer(path)


def write_tokenizer(path: Path) -> Path:
    """A word-level tokenizer built with ``tokenizers``, saved as a fast tokenizer
    (tokenizer.json, tokenizer_config.json): 'w0'..'w125' are ids 2..127, '<eos>' is 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<eos>"] + [f"w{i}" for i in range(126)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>"
    ).save_pretrained(path)
    return path


def mixed_plan(
    mode: str = "FULL_AND_PIECEWISE",
    max_num_seqs: int = 4,
    max_tokens: int = 32,
    sizes=(1, 2, 4, 8, 16, 24, 32),
) -> dict:
    """Piecewise graphs split at the adapter's attention (what plans/hf-mixed.yaml ships)."""
    return {
        "version": 1,
        "name": "hf-test-mixed",
        "scheduler": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_tokens},
        "cudagraph": {
            "mode": mode,
            "attention_support": "ALWAYS",
            "splitting_ops": ["attention"],
            "capture_sizes": list(sizes),
        },
    }


def mixed_schedule(lens, *, prompts, budget: int, seed: int):
    """Continuous batching with chunked prefill, teacher-forced: request i's first ``prompts[i]``
    tokens are its prompt, prefilled in random chunks (1..budget), the rest decode one at a time;
    requests join at staggered steps, so new prompts arrive while others decode. Returns the steps
    (``run_schedule``'s format) and whether each is a uniform decode."""
    gen = torch.Generator().manual_seed(seed)
    done, steps, joined = [0] * len(lens), [], 0
    while any(d < n for d, n in zip(done, lens)):
        joined = min(
            len(lens), joined + int(torch.randint(0, 2, (1,), generator=gen)) + (joined == 0)
        )
        step, left = [], budget
        order = torch.randperm(joined, generator=gen).tolist()
        for i in order:
            if done[i] >= lens[i] or left == 0:
                continue
            if done[i] < prompts[i]:
                want = int(torch.randint(1, budget + 1, (1,), generator=gen))
                n = min(want, prompts[i] - done[i], left)
            else:
                n = 1
            step.append((i, n))
            done[i] += n
            left -= n
        if step:
            steps.append(step)
    uniform = [all(n == 1 for _, n in s) for s in steps]
    return steps, uniform
