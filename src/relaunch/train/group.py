"""Process-level recovery for `torch.distributed`: healthy ranks keep running through a fault.

The SDK owns the process group's life. relaunch's controller publishes a *membership* (a
generation, where its store listens, which ranks take part, which are replacements); the launcher
writes it where `RELAUNCH_MEMBERSHIP` says. :class:`ProcessGroupKeeper` runs the training loop::

    keeper = ProcessGroupKeeper(model, optimizer)
    if not keeper.start():                     # a replacement got its state from a healthy rank
        keeper.completed = load_my_checkpoint()  # others resume as usual
    keeper.settle(sample_input)
    keeper.run(keeper.completed + 1, steps, train_step, after=on_step_done, checkpoint=ckpt)

where ``train_step(step)`` zeroes the gradients, runs forward and backward through
``keeper.module`` (the DDP wrapper) and returns whatever it likes; the keeper then agrees with
every rank that the step may be committed, and only then calls ``optimizer.step()``. So a fault
can only interrupt a step before any rank changed its parameters, and:

- when a peer dies or hangs, the collective in progress fails (a dead peer's connection resets;
  a new membership aborts the group: `train.sockets`; else ``collective_timeout_s``). The keeper
  says so (a data link down at the time: relaunch re-forms the group once it is back, R-30),
  drops the group, waits for the next membership (`train.following`), joins the new group, and a
  healthy rank broadcasts the model, optimizer, RNG state and step to every member (on record as
  a restore); then the step runs again. Healthy ranks never restart, re-import or reload;
- when the controller asks for an online retry (a memory UCE or a network fault), every rank sees
  it at the next commit, rolls back what the step changed (random streams and buffers; a rank
  whose memory the fault touched takes model and optimizer from a healthy replica, or from its
  own copy with ``rollback="snapshot"``: `StepRollback`), and runs the step again.
Without ``RELAUNCH_MEMBERSHIP`` (process-level recovery off), the keeper starts the group from
the usual torchrun variables and a fault propagates as an exception."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from relaunch._rendezvous import STORE_WAIT_S, wait_for_store
from relaunch.protocol.datagrams import RestoreTier
from relaunch.protocol.environment import Env
from relaunch.protocol.operator import OperatorRetry
from relaunch.protocol.plans import Membership, read_membership
from relaunch.protocol.rollback import StepRollback
from relaunch.train import following, overlap, progress
from relaunch.train.checkpoint import CheckpointManager
from relaunch.train.collectives import RetryableCollectives, settings_from_env
from relaunch.train.distributed import (
    elastic_boundaries,
    replica_restore,
    restore_snapshot,
    rng_state,
    rollback_mode,
    set_rng_state,
    settle_ddp_buckets,
    step_snapshot,
)
from relaunch.train.following import GroupLost, Member, changed_membership, wait_for_membership
from relaunch.train.progress import SdkPhase, flush_progress, report_phase, report_restore
from relaunch.train.sockets import StepGuard, shut_down, tcp_sockets

__all__ = ["GroupLost", "Membership", "ProcessGroupKeeper", "read_membership"]
# Membership and read_membership are the protocol's (relaunch.protocol.plans), re-exported here.

NCCL_CLEAN_UP_ONLY = "2"
"""ProcessGroupNCCL's error handling "CleanUpOnly": abort the communicator, keep the process."""


class _Retry(Exception):
    def __init__(self, generation: int) -> None:
        self.generation = generation


