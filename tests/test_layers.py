"""Parameters group into numbered blocks and auxiliary layers."""

from ckptstore.layers import block_index, block_of, is_block, layer_of, ordered_layers


def test_a_parameter_belongs_to_the_block_up_to_its_first_number():
    assert layer_of("model.layers.7.mlp.up_proj.weight") == "model.layers.7"
    assert layer_of("transformer.h.11.attn.c_attn.bias") == "transformer.h.11"


def test_other_parameters_belong_to_their_parent_module():
    assert layer_of("model.embed_tokens.weight") == "model.embed_tokens"
    assert layer_of("model.norm.weight") == "model.norm"
    assert layer_of("lm_head.weight") == "lm_head"
    assert layer_of("scale") == "scale"


def test_blocks_and_auxiliary_layers_are_told_apart():
    assert is_block("model.layers.3") and block_index("model.layers.3") == 3
    assert not is_block("lm_head") and block_index("lm_head") is None


def test_layers_keep_the_module_order():
    names = ["embed.weight", "layers.0.a", "layers.0.b", "layers.1.a", "norm.weight"]
    assert ordered_layers(names) == ["embed", "layers.0", "layers.1", "norm"]


def test_each_expert_of_a_blocks_moe_layer_is_a_layer_of_its_own_inside_its_block():
    expert = "blocks.3.moe.deepspeed_moe.experts.deepspeed_experts.5"
    assert layer_of(f"{expert}.fc1.weight") == expert
    gate = "blocks.3.moe.deepspeed_moe.gate.wg.weight"
    assert layer_of(gate) == "blocks.3"  # the gate stays with its block
    assert block_of(expert) == "blocks.3" and is_block(expert) and block_index(expert) == 3
    names = ["blocks.3.fc.weight", f"{expert}.fc1.weight", "blocks.4.fc.weight"]
    assert ordered_layers(names) == ["blocks.3", expert, "blocks.4"]


def test_experts_of_a_moe_layer_outside_numbered_blocks_are_auxiliary_layers():
    expert = "moe.deepspeed_moe.experts.deepspeed_experts.2"
    assert layer_of(f"{expert}.fc2.bias") == expert
    assert not is_block(expert) and block_index(expert) is None
