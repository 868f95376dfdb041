"""The worker lifecycle shared by prompt and token workers."""
