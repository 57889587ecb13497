"""Training-loop shapes people write, at module level as in their own scripts (issue 13 item 1).

This module is not installed, so `rayzero.fit` ships it by value, as it does a user's script: the
module-level alias of torch.distributed, the HF config and the tokenizer below are exactly what
plain cloudpickle failed on ("cannot pickle 'ConfigModuleInstance'" / "'_Ops' object").
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

import rayzero

HF_CONFIG = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                       bos_token_id=0, eos_token_id=0)
_VOCAB = {"[UNK]": 0, "hello": 1, "ray": 2, "zero": 3}
_BACKEND = Tokenizer(WordLevel(_VOCAB, unk_token="[UNK]"))
_BACKEND.pre_tokenizer = Whitespace()
TOKENIZER = PreTrainedTokenizerFast(tokenizer_object=_BACKEND, unk_token="[UNK]")
LOCK = threading.Lock()  # a module-level object that truly cannot be pickled


def dist_alias_loop(config):
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    rayzero.report({"step": 0, "sum": total.item(), "world": dist.get_world_size()})


def torch_ops_loop(config):
    value = torch.ops.aten.add.Tensor(torch.tensor([1.0]), torch.tensor([2.0]))
    rayzero.report({"step": 0, "value": value.item()})


def hf_model_loop(config):
    model = GPT2LMHeadModel(HF_CONFIG)
    engine, _, _, _ = rayzero.initialize(model=model)  # the run's config, model autos from model.config
    ids = torch.randint(0, HF_CONFIG.vocab_size, (2, 8))
    loss = engine(ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    rayzero.report({"step": 0, "hidden": model.config.hidden_size, "loss": loss.item(),
                    "reduce_bucket_size": engine.config.zero_optimization.reduce_bucket_size})


def tokenizer_loop(config):
    rayzero.report({"step": 0, "ids": TOKENIZER("hello ray zero")["input_ids"]})


def locked_loop(config):
    with LOCK:
        rayzero.report({"step": 0})
