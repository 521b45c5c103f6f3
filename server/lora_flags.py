"""vLLM's LoRA serving flags on graphplan-serve (``--lora-modules``, ``--max-loras``,
``--max-lora-rank``): server/core/lora_serving.py checks them against the plan's ``lora`` block."""

from __future__ import annotations

import argparse

from .core.lora_serving import parse_module


def add_lora_flags(p: argparse.ArgumentParser, positive_int) -> None:
    """vLLM's LoRA flags; the plan's ``lora`` block decides whether graphs carry LoRA kernels."""

    def module(text: str) -> tuple[str, str]:
        try:
            return parse_module(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    p.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=module,
        metavar="NAME=DIR",
        help="--model: LoRA adapters (PEFT directories) loaded at start; a request's model "
        "field picks one by NAME. Needs a plan with lora.enabled",
    )
    p.add_argument(
        "--max-loras",
        type=positive_int,
        help="--model: adapter slots on the device (default and at most: the plan's "
        "lora.max_loras)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=positive_int,
        help="--model: the highest adapter rank served (default 16; at most 512)",
    )


def lora_flags(a: argparse.Namespace) -> list[tuple[str, object]]:
    return [
        ("--lora-modules", a.lora_modules),
        ("--max-loras", a.max_loras),
        ("--max-lora-rank", a.max_lora_rank),
    ]
