"""Speculative decoding (issue 36): a proposer drafts k tokens per decoding request, the target
scores the last token and the k drafts in one step (q = 1 + k tokens a request: the plan's
``scheduler.decode_query_len``, so a uniform step replays the table's q-multiple FULL graphs), and
acceptance commits 1..k+1 tokens. docs/speculative.md says what is built and what is not.

- ``config``: ``--speculative-config`` (vLLM's JSON spelling), checked against the plan.
- ``ngram``: prompt-lookup drafts (numpy, on the host).
- ``proposer``: the interface a proposer implements (EAGLE/MTP heads would plug in there).
- ``verify``: greedy acceptance and Leviathan et al. rejection sampling.
- ``batcher``: the continuous batcher's speculative commit (rollback of rejected KV slots).
- ``step``: the engine's speculative step (synchronous: no async scheduling).
"""
