"""Command-line tools: ``hpcdp-info``, ``hpcdp-bench``."""
