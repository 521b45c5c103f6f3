"""Data parallelism: DP peers agree on each step's route (``agreement``), a DP rank steps its
runner through that agreement (``runner``), and micro-batches split a step in two (``ubatch``)."""

from .agreement import DPCoordinator, DPDecision, DPError, DPTimeoutError, agree, contribution
from .runner import DPRunner

__all__ = [
    "DPCoordinator",
    "DPDecision",
    "DPError",
    "DPTimeoutError",
    "DPRunner",
    "agree",
    "contribution",
]