class ProcessGroupKeeper:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        backend: str = "gloo",
        collective_timeout_s: float | None = None,
        wait_s: float | None = None,
        rollback: str | None = None,
        ddp_options: dict[str, Any] | None = None,
        elastic_every: int | None = None,
        operator_retry: bool | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.backend = backend
        self.nccl = "nccl" in backend.lower()
        env_timeout = os.environ.get(Env.COLLECTIVE_TIMEOUT)
        self.collective_timeout_s = collective_timeout_s or float(env_timeout or 30.0)
        env_wait = os.environ.get(Env.RECOVERY_WAIT)
        self.wait_s = wait_s or float(env_wait or 300.0)
        self.rollback = rollback_mode(rollback, optimizer)
        self.elastic_every, self.elastic = elastic_boundaries(elastic_every)
        self._boundary: dict[str, Any] | None = None
        self.ddp_options = ddp_options or {}
        self.original_rank = int(os.environ.get(Env.RANK, "0"))
        self.pod = int(os.environ[Env.POD]) if Env.POD in os.environ else None
        self.pod_generation = int(os.environ.get(Env.POD_GENERATION, "1"))
        path = os.environ.get(Env.MEMBERSHIP)
        self.membership_path = Path(path) if path else None
        self.membership: Membership | None = None
        self._seen_mtime = 0.0
        self.completed = 0
        """The last step every rank committed."""
        self.module: nn.Module = model
        self.sample: tuple[torch.Tensor, ...] = ()
        self._sockets: set[int] = set()
        self._stores: list[Any] = []
        self._step = StepGuard()
        self._aborted = False
        """The current group was aborted (a newer membership): its collectives' results are void."""
        self._closing = threading.Event()
        self.recoveries: list[dict[str, Any]] = []
        """One entry per recovery this process took part in (kind, generation, step, seconds)."""
        self.ops: RetryableCollectives | None = None
        """R-29: the keeper's collectives (DDP's buckets, its commit, `all_reduce`), issued again
        after a transport fault; on when the job turns operator retry on (HCCL_OP_RETRY_ENABLE
        with L1:1) and process-level recovery runs (`operator_retry` forces it on or off)."""
        settings = settings_from_env()
        wanted = settings is not None if operator_retry is None else operator_retry
        if wanted and self.membership_path is not None and not self.nccl:
            self.ops = RetryableCollectives(
                self.membership_path,
                self.original_rank,
                settings or OperatorRetry(),
                self.collective_timeout_s,
            )

    # -- identity -------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        if self.membership is None:
            return self.original_rank
        return self.membership.ranks[self.original_rank]

    @property
    def world_size(self) -> int:
        if self.membership is None:
            return int(os.environ.get(Env.WORLD_SIZE, "1"))
        return self.membership.world_size

    @property
    def generation(self) -> int:
        return self.membership.generation if self.membership is not None else 0

    @property
    def recovery_enabled(self) -> bool:
        return self.membership_path is not None

    # -- membership -----------------------------------------------------------------------------

    def _latest(self) -> Membership | None:
        """The membership file's content if it changed since the last look (one stat otherwise)."""
        assert self.membership_path is not None
        found, self._seen_mtime = changed_membership(self.membership_path, self._seen_mtime)
        return found

    def _wait_for(self, newer_than: int, deadline: float) -> Membership:
        """The first membership of a generation above `newer_than` that includes this rank."""
        assert self.membership_path is not None
        member = Member(self.original_rank, self.pod, self.pod_generation)
        found = wait_for_membership(self.membership_path, newer_than, deadline, member)
        if found is None:
            raise GroupLost(
                f"no new membership after generation {newer_than} within {self.wait_s:g} s"
            )
        return found

    # -- the group ------------------------------------------------------------------------------

    def _init(self, m: Membership | None) -> None:
        """Form the group of membership `m` (relaunch hears of it: no recovery meanwhile, R-37)."""
        report_phase(SdkPhase.GROUP)
        before = tcp_sockets()
        try:
            self._form(m)
        finally:
            self._sockets = tcp_sockets() - before
            report_phase(SdkPhase.TRAINING)
        self.membership = m

    def _abort(self) -> None:
        """Make every collective of the current group fail now, here and at every peer. NCCL:
        abort the communicators (ncclCommAbort; each peer's keeper aborts its own when it sees
        the new membership, its collectives do not run over sockets). gloo, which has no abort
        that unblocks: shut the group's TCP connections down, which every peer sees at once."""
        self._aborted = True
        if self.nccl and dist.is_initialized():
            with contextlib.suppress(RuntimeError, ValueError):
                dist.distributed_c10d._abort_process_group()
        shut_down(self._sockets)
        self._sockets = set()

    def _watch(self) -> None:
        """A newer membership that re-forms the group aborts the step's collectives (StepGuard)."""
        assert self.membership_path is not None
        while not self._closing.wait(0.05):
            with self._step.deciding() as inside:
                if not inside:
                    continue
                found = read_membership(self.membership_path)
                if (
                    found is not None
                    and found.generation > self.generation
                    and not found.retry
                    and found.operator is None
                    and found.generation > (self.ops.generation if self.ops else 0)
                ):
                    self._abort()

    def _form(self, m: Membership | None) -> None:
        timeout = timedelta(seconds=self.collective_timeout_s)
        if self.nccl and self.membership_path is not None:
            # a failed collective aborts its communicator and raises, the process lives on for
            # the keeper to re-form the group (torchrun's default, 1, tears the process down)
            os.environ[Env.NCCL_ASYNC_ERROR_HANDLING] = NCCL_CLEAN_UP_ONLY
            os.environ[Env.NCCL_BLOCKING_WAIT] = "1"
        self._aborted = False
        if m is None:
            dist.init_process_group(self.backend, timeout=timeout)
        else:
            rank = m.ranks[self.original_rank]
            if rank != 0:  # not into torch's connect backoff (relaunch._rendezvous)
                wait_for_store(m.addr, m.port, STORE_WAIT_S)
            store = dist.TCPStore(  # type: ignore[attr-defined]
                m.addr,
                m.port,
                m.world_size,
                is_master=rank == 0,
                timeout=timedelta(seconds=self.wait_s),
            )
            self._stores.append(store)  # a store's server lives as long as its host process:
            # freed while peers still talk to it, it takes them down (std::terminate)
            dist.init_process_group(
                self.backend, store=store, rank=rank, world_size=m.world_size, timeout=timeout
            )
            if self.ops is not None:
                self.ops.formed(m, store)

    def _device(self) -> torch.device:
        """Where the group's own tensors live: NCCL reduces only tensors on this rank's GPU."""
        if self.nccl:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _wrap(self) -> None:
        self.module = DistributedDataParallel(self.model, **self.ddp_options)
        if self.ops is not None:
            ops = self.ops
            # a lambda: DDP refuses a hook whose annotations are not its own types, and this
            # module's are strings (postponed evaluation)
            self.module.register_comm_hook(None, lambda state, bucket: ops.ddp_hook(state, bucket))

    def _drop_group(self) -> None:
        if dist.is_initialized():
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group()

    def _sync_from_healthy(self, m: Membership) -> None:
        """A healthy rank (the lowest that is not a replacement) broadcasts its state to all."""
        source = min(m.ranks[r] for r in m.ranks if r not in m.joiners)
        box: list[Any] = [None]
        if self.rank == source:
            box = [{"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "rng": rng_state(), "completed": self.completed}]  # fmt: skip
        dist.broadcast_object_list(box, src=source)
        state = box[0]
        if self.rank != source:
            overlap.settle_pending()  # an overlapped save's copy comes before the state it gets
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            set_rng_state(state["rng"])
            self.completed = int(state["completed"])
        if self.original_rank in m.joiners:  # on record: a healthy rank's memory served it
            report_restore(self.completed, RestoreTier.REPLICA, str(source))

    def _begin(self, m: Membership | None) -> None:  # the state once the group first formed
        if m is not None and m.joiners:
            self._sync_from_healthy(m)
        self._wrap()

    def _rejoin(self, m: Membership) -> None:
        """The state after the group re-formed (`_recover`): a healthy rank's, for every rank."""
        self._sync_from_healthy(m)
        self._wrap()
        self._settle()

    def _retry_restore(self, m: Membership) -> None:  # an online retry's suspects: a replica's
        replica_restore(self.model, self.optimizer, m, self.original_rank, self.completed)

    def start(self) -> bool:
        """Form the group. True if this process is a replacement that joined a running job: it
        received the healthy ranks' state and step (:attr:`completed`) and must not load a
        checkpoint. False for a normal start: the script loads its checkpoint, if any, and sets
        :attr:`completed` to the step it resumes after."""
        m = None
        if self.membership_path is not None:
            m = self._wait_for(0, time.time() + self.wait_s)
            self._seen_mtime = self.membership_path.stat().st_mtime_ns
        self._init(m)
        joined = m is not None and self.original_rank in m.joiners
        self._begin(m)
        if self.membership_path is not None:
            threading.Thread(target=self._watch, name="relaunch-membership", daemon=True).start()
        return joined

    def settle(self, *sample: torch.Tensor) -> None:
        """One zero-loss pass so that DDP's gradient buckets are laid out as in an unbroken run
        (see train.distributed.settle_ddp_buckets); repeated after every re-formed group. A
        collective: every rank calls it once, after :meth:`start` and any checkpoint load."""
        self.sample = sample
        self._settle()

    def _settle(self) -> None:
        if self.ops is not None:
            self.ops.begin_step(self.completed)  # its collectives: the same place on every rank
        if self.sample and isinstance(self.module, DistributedDataParallel):
            settle_ddp_buckets(self.module, *self.sample)

    # -- the loop -------------------------------------------------------------------------------

    def commit(self) -> None:
        """Every rank agrees that the step may be applied; raises _Retry if any rank has seen a
        newer membership (so that all of them roll back the same step)."""
        if self.membership is None:
            return
        latest = self._latest()
        seen = self.generation
        if latest is not None and latest.operator is None:
            seen = latest.generation
        flag = torch.tensor([seen], dtype=torch.int64, device=self._device())
        if self.ops is not None:
            self.ops.all_reduce(flag, dist.ReduceOp.MAX)
        else:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True).wait()
        if self._aborted:  # NCCL: an aborted collective may complete with anything in `flag`
            raise RuntimeError("the process group was aborted during the step")
        if int(flag.item()) > self.generation:
            raise _Retry(int(flag.item()))

    def _mark_boundary(self) -> None:
        """In memory, the state after an elastic boundary step: a change of world size resumes
        from here, so when it takes effect depends on the step only, never on timing."""
        if not self.recovery_enabled or not self.elastic:
            return
        self._boundary = {**step_snapshot(self.model, self.optimizer, True), "at": self.completed}

    def _back_to_boundary(self) -> None:
        boundary = self._boundary
        if boundary is None:
            return
        restore_snapshot(self.model, self.optimizer, boundary)
        self.completed = int(boundary["at"])

    def run(
        self,
        first: int,
        last: int,
        train_step: Callable[[int], Any],
        after: Callable[[int, Any], None] | None = None,
        checkpoint: CheckpointManager | None = None,
    ) -> None:
        """Steps `first` to `last`: `train_step`, the commit, the optimizer's step and (while a
        SIGTERM waits) `checkpoint.completed_step`, then `after(step, train_step's result)`."""
        step = first
        self._mark_boundary()
        while step <= last:
            snapshot = self._take_snapshot()
            if self.ops is not None:
                self.ops.begin_step(step)
            self._step.enter()
            try:
                result = train_step(step)
                self.commit()
            except _Retry as retry:
                self._step.leave()
                with following.gasp_if_stale(checkpoint):
                    self._recover(step, snapshot, retry.generation)
                step = self.completed + 1
                continue
            except (RuntimeError, dist.DistError) as error:
                self._step.leave()
                if not self.recovery_enabled:
                    raise
                if self.ops is None and not self._aborted:  # relaunch hears it
                    progress.report_collective_failure(step, 0, self.generation, str(error))
                self._abort()  # the peers still blocked in this collective fail now too
                with following.gasp_if_stale(checkpoint):
                    self._recover(step, snapshot, None, error)
                step = self.completed + 1
                continue
            self._step.leave()
            with checkpoint.hold_gasp() if checkpoint is not None else contextlib.nullcontext():
                self.optimizer.step()
                self.completed = step
                if checkpoint is not None:
                    checkpoint.completed_step = step
            if step % self.elastic_every == 0:
                self._mark_boundary()
            if after is not None:
                after(step, result)
            step += 1

    def all_reduce(self, tensor: torch.Tensor, op: Any = None) -> None:
        """`dist.all_reduce(tensor, op)` in the keeper's group, inside a step (`train_step`): with
        operator retry on, issued again after a transport fault, not failing the step (R-29)."""
        if self.ops is not None:
            self.ops.all_reduce(tensor, op)
        else:
            dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM)

    def _take_snapshot(self) -> dict[str, Any] | None:
        if not self.recovery_enabled:
            return None
        return step_snapshot(self.model, self.optimizer, self.rollback is StepRollback.SNAPSHOT)

    def _restore(self, snapshot: dict[str, Any] | None) -> None:
        if snapshot is not None:
            restore_snapshot(self.model, self.optimizer, snapshot)

    def _recover(
        self,
        step: int,
        snapshot: dict[str, Any] | None,
        generation: int | None,
        error: BaseException | None = None,
    ) -> None:
        began = time.time()
        self._restore(snapshot)
        deadline = began + self.wait_s
        if generation is not None:
            m = self._wait_for(generation - 1, deadline)
            if m.retry:
                self._retry_restore(m)
                self.membership = m
                self._seen_mtime = 0.0
                self._note("retry", m.generation, step, began)
                return
        failed_at = self.generation
        world = self.world_size
        while True:
            self._drop_group()
            m = self._wait_for(failed_at, deadline)
            if m.world_size != world:
                # Elastic: every member goes back to the last boundary, so that the new sharding
                # starts at a step that does not depend on when the fault was noticed.
                self._back_to_boundary()
                world = m.world_size
            try:
                self._init(m)
                self._rejoin(m)
            except (RuntimeError, dist.DistError) as again:
                failed_at = m.generation  # the replacement failed too: wait for the next one
                error = again
                if time.time() >= deadline:
                    raise GroupLost(f"could not re-form the group: {again}") from error
                continue
            self._seen_mtime = 0.0
            self._note("rejoin", m.generation, step, began)
            return

    def _note(self, kind: str, generation: int, step: int, began: float) -> None:
        seconds, world_size = time.time() - began, self.world_size
        self.recoveries.append(dict(kind=kind, generation=generation, step=step,
                                    world_size=world_size, seconds=seconds))  # fmt: skip
        print(
            f"[relaunch] rank {self.original_rank}: {kind} at step {step}, generation "
            f"{generation}, now rank {self.rank} of {self.world_size}, resuming after step "
            f"{self.completed}, {time.time() - began:.3f} s",
            flush=True,
        )

    def close(self) -> None:
        """Stop watching the membership. The group itself ends with the process: destroying a
        gloo group whose store another rank hosts can abort the process at exit."""
        self._closing.set()

    def exit(self, code: int = 0) -> NoReturn:
        """End the process now, output flushed: groups abandoned in a recovery own gloo threads
        whose C++ destructors can std::terminate at exit (torch 2.13 on CPU: 134 after a clean
        finish). Call it last, after checkpoints are written (CheckpointManager.wait())."""
        self.close()
        flush_progress()  # os._exit skips atexit, which would send the last step
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
