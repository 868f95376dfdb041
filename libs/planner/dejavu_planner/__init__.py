"""DejaVu planner and simulator: how many machines for prompts and for tokens."""
