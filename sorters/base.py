"""The sorter interface and the bookkeeping every balancing sorter shares.

Notation (the authors' code, not the paper): `n` workers, each owning `m` local ordering units
(examples, bptt chunks, windows, token blocks), `d` model parameters. An epoch visits positions
0..m-1; at position t worker j uses its local unit `orders[j, t]`.
"""
import torch


class Sorter:
    """Produces each worker's order of its m local units, one epoch at a time.

    Usage per epoch::

        orders = sorter.sort()                # (n, m) LongTensor, row j a permutation of range(m)
        for positions in consecutive chunks:  # LongTensor (k,), e.g. tensor([t, t+1, ..., t+k-1])
            sorter.step(grads, positions)     # grads: (n, k, d), worker j's gradient of the unit at
                                              # epoch position positions[i] is grads[j, i]

    `step` must see every position 0..m-1 exactly once per epoch, in increasing order (the last
    chunk may be shorter). Sorters whose `uses_grads` is False ignore `grads` (pass None).
    """

    name = "base"
    uses_grads = False

    def __init__(self, n_workers: int, m: int, d: int, seed: int = 0, device="cpu"):
        if n_workers < 1 or m < 1 or d < 1:
            raise ValueError(f"{self.name}: need n_workers, m, d >= 1, got {n_workers}, {m}, {d}")
        self.n, self.m, self.d = n_workers, m, d
        self.device = torch.device(device)
        self.generator = torch.Generator().manual_seed(seed)
        self.orders = self._random_orders()
        self.epoch = 0
        self._next_position = 0

    def _random_orders(self) -> torch.Tensor:
        """(n, m) independent uniform permutations, one per worker, from the sorter's generator."""
        rows = [torch.randperm(self.m, generator=self.generator) for _ in range(self.n)]
        return torch.stack(rows).to(self.device)

    def sort(self) -> torch.Tensor:
        """Start an epoch; return the (n, m) orders to use in it (a copy)."""
        if self._next_position not in (0, self.m):
            raise ValueError(f"{self.name}: the epoch ended after {self._next_position} of {self.m} "
                             "positions; step() must see every position once per epoch")
        self.orders = self._next_epoch_orders()
        self.epoch += 1
        self._next_position = 0
        return self.orders.clone()

    def _next_epoch_orders(self) -> torch.Tensor:
        return self.orders

    def step(self, grads, positions) -> None:
        """Record the gradients of the units just used. grads: (n, k, d); positions: (k,)."""
        self._next_position += self._check_positions(positions).numel()

    def _check_positions(self, positions) -> torch.Tensor:
        """Check that `positions` continue the epoch; return them as a CPU LongTensor (k,).
        The caller advances `_next_position` once the whole step is known to be valid."""
        positions = torch.as_tensor(positions, dtype=torch.long).cpu().reshape(-1)
        k = positions.numel()
        expected = torch.arange(self._next_position, self._next_position + k)
        if k == 0 or self._next_position + k > self.m or not torch.equal(positions, expected):
            raise ValueError(f"{self.name}: expected positions {self._next_position}..."
                             f"{min(self._next_position + max(k, 1), self.m) - 1} of {self.m}, "
                             f"got {positions.tolist()[:8]}")
        return positions

    def _check_grads(self, grads, k: int) -> torch.Tensor:
        if grads is None or tuple(grads.shape) != (self.n, k, self.d):
            shape = None if grads is None else tuple(grads.shape)
            raise ValueError(f"{self.name}: grads must have shape (n, k, d) = {(self.n, k, self.d)}, got {shape}")
        return grads

    def state_dict(self) -> dict:
        state = {k: v for k, v in vars(self).items() if k not in ("generator", "device")}
        state = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}
        state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        for key in ("n", "m", "d"):
            if state[key] != getattr(self, key):
                raise ValueError(f"{self.name}: state is for {key}={state[key]}, sorter has {getattr(self, key)}")
        for key, value in state.items():
            if key == "generator":
                self.generator.set_state(value)
            else:
                setattr(self, key, value.to(self.device) if torch.is_tensor(value) else value)


