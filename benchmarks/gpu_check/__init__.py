"""The GPU check (bash scripts/gpu_check.sh runs run.py): context.py is what a step works with, steps.py the steps."""
