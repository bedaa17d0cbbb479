"""Our GGUF reader and dequantisation of its blocks are bit-for-bit the gguf package's."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from minillm.loading.gguf_file import dequantize, read_gguf


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


def _peer_value(field):
    """A GGUFReader field as a Python value, read through the peer's own parts and indices."""
    parts = [field.parts[i] for i in field.data]
    as_python = (lambda p: bytes(p).decode("utf-8", errors="replace")) if field.types[-1] == GGUFValueType.STRING \
        else (lambda p: p.tolist()[0])
    values = [as_python(p) for p in parts]
    return values if field.types[0] == GGUFValueType.ARRAY else values[0]


def test_metadata_and_tensor_table_equal_the_gguf_packages(smollm2_path):
    peer = GGUFReader(str(smollm2_path))
    ours = read_gguf(smollm2_path)
    expected = {k: _peer_value(f) for k, f in peer.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert list(ours.tensors) == [t.name for t in peer.tensors]
    for t in peer.tensors:
        mine = ours.tensors[t.name]
        assert mine.shape == tuple(reversed(t.shape.tolist())) and mine.ggml_type == int(t.tensor_type), t.name
        assert np.array_equal(mine.raw, t.data.reshape(-1).view(np.uint8)), t.name


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path, smollm2_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(bad)
    bad.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="GGUF version 7; supported: 2, 3"):
        read_gguf(bad)
    bad.write_bytes(smollm2_path.read_bytes()[:1_000_000])             # the header, then the download stopped
    with pytest.raises(ValueError, match="truncated or damaged"):
        read_gguf(bad)
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        read_gguf(tmp_path / "missing.gguf")
