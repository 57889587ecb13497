"""Optional integrations with other libraries; each needs its extra (e.g. `rayzero[hf]`)."""
