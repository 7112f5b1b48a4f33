"""MEM: mixture-of-experts models count every expert (memory holds them all, however few a token uses): from the
config's shapes, with no transformers import, equal to the model transformers builds on the meta device and to
the published sizes."""
import json
import os
import sys

import pytest

from preflight.inputs import models
from test_mem import MODELS

# Published totals: Mixtral-8x7B 46.7B, Mixtral-8x22B 141B, Qwen1.5-MoE-A2.7B 14.3B, DeepSeek-V2-Lite 15.7B.
PUBLISHED = {"mixtral-8x7b-v0.1": 46.7e9, "mixtral-8x22b-v0.1": 141e9, "qwen1.5-moe-a2.7b": 14.3e9,
             "deepseek-v2-lite": 15.7e9}
# Shapes the published configs do not exercise: dense layers among sparse ones, a low-rank query, biases.
SMALL = {
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=24, decoder_sparse_step=2,
                      mlp_only_layers=[0], attention_bias=True),
    "qwen2_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_experts=4, num_attention_heads=4, num_key_value_heads=2,
                      mlp_only_layers=[1]),
    "deepseek_v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4,
                        n_shared_experts=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1,
                        n_group=1, topk_group=1, num_experts_per_tok=2),
    "deepseek_v2": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4,
                        n_shared_experts=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=2,
                        attention_bias=True, n_group=1, topk_group=1, num_experts_per_tok=2),
    "olmoe": dict(hidden_size=64, intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                  num_key_value_heads=2, eos_token_id=1, pad_token_id=0),
    "mixtral": dict(hidden_size=64, intermediate_size=32, num_local_experts=4, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=True),
}


def config_of(name):
    with open(os.path.join(MODELS, name, "config.json")) as handle:
        return json.load(handle)


def built_on_the_meta_device(config):
    import torch
    import transformers

    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    return (sum(p.numel() for p in built.parameters()),
            max(sum(p.numel() for p in m.parameters(recurse=False)) for m in built.modules()))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_expert_is_counted_from_the_config_as_published(name):
    model = models.resolve(os.path.join(MODELS, name))
    assert not model.estimated and "every expert" in model.how
    assert abs(model.params - PUBLISHED[name]) / PUBLISHED[name] < 0.01, model.params


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_moe_counts_equal_the_models_built_on_the_meta_device(name):
    pytest.importorskip("transformers")
    config = config_of(name)
    assert models.count_params(config)[:2] == built_on_the_meta_device(config)


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_dense_layers_low_rank_queries_and_biases_count_as_transformers_builds_them(kind):
    pytest.importorskip("transformers")
    config = dict(model_type=kind, num_hidden_layers=3, vocab_size=1000, **SMALL[kind])
    assert models.count_params(config)[:2] == built_on_the_meta_device(config)


def test_dbrx_counts_its_16_experts_as_published():
    """DBRX (databricks/dbrx-base, 132B in all: its shapes), from the config and as transformers builds it."""
    config = {"model_type": "dbrx", "d_model": 6144, "n_heads": 48, "n_layers": 40, "max_seq_len": 32768,
              "vocab_size": 100352, "attn_config": {"kv_n_heads": 8, "clip_qkv": 8, "rope_theta": 500000},
              "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4}}
    params, largest, how, estimated = models.count_params(config)
    assert abs(params - 132e9) / 132e9 < 0.01 and largest == 3 * 16 * 10752 * 6144 and not estimated
    built = models._on_meta_device(config)  # None without transformers
    assert built is None or built == (params, largest)


def test_the_moe_families_import_nothing(monkeypatch):
    monkeypatch.setattr(models, "_on_meta_device", lambda c: pytest.fail("built on the meta device"))
    for name in PUBLISHED:
        models.count_params(config_of(name))


def test_an_unknown_moe_family_is_estimated_with_every_expert(monkeypatch):
    monkeypatch.setattr(models, "_on_meta_device", lambda c: None)  # as without transformers
    config = dict(config_of("mixtral-8x7b-v0.1"), model_type="mixtral-unknown")
    params, largest, how, estimated = models.count_params(config)
    assert estimated and "E·3·h·I" in how
    assert abs(params - PUBLISHED["mixtral-8x7b-v0.1"]) / PUBLISHED["mixtral-8x7b-v0.1"] < 0.05


@pytest.mark.parametrize("field,value", [("decoder_sparse_step", 0), ("num_experts", 1e300), ("num_experts", -1),
                                         ("moe_intermediate_size", "1408"), ("mlp_only_layers", 7),
                                         ("shared_expert_intermediate_size", 10**12)])
def test_an_moe_config_whose_shapes_no_model_has_is_one_line(tmp_path, field, value):
    (tmp_path / "config.json").write_text(json.dumps(dict(config_of("qwen1.5-moe-a2.7b"), **{field: value})))
    with pytest.raises(models.InputError, match="config.json") as info:
        models.resolve(str(tmp_path))
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_deepseek_without_shared_experts_counts_the_routed_ones():
    config = dict(config_of("deepseek-v2-lite"), n_shared_experts=None)
    shared = 26 * 3 * 2048 * 1408 * 2  # the 26 MoE layers' 2 shared experts
    assert models.count_params(config)[0] == models.count_params(config_of("deepseek-v2-lite"))[0] - shared
