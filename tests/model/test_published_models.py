"""Random-weight models of published shapes, made on the device they run on (model.published_model)."""
import pytest
import torch

from minillm.model.llama import published_model, random_model_on, tiny_config
from minillm.perf import roofline


@pytest.mark.parametrize("name, billions", [("llama2-7b", 6.74), ("llama3-8b", 8.03), ("llama3.2-1b", 1.24)])
def test_published_shapes_have_their_published_sizes(name, billions):
    model = published_model(name, device="meta")                  # shapes only, no memory
    count = sum(p.numel() for p in model.parameters())
    assert count == roofline.PUBLISHED[name].num_parameters()
    assert count / 1e9 == pytest.approx(billions, abs=0.01)       # as the Hugging Face Hub lists them
    assert next(model.parameters()).dtype == torch.bfloat16


def test_weights_are_made_on_the_device_in_the_dtype_and_run():
    cfg = tiny_config()
    model = random_model_on(cfg, device="cpu", dtype=torch.bfloat16, seed=3)
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in model.parameters())
    w = model.layers[0].attn.wq.weight.float()
    assert w.std().item() == pytest.approx(cfg.dim ** -0.5, rel=0.1)
    logits = model(torch.randint(0, cfg.vocab_size, (1, 8)))
    assert logits.shape == (1, 8, cfg.vocab_size) and torch.isfinite(logits).all()
    again = random_model_on(cfg, device="cpu", dtype=torch.bfloat16, seed=3)
    assert torch.equal(again.layers[0].attn.wq.weight, model.layers[0].attn.wq.weight)   # seeded


def test_unknown_shape_is_refused():
    with pytest.raises(ValueError, match="unknown model shape 'llama-9b'; allowed: 'llama2-7b'"):
        published_model("llama-9b", device="meta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_1b_shape_is_made_straight_on_the_gpu():
    model = published_model("llama3.2-1b", device="cuda")
    assert all(p.is_cuda for p in model.parameters())
