"""Local SGD and the Quadratic Synchronization Rule (Gu et al. 2024), and the schedules."""
import math

import pytest
import torch

from engine.comm import LocalCommunicator
from common.errors import UserFacingError
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


def reference_lr(step, *, lr=0.5, min_lr=1e-4, warmup=WARMUP, total=TOTAL):
    """The QSR reference scheduler (Gu et al. 2024), written out: linear warm-up from min_lr, step s of
    the warm-up using s / warmup of the way to lr, then half a cosine down to min_lr at the last step."""
    if step < warmup:
        return min_lr + (lr - min_lr) * step / warmup
    progress = (step - warmup) / (total - warmup)
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * progress)) / 2


def test_schedules_warm_up_then_decay_to_min_lr():
    schedule = cosine()
    assert [schedule(s) for s in range(TOTAL)] == pytest.approx([reference_lr(s) for s in range(TOTAL)], rel=1e-12)
    assert schedule(0) == 1e-4 and schedule(WARMUP) == 0.5 and schedule(TOTAL) == pytest.approx(1e-4)
    linear = LRSchedule(1.0, 10, kind="linear", total_epochs=2)
    assert [linear(s) for s in (0, 10, 20)] == pytest.approx([1.0, 0.5, 0.0])
    step = LRSchedule(1.0, 10, every_epochs=1, gamma=0.5, warmup_epochs=0.5)
    assert [step(s) for s in (0, 1, 4, 5, 10, 20)] == pytest.approx([0.0, 0.2, 0.8, 1.0, 0.5, 0.25])


def test_sync_schedule_rules():
    constant = SyncSchedule("constant", H=5, total_steps=100)
    assert constant.round_length(0, 0.1) == 5 and constant.round_length(97, 0.1) == 3  # only the run's end cuts
    post = SyncSchedule("post-local", H=6, switch_step=10, total_steps=100)
    assert post.data_parallel(9) and not post.data_parallel(10) and post.round_length(10, 0.1) == 6
    assert post.round_length(9, 0.1) == 1
    linear = SyncSchedule("linear", h_base=2, alpha=1.0, power=2.0, total_steps=10**6)
    assert linear.round_length(0, 0.1) == 10  # power 1 whatever --power says


def make_workers(n=4, d=6, H=3, name="sgd", averaged_state=(), momentum=0.9):
    comm = LocalCommunicator(n)
    flat = torch.randn(d, dtype=torch.float64)
    schedule = LRSchedule(0.1, steps_per_epoch=100)
    workers = LocalWorkers(flat, comm, name, schedule, SyncSchedule("constant", H=H, total_steps=TOTAL), make_reducer("dense", comm, d, "cpu"),
                           momentum=momentum, averaged_state=averaged_state)
    return workers, flat


def run_round(workers, steps, seed=0):
    generator = torch.Generator().manual_seed(seed)
    averaged = []
    for step in range(steps):
        grads = torch.randn(workers.params.shape, generator=generator, dtype=torch.float64)
        if workers.step(grads, step):
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
        assert workers.step(g, step) == (step == 2)  # the round of H = 3 ends at its third step
        if step == 1:
            assert not torch.equal(workers.params[0], workers.params[1])  # local steps diverge
    expected = torch.stack([o.flat for o in shadow])
    assert torch.allclose(workers.params, expected, rtol=0, atol=1e-12)  # each row stepped on its own
    workers.average()
    assert all(torch.equal(workers.params[0], row) for row in workers.params)  # bit-identical
    assert torch.allclose(workers.params[0], expected.mean(0), atol=1e-12)
    buffers = list(workers.optimizer.buffers.values())
    assert not torch.equal(buffers[0][0], buffers[0][1])  # state stays per worker


def test_h_1_with_plain_sgd_equals_gradient_averaging():
    """Parameter averaging every step = gradient averaging when the update is linear in the gradient."""
    workers, flat = make_workers(H=1, momentum=0.0)
    reference = Optimizer("sgd", flat.clone(), workers.lr_schedule)
    generator = torch.Generator().manual_seed(3)
    for step in range(5):
        grads = torch.randn(workers.params.shape, generator=generator, dtype=torch.float64)
        if workers.step(grads, step):
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


# ------------------------------------------------------------------------------------------------
# oracles: the rule, the optimizers and the averaging written out independently of engine/


def reference_round_lengths(*, h_init, h_base, alpha, power, total=TOTAL, warmup=WARMUP):
    """QSR (Gu et al. 2024): a round starting at step s lasts H_init during warm-up, else
    max(H_base, floor((alpha / lr_s) ** power)), capped at the steps left."""
    lengths, step = [], 0
    while step < total:
        if step < warmup:
            period = h_init
        else:
            period = max(h_base, math.floor((alpha / reference_lr(step)) ** power))
        lengths.append(min(period, total - step))
        step += lengths[-1]
    return lengths


