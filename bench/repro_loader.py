"""The training stand-in: a real ``torch.utils.data.DataLoader`` feeding a loop whose GPU step is
a sleep (or a tiny real model on the CPU), timed batch by batch.

For every batch the loop records when it asked for it, when it got it (the difference is the time
the step waited for data) and when its step ended; every sample carries the seconds its ``pread``
took. Times are seconds since the loop started, and the start includes creating the loader's
iterator (forking the workers), as a training job's first batch does.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from bench.repro_data import PackedTokenShards, ShardLayout

SEQUENTIAL = "sequential"
SHUFFLED = "shuffled"
ORDERS = (SEQUENTIAL, SHUFFLED)
STEP_SLEEP = "sleep"
STEP_TINY_MODEL = "tiny-model"
STEP_KINDS = (STEP_SLEEP, STEP_TINY_MODEL)

TINY_VOCAB = 4096
"""Token ids are folded into this many embeddings for the tiny model: it exists to put a real
forward/backward pass on the CPU, not to learn anything."""
TINY_WIDTH = 64
"""Embedding and hidden width of the tiny model."""
TINY_STRIDE = 128
"""The model sees every 128th position of each window: 20-30 ms per batch of 24 on one core
of this machine, near the default sleep step, rather than seconds for all 4,096."""
TINY_THREADS = 1
"""torch threads for the tiny model, so it takes one core and leaves the other to I/O."""
WORKER_WARNING = ".*worker processes in total.*"
"""torch warns when there are more workers than cores; the brief's loader has 8 workers on this
2-core machine on purpose (they mostly wait on I/O), so the warning is silenced."""


@dataclass(frozen=True)
class LoopConfig:
    """One loop's knobs; the defaults are the brief's baseline."""

    batch_size: int = 24
    workers: int = 8
    prefetch_factor: int = 4
    step_seconds: float = 0.020  # the GPU step's stand-in; 0 makes the loop I/O bound
    step_kind: str = STEP_SLEEP
    batches: int = 999  # stop after this many (or at the end of the epoch, if sooner)
    order: str = SEQUENTIAL
    seed: int = 0  # fixes the shuffled order, the same for every target


@dataclass
class LoopTrace:
    """What one loop measured; times in seconds since the loop started."""

    batch_size: int
    asked: list[float] = field(default_factory=list)  # step i asked for batch i
    ready: list[float] = field(default_factory=list)  # batch i arrived
    done: list[float] = field(default_factory=list)  # step i ended
    read_seconds: list[float] = field(default_factory=list)  # every sample's pread, in order
    probes: list[Any] = field(default_factory=list)  # probe() at the start and after the end

    @property
    def batches(self) -> int:
        return len(self.done)

    def to_json(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "asked": self.asked, "ready": self.ready,
                "done": self.done, "read_seconds": self.read_seconds}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LoopTrace:
        return cls(data["batch_size"], data["asked"], data["ready"], data["done"],
                   data["read_seconds"])


def make_sampler(order: str, samples: int, seed: int) -> Iterable[int] | None:
    """The index order: None lets the DataLoader read sequentially; shuffled is a seeded
    ``RandomSampler``, so every target reads the same permutation."""
    import torch
    from torch.utils.data import RandomSampler

    if order == SEQUENTIAL:
        return None
    if order == SHUFFLED:
        generator = torch.Generator()
        generator.manual_seed(seed)
        return RandomSampler(range(samples), generator=generator)
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def _sleep_step(seconds: float) -> Callable[[Any], None]:
    def step(tokens: Any) -> None:
        time.sleep(seconds)
    return step


def _tiny_model_step() -> Callable[[Any], None]:
    """Forward, backward and an SGD update of a two-layer model on the batch, on the CPU."""
    import torch

    torch.set_num_threads(TINY_THREADS)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(TINY_VOCAB, TINY_WIDTH),
                                torch.nn.Linear(TINY_WIDTH, TINY_WIDTH), torch.nn.Tanh(),
                                torch.nn.Linear(TINY_WIDTH, TINY_VOCAB))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(tokens: Any) -> None:
        ids = (tokens[:, :-1] % TINY_VOCAB).long()
        targets = (tokens[:, 1:] % TINY_VOCAB).long()
        logits = model(ids[:, ::TINY_STRIDE])
        loss = loss_fn(logits.reshape(-1, TINY_VOCAB), targets[:, ::TINY_STRIDE].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return step


def make_step(config: LoopConfig) -> Callable[[Any], None] | None:
    """The GPU step's stand-in, or None for the I/O-bound loop."""
    if config.step_kind == STEP_TINY_MODEL:
        return _tiny_model_step()
    if config.step_kind != STEP_SLEEP:
        raise ValueError(f"step kind must be one of {STEP_KINDS}, got {config.step_kind!r}")
    return _sleep_step(config.step_seconds) if config.step_seconds > 0 else None


def run_loop(root: str, layout: ShardLayout, config: LoopConfig,
             wrap_sampler: Callable[[Iterable[int]], Iterable[int]] | None = None,
             probe: Callable[[], Any] | None = None) -> LoopTrace:
    """Train-loop stand-in over the shards in ``root``; returns its per-batch timings.

    ``wrap_sampler`` wraps the index sampler (the hints sampler does); ``probe`` is called just
    before the loop starts and just after its last batch, and its answers kept in the trace
    (the bench reads link counters there).
    """
    from torch.utils.data import DataLoader, SequentialSampler

    dataset = PackedTokenShards(root, layout)
    sampler = make_sampler(config.order, layout.samples, config.seed)
    if wrap_sampler is not None:
        sampler = wrap_sampler(sampler if sampler is not None
                               else SequentialSampler(range(layout.samples)))
    warnings.filterwarnings("ignore", message=WORKER_WARNING)
    loader = DataLoader(dataset, batch_size=config.batch_size, sampler=sampler, shuffle=False,
                        num_workers=config.workers, drop_last=True,
                        prefetch_factor=config.prefetch_factor if config.workers else None)
    batches = min(config.batches, len(loader))
    step = make_step(config)
    trace = LoopTrace(config.batch_size)
    if probe is not None:
        trace.probes.append(probe())
    clock = time.perf_counter
    started = clock()
    iterator = iter(loader)
    try:
        for _ in range(batches):
            asked = clock()
            tokens, read_seconds = next(iterator)
            ready = clock()
            if step is not None:
                step(tokens)
            trace.asked.append(asked - started)
            trace.ready.append(ready - started)
            trace.done.append(clock() - started)
            trace.read_seconds.extend(read_seconds.tolist())
        if probe is not None:
            trace.probes.append(probe())
    finally:
        # Stop the workers now, so none keeps a shard (and so the mount) open. Dropping the
        # iterator does that only when nothing else holds it, and an exception's traceback does.
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        del iterator
        dataset.close()
    return trace
