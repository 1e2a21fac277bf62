"""The parallel herding bound of the paper's herding simulation: how unevenly an order spreads the gradients."""
import torch


def parallel_herding_bound(z: torch.Tensor, orders: torch.Tensor, center: bool = True) -> float:
    """max over prefixes k of || sum_{t<=k} sum_j z[j, orders[j, t]] ||_inf.

    z: (n, m, d) worker j's m vectors; orders: (n, m) row j a permutation of range(m).
    With `center`, each worker's vectors are first centred on their mean (the paper's setting:
    every worker's m vectors sum to zero), so a perfectly balanced order scores near 0.
    """
    n, m, _ = z.shape
    if tuple(orders.shape) != (n, m):
        raise ValueError(f"orders must have shape {(n, m)}, got {tuple(orders.shape)}")
    z = z.double()
    if center:
        z = z - z.mean(dim=1, keepdim=True)
    ordered = torch.gather(z, 1, orders.to(z.device).long()[:, :, None].expand_as(z))
    prefix_sums = ordered.sum(dim=0).cumsum(dim=0)  # (m, d)
    return prefix_sums.abs().max().item()
