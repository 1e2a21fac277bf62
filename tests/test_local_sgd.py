"""Local SGD and the Quadratic Synchronization Rule (qsr-spec sections 1 and 6), and the schedules."""
import math

import pytest
import torch

from engine.comm import LocalCommunicator
from engine.local_sgd import LocalWorkers, SyncSchedule, qsr_period
from engine.optim import LRSchedule, Optimizer
from engine.reducers import make_reducer

TOTAL, WARMUP = 2000, 200


def rounds(schedule: LRSchedule, *, h_init=3, h_base=4, alpha=0.05, power=2.0, total=TOTAL, warmup=WARMUP):
    """(first step, H) of every round of a run of `total` steps, H from each round's first learning rate."""
    out, step = [], 0
    while step < total:
        period = qsr_period(schedule(step), step, warmup_steps=warmup, total_steps=total, h_init=h_init,
                            h_base=h_base, alpha=alpha, power=power)
        out.append((step, period))
        step += period
    return out


def cosine(total=TOTAL, warmup=WARMUP, lr=0.5, min_lr=1e-4):
    return LRSchedule(lr, steps_per_epoch=100, kind="cosine", total_epochs=total // 100,
                      warmup_epochs=warmup / 100, min_lr=min_lr)


def test_warm_up_uses_h_init_and_alpha_zero_is_constant():
    for start, period in rounds(cosine()):
        if start < WARMUP:
            assert period == 3
    assert {period for _, period in rounds(cosine(), alpha=0.0)[:-1]} == {3}


def test_after_warm_up_h_is_at_least_h_base_and_grows_as_the_lr_decays():
    sequence = [(start, period) for start, period in rounds(cosine()) if start >= WARMUP]
    body = sequence[:-1]  # the last round is capped by the steps left
    assert all(period >= 4 for _, period in body)
    assert [p for _, p in body] == sorted(p for _, p in body)  # cosine lr only falls: H never shrinks
    assert body[-1][1] > 4 * body[0][1]  # and it really grows (quadratically in 1/lr)
    # H is non-increasing in lr at a fixed step
    periods = [qsr_period(lr, 500, warmup_steps=0, total_steps=10**9, h_init=1, h_base=2, alpha=0.1)
               for lr in (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3)]
    assert periods == sorted(periods, reverse=True) and periods[0] == int((0.1 / 1e-3) ** 2)
    assert qsr_period(0.1, 500, warmup_steps=0, total_steps=10**9, h_init=1, h_base=2, alpha=0.1, power=1) == 2


@pytest.mark.parametrize("alpha", [0.0, 0.01, 0.05, 0.5])
def test_round_lengths_sum_to_the_run(alpha):
    sequence = rounds(cosine(), alpha=alpha)
    assert sum(period for _, period in sequence) == TOTAL
    assert sequence[-1][0] + sequence[-1][1] == TOTAL


def test_schedules_warm_up_then_decay_to_min_lr():
    schedule = cosine()
    assert schedule(0) == pytest.approx(1e-4 + (0.5 - 1e-4) / WARMUP) and schedule(WARMUP - 1) == 0.5
    assert schedule(WARMUP) == 0.5 and schedule(TOTAL) == pytest.approx(1e-4)
    linear = LRSchedule(1.0, 10, kind="linear", total_epochs=2)
    assert [linear(s) for s in (0, 10, 20)] == pytest.approx([1.0, 0.5, 0.0])
    step = LRSchedule(1.0, 10, every_epochs=1, gamma=0.5, warmup_epochs=0.5)
    assert [step(s) for s in (0, 4, 5, 10, 20)] == pytest.approx([0.2, 1.0, 1.0, 0.5, 0.25])


def test_sync_schedule_rules():
    constant = SyncSchedule("constant", H=5)
    assert constant.round_length(0, 0.1, 100) == 5 and constant.round_length(0, 0.1, 3) == 3  # epoch end cuts
    post = SyncSchedule("post-local", H=6, switch_step=10)
    assert post.data_parallel(9) and not post.data_parallel(10) and post.round_length(10, 0.1, 100) == 6
    linear = SyncSchedule("linear", h_base=2, alpha=1.0, power=2.0, total_steps=10**6)
    assert linear.round_length(0, 0.1, 10**6) == 10  # power 1 whatever --power says


