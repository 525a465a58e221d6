"""kai_fractions: make KAI Scheduler's NvFractions GPU shares real on the node."""

__version__ = "0.1.0"
