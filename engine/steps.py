"""The kinds of training step. Each takes every local worker's units of the step, computes
gradients, exchanges them, hands the sorter the unit gradients it balances, and steps the optimizer:

data_parallel_step  the paper's: one shared parameter vector, the workers' mean gradient all-reduced
exact_records_step  the same with --exact-low-memory: the sorter gets the units as layer records, not (n, k, d)
sparsified_step     the same, the mean going through a sparsifying --reducer (needs each worker's gradient)
local_step          --sync local SGD: each worker steps on its own parameters, averaged every H steps

They differ in what is averaged and when the sorter sees the unit gradients; the timer's laps charge
each part to its region (engine.progress.RegionTimer).
"""
import torch


def data_parallel_step(task, sorter, exchange, optimizer, unit_ids, positions, timer, herding_log=None):
    """One step of the paper's data-parallel training on the shared parameters; returns the local loss (a scalar)
    or, where the sorter takes per-unit gradients, the local losses (n_local, k) or (n_local,) whose mean it is.
    herding_log (--log-herding): keeps this step's per-unit gradients (computed on the side for D-RR & co.)."""
    flat, (n_local, k) = task.model.flat, unit_ids.shape
    batch = task.units(exchange.comm.local_workers, unit_ids)
    real_unit_grads = None  # this step's (n_local, k, d) per-unit gradients, where they were formed
    ended = False  # whether the task's end_step has run (worker_gradients calls it itself)
    if sorter.uses_grads and getattr(sorter, "uses_batch_size", False):
        # MB-GraB: a unit is a worker's whole step, its gradient the worker's mean gradient (n_local, 1, d), all
        # gathered in place of the all-reduce; the update is their mean (sorters/microbatch.py)
        worker_grads, _, worker_losses = task.worker_gradients(flat, exchange.comm.local_workers, unit_ids,
                                                               per_unit=False)
        unit_grads, local_mean_grad, local_loss, aux = worker_grads[:, None], None, worker_losses, None
        ended = True
    elif sorter.uses_grads and task.sketches_from_records(flat, exchange.sketch):  # --sketch-dim, no (units, d)
        unit_grads, local_mean_grad, unit_losses = task.unit_sketches(flat, batch, n_local, k, exchange.sketch)
        local_loss, aux = unit_losses, None
    elif sorter.uses_grads:
        unit_grads, unit_losses = task.unit_grads(flat, batch, n_local, k)
        local_mean_grad, local_loss, aux, real_unit_grads = None, unit_losses, None, unit_grads
    else:
        unit_grads = None
        local_mean_grad, local_loss, aux = task.batch_grad(flat, batch)
    timer.lap("compute")
    update, every_unit_grad = exchange.exchange(unit_grads, local_mean_grad)
    timer.lap("comm")
    if herding_log:  # the real gradients: not the sketches a --sketch-dim sorter gathered
        gathered = every_unit_grad if exchange.sketch is None and not ended else None  # MB-GraB's are (n, 1, d)
        herding_log.record(positions.start // k, gathered, lambda: real_unit_grads if real_unit_grads is not None
                           else task.unit_grads(flat, batch, n_local, k)[0])
        timer.lap("compute")
    sorter.step(every_unit_grad, positions)
    del unit_grads, real_unit_grads, every_unit_grad  # (n, k, d) can be GBs: free before the next step computes
    timer.lap("sorter")
    if task.clip_grad_norm:
        update = clip_to_norm(update, task.clip_grad_norm)
    optimizer.step(update)
    if not ended:
        task.end_step(aux)
    return local_loss


def exact_records_step(task, sorter, exchange, optimizer, exact, unit_ids, positions, timer):
    """One data-parallel step with --exact-low-memory: the units' gradients reach the sorter (an ExactCDGraB)
    as the layer records of the step's own backward, never formed as (n_local, k, d); the update is the mean
    gradient of that backward, all-reduced. Returns the local loss."""
    n_local, k = unit_ids.shape
    batch = task.units(exchange.comm.local_workers, unit_ids)
    local_parts, local_mean_grad, unit_losses = task.unit_records(exact, batch, n_local, k)
    timer.lap("compute")
    update, every_unit = exchange.exchange_units(local_parts, local_mean_grad, sorter.share)
    del local_parts
    timer.lap("comm")
    sorter.step(every_unit, positions)
    del every_unit  # the records can be GBs: free them before the next step records
    timer.lap("sorter")
    if task.clip_grad_norm:
        update = clip_to_norm(update, task.clip_grad_norm)
    optimizer.step(update)
    task.end_step(None)
    return unit_losses.mean()


