"""GPTQ: the lazy block update is exact, it beats RTN on the layer objective, on held-out
activations of every linear of SmolLM2, and end to end on a tiny model."""
import pytest
import torch

from minillm.model.llama import random_model, tiny_config
from minillm.model.positions import rope_cos_sin
from minillm.quant import calibration_windows, int4, quantize_model, save_quantized, load_quantized
from minillm.quant.gptq import HessianAccumulator, gptq_quantize
from minillm.quant.linear import QuantLinear
from minillm.quant.sequential import SUBLAYER_GROUPS, capture_inputs


def _layer_problem(out_f=48, in_f=160, n=600, seed=0, dtype=torch.float64):
    """A weight and inputs with unequal channel scales and correlations (like real activations)."""
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(out_f, in_f, generator=gen, dtype=dtype)
    mix = torch.randn(in_f, in_f, generator=gen, dtype=dtype) / in_f ** 0.5 + torch.eye(in_f, dtype=dtype)
    X = torch.randn(n, in_f, generator=gen, dtype=dtype) @ mix * torch.rand(in_f, generator=gen, dtype=dtype) * 3
    return W, X


def _dequant(codes, s, z, perm, bits, group_size):
    return int4.dequantize(**int4.encode(codes, s, z, bits, False, perm), bits=bits, group_size=group_size)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [32, 128, 64])
def test_blocksize_1_and_128_give_the_same_codes(group_size, act_order):
    W, X = _layer_problem()
    H = 2 * X.T @ X / X.shape[0]
    one = gptq_quantize(W, H, group_size=group_size, blocksize=1, act_order=act_order)
    lazy = gptq_quantize(W, H, group_size=group_size, blocksize=128, act_order=act_order)
    for a, b in zip(one[:3], lazy[:3]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_beats_rtn_on_the_layer_objective(bits):
    W, X = _layer_problem(dtype=torch.float32)
    acc = HessianAccumulator(W.shape[1])
    for chunk in X.split(128):
        acc.add(chunk)
    assert torch.allclose(acc.hessian(), 2 * X.T @ X / X.shape[0], rtol=1e-4, atol=1e-3)
    Q = _dequant(*gptq_quantize(W, acc.hessian(), bits=bits, group_size=32, act_order=True), bits, 32)
    R = int4.fake_quantize(W, bits, 32)
    gptq_err = ((W - Q) @ X.T).pow(2).sum()
    rtn_err = ((W - R) @ X.T).pow(2).sum()
    assert gptq_err < 0.9 * rtn_err


def test_dead_inputs_get_zero_weight():
    W, X = _layer_problem(dtype=torch.float32)
    X[:, 7] = 0
    codes, s, z, _ = gptq_quantize(W, 2 * X.T @ X / len(X), group_size=32)
    assert (_dequant(codes, s, z, None, 4, 32)[:, 7] == 0).all()


def test_bad_blocksize():
    W, X = _layer_problem(dtype=torch.float32)
    with pytest.raises(ValueError, match="blocksize"):
        gptq_quantize(W, X.T @ X, group_size=32, blocksize=48)


def test_quantize_model_gptq_tiny_end_to_end(tmp_path):
    model = random_model(tiny_config(), seed=0)
    # 1024 calibration tokens: with fewer than ~5x the input width, H is poorly estimated and
    # GPTQ over-fits its calibration set (192 tokens here lose to RTN on held-out tokens)
    calib = torch.randint(0, 256, (16, 64), generator=torch.Generator().manual_seed(1))
    held_out = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(2))
    ref = model(held_out)
    rtn = quantize_model(random_model(tiny_config(), seed=0), "int4", group_size=32)
    quantize_model(model, "gptq", group_size=32, calibration_ids=calib)
    assert all(isinstance(m, QuantLinear) and "perm" in m.tensor_names
               for name, m in model.named_modules() if name.endswith(("wq", "w_down")))
    gptq_err = (model(held_out) - ref).pow(2).mean()
    assert gptq_err < (rtn(held_out) - ref).pow(2).mean()
    again = load_quantized(tiny_config(), save_quantized(model, tmp_path / "gptq.safetensors"))
    assert torch.equal(again(held_out), model(held_out))


@torch.no_grad()
def test_smollm2_linears_gptq_error_at_most_rtn_on_held_out_activations(llm):
    """For every linear of blocks 0 and 10 (14 of the 210: blocks 0, 10, 20, 29 passed too but took
    7 minutes on the shared 2-core CPU; the benchmark covers the whole model): H from 8 calibration
    windows of 512 tokens, error ||W X - Q X||^2 on a held-out window of the evaluation text,
    both 4-bit asymmetric g128 with the same quantiser. Activations are the full-precision
    model's (the blocks in between only run forward)."""
    from minillm.evaluate import evaluation_text

    model, tok = llm.model, llm.get_tokenizer()
    # 4096 tokens: with 1536 (3 x 512), about one token per input of w_down, H is estimated so
    # poorly that GPTQ over-fits and lost to RTN on block 10's w_down (7487 vs 7067) in our run
    calib = calibration_windows(tok, n_windows=8, window=512)                     # (8, 512)
    held = torch.tensor([tok.encode(evaluation_text())[:512]])                    # (1, 512)
    cos, sin = rope_cos_sin(torch.arange(512), model.cfg.head_dim, model.cfg.rope_theta)
    h_cal, h_held = model.embed(calib), model.embed(held)
    names = [n for group in SUBLAYER_GROUPS for n in group]
    worse = []
    for i, block in enumerate(model.layers):
        if i > 10:
            break
        if i not in (0, 10):
            h_cal, h_held = block(h_cal, cos, sin), block(h_held, cos, sin)
            continue
        acc = {n: HessianAccumulator(block.get_submodule(n).in_features) for n in names}
        held_x = {}
        h_cal_next = capture_inputs(block, names, h_cal, cos, sin, lambda n, x: acc[n].add(x))
        h_held_next = capture_inputs(block, names, h_held, cos, sin, lambda n, x: held_x.setdefault(n, x[0]))
        for n in names:
            W = block.get_submodule(n).weight                                      # (O, I)
            Q = _dequant(*gptq_quantize(W, acc[n].hessian(), bits=4, group_size=128, act_order=True), 4, 128)
            R = int4.fake_quantize(W, 4, 128)
            X = held_x[n].reshape(-1, W.shape[1])                                  # (512, I)
            gptq_err, rtn_err = ((W - Q) @ X.T).pow(2).sum(), ((W - R) @ X.T).pow(2).sum()
            if gptq_err > rtn_err:
                worse.append((i, n, gptq_err.item(), rtn_err.item()))
        h_cal, h_held = h_cal_next, h_held_next
    assert not worse, worse
