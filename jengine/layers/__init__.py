"""Model building blocks: pure functions of (weights, activations)."""