class OnlineBalancer(Sorter):
    """Shared state of the GraB-family sorters: the next epoch's order is built during this epoch.

    A unit whose sign is +1 is written at the left end of `next_orders` (pointer L moving right),
    one with sign -1 at the right end (pointer R moving left), so negatives appear reversed.
    Units are stored as local unit ids (`orders[j, t]`), so orders compose across epochs.
    """

    uses_grads = True

    def __init__(self, n_workers, m, d, seed=0, device="cpu", dtype=torch.float32):
        super().__init__(n_workers, m, d, seed, device)
        self.dtype = dtype
        self._reset_epoch_state()

    def _reset_epoch_state(self):
        self.next_orders = torch.full((self.n, self.m), -1, dtype=torch.long, device=self.device)

    def _next_epoch_orders(self):
        if self._next_position == 0:  # no step this epoch (e.g. the very first sort): keep the order
            return self.orders
        assert bool((self.next_orders >= 0).all()), "balancer left a slot of next_orders empty"
        return self.next_orders

    def sort(self):
        orders = super().sort()
        self._reset_epoch_state()
        return orders


class PairBalancer(OnlineBalancer):
    """Pair balance: units at positions (0,1), (2,3), ... form pairs; the sign of the pair
    difference (first - second) decides which of the two goes left and which goes right.

    Pairs are formed inside a step when k is even, and across consecutive steps otherwise
    (the first unit's gradient is cached as a copy). With m odd, the last unit has no partner and
    takes the one slot left in the middle. Subclasses decide the signs (`_pair_signs`).
    """

    def _reset_epoch_state(self):
        super()._reset_epoch_state()
        self.left, self.right = 0, self.m - 1
        self.pending = None           # (n, d) copy of an unpaired first unit's gradients
        self.pending_position = -1
        self._reset_running_sums()

    def _reset_running_sums(self):
        raise NotImplementedError

    def _pair_signs(self, diffs: torch.Tensor) -> torch.Tensor:
        """diffs: (n, P, d) first - second for P consecutive pairs; return (n, P) bool, True = first goes left."""
        raise NotImplementedError

    def step(self, grads, positions):
        positions = self._check_positions(positions)
        k = positions.numel()
        grads = self._check_grads(grads, k).to(device=self.device, dtype=self.dtype)
        self._next_position += k
        with torch.no_grad():
            diff_blocks, first_pos, second_pos = [], [], []
            start = 0
            if self.pending is not None:
                # in place: the cached copy is ours, and this saves an (n, d) allocation per step
                diff_blocks.append(self.pending.sub_(grads[:, 0]).unsqueeze(1))
                first_pos.append(self.pending_position)
                second_pos.append(int(positions[0]))
                self.pending, start = None, 1
            n_paired = (k - start) // 2 * 2
            if n_paired:
                block = grads[:, start:start + n_paired]
                diff_blocks.append(block[:, 0::2] - block[:, 1::2])
                first_pos += positions[start:start + n_paired:2].tolist()
                second_pos += positions[start + 1:start + n_paired:2].tolist()
            if (k - start) % 2:
                # a copy, never a view of the caller's buffer (spec bug 1: the original cached a
                # reference to a gather buffer that the next step overwrote, so every diff was 0)
                self.pending = grads[:, k - 1].clone()
                self.pending_position = int(positions[k - 1])
            if diff_blocks:
                diffs = torch.cat(diff_blocks, dim=1) if len(diff_blocks) > 1 else diff_blocks[0]
                self._place_pairs(self._pair_signs(diffs), first_pos, second_pos)
            if self._next_position == self.m and self.pending is not None:
                assert self.left == self.right
                self.next_orders[:, self.left] = self.orders[:, self.pending_position]
                self.pending, self.left, self.right = None, self.left + 1, self.right - 1

    def _place_pairs(self, first_left: torch.Tensor, first_pos: list, second_pos: list):
        """first_left: (n, P) bool. Pair i takes slot left+i on the left and right-i on the right."""
        n_pairs = len(first_pos)
        firsts = self.orders[:, first_pos]
        seconds = self.orders[:, second_pos]
        to_left = torch.where(first_left, firsts, seconds)
        to_right = torch.where(first_left, seconds, firsts)
        self.next_orders[:, self.left:self.left + n_pairs] = to_left
        self.next_orders[:, self.right - n_pairs + 1:self.right + 1] = to_right.flip(1)
        self.left += n_pairs
        self.right -= n_pairs


def sign_as_float(plus: torch.Tensor) -> torch.Tensor:
    """bool -> +1.0 / -1.0, same shape."""
    return plus.to(torch.float32) * 2 - 1
