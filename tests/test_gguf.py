"""Our dequantisation of GGUF blocks is bit-for-bit the gguf package's."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from minillm.gguf_file import dequantize, read_gguf


def test_every_tensor_of_the_real_file_bit_exact(smollm2_path):
    reader = GGUFReader(str(smollm2_path))
    ours = read_gguf(smollm2_path)
    seen_types = set()
    for t in reader.tensors:
        ref = gguf_dequantize(t.data, t.tensor_type)
        mine = ours.tensors[t.name].to_float32()
        assert mine.shape == ref.shape, t.name
        assert np.array_equal(mine.view(np.uint32), ref.view(np.uint32)), t.name
        seen_types.add(t.tensor_type.name)
    assert len(reader.tensors) == 272
    assert seen_types == {"Q4_1", "Q8_0", "F32"}


@pytest.mark.slow                                       # the peer library (gguf) quantises
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32"])
def test_each_supported_format_bit_exact_on_random_data(qtype):
    """The real file has no Q4_0/F16/BF16 tensors: quantise random data with gguf and compare."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 256)) * 3).astype(np.float32)
    t = GGMLQuantizationType[qtype]
    raw = gguf_quantize(x, t)
    ref = gguf_dequantize(raw, t)
    mine = dequantize(raw, int(t), x.shape)
    assert np.array_equal(mine.view(np.uint32), ref.astype(np.float32).view(np.uint32))
    if qtype in ("Q4_0", "Q4_1"):   # 4 bits really lose something: the test data is not trivial
        assert np.abs(mine - x).max() > 1e-3


def test_unsupported_type_is_a_clear_error():
    with pytest.raises(ValueError, match="not supported; supported: F32"):
        dequantize(np.zeros(64, np.uint8), 12, (1, 256))  # Q4_K


def test_metadata_matches_the_published_config(smollm2_path):
    meta = read_gguf(smollm2_path).metadata
    assert meta["llama.block_count"] == 30 and meta["llama.embedding_length"] == 576
    assert meta["llama.attention.head_count"] == 9 and meta["llama.attention.head_count_kv"] == 3
    assert meta["llama.rope.freq_base"] == 100000.0
    assert meta["tokenizer.ggml.bos_token_id"] == 1 and meta["tokenizer.ggml.eos_token_id"] == 2
