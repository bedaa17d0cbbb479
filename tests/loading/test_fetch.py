"""Fetching "smollm2": offline with no cache is a clear error that says how to provide the file."""
import pytest

from minillm.loading import loader


def test_offline_without_cache_explains_how_to_provide_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")     # no local wheel folders
    monkeypatch.setenv("PIP_NO_INDEX", "1")                # and no index: as if offline
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(RuntimeError) as err:
        loader.fetch_smollm2()
    msg = str(err.value)
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in msg and "MINILLM_CACHE" in msg and "model=" in msg


def test_corrupted_cache_file_is_replaced(tmp_path, monkeypatch, smollm2_path):
    """A wrong checksum is never loaded: the file is fetched again (here: from a local copy)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / loader.SMOLLM2["file"]).write_bytes(b"not a model")
    monkeypatch.setenv("MINILLM_CACHE", str(cache))
    got = loader.fetch_smollm2()
    assert got.parent == cache and loader._sha256(got) == loader.SMOLLM2["sha256"]
    assert got.stat().st_size == loader.SMOLLM2["bytes"]        # the size the README quotes
