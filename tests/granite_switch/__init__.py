"""Granite Switch tests: a composed Switch checkpoint checked against granite-switch's HF model."""