def make_workers(n=4, d=6, H=3, name="sgd", average_opt_state=False, momentum=0.9):
    comm = LocalCommunicator(n)
    flat = torch.randn(d, dtype=torch.float64)
    schedule = LRSchedule(0.1, steps_per_epoch=100)
    workers = LocalWorkers(flat, comm, name, schedule, SyncSchedule("constant", H=H), make_reducer("dense", comm, d, "cpu"),
                           momentum=momentum, average_opt_state=average_opt_state)
    return workers, flat


def run_round(workers, steps, seed=0):
    generator = torch.Generator().manual_seed(seed)
    averaged = []
    for step in range(steps):
        grads = torch.randn(workers.params.shape, generator=generator, dtype=torch.float64)
        if workers.step(grads, step, 100 - step):
            workers.average()
            averaged.append(step)
    return averaged


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_averaging_makes_workers_identical_and_keeps_optimizer_state_local(name):
    workers, _ = make_workers(name=name)
    before = workers.params.clone()
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(workers.params.shape, generator=generator, dtype=torch.float64) for _ in range(3)]
    shadow = [Optimizer(name, before[j].clone(), workers.lr_schedule, 0.9) for j in range(4)]
    for step, g in enumerate(grads):
        for j in range(4):
            shadow[j].step(g[j])
        assert workers.step(g, step, 100) == (step == 2)  # the round of H = 3 ends at its third step
        if step == 1:
            assert not torch.equal(workers.params[0], workers.params[1])  # local steps diverge
    expected = torch.stack([o.flat for o in shadow])
    assert torch.allclose(workers.params, expected, rtol=0, atol=1e-12)  # each row stepped on its own
    workers.average()
    assert all(torch.equal(workers.params[0], row) for row in workers.params)  # bit-identical
    assert torch.allclose(workers.params[0], expected.mean(0), atol=1e-12)
    buffers = list(workers.optimizer.buffers.values())
    assert not torch.equal(buffers[0][0], buffers[0][1])  # state stays per worker


def test_average_opt_state_averages_the_moments_too():
    workers, _ = make_workers(average_opt_state=True)
    run_round(workers, 3)
    momentum = workers.optimizer.buffers["momentum"]
    assert all(torch.equal(momentum[0], row) for row in momentum)


def test_h_1_with_plain_sgd_equals_gradient_averaging():
    """Parameter averaging every step = gradient averaging when the update is linear in the gradient."""
    workers, flat = make_workers(H=1, momentum=0.0)
    reference = Optimizer("sgd", flat.clone(), workers.lr_schedule)
    generator = torch.Generator().manual_seed(3)
    for step in range(5):
        grads = torch.randn(workers.params.shape, generator=generator, dtype=torch.float64)
        if workers.step(grads, step, 100):
            workers.average()
        reference.step(grads.mean(0))
    assert torch.allclose(workers.anchor, reference.flat, atol=1e-12)


def test_state_round_trip_continues_identically():
    workers, flat = make_workers(name="adamw")
    run_round(workers, 3)
    workers.end_epoch()
    state = workers.state_dict()
    assert state["optimizer"]["exp_avg"].shape == (4, 6)
    copy, copy_flat = make_workers(name="adamw")
    copy_flat.copy_(flat)
    copy.load_state_dict(state)
    run_round(workers, 6, seed=5)
    run_round(copy, 6, seed=5)
    assert torch.equal(workers.params, copy.params) and math.isclose(workers.optimizer.count, copy.optimizer.count)


def test_default_out_names_the_settings_that_differ_from_their_defaults():
    from engine.cli import check_args, common_parser

    parser = common_parser("toy", "toy", dict(sorter="CD-GraB", lr=0.1, B=4, node_cnt=2, epochs=3))
    defaults = vars(parser.parse_args([]))
    plain = parser.parse_args([])
    check_args(plain, "toy", defaults)
    assert plain.out == "results/toy/CD-GraB-node2-B4-lr0.1-seed0"
    local = parser.parse_args(["--sync", "qsr", "--alpha", "0.1", "--reducer", "exdyna", "--density", "0.5",
                               "--lr-schedule", "cosine"])
    check_args(local, "toy", defaults)
    assert local.out == "results/toy/CD-GraB-node2-B4-lr0.1-qsr-exdyna-cosine-alpha0.1-density0.5-seed0"
