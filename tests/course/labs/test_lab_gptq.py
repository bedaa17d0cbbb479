"""Lab gptq: the Hessian accumulator and the inverse-Hessian factor on their own."""
import torch

from minillm.quant.gptq import HessianAccumulator, inverse_hessian_factor


def test_hessian_is_2_xtx_over_n():
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(2, 7, 12, generator=g), torch.randn(5, 12, generator=g), torch.randn(1, 1, 12, generator=g)]
    acc = HessianAccumulator(12)
    for x in chunks:
        acc.add(x)
    X = torch.cat([x.reshape(-1, 12) for x in chunks])                  # (20, 12)
    assert acc.count == 20
    assert torch.allclose(acc.hessian(), 2 * X.T @ X / 20, rtol=1e-5, atol=1e-5)


def test_inverse_hessian_factor():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(40, 16, generator=g, dtype=torch.float64)
    H = 2 * X.T @ X / 40
    before = H.clone()
    U = inverse_hessian_factor(H, damp=0.01)
    assert torch.equal(H, before), "the caller's H must not change"
    assert torch.equal(U, U.triu()), "the factor is upper triangular"
    damped = H + 0.01 * H.diagonal().mean() * torch.eye(16, dtype=torch.float64)
    assert torch.allclose(U.T @ U, torch.linalg.inv(damped), rtol=1e-8, atol=1e-10)
    assert (U.diagonal() > 0).all()
