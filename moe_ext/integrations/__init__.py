"""Adapters that put the fused MoE into existing model code."""
