"""Node enforcement engine: inventory, the pure node plan and the enforcers that apply it."""
