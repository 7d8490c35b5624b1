"""Structured outputs: constraints compiled into grammars, and the matchers that follow them.

The compiler runs in the scheduler's process (or the offline engine's), the matchers where
tokens are sampled (worker rank 0); both use xgrammar, which imports torch, so the API server
never imports this package.
"""
