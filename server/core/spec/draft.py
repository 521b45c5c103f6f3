"""The draft-model proposer (``{"method": "draft_model", "model": DIR, "num_speculative_tokens":
k}``): a smaller Hugging Face decoder with the target's vocabulary drafts k tokens greedily, k
sequential decode steps a step, through its own ``GraphRunner`` over its own paged KV cache.

Its table is the target's plan with ``decode_query_len: 1`` (the same capture sizes: its decode
steps of one token a request replay FULL graphs, its catch-up chunks route as the plan says for
mixed steps). Its KV follows the target's accepted tokens without hooks: per cache row it
remembers the tokens whose K/V it wrote, in order, and each step keeps the longest prefix that
agrees with the request's sequence (a rejected draft, a preempted request, a new request on the
row: the rest is rewritten), feeds the tokens after it (catch-up chunks within the plan's token
budget), then the last token and its own drafts. Greedy drafts are one-hot, so acceptance is
``verify.accepted`` (exact for greedy and sampled targets: server/core/spec/verify.py).

Its KV pool is sized as the target's default (every row at max_model_len where memory allows);
a step it cannot fit proposes nothing (the target decodes, padded drafts are rejected) and starts
its rows over."""

from __future__ import annotations

import copy
from typing import Any, Sequence

import numpy as np
import torch

from graphplan.models.paged_kv import KVCacheSizeError

from .config import SpeculativeConfigError


class DraftModelProposer:
    def __init__(self, model: Any, runner: Any, k: int, max_tokens: int, max_reqs: int):
        self.model, self.runner, self.k = model, runner, k
        self.max_tokens, self.max_reqs = max_tokens, max_reqs
        self._cached: dict[int, list[int]] = {}
        """cache row -> the tokens whose K/V the draft holds, position by position."""
        self.steps = 0
        """Draft forward steps run (catch-up chunks and draft decodes)."""

    def propose(
        self, seqs: Sequence[Sequence[int]], ks: Sequence[int], rows: Sequence[int] = ()
    ) -> list[list[int]]:
        try:
            return self._propose([list(s) for s in seqs], list(ks), list(rows))
        except KVCacheSizeError:
            for row in rows:  # start these rows over once blocks free up
                self._cached.pop(row, None)
                self.model.release(row)
            return [[] for _ in seqs]

    @torch.no_grad()
    def _propose(self, seqs: list[list[int]], ks: list[int], rows: list[int]) -> list[list[int]]:
        valid = [self._valid(row, seq) for row, seq in zip(rows, seqs)]
        self._catch_up(seqs, rows, valid)
        drafts: list[list[int]] = [[] for _ in seqs]
        feed = [seq[-1] for seq in seqs]
        for j in range(max(ks)):
            live = [i for i, k in enumerate(ks) if k > j]
            reqs = [(rows[i], len(seqs[i]) - 1 + j, [feed[i]]) for i in live]
            for i, tok in zip(live, self._last_tokens(reqs)):
                drafts[i].append(tok)
                feed[i] = tok
        for i, row in enumerate(rows):  # K/V written: the sequence and all drafts but the last
            self._cached[row] = seqs[i] + drafts[i][:-1]
        return drafts

    def _valid(self, row: int, seq: list[int]) -> int:
        """How many of the row's cached positions hold ``seq``'s tokens (at most all but its last)."""
        held = self._cached.get(row, [])
        n = min(len(held), len(seq) - 1)
        diff = np.flatnonzero(np.asarray(held[:n]) != np.asarray(seq[:n]))
        return int(diff[0]) if len(diff) else n

    def _catch_up(self, seqs: list[list[int]], rows: list[int], valid: list[int]) -> None:
        """Write the K/V of each sequence's tokens after its valid prefix, but its last, in
        chunks of at most the plan's token budget and seat count."""
        pos = list(valid)
        while True:
            budget = self.max_tokens
            reqs: list[tuple[int, int, Any]] = []
            for i, seq in enumerate(seqs):
                n = min(budget, len(seq) - 1 - pos[i])
                if n > 0 and len(reqs) < self.max_reqs:
                    reqs.append((rows[i], pos[i], seq[pos[i] : pos[i] + n]))
                    pos[i] += n
                    budget -= n
            if not reqs:
                return
            self._run(reqs)

    def _run(self, reqs: list) -> Any:
        self.steps += 1
        batch = self.model.make_batch(reqs)
        mql = max(len(t) for _, _, t in reqs)
        return self.runner.step(batch, num_reqs=len(reqs), max_query_len=mql)

    def _last_tokens(self, reqs: list) -> list[int]:
        """The draft's greedy token after each request's last fed token."""
        out = self._run(reqs)
        last = np.cumsum([len(t) for _, _, t in reqs]) - 1
        index = torch.from_numpy(last).to(self.model.device)
        return self.model.logits(out, index).argmax(dim=-1).tolist()


def draft_table(table: Any) -> Any:
    """The target's plan with decode_query_len 1: the draft's graphs (its decode sizes)."""
    from graphplan.compiler import compile_plan

    plan = copy.deepcopy(table.plan)
    plan["name"] = f"{plan.get('name', 'plan')}-draft"
    plan["scheduler"]["decode_query_len"] = 1
    return compile_plan(plan)


def build_draft_proposer(config: Any, engine: Any) -> DraftModelProposer:
    """The draft model of ``config.model`` beside the engine's target: same vocabulary (and the
    same tokens for the same ids where both have a tokenizer), its own KV pool and runner."""
    from graphplan.runtime import GraphRunner

    from ..hf_model import HFSpec

    target = engine.model
    spec = engine.spec
    dtype = getattr(spec, "dtype", None)
    draft_spec = HFSpec(
        model=config.model,
        max_model_len=target.cfg.max_model_len,
        dtype=dtype,
        random_weights=getattr(spec, "random_weights", False),  # then from the target's seed
        seed=getattr(spec, "seed", 0),
    )
    check_same_vocab(draft_spec, target, spec)
    table = draft_table(engine.table)
    model = draft_spec.build(table, engine.device)
    runner = GraphRunner(model, table, model.static_inputs(), device=engine.device, progress=False)
    runner.capture()
    return DraftModelProposer(model, runner, config.k, table.max_tokens, table.max_num_seqs)


def check_same_vocab(draft_spec: Any, target: Any, target_spec: Any) -> None:
    draft_spec.check()
    vocab = draft_spec.limits()["vocab_size"]
    if vocab != target.cfg.vocab_size:
        raise SpeculativeConfigError(
            f"--speculative-config.model {draft_spec.model}: vocab_size {vocab}, the target's is "
            f"{target.cfg.vocab_size}; a draft model needs the target's tokenizer"
        )
    mine = draft_spec.load_tokenizer()
    theirs = getattr(target, "tokenizer", None)
    if mine is None or theirs is None:
        return
    probe = list(range(0, vocab, max(1, vocab // 512)))
    if [mine.decode([i]) for i in probe] != [theirs.decode([i]) for i in probe]:
        raise SpeculativeConfigError(
            f"--speculative-config.model {draft_spec.model}: its tokenizer maps ids to other text "
            "than the target's; a draft model needs the target's tokenizer"
        )
