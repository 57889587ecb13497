"""Which modules `engine.compile` compiles one by one at stage 3 (`find_regions`), and the
arguments of DeepSpeed's signature it refuses, each named with its fix ([Note: compiling stage 3]
in rayzero/engine/compile.py). No process group: nothing here reaches an engine."""
from __future__ import annotations

import pytest
import torch

from rayzero.config.errors import RayZeroValueError
from rayzero.engine.compile import compile_engine, find_regions


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)


class Model(torch.nn.Module):
    """A short list of big blocks beside a longer list of small ones, and a list of mixed classes."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(5))  # 5 modules
        self.blocks = torch.nn.ModuleList(Block(4) for _ in range(3))  # 9 modules
        self.mixed = torch.nn.ModuleList([Block(4), torch.nn.Linear(4, 4), Block(4), Block(4)])  # 11, mixed


def test_default_regions_are_the_children_of_the_largest_list_of_one_class():
    model = Model()
    assert find_regions(model, None) == list(model.blocks)
    assert find_regions(torch.nn.Sequential(torch.nn.Linear(2, 2)), None) == []


def test_regions_by_name_module_or_class_in_the_order_given_without_repeats():
    model = Model()
    chosen = find_regions(model, ["heads.1", model.blocks[0], Block])
    assert chosen == [model.heads[1], model.blocks[0], model.blocks[1], model.blocks[2], model.mixed[0],
                      model.mixed[2], model.mixed[3]]


@pytest.mark.parametrize("spec, words", [
    ("blocks.7", "no module named 'blocks.7'"),
    (torch.nn.Conv1d, "no Conv1d module"),
    (torch.nn.Linear(4, 4), "not part of the model"),
    (3, "give module names, modules or module classes"),
])
def test_a_region_that_is_not_in_the_model_is_refused_by_name(spec, words):
    with pytest.raises(RayZeroValueError, match="engine.compile\\(regions=") as error:
        find_regions(Model(), [spec])
    assert words in str(error.value)


def test_deepcompile_schedules_and_compiled_autograd_are_refused_naming_the_argument():
    with pytest.raises(RayZeroValueError, match="schedule=.*DeepCompile.*drop schedule="):
        compile_engine(None, "inductor", {}, [(0, ["zero3"])], False, None)
    with pytest.raises(RayZeroValueError, match="compiled_autograd_enabled=True.*drop the flag"):
        compile_engine(None, "inductor", {}, None, True, None)
