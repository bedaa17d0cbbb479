"""The engine's one configuration (minillm/config.py): LLM's keywords grouped, validated once, and
the very object every component reads."""
import pytest

from helpers import CharTokenizer
from minillm import LLM
from minillm.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from minillm.model.llama import random_model, tiny_config


def tiny_llm(**kwargs):
    return LLM(model=random_model(tiny_config(), seed=0), tokenizer=CharTokenizer(), device="cpu",
               max_model_len=256, **kwargs)


def test_flat_keywords_land_in_their_groups_and_round_trip():
    config = EngineConfig.from_kwargs(block_size=8, max_num_seqs=3, speculative_method="ngram",
                                      num_speculative_tokens=2, tensor_parallel_size=1, kv_cache_dtype="int8")
    assert config.cache == CacheConfig(block_size=8, kv_cache_dtype="int8")
    assert config.scheduler == SchedulerConfig(max_num_seqs=3)
    assert config.speculative == SpeculativeConfig("ngram", 2)
    assert config.parallel == ParallelConfig() and config.parallel.mode is None
    assert EngineConfig.from_kwargs(**config.to_kwargs()) == config
    assert config.replace(max_num_seqs=5).scheduler.max_num_seqs == 5 and config.scheduler.max_num_seqs == 3
    with pytest.raises(ValueError, match="'max_num_seq' is not an engine option; allowed: .*max_num_seqs"):
        EngineConfig.from_kwargs(max_num_seq=4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=0), "block_size = 0 is invalid"),
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype = 'int4' is not supported; allowed: 'auto', 'int8', 'fp8'"),
    (dict(prefix_cache="radix"), "prefix_cache = 'radix' needs enable_prefix_caching=True"),
    (dict(max_num_seqs=0), "max_num_seqs = 0 is invalid; allowed: an integer >= 1"),
    (dict(max_num_batched_tokens=True), "max_num_batched_tokens = True is invalid"),
    (dict(max_model_len=1), "max_model_len = 1 is invalid; allowed: an integer >= 2"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=128),
     "max_num_batched_tokens = 64 is smaller than max_model_len = 128"),
    (dict(speculative_method="medusa"), "speculative_method = 'medusa' is unknown"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens = 0 is invalid"),
    (dict(speculative_method="ngram", speculative_policy="greedy"), "speculative_policy = 'greedy' is unknown"),
    (dict(tensor_parallel_size=2, pipeline_parallel_size=2), "one of them > 1"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size = 0 is invalid"),
    (dict(tensor_parallel_size=2, quantization="int8"), "allowed with it: quantization=None"),
    (dict(pipeline_parallel_size=2, speculative_method="ngram"), "speculative_method=None"),
    (dict(tensor_parallel_size=2, attention_backend="flash"),
     "attention_backend = 'flash' with tensor/pipeline parallelism is not supported; allowed with it: 'sdpa'"),
    (dict(quantization="int3"), "quantization = 'int3' is not supported"),
    (dict(attention_backend="xformers"), "attention_backend = 'xformers' is not supported"),
    (dict(enforce_eager="yes"), "enforce_eager = 'yes' is invalid"),
    (dict(tune_kernels=1), "tune_kernels = 1; allowed: True or False"),
    (dict(num_kv_blocks=10, block_size=16, max_model_len=256), "num_kv_blocks = 10 is too small; allowed: an "
                                                               "integer >= 16"),
])
def test_every_bad_option_is_refused_by_the_config_before_anything_loads(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)
    with pytest.raises(ValueError, match=message):        # a missing checkpoint would fail later, in the load
        LLM(model="/nonexistent/model.gguf", **{"max_model_len": 256, **kwargs})


def test_the_engine_and_its_parts_read_the_llms_one_config():
    llm = tiny_llm(max_num_seqs=3, max_num_batched_tokens=96, block_size=8, num_kv_blocks=40,
                   enable_prefix_caching=True, prefix_cache="radix", tune_kernels=False)
    engine = llm.engine
    assert engine.config is llm.engine_config
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (3, 96)
    assert (engine.block_manager.block_size, engine.block_manager.num_blocks) == (8, 40)
    assert type(engine.block_manager.prefix_cache).__name__ == "RadixCache"
    assert engine.kv.k.shape[1:3] == (40, 8)
    with pytest.raises(ValueError, match="max_model_len = 4096 exceeds the model's context"):
        LLM(model=random_model(tiny_config(), seed=0), tokenizer=CharTokenizer(), device="cpu", max_model_len=4096)
