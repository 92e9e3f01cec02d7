"""Reversible segments: configuration and the plan-time numeric check."""
