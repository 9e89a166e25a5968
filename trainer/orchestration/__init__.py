"""Orchestration planner: per-module parallelism for the disaggregated pipeline, the monolithic
baseline, and a paper-scale simulation (labelled as such)."""
