"""The per-rank training loop.

Lifecycle (see docs/engine.md): `setup()` builds the rank's parts (`d9d.engine.train_parts`: context →
seeds → task → data → model stages → reducer → optimizers/LR → checkpointer) and resumes from the latest
checkpoint; `train()` runs the loop (commands → microbatches → forward/backward → reduce + scale → clip →
optimizer/LR step → report → evaluate (`eval.period`) → checkpoint) and finishes (evaluating once more).
The loop itself knows nothing about which parallelism is in use.
"""

from __future__ import annotations

import gc
import math
import time
import warnings
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from d9d.core.context import DistributedContext
from d9d.core.host_copy import HostCopy
from d9d.core.storage import Location
from d9d.engine.async_save import STALL_METRIC, AsyncSaver, report_metrics, resolve_async
from d9d.engine.commands import CommandHandler, broadcast_commands
from d9d.engine.config import TrainConfig
from d9d.engine.events import (
    CheckpointSaved,
    EventBus,
    ForwardBackwardFinished,
    OptimizerStepFinished,
    StepFinished,
    StepRepeated,
    StepSkipped,
    StepStarted,
    TrainingFinished,
)
from d9d.engine.export import publish_export, storage_export_dir
from d9d.engine.nonfinite import (
    NonFiniteError,
    StepValues,
    StepValuesRead,
    attribute,
    check_weights_finite,
    describe,
)
from d9d.engine.offload import HostOffload, SleepReport, WakeReport, training_state_tensors
from d9d.engine.progress import StepProgress
from d9d.engine.resume import base_lrs, committed_config, decide_resume, resume_changes, set_base_lrs
from d9d.engine.runtime import MetricPoint, RankResult, RunReporter, mark_failed_step
from d9d.engine.stages import log_compile_warmup
from d9d.engine.state import TrainProgress
from d9d.engine.step import counts_positions, global_loss, processed_positions, to_device
from d9d.engine.train_parts import TrainParts, build_train_parts
from d9d.parallel.compile import begin_step, release_cuda_graphs
from d9d.parallel.expert import release_expert_communication
from d9d.profiling import NullProfiler, StepHook, StepProfiler


