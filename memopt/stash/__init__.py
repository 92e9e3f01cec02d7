"""Exact forward with a K-bit stash for backward."""
