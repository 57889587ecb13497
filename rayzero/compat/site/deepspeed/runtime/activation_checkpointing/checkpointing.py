"""`deepspeed.checkpointing` (rayzero): rayzero.checkpointing, DeepSpeed's activation checkpointing API."""
from rayzero.checkpointing import *
