"""Model shapes by name: the one registry of the published architectures the lessons count with.

SmolLM2-135M is the model this project runs; the others are shapes only (roofline calculations,
random-weight speed stand-ins: model.llama.published_model). ModelConfig has no default shape: a shape is
named here (ModelConfig.named("llama3-8b") looks it up in SHAPES) or read from a checkpoint
(minillm/loading/loader.py).
"""
from __future__ import annotations

import dataclasses

from .llama import ModelConfig
from .mla import MLAShape
from .moe import MoEShape

# HuggingFaceTB/SmolLM2-135M-Instruct's config.json (the GGUF this project loads carries the same numbers).
SMOLLM2_135M = ModelConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                           ffn_dim=1536, rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True)

# Published model shapes, from each model's config.json on the Hugging Face Hub (meta-llama/Llama-2-7b-hf,
# Llama-2-70b-hf, Meta-Llama-3-8B, Meta-Llama-3-70B, Llama-3.1-70B): hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, intermediate_size, vocab_size, max_position_embeddings.
LLAMA2_7B = ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
                        ffn_dim=11008, rope_theta=10000.0, max_seq_len=4096, tie_embeddings=False)
LLAMA2_70B = ModelConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                         ffn_dim=28672, rope_theta=10000.0, max_seq_len=4096, tie_embeddings=False)
LLAMA3_8B = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                        ffn_dim=14336, rope_theta=500000.0, max_seq_len=8192, tie_embeddings=False)
LLAMA3_70B = ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                         ffn_dim=28672, rope_theta=500000.0, max_seq_len=8192, tie_embeddings=False)
LLAMA31_70B = dataclasses.replace(LLAMA3_70B, max_seq_len=131072)    # same weights' shape, 128K context
# meta-llama/Llama-3.2-1B's config.json; its "llama3" RoPE frequency scaling is not modelled here (same
# shapes and cost; the values would differ, and these models are random-weight speed stand-ins)
LLAMA32_1B = ModelConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                         ffn_dim=8192, rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True)
PUBLISHED = {"llama2-7b": LLAMA2_7B, "llama3-8b": LLAMA3_8B, "llama3.2-1b": LLAMA32_1B}   # model.llama.published_model

# The interview cards' GPU-scale answers (lessons 01-03), from config.json on the Hugging Face Hub:
# meta-llama/Llama-2-13b-hf (MHA: 40 query and 40 KV heads) and Qwen/Qwen2.5-7B (GQA, 28 query and 4 KV heads, biases on q/k/v, untied LM head;
# 32K native context, its YaRN extension to 128K not modelled).
LLAMA2_13B = ModelConfig(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, head_dim=128,
                         ffn_dim=13824, rope_theta=10000.0, max_seq_len=4096, tie_embeddings=False)
QWEN25_7B = ModelConfig(vocab_size=152064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128,
                        ffn_dim=18944, rope_theta=1000000.0, max_seq_len=32768, tie_embeddings=False,
                        qkv_bias=True)
# Lesson 03's families table (issue 45). Qwen/Qwen3-8B's config.json and model card (36 layers, 32 query and 8
# KV heads of 128, QK-norm, no biases, untied; 8.2B parameters, 6.95B without the embeddings; 32K native
# context, YaRN to 128K not modelled). Mistral 7B (Jiang et al. 2023, arXiv 2310.06825, Table 1: dim 4096,
# 32 layers, head_dim 128, hidden_dim 14336, 32 heads, 8 KV heads, window 4096, context 8192, vocab 32000).
QWEN3_8B = ModelConfig(vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
                       ffn_dim=12288, rope_theta=1000000.0, max_seq_len=32768, tie_embeddings=False, qk_norm=True)
MISTRAL_7B = ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                         ffn_dim=14336, rope_theta=10000.0, max_seq_len=8192, tie_embeddings=False)
MISTRAL_7B_WINDOW = 4096        # tokens each layer attends back (the paper's W)

# Lesson 13 (DeepSeek's ideas), from config.json on the Hugging Face Hub. deepseek-ai/DeepSeek-V3: 61 layers of
# MLA (128 heads; q latent 1536, kv latent 512, 128 + 64 RoPE query/key widths, values 128), the first 3 dense
# (18432 wide), then 256 routed experts of 2048 (top 8 by sigmoid score, 8 groups of which 4 kept, x 2.5) and
# 1 shared; YaRN to 128K not modelled; its multi-token-prediction module (the checkpoint's layer 61) is not
# counted. deepseek-ai/DeepSeek-V2-Lite: 27 layers of MLA without a query latent (16 heads), the first dense
# (10944), then 64 experts of 1408 (top 6 by softmax, not renormalised) and 2 shared.
# mistralai/Mixtral-8x7B-v0.1: Mistral 7B's attention, 8 experts of 14336, top 2 by softmax.
DEEPSEEK_V3 = ModelConfig(vocab_size=129280, dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, head_dim=64,
                          ffn_dim=18432, rope_theta=10000.0, max_seq_len=163840, tie_embeddings=False, norm_eps=1e-6,
                          mla=MLAShape(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                       v_head_dim=128),
                          moe=MoEShape(n_experts=256, top_k=8, expert_ffn_dim=2048, router="sigmoid", n_shared=1,
                                       n_group=8, topk_group=4, routed_scale=2.5, first_dense=3))
DEEPSEEK_V2_LITE = ModelConfig(vocab_size=102400, dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, head_dim=64,
                               ffn_dim=10944, rope_theta=10000.0, max_seq_len=163840, tie_embeddings=False,
                               norm_eps=1e-6,
                               mla=MLAShape(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                                            qk_rope_head_dim=64, v_head_dim=128),
                               moe=MoEShape(n_experts=64, top_k=6, expert_ffn_dim=1408, router="softmax", n_shared=2,
                                            norm_topk=False, first_dense=1))
MIXTRAL_8X7B = ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                           ffn_dim=14336, rope_theta=1000000.0, max_seq_len=32768, tie_embeddings=False,
                           moe=MoEShape(n_experts=8, top_k=2, expert_ffn_dim=14336))


SHAPES = {"smollm2-135m": SMOLLM2_135M, "llama2-7b": LLAMA2_7B, "llama2-13b": LLAMA2_13B, "llama2-70b": LLAMA2_70B,
          "llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B, "llama3.1-70b": LLAMA31_70B, "llama3.2-1b": LLAMA32_1B,
          "qwen2.5-7b": QWEN25_7B, "qwen3-8b": QWEN3_8B, "mistral-7b": MISTRAL_7B, "deepseek-v3": DEEPSEEK_V3,
          "deepseek-v2-lite": DEEPSEEK_V2_LITE, "mixtral-8x7b": MIXTRAL_8X7B}

