"""The demo job: a small GPT-style character language model trained with the public rayzero API.

`rayzero demo` (rayzero/driver/demo.py) runs `train.train_loop` on Ray workers; the same loop runs
under torchrun (bench/runtime.py compares the two).
"""
