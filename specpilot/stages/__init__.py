"""Stages of the tuning loop: one module per stage, each a plain function and a `specpilot stage` command."""