def sparsified_step(task, sorter, exchange, optimizer, unit_ids, positions, timer):
    """One step on the shared parameters whose gradient average goes through a sparsifying reducer
    (--reducer topk / exdyna: its error feedback needs each worker's own gradient). Returns the local loss."""
    worker_grads, unit_grads, losses = task.worker_gradients(task.model.flat, exchange.comm.local_workers,
                                                             unit_ids, per_unit=sorter.uses_grads)
    timer.lap("compute")
    update = exchange_and_sort(exchange, sorter, unit_grads, worker_grads, positions, timer)
    del unit_grads  # (n_local, k, d): free before the next step computes
    if task.clip_grad_norm:
        update = clip_to_norm(update, task.clip_grad_norm)
    optimizer.step(update)
    return losses.mean()


def local_step(task, sorter, exchange, local, unit_ids, positions, global_step, timer,
               gather_per_round: bool = True):
    """One step of local SGD (`local`: LocalWorkers): each worker steps on its own gradient, and the
    round's last step averages the workers; --sync post-local before its switch: a data-parallel step.
    Returns the local loss.

    The balancing sorters' unit gradients are all-gathered once per round (gather_per_round; at the
    latest every GradientExchange.DEFER_LIMIT_BYTES) or every step: the same bytes and the same
    orders, fewer collectives (bench/gather_batching.py)."""
    worker_grads, unit_grads, losses = task.worker_gradients(local.params, exchange.comm.local_workers, unit_ids,
                                                             per_unit=sorter.uses_grads)
    timer.lap("compute")
    data_parallel = local.data_parallel(global_step)
    if data_parallel:
        gradients = exchange_and_sort(exchange, sorter, unit_grads, worker_grads, positions, timer)
        del unit_grads
    else:
        gradients = worker_grads
    if task.clip_grad_norm:  # per worker with local steps, as the reference clips the local gradient
        gradients = clip_to_norm(gradients, task.clip_grad_norm)
    round_over = local.step(gradients, global_step)
    timer.lap("compute")
    if round_over:
        local.average()
        timer.lap("comm")
    if data_parallel:  # the sorter has had this step's gradients
        return losses.mean()
    if not sorter.uses_grads:
        sorter.step(None, positions)
    elif not gather_per_round:
        sorter.step(exchange.gather_unit_grads(unit_grads), positions)
    elif exchange.defer_unit_grads(unit_grads, positions) or round_over:
        flush_deferred(exchange, sorter, timer)
    timer.lap("sorter")
    return losses.mean()


def exchange_and_sort(exchange, sorter, unit_grads, worker_grads, positions, timer) -> torch.Tensor:
    """Average the workers' gradients worker_grads (n_local, d) through the reducer, and hand every
    worker's unit gradients (unit_grads (n_local, k, d) gathered, or None) to the sorter. Returns the
    average (d,)."""
    update, every_unit_grad = exchange.exchange(unit_grads, None, worker_grads)
    timer.lap("comm")
    sorter.step(every_unit_grad, positions)
    del every_unit_grad
    timer.lap("sorter")
    return update


def flush_deferred(exchange, sorter, timer) -> None:
    """Gather the deferred unit gradients in one collective and hand them to the sorter in step order."""
    gathered = exchange.flush_unit_grads()
    timer.lap("comm")
    for every_unit_grad, positions in gathered:
        sorter.step(every_unit_grad, positions)


def clip_to_norm(gradient: torch.Tensor, max_norm: float) -> torch.Tensor:
    """(d,) gradient, or (n_local, d) one per worker, each scaled down to L2 norm max_norm when larger
    (torch's clip_grad_norm_ rule)."""
    norm = gradient.norm(dim=-1, keepdim=True)
    return gradient * (max_norm / (norm + 1e-6)).clamp(max=1.0)

