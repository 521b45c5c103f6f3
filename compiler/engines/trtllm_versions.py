"""TensorRT-LLM releases and the default ``cuda_graph_config`` list each one generates.

``--engine-version`` takes a release as TensorRT-LLM tags it (``1.0``, ``1.2.0``, ``1.3.0rc13``,
``v1.1.0rc0``) or ``main``; the default is the newest rule. The list generator changed twice
(``compiler.sizes.trtllm_generated`` holds the three rules). Each boundary below was read in
``tensorrt_llm/llmapi/llm_args.py`` as rendered in the release's own API docs (NVIDIA/TensorRT-LLM
``gh-pages``: ``<release>/_modules/tensorrt_llm/llmapi/llm_args.html``, gh-pages commit given) and
on ``main`` (commit 00043967):

- ``pow2-floor``: 1.0.0 (gh-pages 090dc649), powers of two ``2**i`` for ``i`` in
  ``range(8, floor(log2(max)))``.
- ``pow2-ceil``: 1.1.0rc0 (59331372), 1.1.0 (8660c119), 1.2.0 (7e873e54), 1.3.0rc11 (828c4111):
  ``range(8, ceil(log2(max)))``.
- ``step64``: 1.3.0rc13 (0fa00422), 1.3.0rc20 (f67b8b96), 1.3.0rc24 (32b086cd), main (00043967):
  the padded list steps by 64 after 128 (PR #12895, merged 2026-04-24); unpadded stays
  ``pow2-ceil``.

1.3.0rc12 has no rendered ``llm_args`` in the index: it is read with the rule of the last release
verified before it (``pow2-ceil``), and import says so.
"""

from __future__ import annotations

import re

from . import flags as F

VERSIONS = {
    "1.0": "TensorRT-LLM 1.0.x: powers of two from 256 below 2**floor(log2 max)",
    "1.1": "1.1.0rc0 .. 1.1.x: powers of two from 256 below 2**ceil(log2 max)",
    "1.2": "1.2.x: as 1.1",
    "1.3": "1.3.0rc13 and later 1.3: the padded list steps by 64 after 128 (PR #12895)",
    "main": "TensorRT-LLM main (commit 00043967): as 1.3",
}
DEFAULT_VERSION = "main"
RULE_TEXT = {
    "pow2-floor": "powers of two below 2**floor(log2 max)",
    "pow2-ceil": "powers of two below 2**ceil(log2 max)",
    "step64": "steps of 64 after 128 when padded",
}
_RELEASE = re.compile(r"v?(\d{1,3})\.(\d{1,3})(?:\.(\d{1,3}))?(?:rc(\d{1,3}))?")
_FINAL = 10**6  # a release without rc sorts after all its rcs
_FIRST_CEIL = (1, 1, 0, 0)
_FIRST_STEP64 = (1, 3, 0, 13)
_UNVERIFIED = {(1, 3, 0, 12)}
_NEWEST_VERIFIED = (1, 4, 0, 1)  # 1.4.0rc1's docs render the step64 config classes


def _key(version: str) -> tuple[int, int, int, int] | None:
    m = _RELEASE.fullmatch(version)
    if not m:
        return None
    major, minor, patch, rc = m.groups()
    return int(major), int(minor), int(patch or 0), int(rc) if rc is not None else _FINAL


def check_version(version: str | None) -> str:
    """The release named by ``--engine-version`` (default: ``main``), or a located error."""
    v = (version or DEFAULT_VERSION).strip()
    if v == "main":
        return v
    key = _key(v)
    if key is None or key < (1, 0, 0, 0):
        raise F.input_error(
            "<trtllm>",
            "unknown-engine-version",
            f"TensorRT-LLM version {v!r} is not one graphplan reads",
            "name a release 1.0 or later as tagged (1.0, 1.2.0, 1.3.0rc13) or main; "
            "docs/engines.md lists the rules",
        )
    return v.lstrip("v")


def size_rule(version: str) -> str:
    """Which of ``compiler.sizes.TRTLLM_RULES`` a (checked) release generates its list with."""
    if version == "main":
        return "step64"
    key = _key(version)
    assert key is not None  # check_version accepted it
    if key < _FIRST_CEIL:
        return "pow2-floor"
    return "pow2-ceil" if key < _FIRST_STEP64 else "step64"


def rule_note(version: str) -> str:
    """Why the rule for ``version`` is assumed rather than read, or ``""``."""
    key = None if version == "main" else _key(version)
    if key in _UNVERIFIED:
        return (
            f"TensorRT-LLM {version}'s list rule was not verified (1.3.0rc11 uses "
            "powers of two, 1.3.0rc13 steps of 64); read as powers of two"
        )
    if key is not None and key > _NEWEST_VERIFIED:
        return f"TensorRT-LLM {version} is newer than graphplan verified; read with main's rule"
    return ""
