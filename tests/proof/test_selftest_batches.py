"""The self-test proves every batch size serving will run: a variant exact at batch 1 and wrong at
batch 4 is rejected when serving micro-batches up to 4 (it served 34/48 correct where FP32 served 47/48)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.bundle.load import load_bundle
from agent.config import Config, PipelineConfig
from agent.proof.selftest import SelftestOptions, batch_sizes, options_from_config, run_selftest
from agent.testing import rewrite_manifest
from batch_faults import batch_opts, wrong_at_batch

DIGITS = Path(__file__).resolve().parents[2] / "models" / "digits-classifier"


def test_a_variant_wrong_only_at_batch_4_is_rejected_when_serving_batches_up_to_4(tiny_bundle: Path) -> None:
    wrong_at_batch(tiny_bundle / "model_int8.onnx", 4)
    rewrite_manifest(tiny_bundle)
    bundle = load_bundle(tiny_bundle)
    assert run_selftest(bundle, None, batch_opts(1)).selected is not None  # exact at batch 1: batch 1 cannot see it
    assert run_selftest(bundle, None, batch_opts(3)).selected is not None  # sizes 2 and 3 are fine too
    report = run_selftest(bundle, None, batch_opts(4))
    assert report.selected is None
    int8 = next(r for r in report.results if r.candidate.variant == "int8")
    found = [f for f in int8.findings if f.check == "reproduction"]
    assert found and found[0].stage == "batch 4", int8.reasons


def test_the_batch_sizes_proven_follow_the_serving_configuration(tiny_bundle: Path) -> None:
    bundle = load_bundle(tiny_bundle)
    assert batch_sizes(bundle, 1) == () and batch_sizes(bundle, 4) == (2, 3, 4)
    cfg = Config(pipeline=PipelineConfig(max_batch=4))
    assert options_from_config(cfg).max_batch == 4


def test_the_golden_set_also_runs_from_as_many_concurrent_callers_as_serving_uses(tiny_bundle: Path) -> None:
    from dataclasses import replace

    from agent.proof import selftest

    calls: list[int] = []
    real = selftest.judge_concurrent

    def spy(opened, m, tensors, single, workers, bounds):  # the real check, counted
        calls.append(workers)
        return real(opened, m, tensors, single, workers, bounds)

    selftest.judge_concurrent = spy
    try:
        report = run_selftest(load_bundle(tiny_bundle), None, replace(batch_opts(2), workers=3))
    finally:
        selftest.judge_concurrent = real
    assert report.selected is not None and calls == [3]  # a healthy variant reproduces under 3 callers
    assert options_from_config(Config(pipeline=PipelineConfig(inference_workers=3))).workers == 3


def test_concurrent_callers_share_the_golden_set_each_sample_once_under_concurrency(tiny_bundle: Path) -> None:
    """Each caller runs its own share (every sample once, not the whole set per caller: twice the runs of a
    two-caller proof bought nothing); fewer samples than callers: each caller still runs one."""
    import numpy as np

    from agent.proof import selftest
    from agent.proof.session import open_session
    from agent.proof.terms import SessionSettings

    bundle = load_bundle(tiny_bundle)
    m = bundle.manifest
    golden = list(bundle.golden_samples())
    opened = open_session(bundle.path(m.variant("fp32").file), "CPUExecutionProvider", {}, SessionSettings(),
                          sample=golden[0].input)
    tensors = [g.input for g in golden]
    single = [selftest.split_batch(o, 0) for t in tensors for o in selftest.run_golden(opened, m, t, False)]
    ran: list[int] = []
    real_run = opened.session.run

    def counted(names, feeds, *a):  # the real session, its runs counted by which golden tensor they were given
        x = next(iter(feeds.values()))
        ran.append(next(i for i, t in enumerate(tensors) if t.shape == x.shape and np.array_equal(t, x)))
        return real_run(names, feeds, *a)

    opened.session.run = counted
    bounds = selftest.reproduction_bounds("fp32", "CPUExecutionProvider", m.selftest.reproduction)
    assert len(tensors) >= 4 and selftest.judge_concurrent(opened, m, tensors, single, 2, bounds) == []
    assert sorted(ran) == list(range(len(tensors)))  # once each
    ran.clear()
    assert selftest.judge_concurrent(opened, m, tensors[:3], single[:3], 2, bounds) == []
    assert sorted(ran) == [0, 1, 2]  # odd: still once each (the shares were cut in halves, and one wrapped)
    ran.clear()
    assert selftest.judge_concurrent(opened, m, tensors[:1], single[:1], 3, bounds) == []
    assert ran == [0, 0, 0]


def test_with_one_serving_worker_the_proof_never_calls_the_model_from_two_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Serving with `inference_workers: 1` never runs its session from two threads; the proof (its reduced-decode
    check makes frames on two threads) must not either, or a provider unsafe under concurrent calls would be
    charged for a crash serving never has (found by review)."""
    import threading

    from agent.proof import selftest
    from agent.proof.selection import SelectionPolicy

    real_open = selftest.open_session
    lock, state = threading.Lock(), {"now": 0, "most": 0}

    def open_session(*a, **kw):  # the real session, its runs in flight counted
        opened = real_open(*a, **kw)
        run = opened.session.run

        def counted(*x, **y):
            with lock:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
            try:
                return run(*x, **y)
            finally:
                with lock:
                    state["now"] -= 1

        opened.session.run = counted
        return opened

    monkeypatch.setattr(selftest, "open_session", open_session)
    opts = selftest.SelftestOptions(use_cache=False, workers=1, policy=SelectionPolicy(variant="fp32"))
    report = run_selftest(load_bundle(DIGITS), tmp_path, opts)
    assert report.selected is not None and report.decode["max_scale"] > 1, report.decode  # the check ran, and passed
    assert state["most"] == 1


