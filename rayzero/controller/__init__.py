"""rayzero.controller: the run's state machine, its failure policy, and the worker group it drives."""
