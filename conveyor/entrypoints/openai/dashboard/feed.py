"""The dashboard's data: the engine's step records of the last minute, and the state of the
moment (gauges, totals, latency percentiles, the KV block map, the requests held).

Step records come with every step's stats (engine/records.py), so the feed only keeps them:
one append per step, on the thread that reports the step. Everything else is built when a
page asks, at most once per TICK seconds however many pages watch, and the core builds its
snapshot between two steps, so a server nobody watches pays for the records alone.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

from conveyor.engine.records import CoreSnapshot, StepRecord
from conveyor.metrics import EngineMetrics

WINDOW = 60.0  # seconds of step records kept and shown
TICK = 0.5  # seconds between two updates of a page
RATE_WINDOW = 10.0  # seconds over which the throughput tiles are averaged
MAX_RECORDS = 30_000  # a bound on the records kept, whatever the step rate
MAX_REQUEST_ROWS = 256  # rows of the request table, over all replicas


class DashboardFeed:
    def __init__(self, engine, metrics: EngineMetrics, model_name: str, device: str) -> None:
        self.engine, self.metrics = engine, metrics
        self.model_name, self.device = model_name, device
        self.kernel_plan = engine.kernel_plan  # op -> kernel[isa], fixed at load (model/plan.py)
        self.num_replicas = engine.num_replicas
        self.started = time.time()
        self.closed = False  # set on shutdown: open event streams end
        self.num_watchers = 0
        self._records: deque[tuple[int, StepRecord]] = deque()
        self._num_records = 0  # appended so far: the cursor of the next one
        self._last_seq: dict[int, int] = {}  # per replica: the last record taken
        self._lock = threading.Lock()  # records come from the engine thread in-process
        self._hook_seconds = 0.0  # spent in on_step, for the cost line
        self._state: dict | None = None
        self._state_time = 0.0
        self._refresh: asyncio.Task | None = None
        self._snapshots: list[CoreSnapshot | None] = []

    # ---- fed after every step --------------------------------------------------------------

    def on_step(self, engine, outputs) -> None:
        start = time.perf_counter()
        record = engine.get_stats().last_record
        replica = engine.replica_index
        if record is not None and self._last_seq.get(replica) != record.seq:
            self._last_seq[replica] = record.seq
            with self._lock:
                self._records.append((replica, record))
                self._num_records += 1
                oldest = record.time - WINDOW - 5.0
                while self._records and (
                    self._records[0][1].time < oldest or len(self._records) > MAX_RECORDS
                ):
                    self._records.popleft()
        self._hook_seconds += time.perf_counter() - start

    def on_abort(self, engine, request_id: str) -> None:
        """An abort may end the last requests: the core then sends a record of no step."""
        self.on_step(engine, [])

    def records_since(self, cursor: int | None) -> tuple[list[list], int]:
        """Step records after `cursor` (None: the whole window), as rows, and the new cursor."""
        with self._lock:
            records, end = list(self._records), self._num_records
        first = end - len(records)
        start = 0 if cursor is None else max(cursor - first, 0)
        return [_record_row(replica, r) for replica, r in records[start:]], end

    # ---- built when watched ----------------------------------------------------------------

    async def state(self, fresh: bool = False) -> dict:
        """The state of the moment; one build serves every page that asks within a tick.

        The core answers a snapshot between two steps, and a step can take seconds (a long
        prefill chunk on a CPU): so a page's update does not wait for it. It shows the last
        snapshot and asks for the next one (`fresh`: waits for it, for a one-off query)."""
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._refresh_snapshots())
        if fresh or not self._snapshots:
            await asyncio.shield(self._refresh)
        elif self._state is not None and time.monotonic() - self._state_time < TICK * 0.8:
            return self._state
        self._state = self._compose(self._snapshots)
        self._state_time = time.monotonic()
        return self._state

    async def _refresh_snapshots(self) -> None:
        snapshots = await self.engine.snapshots()
        # A replica that did not answer in time keeps its last map.
        if len(self._snapshots) != len(snapshots):
            self._snapshots = list(snapshots)
        else:
            self._snapshots = [s or old for s, old in zip(snapshots, self._snapshots, strict=True)]

    def _compose(self, snapshots: list[CoreSnapshot | None]) -> dict:
        stats = self.engine.get_stats()
        sched = stats.scheduler
        now, mono = time.time(), time.monotonic()
        with self._lock:
            records = list(self._records)
        recent = [r for _, r in records if r.time > now - RATE_WINDOW]
        minute = [r for _, r in records if r.time > now - WINDOW]
        span = min(RATE_WINDOW, max(now - self.started, 1e-9))
        busy = sum(r.seconds for r in recent)
        spec = stats.spec
        finished = dict(self.metrics.finished)
        kv_maps, rows = [], []
        snapshot_seconds = record_seconds = step_seconds = 0.0
        for replica, snapshot in enumerate(snapshots):
            if snapshot is None:
                continue
            snapshot_seconds += snapshot.build_seconds
            record_seconds += snapshot.record_seconds
            step_seconds += snapshot.step_seconds
            kv_maps.append(
                {
                    "replica": replica,
                    "time": snapshot.time,  # when the core took it
                    "num_blocks": snapshot.num_blocks,
                    "block_size": snapshot.block_size,
                    "stride": snapshot.stride,
                    "cells": snapshot.cells.decode("ascii", "replace").translate(_DIGITS),
                    "counts": snapshot.counts,
                }
            )
            rows += [[replica, *row] for row in snapshot.requests]
        rows.sort(key=lambda row: (row[2] != "running", -row[8]))
        ttft, itl = self.metrics.recent_ttft, self.metrics.recent_itl
        return {
            "time": now,
            "model": self.model_name,
            "device": self.device,
            "kernel_plan": self.kernel_plan,
            "replicas": self.num_replicas,
            "uptime": now - self.started,
            "now": {
                "running": sched.num_running,
                "waiting": sched.num_waiting,
                "preempted": sched.num_preempted,
                "kv_usage": sched.kv_cache_usage,
            },
            "totals": {
                "steps": stats.num_steps,
                "prompt_tokens": stats.num_prompt_tokens_total,
                "generation_tokens": stats.num_generation_tokens_total,
                "preemptions": sched.num_preemptions_total,
                "prefix_queries": sched.prefix_cache_queries,
                "prefix_hits": sched.prefix_cache_hits,
                "finished": sum(finished.values()),
                "finished_by_reason": finished,
                "spec_draft_tokens": spec.num_draft_tokens if spec else None,
                "spec_accepted": spec.num_accepted_tokens if spec else None,
            },
            "rates": {  # over the last RATE_WINDOW seconds of steps
                "window": span,
                "generation_tps": sum(r.generated_tokens for r in recent) / span,
                "prefill_tps": sum(r.prefill_tokens for r in recent) / span,
                "steps_per_s": len(recent) / span,
                "step_ms": 1000 * busy / len(recent) if recent else None,
                "requests_per_step": (
                    sum(r.num_requests for r in recent) / len(recent) if recent else None
                ),
                "busy": busy / span / max(self.num_replicas, 1),
            },
            "minute": {  # over the last WINDOW seconds
                "preemptions": sum(len(r.preempted_request_ids) for r in minute),
                "ttft": ttft.summary(mono) if ttft is not None else None,
                "itl": itl.summary(mono) if itl is not None else None,
            },
            "kv": kv_maps,
            "requests": rows[:MAX_REQUEST_ROWS],
            "num_requests": sum(s.num_running + s.num_waiting for s in snapshots if s),
            "cost": {  # what watching costs the engine
                "record_seconds": record_seconds,  # in the core, every step (totals)
                "step_seconds": step_seconds,
                "hook_seconds": self._hook_seconds,  # in the front end, every step
                "snapshot_ms": 1000 * snapshot_seconds,  # in the core, per update
                "watchers": self.num_watchers,
            },
        }


_DIGITS = str.maketrans({chr(i): str(i) for i in range(4)})


def _record_row(replica: int, r: StepRecord) -> list:
    return [
        replica,
        r.step,
        round(r.time, 4),
        round(r.seconds, 5),
        r.num_requests,
        r.prefill_tokens,
        r.decode_tokens,
        r.generated_tokens,
        r.joined,
        r.first_token,
        r.left,
        tuple(r.preempted_request_ids),
    ]
