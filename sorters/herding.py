"""The parallel herding bound of the paper's herding simulation: how unevenly an order spreads the gradients."""
import torch


def parallel_herding_bound(z: torch.Tensor, orders: torch.Tensor, center: bool = True) -> float:
    """The parallel herding bound: max over prefixes k of || sum_{t<=k} sum_j z[j, orders[j, t]] ||_inf.

    Args:
        z: (n, m, d), worker j's m vectors in row j.
        orders: (n, m), row j worker j's order: unit ids in range(m), a permutation (SWR's rows repeat units:
            the bound is then that of the units visited, whose full sum need not be zero).
        center: first centre each worker's vectors on their mean (the paper's setting: every worker's m
            vectors sum to zero), so that a perfectly balanced order scores near 0.

    Returns:
        The bound, computed in float64.

    Raises:
        ValueError: `orders` is not of shape (n, m).

    Example:
        >>> z = torch.tensor([[[1.0], [-1.0]], [[2.0], [-2.0]]])
        >>> parallel_herding_bound(z, torch.tensor([[0, 1], [1, 0]]))
        1.0
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
