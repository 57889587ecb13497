"""`deepspeed.checkpoint` (rayzero)."""