def _counting_sessions(monkeypatch: pytest.MonkeyPatch, wrong_when_concurrent: bool = False,
                       wrong_when_alone: bool = False) -> list[tuple[str, object]]:
    """Every candidate session's runs: (the thread that made it, its first input); `wrong_when_concurrent`: the
    outputs of runs made by the proof's concurrent callers are shifted (a session wrong only under concurrent
    callers, as a thread-unsafe kernel would be; run alone it is exact); `wrong_when_alone`: the other way
    round (wrong only when one caller runs it, as serving does at light load)."""
    import threading

    import numpy as np

    from agent.proof import selftest

    threads: list[tuple[str, object]] = []
    real_open = selftest.open_session

    def open_session(*a, **kw):
        opened = real_open(*a, **kw)
        run = opened.session.run

        def counted(*x, **y):
            name = threading.current_thread().name
            threads.append((name, next(iter(x[1].values()))))
            outs = run(*x, **y)
            if name.startswith("selftest-concurrent") and wrong_when_concurrent or \
                    not name.startswith("selftest-concurrent") and wrong_when_alone:
                outs = [np.asarray(o) + np.float32(8.0) for o in outs]
            return outs

        opened.session.run = counted
        return opened

    monkeypatch.setattr(selftest, "open_session", open_session)
    return threads


def _fp32_with_callers(workers: int) -> SelftestOptions:
    """The FP32 alone, proven for `workers` serving callers, no micro-batch, no reduced decode."""
    from dataclasses import replace

    from agent.proof.selection import SelectionPolicy

    return replace(SelftestOptions(use_cache=False, latency_runs=3, policy=SelectionPolicy(variant="fp32")),
                   workers=workers, skip_reduced_decode="not this test's question")


def test_with_concurrent_callers_the_golden_set_runs_once_from_them_and_reproduces(
        tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Serving with two inference workers and no micro-batches: the one golden pass runs from two callers (each
    sample once), judged against the variant's recorded outputs; no second pass alone (it doubled the golden
    runs: 4.5 of a U2-Net-p proof's 10.3 s)."""
    import numpy as np

    runs = _counting_sessions(monkeypatch)
    bundle = load_bundle(tiny_bundle)
    golden = [g.input for g in bundle.golden_samples()]
    opts = _fp32_with_callers(2)
    report = run_selftest(bundle, None, opts)
    assert report.selected is not None, report.reason

    def sample(x: object) -> int | None:
        return next((i for i, g in enumerate(golden) if np.shape(g) == np.shape(x) and np.array_equal(g, x)), None)

    concurrent = [sample(x) for t, x in runs if t.startswith("selftest-concurrent")]
    assert len(golden) >= 2 and sorted(concurrent) == list(range(len(golden))), concurrent  # each sample once
    assert len({t for t, _ in runs if t.startswith("selftest-concurrent")}) == 2
    # alone, only the latency loop's tensor (golden[0]) runs: no second golden pass
    alone = {sample(x) for t, x in runs if not t.startswith("selftest-concurrent")} - {None}
    assert alone <= {0}, alone


def test_a_session_wrong_only_under_concurrent_callers_is_refused_naming_the_concurrent_callers(
        tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reproduction under concurrent callers fails; the lone pass that follows tells the fault apart: the
    candidate is refused at stage `2 concurrent callers`, not as a wrong model."""
    _counting_sessions(monkeypatch, wrong_when_concurrent=True)
    opts = _fp32_with_callers(2)
    report = run_selftest(load_bundle(tiny_bundle), None, opts)
    assert report.selected is None
    fp32 = next(r for r in report.results if r.candidate.variant == "fp32")
    stages = {f.stage for f in fp32.findings if f.check == "reproduction"}
    assert stages == {"2 concurrent callers"}, fp32.reasons


def test_every_concurrent_caller_runs_samples_of_its_own(tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three callers, each its own thread and at least one sample (a fault needing all of serving's callers in
    flight must meet all of them: cut in thirds of ceil(n/3), one caller ran nothing for some counts)."""
    runs = _counting_sessions(monkeypatch)
    bundle = load_bundle(tiny_bundle)
    assert len(list(bundle.golden_samples())) >= 3
    opts = _fp32_with_callers(3)
    assert run_selftest(bundle, None, opts).selected is not None
    assert len({t for t, _ in runs if t.startswith("selftest-concurrent")}) == 3


def test_a_session_wrong_only_when_one_caller_runs_it_is_refused(tiny_bundle: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The golden pass runs from the concurrent callers; one sample also runs alone, as serving runs at light
    load: a session wrong only then is refused (found by review: no lone run was judged at all)."""
    _counting_sessions(monkeypatch, wrong_when_alone=True)
    opts = _fp32_with_callers(2)
    report = run_selftest(load_bundle(tiny_bundle), None, opts)
    assert report.selected is None
    fp32 = next(r for r in report.results if r.candidate.variant == "fp32")
    assert "one caller alone" in {f.stage for f in fp32.findings if f.check == "reproduction"}, fp32.reasons