def freeze_heap(ctx: DistributedContext) -> None:
    """Collect once, then move every live object out of the cyclic collector's scans (`gc.freeze`): the
    automatic collections that follow walk only what later steps allocate (`GCConfig.freeze`)."""
    gc.collect()
    gc.freeze()
    if ctx.is_main_process:
        ctx.logger.info(
            "froze %d objects out of the garbage collector's scans (gc.freeze)", gc.get_freeze_count()
        )


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        ctx: DistributedContext,
        reporter: RunReporter,
        events: EventBus | None = None,
        attempt: int = 0,
    ) -> None:
        self.config = config
        self.attempt = attempt  # 0: a new launch; restarts continue from their own commits
        self.ctx = ctx
        self.reporter = reporter
        self.events = events or EventBus()
        self.progress = TrainProgress()
        self.commands = CommandHandler(lambda: broadcast_commands(reporter, ctx, self.progress.step), self)
        self._parts: TrainParts | None = None
        self._checkpoint_requested = False
        self._last_saved: int | None = None
        self._finished_at_start = False
        self._offload = HostOffload(ctx.device)
        self._saver: AsyncSaver | None = None
        self._nonfinite_steps = 0  # non-finite steps skipped or rolled back in this attempt
        self._counts_positions = True  # whether this rank's batch enters the step's processed positions

    @property
    def parts(self) -> TrainParts:
        if self._parts is None:
            raise RuntimeError("Trainer.setup() must run before training")
        return self._parts

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """This rank's model stages."""
        return self.parts.stages.modules

    def setup(self) -> None:
        self.ctx.set_timeout(timedelta(seconds=self.config.timeouts.init_s))
        self._parts = build_train_parts(self.config, self.ctx, self.reporter, self.events, self.progress)
        self._counts_positions = counts_positions(self.ctx, self._parts.runner.loss_pp_rank)
        if resolve_async(self.config.checkpointing.async_save, self.ctx.device):
            self._saver = AsyncSaver(self._parts.checkpointer, self.ctx, self._committed)
        self._resume()

    def _resume(self) -> None:
        """Decide again what the driver decided (`d9d.engine.resume`): torchrun has no driver, and a
        restarted attempt resumes from what its predecessor committed."""
        parts = self.parts
        decision = decide_resume(self.config, parts.checkpointer.latest(), new_launch=self.attempt == 0)
        latest = decision.step_dir
        if latest is None:
            return
        if decision.action == "finished":
            # Nothing to train and nothing to write: only the progress is read, for the result.
            self.progress.load_state_dict(parts.checkpointer.load_engine_state(latest))
            self._finished_at_start = True
            self._last_saved = self.progress.step
            self.ctx.logger.warning("run %s %s", self.config.run.name, decision.message)
            return
        configured = base_lrs(parts.optimizer, parts.schedulers)  # this launch's, before the commit's
        engine_state, rank_state = parts.checkpointer.load(
            latest, parts.optimizer.pair_with(parts.stages.by_index)
        )
        lr_before = parts.optimizer.lr  # the commit's LR for the next step, under the commit's plan
        parts.state.load_state_dict(engine_state)  # a scheduler re-plans its LR for this config's steps
        committed_base = base_lrs(parts.optimizer, parts.schedulers)
        if rank_state is not None:
            parts.state.load_rank_state_dict(rank_state)
        if self.attempt == 0:
            # The config wins from the resume step (docs/engine.md, "What may change on resume"); a
            # restarted attempt continues what its launch decided (an `update` may have moved the LR).
            set_base_lrs(parts.optimizer, parts.schedulers, configured)
        self._last_saved = self.progress.step  # that step is committed: never written again
        self.ctx.logger.info("resumed from %s at step %d", latest, self.progress.step)
        if self.attempt == 0:
            self._announce_resume(latest, committed_base, configured, lr_before)

    def _announce_resume(
        self, step_dir: Location, committed: list[float], configured: list[float], lr_before: float
    ) -> None:
        """Say on the console and to the tracker what this launch changed in the optimization (a new base
        LR, a re-planned schedule); nothing when it continues as the commit would have."""
        step = self.progress.step
        notes = resume_changes(self.config, committed_config(step_dir) or {}, committed, configured, step)
        if not notes:
            return
        lr_after = self.parts.optimizer.lr
        if lr_after != lr_before:
            notes.append(f"the LR for step {step + 1} is {lr_after:.3g} (the commit's plan: {lr_before:.3g})")
        if self.ctx.is_main_process:
            # The launcher's console too (under Ray the coordinator's: `d9d train` prints it, the summary
            # keeps it), where the reporter can say something (`notice`).
            notice = getattr(self.reporter, "notice", None)
            for note in notes:
                self.ctx.logger.warning("resume at step %d: %s", step, note)
                if callable(notice):
                    notice(f"resume at step {step}: {note}")
            values = {"resume/lr": lr_after, "resume/lr_before": lr_before, "resume/base_lr": configured[0]}
            values["resume/total_steps"] = float(self.config.trainer.total_steps)
            self.reporter.metrics(MetricPoint(step + 1, 0, values, "train", time.time()))

    # -- loop ---------------------------------------------------------------------------------------

    def train(self) -> RankResult:
        c = self.config
        progress = StepProgress(
            c.trainer.total_steps,
            self.progress.step,
            self.ctx.logger,
            self.ctx.is_main_process,
            c.logging.progress_bar,
            c.logging.period,
        )
        if c.gc.period is not None:
            gc.disable()
        tokens_per_s: float | None = None
        finished = True
        first_step = True
        profiler = self._build_profiler()
        in_step = self.progress.step + 1
        try:
            with profiler:
                while self.progress.step < c.trainer.total_steps:
                    in_step = self.progress.step + 1  # an error from here on is this step's
                    if not self.commands.at_boundary():
                        finished = False
                        break
                    tokens_per_s, advanced = self._run_step(progress)
                    profiler.step()
                    if first_step:
                        # The attempt's first step is done (loading, compilation): hung ranks surface quickly.
                        self.ctx.set_timeout(timedelta(seconds=c.timeouts.step_s))
                        log_compile_warmup(self.ctx, self.parts.stages)
                        self._hint_cuda_graphs()
                        self._reserve_checkpoint_buffers()
                        if c.gc.freeze:
                            freeze_heap(self.ctx)
                        first_step = False
                    if advanced:
                        self._after_step(self.progress.step)
            self._finish(finished)
        except Exception as e:
            mark_failed_step(e, in_step)  # for launchers: the same error at the same step is not retried
            raise
        finally:
            self.parts.data.close()  # also after an error: the prefetch thread must not outlive the run
            progress.close()
            if c.gc.freeze:
                gc.unfreeze()  # back into the collector's reach: cycles of this run's objects can go now
            if c.gc.period is not None:
                gc.enable()
            release_cuda_graphs(self.parts.stages.compile_reports)
        status = "finished" if finished else "stopped"
        self.events.publish(TrainingFinished(self.progress.step, status))
        losses = self.progress.losses
        return RankResult(
            status="finished" if finished else "stopped",
            steps=self.progress.step,
            final_loss=losses[-1] if losses else None,
            tokens_per_s=tokens_per_s,
            losses=tuple(losses),
        )

    def _run_step(self, progress: StepProgress) -> tuple[float | None, bool]:
        """One optimizer step with its reporting; returns its tokens per second (processed positions), and
        False when the step rolled the run back to its newest commit (nothing to report or save at this
        step)."""
        step = self.progress.step + 1
        start = time.perf_counter()
        self.events.publish(StepStarted(step))
        outcome = self._train_step(step)
        if outcome is None:
            return None, False
        loss, weight, positions, grad_norm, lr = outcome
        step_time = time.perf_counter() - start
        # tokens/s: the positions the model processed (padding excluded), what MFU counts; loss tokens/s:
        # the tokens the loss is taken over (masked prompts and padding excluded)
        tokens_per_s = positions / step_time if step_time > 0 and math.isfinite(positions) else None
        loss_tokens_per_s = weight / step_time if step_time > 0 else None
        self.progress.finish_step(step, loss)
        self.events.publish(StepFinished(step, loss))
        self.parts.reports.step(step, loss, lr, grad_norm, step_time, tokens_per_s, loss_tokens_per_s)
        progress.update(step, loss, lr, tokens_per_s)
        return tokens_per_s, True

    def _after_step(self, step: int) -> None:
        c = self.config
        if self._saver is not None:
            self._saver.poll()  # commits a background save once every rank has written it
        if c.gc.period is not None and step % c.gc.period == 0:
            gc.collect()
        self._evaluate(step, final=False)
        period = c.checkpointing.period
        if self._checkpoint_requested or (period is not None and step % period == 0):
            self.save_checkpoint()

    def _evaluate(self, step: int, *, final: bool) -> None:
        evaluator = self.parts.evaluator
        if evaluator is not None and evaluator.due(step, final=final):
            evaluator.evaluate(step)

    def _finish(self, finished: bool) -> None:
        c = self.config
        self.parts.data.close()
        if finished and self.progress.step > 0:
            self._evaluate(self.progress.step, final=True)
        wanted = not finished or c.checkpointing.save_at_end
        if wanted and self.progress.step > 0 and self._last_saved != self.progress.step:
            self.save_checkpoint()
        if self._saver is not None:
            self._saver.wait()  # the run ends with every save committed
        if finished and c.checkpointing.export_hf_dir is not None and not self._finished_at_start:
            self.parts.model.export(self.modules, self.ctx, c.checkpointing.export_hf_dir)
            self.ctx.logger.info("exported the model to %s", c.checkpointing.export_hf_dir)
            durable = storage_export_dir(c)
            if durable is not None and self.ctx.is_main_process:
                try:
                    publish_export(c.checkpointing.export_hf_dir, durable)
                    self.ctx.logger.info("copied the export to %s", durable)
                except Exception:  # the store's client; a restart would not export again (run finished)
                    self.ctx.logger.exception(
                        "copying the export to %s failed; `d9d export %s --hf %s` writes it from the last "
                        "commit",
                        durable,
                        c.storage_root,
                        durable,
                    )
        for module in self.modules:  # every rank gets here together: the release is a barrier per EP group
            release_expert_communication(module)
        self.parts.reports.finish()

    def _hint_cuda_graphs(self) -> None:
        """Once, on the main process: where compiled CUDA blocks could replay as graphs and the step runs
        several microbatches, say so (`cuda_graphs_hint`)."""
        reports = self.parts.stages.compile_reports
        compiled = any(r.enabled and r.modules > 0 for r in reports)
        if not self.ctx.is_main_process or self.ctx.device.type != "cuda" or not compiled:
            return
        hint = self.config.cuda_graphs_hint(self.parts.grad_accumulation)
        if hint is not None:
            self.ctx.logger.info(hint)

    def _build_profiler(self) -> StepHook:
        p = self.config.profiling
        if not p.enabled:
            return NullProfiler()
        traces = p.traces_dir if p.traces_dir is not None else self.config.run_dir / "traces"
        return StepProfiler(
            traces,
            self.ctx.rank,
            wait=p.wait,
            warmup=p.warmup,
            active=p.active,
            first_step=self.progress.step,
        )

    def _train_step(self, step: int) -> tuple[float, float, float, float, float] | None:
        """(loss, weight, processed positions (NaN: unknown), grad norm, the learning rate the step ran with)
        of the step, weight and positions summed over the ranks; None when it rolled back (`_nonfinite`).
        The LR is read before the scheduler moves it on to the next step's."""
        parts = self.parts
        lr = parts.optimizer.lr
        microbatches = parts.data.next_step()
        if len(microbatches) != parts.grad_accumulation:
            raise RuntimeError(
                f"data provider returned {len(microbatches)} microbatches for step {step}, "
                f"expected gradient_accumulation={parts.grad_accumulation} (a finite dataset ran out? "
                "repeat it, e.g. data.options.epochs=null for the text provider, or train for fewer steps)"
            )
        # counted on the host batches (no device work); one rank per distinct batch contributes
        positions = processed_positions(microbatches) if self._counts_positions else 0.0
        pin = self.config.data_loading.pin_memory
        microbatches = [to_device(mb, self.ctx.device, pin) for mb in microbatches]
        exchange = parts.exchange
        # What a rerun after an exchange overflow restores (d9d.engine.exchange): RNG streams, task metrics.
        start_state = (
            {k: piece.state_dict() for k, piece in parts.state.per_rank.items()} if exchange.enabled else None
        )
        while True:
            parts.optimizer.zero_grad(set_to_none=True)
            begin_step(parts.stages.compile_reports)
            loss_sum, weight = parts.runner.forward_backward(microbatches)
            record = exchange.take()
            overflow = None if record is None else exchange.overflowed(record)
            totals = global_loss(self.ctx, loss_sum, weight, overflow, positions)
            # Where the optimizer divides gradients inside its update (fused Adam), they stay sums until
            # then: no pass over every gradient for the division, nor for clipping (its factor joins the
            # divisor).
            optimizer_divides = parts.optimizer.divides_gradients
            parts.reducer.finish(None if optimizer_divides else totals[1])
            norm, divisor = parts.clipper.clip(totals[1] if optimizer_divides else None)
            # The loss, its weight and the gradient norm reach the host in one read: the non-finite guard
            # costs no synchronization of its own. Where the optimizer can skip on the device (fused Adam
            # with state), its update is queued before that read, gated by the same values on the device,
            # so the host's wait ends when backward does and the next step's host work overlaps the
            # optimizer kernels.
            read = StepValuesRead(totals[:-1], norm)
            # queued right behind the values' copy: waiting for it after them costs nothing more
            positions_read = HostCopy(totals[-1])
            stepped = parts.optimizer.skips_on_device
            if stepped:
                parts.optimizer.step(skip_if=read.skip, grad_divisor=divisor)
            values = read.wait()
            global_positions = float(positions_read.wait())
            if record is None or not exchange.settle(step, record, values.exchange_overflow):
                break
            assert start_state is not None
            for key, piece in parts.state.per_rank.items():
                piece.load_state_dict(start_state[key])
            self.events.publish(StepRepeated(step, "an expert exchange overflowed its capacity"))
        if exchange.calibrated:
            parts.reports.step_metrics["exchange_capacity_rows"] = float(exchange.largest_rows)
            parts.reports.step_metrics["exchange_reruns"] = float(exchange.reruns)  # since the run began
        if values.weight <= 0:
            raise RuntimeError(
                f"step {step}: the global loss weight is {values.weight}; no sample had a target"
            )
        self.events.publish(ForwardBackwardFinished(step, values.loss_sum, values.weight))
        if not values.finite:
            if not self._nonfinite(step, values, loss_sum):
                return None
        elif not stepped:
            parts.optimizer.step(grad_divisor=divisor)
        if parts.schedulers is not None:
            with warnings.catch_warnings():
                # A skipped first step: torch warns that the schedule moved before the optimizer did.
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                parts.schedulers.step()
        if values.finite:
            self.events.publish(OptimizerStepFinished(step, values.grad_norm, lr))
        return values.loss_sum / values.weight, values.weight, global_positions, values.grad_norm, lr

    def _nonfinite(self, step: int, values: StepValues, local_loss: torch.Tensor) -> bool:
        """A step whose loss or gradient norm is not finite (every rank gets here at the same step). Stop,
        skip the update (True: the step counts) or roll back to the newest commit (False)."""
        c = self.config.trainer
        parts = self.parts
        reason, ranks = describe(step, values, attribute(self.ctx, local_loss, self.modules))
        self._nonfinite_steps += 1
        if c.on_nonfinite == "stop" or self._nonfinite_steps > c.max_nonfinite_steps:
            why = (
                "trainer.on_nonfinite=stop"
                if c.on_nonfinite == "stop"
                else f"more than trainer.max_nonfinite_steps={c.max_nonfinite_steps} in this attempt"
            )
            raise NonFiniteError(
                f"{reason}; stopping ({why}). Nothing of this step was applied; the newest commit is "
                "what a resume continues from (lower the LR, check the data of this step, or set "
                "trainer.on_nonfinite: skip | rollback)",
                step,
                ranks,
            )
        parts.optimizer.zero_grad(set_to_none=True)
        count = f"{self._nonfinite_steps} of at most {c.max_nonfinite_steps} in this attempt"
        parts.reports.step_metrics["nonfinite_steps"] = float(self._nonfinite_steps)
        if c.on_nonfinite == "skip":
            self.ctx.logger.warning("%s; update skipped (trainer.on_nonfinite=skip, %s)", reason, count)
            self.events.publish(StepSkipped(step, reason))
            return True
        to_step = self._rollback(step, reason)
        self.ctx.logger.warning(
            "%s; rolled back to the commit of step %d, skipping the batches of steps %d-%d "
            "(trainer.on_nonfinite=rollback, %s)",
            reason,
            to_step,
            to_step + 1,
            step,
            count,
        )
        self.events.publish(StepSkipped(step, reason, rolled_back_to=to_step))
        return False

    def _rollback(self, step: int, reason: str) -> int:
        """Restore the newest commit, keeping the data position after `step`: the batches since the commit
        are skipped (they are the ones that led here). Returns the commit's step."""
        parts = self.parts
        if self._saver is not None:
            self._saver.wait()  # a save in flight is a commit to roll back to
        latest = parts.checkpointer.latest()
        if latest is None:
            raise NonFiniteError(
                f"{reason}; trainer.on_nonfinite=rollback, but the run has no commit to roll back to",
                step,
                [],
            )
        data_after = parts.data.state_dict()
        engine_state, rank_state = parts.checkpointer.load(
            latest, parts.optimizer.pair_with(parts.stages.by_index)
        )
        parts.state.load_state_dict(engine_state)
        if rank_state is not None:
            parts.state.load_rank_state_dict(rank_state)
        parts.data.load_state_dict(data_after)
        self._last_saved = self.progress.step
        return self.progress.step

    # -- commands (CommandTarget) and checkpoints ---------------------------------------------------

    def request_checkpoint(self) -> None:
        self._checkpoint_requested = True

    def save_requested_checkpoint(self) -> None:
        if self._checkpoint_requested and self.progress.step > 0:
            self.save_checkpoint(commit=True)

    def update(self, values: Mapping[str, Any]) -> None:
        unknown = set(values) - {"lr"}
        if unknown:
            self.ctx.logger.warning("ignoring settings that cannot change live: %s", sorted(unknown))
        if "lr" in values:
            new_lr = float(values["lr"])
            if self.parts.schedulers is not None:
                self.parts.schedulers.set_base_lr(new_lr)
            else:
                self.parts.optimizer.set_lr(new_lr)
            self.ctx.logger.info("learning rate set to %g", new_lr)

    def paused(self) -> None:
        if self._saver is not None:
            self._saver.wait()  # a paused run holds no save written but uncommitted (every rank pauses here)
        self.ctx.logger.info("paused at step %d", self.progress.step)
        self.parts.reports.paused(self.progress.step)

    def resumed(self) -> None:
        self.ctx.logger.info("resumed at step %d", self.progress.step)

    @property
    def asleep(self) -> bool:
        """The training state is in host memory (between a sleep and its wake)."""
        return self._offload.asleep

    def sleep(self) -> None:
        """Parameters, gradients, buffers and optimizer state to host memory (`d9d.engine.offload`)."""
        if self._saver is not None:
            self._saver.wait()  # a save in flight commits before the state leaves the device
        parts = self.parts
        report = self._offload.sleep(
            training_state_tensors(parts.stages.modules, parts.optimizer.optimizers.values())
        )
        self.ctx.logger.info("asleep at step %d: %s", self.progress.step, _describe_sleep(report))
        values = {"asleep": 1.0, "sleep_s": report.seconds, "offloaded_bytes": float(report.offloaded_bytes)}
        if report.device_allocated_before is not None and report.device_allocated_after is not None:
            values["device_allocated_before"] = float(report.device_allocated_before)
            values["device_allocated_after"] = float(report.device_allocated_after)
        self._report_health(values)

    def wake(self) -> None:
        report = self._offload.wake()
        self.ctx.logger.info("awake at step %d: %s", self.progress.step, _describe_wake(report))
        values = {"asleep": 0.0, "wake_s": report.seconds}
        if report.device_allocated_after is not None:
            values["device_allocated_after_wake"] = float(report.device_allocated_after)
        self._report_health(values)

    def _report_health(self, values: dict[str, float]) -> None:
        if self.ctx.is_main_process:
            self.reporter.metrics(MetricPoint(self.progress.step, 0, values, "health", time.time()))

    def save_checkpoint(self, *, commit: bool = False) -> None:
        """Save the current step. With `checkpointing.async` the write goes on in the background and is
        committed later (`d9d.engine.async_save`), unless `commit`: then it is committed before returning
        (a command's request: whoever asked expects the commit)."""
        step = self.progress.step
        self._checkpoint_requested = False
        if self._last_saved == step:
            if commit and self._saver is not None:
                self._saver.wait()
            return  # saved already (a request right after a periodic save, or the resumed step)
        parts = self.parts
        # Never commit non-finite weights (an update from finite gradients can still overflow).
        check_weights_finite(self.ctx, self.modules, step)
        stages = parts.optimizer.pair_with(parts.stages.by_index)
        engine_state, rank_state = parts.state.state_dict(), parts.state.rank_state_dict()
        if self._saver is not None:
            self._saver.save(step, stages, engine_state, rank_state)
            self._last_saved = step  # being written: never started again, committed by the saver
            if commit:
                self._saver.wait()
            return
        start = time.perf_counter()
        path = parts.checkpointer.save(step, stages, engine_state, rank_state)
        self._last_saved = step
        stall = time.perf_counter() - start
        report_metrics(self.ctx, parts.checkpointer, step, {STALL_METRIC: stall})
        self._committed(step, path)

    def _reserve_checkpoint_buffers(self) -> None:
        """Periodic async saves: their host buffers are allocated after the first step, not in the first
        checkpoint step (the optimizer state exists only once a step has run)."""
        if self._saver is not None and self.config.checkpointing.period is not None:
            parts = self.parts
            self._saver.reserve(parts.optimizer.pair_with(parts.stages.by_index))

    def _committed(self, step: int, path: Location) -> None:
        self.events.publish(CheckpointSaved(step, path))


def _describe_sleep(report: SleepReport) -> str:
    text = (
        f"{report.offloaded_bytes / 2**20:.1f} MiB in {report.storages} storages to host "
        f"in {report.seconds:.3f} s"
    )
    if report.device_allocated_before is not None and report.device_allocated_after is not None:
        text += (
            f"; device memory allocated {report.device_allocated_before / 2**20:.1f} MiB -> "
            f"{report.device_allocated_after / 2**20:.1f} MiB"
        )
    if report.kept_bytes:
        text += f"; {report.kept_bytes / 2**20:.1f} MiB not resizable, kept on the device"
    return text


def _describe_wake(report: WakeReport) -> str:
    text = f"{report.restored_bytes / 2**20:.1f} MiB back on the device in {report.seconds:.3f} s"
    if report.device_allocated_after is not None:
        text += f"; device memory allocated {report.device_allocated_after / 2**20:.1f} MiB"
    return text