@pytest.mark.parametrize("rule, power", [("qsr", 2.0), ("qsr", 3.0), ("linear", 1.0)])
def test_round_lengths_of_a_whole_run_follow_the_rule(rule, power):
    """LocalWorkers over a 2000-step run (one epoch) with a warmed-up cosine: the round lengths it
    produces are the rule's, each H taken from the learning rate of its round's first step."""
    h_init, h_base, alpha = 3, 4, 0.05 if power > 1 else 0.01
    sync = SyncSchedule(rule, h_base=h_base, h_init=h_init, alpha=alpha, power=power, warmup_steps=WARMUP,
                        total_steps=TOTAL)
    comm = LocalCommunicator(2)
    workers = LocalWorkers(torch.zeros(3), comm, "sgd", cosine(), sync, make_reducer("dense", comm, 3, "cpu"))
    lengths = []
    for step in range(TOTAL):
        if workers.step(torch.zeros(2, 3), step):
            lengths.append(workers.round_length)
            workers.average()
    expected = reference_round_lengths(h_init=h_init, h_base=h_base, alpha=alpha, power=power)
    assert lengths == expected
    assert len(set(expected)) > 5 and expected[0] == h_init  # the rule has work to do: H grows


def torch_optimizers(name, start, n, momentum, weight_decay):
    """n independent torch.optim optimizers, one per worker, each on its own copy of `start` (d,)."""
    params = [torch.nn.Parameter(start.clone()) for _ in range(n)]
    if name == "sgd":
        return params, [torch.optim.SGD([p], lr=0.0, momentum=momentum, weight_decay=weight_decay) for p in params]
    return params, [torch.optim.AdamW([p], lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
                    for p in params]


def torch_local_step(params, optimizers, grads, lr):
    for p, optimizer, g in zip(params, optimizers, grads):
        optimizer.param_groups[0]["lr"] = lr
        p.grad = g.clone()
        optimizer.step()


def torch_average(params, optimizers, state_names):
    """The reference's averaging: the parameters and the requested optimizer-state fields, each
    replaced by its mean over the workers; everything else stays per worker."""
    with torch.no_grad():
        for tensors in [params] + [[o.state[p][key] for p, o in zip(params, optimizers)] for key in state_names]:
            mean = torch.stack(list(tensors)).mean(0)
            for t in tensors:
                t.copy_(mean)


@pytest.mark.parametrize("name, averaged", [("sgd", ()), ("adamw", ()), ("adamw", ("exp_avg",)),
                                            ("adamw", ("exp_avg_sq",)), ("adamw", ("exp_avg", "exp_avg_sq"))])
def test_local_steps_and_averaging_match_per_worker_torch_optimizers(name, averaged):
    n, d, H, momentum, weight_decay = 3, 5, 3, 0.9, 0.01
    comm = LocalCommunicator(n)
    start = torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    workers = LocalWorkers(start.clone(), comm, name, cosine(), SyncSchedule("constant", H=H, total_steps=TOTAL),
                           make_reducer("dense", comm, d, "cpu"), momentum, weight_decay, averaged_state=averaged)
    params, optimizers = torch_optimizers(name, start, n, momentum, weight_decay)
    generator = torch.Generator().manual_seed(2)
    for step in range(4 * H):
        grads = torch.randn(n, d, dtype=torch.float64, generator=generator)
        torch_local_step(params, optimizers, grads, reference_lr(step))
        if workers.step(grads, step):
            workers.average()
            torch_average(params, optimizers, averaged)
        assert torch.allclose(workers.params, torch.stack([p.detach() for p in params]), rtol=0, atol=1e-12)
        states = {"momentum": "momentum_buffer"} if name == "sgd" else {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
        for ours, theirs in states.items():
            expected = torch.stack([o.state[p][theirs] for p, o in zip(params, optimizers)])
            assert torch.allclose(workers.optimizer.buffers[ours], expected, rtol=0, atol=1e-12), (step, ours)
    # the states that are not averaged did diverge (so the comparison above could tell)
    for ours in set(workers.optimizer.buffers) - set(averaged):
        assert not torch.equal(workers.optimizer.buffers[ours][0], workers.optimizer.buffers[ours][1])


def test_sparse_averaging_adds_the_mean_of_what_the_workers_sent():
    """--reducer topk under local steps, against top-k with error feedback written out: each worker
    offers its change since the last averaging plus its residual, picks its k largest, all send their
    values at the union, and the anchor moves by their mean there."""
    n, d, H, k = 3, 8, 2, 3
    comm = LocalCommunicator(n)
    start = torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    workers = LocalWorkers(start.clone(), comm, "sgd", cosine(), SyncSchedule("constant", H=H, total_steps=TOTAL),
                           make_reducer("topk", comm, d, "cpu", density=k / d))
    params, optimizers = torch_optimizers("sgd", start, n, 0.0, 0.0)
    anchor, residual = start.clone(), torch.zeros(n, d, dtype=torch.float64)
    generator = torch.Generator().manual_seed(4)
    for step in range(5 * H):
        grads = torch.randn(n, d, dtype=torch.float64, generator=generator)
        torch_local_step(params, optimizers, grads, reference_lr(step))
        if workers.step(grads, step):
            workers.average()
            acc = torch.stack([p.detach() for p in params]) - anchor + residual  # (n, d)
            union = sorted({int(i) for row in acc for i in row.abs().topk(k).indices})
            anchor[union] += acc[:, union].mean(0)
            residual = acc.clone()
            residual[:, union] = 0
            with torch.no_grad():
                for p in params:
                    p.copy_(anchor)
            assert torch.allclose(workers.anchor, anchor, rtol=0, atol=1e-12), step
    assert torch.allclose(workers.reducer.residual, residual, rtol=0, atol=1e-12)


def test_averaging_sgd_momentum_or_every_buffer_is_refused():
    from engine.cli import check_args, common_parser

    parser = common_parser("toy", "toy", dict(sorter="CD-GraB", lr=0.1, B=4, node_cnt=2, epochs=3))
    for flags, message in [(["--sync", "constant", "--average-opt-state"], "--avg-m and --avg-v"),
                           (["--avg-m"], "need local steps")]:
        with pytest.raises(UserFacingError, match=message):
            check_args(parser.parse_args(flags), "toy")
    with pytest.raises(UserFacingError, match="no momentum"):
        make_workers(averaged_state=("momentum",))


def test_epoch_end_mid_round_evaluates_the_mean_and_leaves_the_workers_alone():
    """A round that is still going at an epoch's end: `flat` gets the plain mean of the workers' rows
    (what is evaluated and checkpointed), and the workers go on exactly as if no epoch had ended."""
    workers, flat = make_workers(H=5)
    twin, _ = make_workers(H=5)
    twin.params.copy_(workers.params), twin.anchor.copy_(workers.anchor)
    assert run_round(workers, 3) == [] and run_round(twin, 3) == []  # 3 of the round's 5 steps
    rows = workers.params.clone()
    workers.end_epoch()
    assert torch.allclose(flat, rows.mean(0), rtol=0, atol=1e-15)
    assert torch.equal(workers.params, rows) and workers.round_left == 2
    generator = torch.Generator().manual_seed(9)
    for step in (3, 4):
        grads = torch.randn(workers.params.shape, generator=generator, dtype=torch.float64)
        assert workers.step(grads, step) == twin.step(grads, step) == (step == 4)
    workers.average(), twin.average()
    assert torch.equal(workers.params, twin.params)


def reference_linear_lr(step, *, lr, min_lr, warmup, total):
    """The QSR reference's linear schedule, written out: warm-up from min_lr, then a straight line from lr
    down to min_lr at the last step."""
    if step < warmup:
        return min_lr + (lr - min_lr) * step / warmup
    return min_lr + (lr - min_lr) * (1 - (step - warmup) / (total - warmup))


def test_linear_schedule_decays_to_min_lr():
    schedule = LRSchedule(0.4, steps_per_epoch=50, kind="linear", total_epochs=4, warmup_epochs=0.5, min_lr=0.01)
    expected = [reference_linear_lr(s, lr=0.4, min_lr=0.01, warmup=25, total=200) for s in range(201)]
    assert [schedule(s) for s in range(201)] == pytest.approx(expected, rel=1e-12)


def test_the_first_step_after_warm_up_uses_the_rule_not_h_init():
    """A round that starts at step == warmup_steps is past the warm-up (step < warmup_steps takes H_init)."""
    common = dict(warmup_steps=100, total_steps=10**6, h_init=7, h_base=1, alpha=0.75)
    assert qsr_period(0.25, 99, **common) == 7
    assert qsr_period(0.25, 100, **common) == 9  # (0.75 / 0.25) ** 2, exact in binary
    assert qsr_period(0.25, 100, **common, power=1) == 3


def test_post_local_steps_on_the_mean_gradient_then_locally_like_torch_optimizers():
    """--sync post-local: before the switch every worker applies the mean gradient (the rows stay equal and
    an epoch that ends there hands that model to evaluation); after it, local rounds of H steps. Checked
    against one torch.optim.SGD per worker."""
    n, d, H, switch, steps = 3, 5, 3, 4, 10
    comm = LocalCommunicator(n)
    start = torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    flat = start.clone()
    workers = LocalWorkers(flat, comm, "sgd", cosine(), SyncSchedule("post-local", H=H, switch_step=switch, total_steps=steps),
                           make_reducer("dense", comm, d, "cpu"), momentum=0.9)
    params, optimizers = torch_optimizers("sgd", start, n, 0.9, 0.0)
    generator = torch.Generator().manual_seed(6)
    averaged_at = []
    for step in range(steps):
        grads = torch.randn(n, d, dtype=torch.float64, generator=generator)
        assert workers.data_parallel(step) == (step < switch)
        if step < switch:
            torch_local_step(params, optimizers, [grads.mean(0)] * n, reference_lr(step))
            assert not workers.step(grads.mean(0), step)
        else:
            torch_local_step(params, optimizers, grads, reference_lr(step))
            if workers.step(grads, step):
                workers.average()
                torch_average(params, optimizers, ())
                averaged_at.append(step)
        assert torch.allclose(workers.params, torch.stack([p.detach() for p in params]), rtol=0, atol=1e-12), step
        if step == switch - 1:  # an epoch ending inside the data-parallel phase
            workers.end_epoch()
            assert torch.allclose(flat, params[0].detach(), rtol=0, atol=1e-12)
    assert averaged_at == [switch + H - 1, switch + 2 * H - 1]
    workers.end_epoch()
    assert torch.allclose(flat, params[0].detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("sync, expected", [
    # rounds end at steps 2, 5, 8 | 11 (the round 9-11 crosses the epoch end), 14, 17, 19 (capped by the run)
    (SyncSchedule("constant", H=3, total_steps=20), [(3, 3.0), (4, 11 / 4)]),
    (SyncSchedule("constant", H=5, total_steps=20), [(2, 5.0)] * 2),
    # no averaging at all in epoch 1: the first round ends at step 14, the second is capped at 5 steps
    (SyncSchedule("constant", H=15, total_steps=20), [(0, math.nan), (2, 10.0)]),
    # 4 gradient averages then rounds of 3, 3 | 3, 3, 3 and 1 (capped)
    (SyncSchedule("post-local", H=3, switch_step=4, total_steps=20), [(4 + 2, 10 / 6), (4, 10 / 4)]),
])
def test_epoch_stats_count_averagings_and_the_rounds_they_close(sync, expected):
    """syncs = averagings in the epoch, mean_H = the mean length of the rounds they closed, steps taken in
    the previous epoch included; rounds are cut only by the run's end, never by an epoch's."""
    steps = 10
    n, d = 2, 3
    comm = LocalCommunicator(n)
    workers = LocalWorkers(torch.zeros(d), comm, "sgd", LRSchedule(0.1, steps), sync, make_reducer("dense", comm, d, "cpu"))
    for epoch in range(2):
        for step in range(steps):
            global_step = epoch * steps + step
            grads = torch.ones(n, d) if not workers.data_parallel(global_step) else torch.ones(d)
            if workers.step(grads, global_step):
                workers.average()
        workers.end_epoch()
        stats = workers.epoch_stats()
        assert (stats["syncs"], stats["mean_H"]) == pytest.approx(expected[epoch], nan_ok=True)


@pytest.mark.parametrize("reducer_name, averaged", [("dense", ()), ("dense", ("exp_avg",)),
                                                    ("dense", ("exp_avg", "exp_avg_sq")), ("topk", ("exp_avg_sq",))])
def test_averaging_counts_the_parameters_and_the_requested_moments(reducer_name, averaged):
    """Bytes per averaging, summed over the n workers: the dense path all-reduces one flat buffer of the d
    parameters and each requested moment (n * d * (1 + moments) values); the sparse path sends the
    parameters' change through the reducer (counted there) and the moments dense (n * d * moments)."""
    n, d, H, rounds = 3, 8, 2, 3
    comm = LocalCommunicator(n)
    reducer = make_reducer(reducer_name, comm, d, "cpu", density=0.25)
    workers = LocalWorkers(torch.zeros(d, dtype=torch.float64), comm, "adamw", cosine(), SyncSchedule("constant", H=H, total_steps=100),
                           reducer, averaged_state=averaged)
    generator = torch.Generator().manual_seed(7)
    for step in range(H * rounds):
        if workers.step(torch.randn(n, d, dtype=torch.float64, generator=generator), step):
            workers.average()
    values_per_round = n * d * ((1 + len(averaged)) if reducer_name == "dense" else len(averaged))
    assert workers.comm_bytes == rounds * values_per_round * 8  # float64
    assert (reducer.comm_bytes > 0) == (reducer_name != "dense")  # the parameters' change went through topk
