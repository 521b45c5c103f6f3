"""Turn a Route into its reason chain: the sentences ``plan explain`` prints. Plain Python."""

from __future__ import annotations

from .records import RuntimeMode, Why, decode_token_range


def _batch_sentence(t, n, r, mql, uniform) -> str:
    shape = f"{n} tokens"
    if r is not None:
        shape += f", {r} requests"
    if mql is not None:
        shape += f", max_query_len {mql}"
    if uniform:
        return f"batch: {shape} -> uniform decode (every request has q={t.q} tokens)"
    if r is None or mql is None:
        return f"batch: {shape} -> mixed (give --reqs and --query-len to test uniform decode)"
    return (
        f"batch: {shape} -> mixed (uniform decode needs max_query_len == q={t.q} "
        f"and num_tokens == q * num_reqs)"
    )


def _mixed_hint(res) -> str:
    """A change that would give mixed batches graphs."""
    if res.splitting_ops:
        return (
            "mode FULL_AND_PIECEWISE would replay PIECEWISE graphs for them "
            "(attention runs eager between pieces)"
        )
    return (
        "give them graphs with mode FULL_AND_PIECEWISE and cudagraph.splitting_ops: "
        "[attention], or mode FULL if attention_support is ALWAYS"
    )


def route_reasons(route, ctx) -> tuple[str, ...]:
    """The reason chain of ``route``; ``ctx`` is its RouteContext (what was asked)."""
    t, n, r, mql, uniform, pad_to = (
        ctx.table,
        ctx.num_tokens,
        ctx.num_reqs,
        ctx.max_query_len,
        ctx.uniform,
        ctx.pad_to,
    )
    out = [_batch_sentence(t, n, r, mql, uniform)]
    res = t.settings
    if res.lora_enabled:
        out.append(
            f"LoRA: {ctx.num_active_loras} active adapter(s) -> captured case "
            f"num_active_loras={res.lora_cases[ctx.lora_case]}"
        )
    ub = res.ubatch
    if ub.enabled:
        thr = ub.decode_token_threshold if uniform else ub.prefill_token_threshold
        kind = "decode" if uniform else "prefill"
        verdict = "wants" if route.wants_ubatch else "does not want"
        out.append(
            f"ubatch: {n} tokens vs {kind} threshold {thr} -> {verdict} to micro-batch "
            "(DP ranks agree before it happens)"
        )
    why, g = route.why, route.graph
    largest = t.capture_sizes[-1] if t.capture_sizes else 0
    if pad_to is not None and pad_to != n:
        out.append(f"DP: the ranks agreed on {pad_to} tokens, so this rank pads {n} -> {pad_to}")
    if g is not None:
        at = n if pad_to is None else pad_to
        out.append(f"pad: {at} -> {g.num_tokens} tokens (smallest capture size >= {at})")
    if why == Why.FULL_DECODE:
        out.append(
            f"FULL decode graph #{route.graph_id}: key ({g.num_tokens} tokens, "
            f"{g.num_reqs} requests, uniform)"
        )
    elif why == Why.FULL_UBATCHED:
        out.append(
            f"FULL ubatched decode graph #{route.graph_id}: {g.num_ubatches} micro-batches "
            f"over {g.num_tokens} tokens"
        )
    elif why == Why.FULL_MIXED:
        extra = " (routines are not separate, so uniform batches use it too)" if uniform else ""
        out.append(
            f"FULL graph #{route.graph_id}: key ({g.num_tokens} tokens, up to "
            f"{g.num_reqs} requests){extra}"
        )
    elif why == Why.PIECEWISE:
        if uniform and res.decode_mode is RuntimeMode.FULL and res.separate_routines:
            decode = decode_token_range(t.q, t.max_num_seqs)
            out.append(
                f"no FULL decode graph at {g.num_tokens} tokens (decode graphs cover "
                f"q..q*max_num_seqs = {decode.start}..{decode[-1]} among the capture sizes)"
            )
        out.append(
            f"PIECEWISE graph #{route.graph_id}: relaxed key ({g.num_tokens} tokens, any "
            f"request count); attention runs eager with the real {n} tokens"
        )
    elif why == Why.NO_GRAPHS:
        out.append(
            f"eager: the plan captures no graphs (resolved mode {res.mode.name}, "
            f"{len(t.capture_sizes)} capture sizes)"
        )
    elif why == Why.TOO_BIG and not uniform and res.mixed_mode is RuntimeMode.NONE:
        out.append(
            f"eager: mixed batches always run eager in mode {res.mode.name} (its mixed "
            f"routine is NONE), whatever the capture sizes; {_mixed_hint(res)}"
        )
    elif why == Why.TOO_BIG:
        out.append(
            f"eager: {route.padded_tokens} tokens exceed the largest capture size "
            f"{largest} (add sizes up to {route.padded_tokens}, e.g. a higher preset "
            "ceiling; sizes stop at scheduler.max_num_batched_tokens)"
        )
    elif why == Why.MIXED_NONE:
        out.append(
            f"eager: the mixed routine is NONE in mode {res.mode.name} and no FULL decode "
            f"graph fits this batch; {_mixed_hint(res)}"
        )
    elif why == Why.NO_TWIN:
        out.append(
            "eager: this size is captured only ubatched and "
            "parallel.ubatch.plain_twins is false, so a batch that does not "
            "micro-batch has no graph"
        )
    elif why == Why.NO_UBATCH_GRAPH:
        out.append(
            "eager: no ubatched graph at this size (ubatched FULL graphs exist for "
            "uniform-decode sizes at or above parallel.ubatch.decode_token_threshold, "
            "when decode graphs are FULL); the micro-batches run eagerly"
        )
    elif why == Why.UBATCH_MIXED:
        out.append(
            "eager: ubatched graphs exist only for uniform-decode batches; micro-batches "
            "of a mixed batch run eagerly"
        )
    elif why == Why.NOT_ALLOWED:
        out.append(
            "eager: no graph of the allowed mode exists for this batch (DP ranks agreed "
            "on a weaker mode, or none was captured for this key)"
        )
    return tuple(out)
