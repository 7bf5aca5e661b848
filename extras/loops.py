"""What happens around each training step, whatever the step does (a script's train_step, or one a
user wrote): progress for the watchdog, the step's seeds, its batch on the device, the stop every
rank agrees on, the records, a mid-epoch validation, the saves and a stop by a signal (EpochSteps).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from utils import (
    Stopped,
    UsageError,
    batch_to_device,
    describe_value,
    epoch_loader,
    errors_shared_by_all_ranks,
    samples_in_step,
    seed_step,
)


class EpochSteps:
    """An epoch's steps after steps_done (a run continued mid-epoch). Iterated, it gives each
    step's batch on the device, (inputs, targets), and sets run.samples to the step's (this rank's
    samples, all ranks' samples), what run.backward() weights the loss by; given micro_batches (K),
    an iterator of the step's micro-batches, (inputs, targets, samples) each, and run.samples
    (None, all ranks' samples). done(result) must follow each step, on every rank: result is
    train_step's dict, its "loss" and "outputs" recorded (with micro-batches the step records
    each one's itself), its "grad_norm" (None or missing: measured, at recording steps only);
    a signal is acted on there. validate(run, epoch, step) and save(run, epoch, step) are the
    script's. Every rank iterates it, in the same steps."""

    def __init__(
        self,
        run,
        epoch: int,
        steps_done: int,
        validate: Callable,
        save: Callable,
        micro_batches: int | None = None,
    ):
        self.run, self.epoch, self.steps_done = run, epoch, steps_done
        self.validate, self.save, self.micro = validate, save, micro_batches
        # the epoch told to the dataset (an image folder draws its crops from it); continued
        # mid-epoch: the same order, without the batches already trained on
        self.loader = epoch_loader(run.train_loader, epoch, steps_done * (micro_batches or 1))
        # continued mid-epoch: with the sums the checkpoint kept
        self.meter = run.recorder.meter_for_epoch(run.device, steps_done)
        self.step = steps_done
        self.scored = None  # the step's (samples, targets) the record scores its outputs on

    def __iter__(self):
        run, args, epoch = self.run, self.run.args, self.epoch
        batches = self.meter.timed(self.loader)
        if self.micro:  # K micro-batches a step (zip drops a remainder, a smaller step)
            batches = zip(*[batches] * self.micro)
        # every rank takes the same steps (a small all-reduce a step): a stream that ends unevenly
        # stops all after the same one; --steps-per-epoch may cut an epoch
        steps = run.stop.steps(batches, self.steps_done, run.recorder.steps_per_epoch)
        for step, batch in steps:
            self.step = step
            run.recorder.phases.new_step()  # its first optimizer step counts it, once
            # dropout and other randomness in the model: this rank's own, from (seed, rank, epoch,
            # step), as one process draws its own for each sample
            seed_step(args.seed, epoch, step)
            # all ranks' samples in this step: --batch-size, or what your batch sampler drew
            step_samples = samples_in_step(run.train_loader.sampler, step, args.batch_size)
            if self.micro:
                run.samples = (None, step_samples)
                self.scored = (0, None)  # the samples of the micro-batches as they come
                yield self.micro_batches(batch)
                continue
            run.watchdog.batch(epoch, step)  # progress: the watchdog times the steps
            samples, batch = batch
            run.samples = (samples, step_samples)
            inputs, targets = self.on_device(batch, step)
            self.scored = (samples, targets)
            yield inputs, targets

    def on_device(self, batch, step: int) -> tuple:
        """A batch's (inputs, targets) on the device; its random draws keyed by (epoch, step)."""
        run = self.run
        dataset, channels_last = self.loader.dataset, run.args.channels_last
        return batch_to_device(batch, run.device, dataset, channels_last, key=(self.epoch, step))

    def micro_batches(self, batches):
        """The step's micro-batches, each (inputs, targets, samples) on the device as it comes; each
        one's loss and accuracy recorded by the step (run.recorder.meter.update)."""
        first = (self.step - 1) * self.micro + 1
        for micro_step, (samples, batch) in enumerate(batches, first):
            self.run.watchdog.batch(self.epoch, micro_step)  # progress, a micro-batch
            self.scored = (self.scored[0] + samples, None)
            yield *self.on_device(batch, micro_step), samples

    def done(self, result: dict, extra: Callable[[], dict] | None = None) -> None:
        """After each step (every rank): its loss and accuracy added up, and, as all ranks agreed,
        a record (with extra()'s values in it), --eval-every's validation, a save, a stop by a
        signal."""
        run, args, epoch, step = self.run, self.run.args, self.epoch, self.step
        if not isinstance(result, dict) or (
            self.micro is None and not {"loss", "outputs"} <= result.keys()
        ):
            raise UsageError(
                "train_step must return a dict of the step's loss and outputs (and its grad_norm or"
                f" None), not {describe_value(result)}"
            )
        samples, targets = self.scored
        if self.micro is None:
            self.meter.update(result["loss"], result["outputs"], targets, samples)
        self.meter.add_others(result, samples)
        # as the step began: SIGTERM or SIGUSR1 on any rank, or no next batch on one, stops all
        # after this step
        signum, last = run.stop.agreed()
        # a record every --print-freq steps and at the end; a diverged run stops here
        if step % args.print_freq == 0 or last:
            # all-reduce, every rank: all ranks' loss, accuracy and speed since the last record
            since_record = self.meter.since_record()
            lr = run.optimizer.param_groups[0]["lr"]
            grad_norm = result.get("grad_norm")
            grads = [p.grad for p in run.model.parameters() if p.grad is not None]
            if grad_norm is None and grads:  # not clipped: measured, the gradients left as they are
                grad_norm = nn.utils.get_total_norm(grads)
            if hasattr(grad_norm, "full_tensor"):  # FSDP's: all shards' (a collective)
                grad_norm = grad_norm.full_tensor()
            # all-reduce, every rank: the step's other losses (a GAN's generator loss), train_<name>
            values = {**self.meter.others_since_record(), **(extra() if extra else {})}
            run.recorder.train(epoch, step, since_record, lr, grad_norm, **values)
        # --eval-every N: mid-epoch too; not training: its time is left out of the speed and the
        # phases
        if args.eval_every and step % args.eval_every == 0 and not last:
            with self.meter.paused():
                self.validate(run, epoch, step)
            run.model.train()
        # this point of the epoch: the same command continues from here (after a signal, when
        # --save-minutes' timer fired on some rank, every --save-every steps)
        timer = run.stop.save_timer_fired()  # and it starts again
        if signum or timer or (args.save_every and step % args.save_every == 0):
            with self.meter.paused():  # its time left out of the speed too
                self.save(run, epoch, step)
        if signum:
            with errors_shared_by_all_ranks():
                run.saves.wait()  # the stop's checkpoint whole before the process ends
            raise Stopped(signum, epoch, step, run.recorder.steps_per_epoch)

    def epoch_record(self) -> dict:
        """All-reduce, every rank: the epoch's loss and accuracy over all ranks, its time and
        speed."""
        return self.meter.epoch_record()
