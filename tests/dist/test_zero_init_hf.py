"""`rayzero.zero.Init` around Hugging Face models built from a config ([Note: Hugging Face models under
zero.Init]). The oracle is transformers itself, not rayzero: the same model built whole with
initialisation off (`no_init_weights`) and then `initialize_weights()`, the walk transformers'
own ZeRO-3 path replays, from the same seed. Partitioned over 2 ranks, every parameter and
buffer must equal it bitwise, ties must hold, and the engine's first loss must equal the
reference model's on the same batch. GPT-2 (Conv1D without reset_parameters, c_proj scaled by
the parent, tied head) and Llama (rotary buffers computed in __init__, RMSNorm)."""
from __future__ import annotations

import math

import pytest
import torch
from testkit.harness import spawn

pytestmark = pytest.mark.dist
transformers = pytest.importorskip("transformers")

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _model(kind: str):
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                          embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    return transformers.AutoModelForCausalLM.from_config(config)  # the way the HF guides build one


def _build(rank: int, world: int, kind: str) -> dict:
    import rayzero
    from rayzero.zero import GatheredParameters
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights

    torch.manual_seed(0)
    with no_init_weights():
        reference = _model(kind)
    if hasattr(reference, "initialize_weights"):
        reference.initialize_weights()
        reference.tie_weights()  # transformers' order (init_weights, from_config under ZeRO-3): init, then tie
    else:
        reference.init_weights()  # 4.x: apply(_initialize_weights), then tie
    torch.manual_seed(0)
    with rayzero.zero.Init(config=CONFIG):
        model = _model(kind)
    out: dict = {"mismatch": [], "tied": None}
    if kind == "gpt2":
        out["tied"] = model.lm_head.weight is model.transformer.wte.weight
        block = model.transformer.h[0]
        with GatheredParameters([block.attn.c_proj.weight, block.attn.c_attn.weight]):
            out["std"] = (float(block.attn.c_proj.weight.detach().std()), float(block.attn.c_attn.weight.detach().std()))
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        with GatheredParameters(param):
            if not torch.equal(param.detach(), expected[name].detach()):
                out["mismatch"].append(name)
    expected_buffers = dict(reference.named_buffers())
    for name, buffer in model.named_buffers():
        if not torch.equal(buffer, expected_buffers[name]):
            out["mismatch"].append(name)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    engine, *_ = rayzero.initialize(model=model, config=CONFIG)
    out["losses"] = (float(engine(input_ids=tokens, labels=tokens).loss),
                     float(reference(input_ids=tokens, labels=tokens).loss))
    engine.close()
    return out


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_zero_init_initialises_hf_models_as_transformers_does(kind):
    for rank, out in enumerate(spawn(2, _build, kind)):
        assert out["mismatch"] == [], f"rank {rank}: differ from transformers' own init: {out['mismatch']}"
        assert out["losses"][0] == pytest.approx(out["losses"][1], rel=1e-6), f"rank {rank}"
        if kind == "gpt2":
            assert out["tied"]
            c_proj, c_attn = out["std"]  # GPT-2's scheme, independent of both builds: 0.02 / sqrt(2 n_layer)
            assert c_attn == pytest.approx(0.02, rel=0.1)
            assert c_proj == pytest.approx(0.02 / math.sqrt(4), rel=0.1)


def _from_pretrained_inside(rank: int, world: int, path: str) -> str:
    import rayzero
    from rayzero.config.errors import RayZeroValueError

    try:
        with rayzero.zero.Init(config=CONFIG):
            transformers.GPT2LMHeadModel.from_pretrained(path)
    except (RayZeroValueError, RuntimeError) as error:  # 4.x re-raises it in "Error(s) in loading state_dict"
        return str(error)
    return "no error"


def test_from_pretrained_inside_zero_init_says_where_to_load(tmp_path):
    _model("gpt2").save_pretrained(tmp_path)
    # in a process of its own: transformers leaves its init switches off after an error mid-load
    message, = spawn(1, _from_pretrained_inside, str(tmp_path))
    assert "load the model outside the block" in message


class Scaled(transformers.PreTrainedModel):
    """_init_weights (transformers' default) initialises the Linear, not the model's own parameters."""
    config_class = transformers.PretrainedConfig

    def __init__(self, config, matrix: bool = False):
        super().__init__(config)
        self.proj = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.full((4, 4) if matrix else (4,), 3.0))
        self.post_init()


def test_a_vector_init_weights_leaves_alone_keeps_its_constructor_value():
    import rayzero
    from rayzero.zero import GatheredParameters

    with rayzero.zero.Init(config=CONFIG):
        model = Scaled(transformers.PretrainedConfig())
    with GatheredParameters([model.scale, model.proj.weight]):
        assert torch.equal(model.scale.detach(), torch.full((4,), 3.0))
        built = float(model.proj.weight.detach().std())
    # as a plain build initialises it: normal(0, 0.02) from 5.x's _init_weights, or 4.x's
    # no-op _init_weights leaving the Linear's own init (std ~0.29 here), never NaN or torch.empty
    plain = float(Scaled(transformers.PretrainedConfig()).proj.weight.detach().std())
    assert plain / 2 < built < plain * 2, (built, plain)


def test_a_matrix_init_weights_leaves_unset_is_named():
    import rayzero
    from rayzero.config.errors import RayZeroValueError

    with pytest.raises(RayZeroValueError, match=r"Scaled\.scale .*not set by the model's _init_weights"):
        with rayzero.zero.Init(config=CONFIG):
            Scaled(transformers.PretrainedConfig(), matrix=True)
