"""Operator plugins: which are installed (registry.py), running their hooks in a worker under
limits (hooks.py), and the supervised worker process of a job's sample hooks (host.py)."""
