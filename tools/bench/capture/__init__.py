"""Capture benchmarks: is the captured training graph the user's model? (issue 21)"""
