"""The serving shapes a candidate is proven at besides one frame: every micro-batch size serving will run
(each golden row judged inside batches of each size) and several inference callers on one session at once,
each judged for reproduction against the same candidate's batch-1 output."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from agent.bundle.load import Bundle
from agent.proof.parity import judge_reproduction
from agent.proof.stage_proof import used_outputs
from agent.proof.stages import pre_fixed_size
from agent.vocabulary.decoders import split_batch
from agent.vocabulary.inputs import InputFeeder


def batch_sizes(bundle: Bundle, max_batch: int) -> tuple[int, ...]:
    """The batch sizes above 1 that serving will run this bundle at: every size up to the micro-batch,
    where the model can be batched at all (the rule `Engine.dynamic_batch` applies)."""
    m = bundle.manifest
    fixed = pre_fixed_size(m.input.shape) if m.preprocess.graph else m.preprocess.resize is None or m.preprocess.resize.fixed_size
    if max_batch <= 1 or isinstance(m.input.shape[0], int) or m.stateful or not fixed:
        return ()
    return tuple(range(2, max_batch + 1))


def judge_batches(opened: Any, m: Any, tensors: Sequence[np.ndarray], single: Sequence[dict[str, np.ndarray]],
                  sizes: Sequence[int], bounds: Any) -> list[Any]:
    """Each golden tensor run inside a batch of each size (filled round-robin with the others, as a
    micro-batch of frames), its row judged for reproduction against the same candidate's batch-1 output:
    a variant exact at batch 1 and wrong at batch 4 served 34/48 where FP32 served 47/48."""
    findings: list[Any] = []
    feeder = InputFeeder.for_manifest(m)
    n = len(tensors)
    for b in sizes:
        # every row of every batch is judged: with fewer golden samples than the batch, a sample repeats
        # in it, and judging only its first row left the rows past the golden count unproven
        rows: list[dict[str, np.ndarray]] = []
        refs: list[dict[str, np.ndarray]] = []
        for start in range(0, n, b):
            idx = [(start + k) % n for k in range(b)]
            batch = np.concatenate([tensors[i] for i in idx])
            outs = dict(zip([o.name for o in opened.session.get_outputs()],
                            opened.session.run(None, feeder.feeds(batch, "selftest"))))
            for k, i in enumerate(idx):
                rows.append(split_batch(outs, k, m.batch_axes))
                refs.append(single[i])
        rows, refs = used_outputs(m, rows, refs)  # outputs not in postprocess.uses: never judged
        q = judge_reproduction(m.postprocess, rows, refs, bounds, "batch 1", stage=f"batch {b}")
        if not q.passed:
            findings += list(q.findings)
            break  # the smallest failing size names the fault
    return findings


def run_concurrently(opened: Any, m: Any, tensors: Sequence[np.ndarray],
                     workers: int) -> list[tuple[int, dict[str, np.ndarray]]]:
    """(golden sample, its outputs) of the golden set run from `workers` callers at once on the one session,
    as serving's inference pool runs it: caller k runs samples k, k + workers, ... (every sample once, every
    caller at least one); with fewer samples than callers, caller k runs sample k mod n (some twice). The
    callers start together (a barrier): a pool thread that finished its share before the next was handed out
    would otherwise run that one too, on one thread -- no concurrency at all (340 of 1,500 two-sample passes
    under load, found by review)."""
    feeder = InputFeeder.for_manifest(m)
    names = [o.name for o in opened.session.get_outputs()]
    n = len(tensors)
    shares = [list(range(k, n, workers)) or [k % n] for k in range(workers)]
    together = threading.Barrier(workers)

    def caller(share: list[int]) -> list[tuple[int, dict[str, np.ndarray]]]:
        try:
            together.wait(timeout=10)
        except threading.BrokenBarrierError:
            pass  # a caller not started within 10 s (a starved machine): the others run anyway
        out = []
        for i in share:
            outs = dict(zip(names, opened.session.run(None, feeder.feeds(tensors[i], "selftest"))))
            out.append((i, split_batch(outs, 0, m.batch_axes)))
        return out

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="selftest-concurrent") as pool:
        return [r for rows in pool.map(caller, shares) for r in rows]


def judge_concurrent(opened: Any, m: Any, tensors: Sequence[np.ndarray], single: Sequence[dict[str, np.ndarray]],
                     workers: int, bounds: Any) -> list[Any]:
    """The golden set from `workers` concurrent callers (`run_concurrently`), every output judged against
    batch 1 run alone: a crash or a wrong answer that needs concurrent callers happens here, under this
    candidate's marker. (Each caller used to run the whole set: twice the runs for the same samples judged,
    58 of the demo FP32 proof's 111 ms.) Findings name the golden sample, not the row of the runs."""
    runs = run_concurrently(opened, m, tensors, workers)
    got, want = used_outputs(m, [r for _, r in runs], [single[i] for i, _ in runs])  # the used outputs only
    q = judge_reproduction(m.postprocess, got, want, bounds, "batch 1", stage=f"{workers} concurrent callers")
    return [replace(f, sample=runs[f.sample][0]) if f.sample is not None and 0 <= f.sample < len(runs) else f
            for f in q.findings]
