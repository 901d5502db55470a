"""Audio front-ends compiled to ONNX graphs and put in front of a bundle's model (build time only).

A front-end named in the spec (`frontend: {type: whisper_log_mel, ...}`) becomes plain ONNX operators
(Pad, Conv as a windowed DFT, MatMul with a mel filterbank, Log, ReduceMax, Sqrt), merged before the model's
input, so the bundle takes raw samples and the device runs -- and the self-test proves -- the front-end
and the model as one graph. No Python runs on the device. Needs the `build` extra (onnx).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from agent.bundle.frontend_blocks import RFFT_WINDOWS, Rfft, periodic_window
from agent.errors import BundleError

FRONTEND_TYPES = ("whisper_log_mel", "stft_magnitude", "kaldi_fbank", "rfft")


@dataclass(frozen=True)
class WhisperLogMel:
    """Whisper's log-mel (transformers' WhisperFeatureExtractor): centred reflect-padded STFT with a
    periodic Hann window, power, Slaney mel filterbank, log10 floored at 1e-10, the last frame dropped,
    clamped to (max - 8), then (x + 4) / 4; optionally the waveform normalised to zero mean, unit variance."""

    samples: int = 128000
    sample_rate: int = 16000
    n_fft: int = 400
    hop: int = 160
    n_mels: int = 80
    normalize: bool = True

    @property
    def frames(self) -> int:
        return self.samples // self.hop

    def describe(self) -> dict[str, Any]:
        return {"type": "whisper_log_mel", "samples": self.samples, "sample_rate": self.sample_rate,
                "n_fft": self.n_fft, "hop": self.hop, "n_mels": self.n_mels, "normalize": self.normalize}


    @property
    def out_dims(self) -> list[int]:
        return [self.n_mels, self.frames]

    def graph(self, opset: int) -> Any:
        return whisper_log_mel_graph(self, opset)


@dataclass(frozen=True)
class StftMagnitude:
    """torch.stft(center=True, pad_mode='reflect', window=torch.hann_window(n_fft), onesided).abs() ** power:
    a centred reflect-padded STFT with a periodic Hann window (or `window`: hamming, rectangular), its
    magnitude (power 1) or power (2), or the complex STFT itself.
    `audio` [B, samples] -> `features` [B, n_fft // 2 + 1, 1 + samples // hop]."""

    samples: int
    n_fft: int = 512
    hop: int = 128
    power: int = 1
    complex: bool = False  # the STFT itself: [B, F, frames, 2] (real, imaginary), torch.view_as_real's layout
    window: str = "hann"  # periodic, as torch.hann_window / torch.hamming_window; or rectangular

    def __post_init__(self) -> None:
        if self.power not in (1, 2):
            raise TypeError(f"power must be 1 (magnitude) or 2 (power), found {self.power!r}")
        if self.window not in RFFT_WINDOWS:
            raise TypeError(f"window {self.window!r} is not one of {list(RFFT_WINDOWS)}")
        if self.n_fft < 2 or self.hop < 1 or self.samples <= self.n_fft // 2:
            # reflect padding needs more samples than the pad (torch refuses the same)
            raise TypeError(f"n_fft {self.n_fft}, hop {self.hop}, samples {self.samples}: needs n_fft >= 2, hop >= 1 "
                            "and samples > n_fft / 2")

    @property
    def frames(self) -> int:
        return 1 + self.samples // self.hop

    @property
    def out_dims(self) -> list[int]:
        return [self.n_fft // 2 + 1, self.frames] + ([2] if self.complex else [])

    def describe(self) -> dict[str, Any]:
        return {"type": "stft_magnitude", "samples": self.samples, "n_fft": self.n_fft, "hop": self.hop,
                "power": self.power, "complex": self.complex, "window": self.window}

    def graph(self, opset: int) -> Any:
        return stft_magnitude_graph(self, opset)


@dataclass(frozen=True)
class KaldiFbank:
    """Kaldi's log mel filterbank (kaldi-native-fbank / torchaudio.compliance.kaldi.fbank defaults: no dither,
    snip_edges, DC offset removed, pre-emphasis 0.97, Povey window (or `window`: hamming, hanning,
    rectangular, sine, as Kaldi defines them), FFT padded to a power of two, power
    spectrum, Kaldi mel banks from low_freq to high_freq (0: Nyquist), log floored at FLT_EPSILON), then
    optionally LFR (FunASR's low frame rate: lfr_m frames stacked every lfr_n, the first frame repeated
    (lfr_m - 1) // 2 times before, the last one after) and CMVN ((x + cmvn_shift) * cmvn_scale, FunASR's
    am.mvn AddShift / Rescale). `input_scale` multiplies the samples first (FunASR feeds 16-bit values:
    32768). `audio` [B, samples] -> `features` [B, frames, n_mels * lfr_m]."""

    samples: int
    sample_rate: int = 16000
    frame_length: int = 400
    frame_shift: int = 160
    n_mels: int = 80
    low_freq: float = 20.0
    high_freq: float = 0.0
    preemph: float = 0.97
    input_scale: float = 1.0
    lfr_m: int = 1
    lfr_n: int = 1
    cmvn_shift: tuple[float, ...] = ()
    cmvn_scale: tuple[float, ...] = ()
    window: str = "povey"  # Kaldi's window_type: FunASR's WavFrontend (FSMN-VAD, Paraformer) uses hamming
    # LFR's last frames, which lack right context: "pad" repeats the last frame (FunASR's apply_lfr, a whole
    # utterance); "drop" does not make them (its online apply_lfr on a chunk that is not the last)
    lfr_tail: str = "pad"
    # "window": each window's LFR pads (or drops) its own edges. "stream": the context of a window's first and
    # last LFR frames is real audio -- the window overlaps the previous one (frame.window - frame.hop samples)
    # and only LFR frames whose lfr_m fbank frames are all in the window are made -- and on a stream's first
    # window the first fbank frame is repeated before it, as FunASR's WavFrontendOnline kept across chunks.
    # Whether a window is a stream's first is a state the graph carries: the spec declares it under
    # `inputs` ({name: fe_lfr_started, kind: state, shape: [1, 1], from_output: fe_lfr_startedN}).
    lfr_context: str = "window"

    def __post_init__(self) -> None:
        if self.lfr_tail not in ("pad", "drop"):
            raise TypeError(f"lfr_tail {self.lfr_tail!r} is not one of ['pad', 'drop']")
        if self.lfr_context not in ("window", "stream"):
            raise TypeError(f"lfr_context {self.lfr_context!r} is not one of ['window', 'stream']")
        if self.lfr_context == "stream" and (self.lfr_n != 1 or self.lfr_m < 2):
            raise TypeError(f"lfr_context stream stacks every frame: it needs lfr_n 1 and lfr_m >= 2 (lfr_m "
                            f"{self.lfr_m}, lfr_n {self.lfr_n})")
        if self.window not in KALDI_WINDOWS:
            raise TypeError(f"window {self.window!r} is not one of Kaldi's {list(KALDI_WINDOWS)}")
        if self.samples < self.frame_length or self.frame_shift < 1 or self.lfr_m < 1 or self.lfr_n < 1:
            raise TypeError(f"samples {self.samples} must hold one frame of {self.frame_length}; frame_shift, lfr_m "
                            "and lfr_n must be >= 1")
        if self.frames < 1:
            raise TypeError(f"samples {self.samples} make {self.fbank_frames} fbank frames: no LFR frame of {self.lfr_m} "
                            "has them all (lfr_tail: drop)")
        object.__setattr__(self, "cmvn_shift", tuple(float(v) for v in self.cmvn_shift))
        object.__setattr__(self, "cmvn_scale", tuple(float(v) for v in self.cmvn_scale))
        dim = self.n_mels * self.lfr_m
        for key in ("cmvn_shift", "cmvn_scale"):
            n = len(getattr(self, key))
            if n not in (0, dim):
                raise TypeError(f"{key} has {n} values, the features have {dim} (n_mels * lfr_m)")

    @property
    def fbank_frames(self) -> int:
        return 1 + (self.samples - self.frame_length) // self.frame_shift

    @property
    def state(self) -> tuple[str, str] | None:
        """The (input, output) of the front-end's own state, or None."""
        return LFR_STARTED if self.lfr_context == "stream" else None

    @property
    def frames(self) -> int:
        if self.lfr_context == "stream":  # only the LFR frames whose lfr_m fbank frames are all in the window
            return max(0, self.fbank_frames - self.lfr_m + 1)
        if self.lfr_tail == "drop":  # only the LFR frames whose lfr_m fbank frames all exist (after the left pad)
            return max(0, (self.fbank_frames + (self.lfr_m - 1) // 2 - self.lfr_m) // self.lfr_n + 1)
        return -(-self.fbank_frames // self.lfr_n)

    @property
    def out_dims(self) -> list[int]:
        return [self.frames, self.n_mels * self.lfr_m]

    def describe(self) -> dict[str, Any]:
        return {"type": "kaldi_fbank", "samples": self.samples, "sample_rate": self.sample_rate,
                "frame_length": self.frame_length, "frame_shift": self.frame_shift, "n_mels": self.n_mels,
                "lfr_m": self.lfr_m, "lfr_n": self.lfr_n, "cmvn": bool(self.cmvn_shift or self.cmvn_scale),
                "window": self.window, "lfr_tail": self.lfr_tail, "lfr_context": self.lfr_context}

    def graph(self, opset: int) -> Any:
        return kaldi_fbank_graph(self, opset)


Frontend = WhisperLogMel | StftMagnitude | KaldiFbank | Rfft


LFR_STARTED = ("fe_lfr_started", "fe_lfr_startedN")  # lfr_context stream: 0 on a stream's first window, then 1
KALDI_WINDOWS = ("povey", "hamming", "hanning", "rectangular", "sine")  # blackman: 1.4e-3 off knf, over the bound


def kaldi_window(kind: str, n: int) -> np.ndarray:
    """Kaldi's FeatureWindowFunction (feature-window.cc), in float64: a = 2 pi / (n - 1)."""
    a = 2 * np.pi / (n - 1)
    i = np.arange(n)
    if kind == "hanning":
        return 0.5 - 0.5 * np.cos(a * i)
    if kind == "sine":
        return np.sin(0.5 * a * i)
    if kind == "hamming":
        return 0.54 - 0.46 * np.cos(a * i)
    if kind == "povey":
        return (0.5 - 0.5 * np.cos(a * i)) ** 0.85
    if kind == "rectangular":
        return np.ones(n)
    raise ValueError(f"unknown Kaldi window {kind!r}")


def kaldi_mel_banks(n_mels: int, n_fft: int, sample_rate: float, low: float, high: float) -> np.ndarray:
    """(n_mels, n_fft // 2 + 1) Kaldi MelBanks: triangles in mel = 1127 ln(1 + f / 700), over the FFT bins
    below Nyquist (Kaldi never weights the Nyquist bin)."""
    high = high if high > 0 else sample_rate / 2 + high
    mel = lambda f: 1127.0 * np.log(1.0 + np.asarray(f, np.float64) / 700.0)  # noqa: E731
    lo, hi = mel(low), mel(high)
    delta = (hi - lo) / (n_mels + 1)
    m = mel(np.arange(n_fft // 2) * sample_rate / n_fft)
    out = np.zeros((n_mels, n_fft // 2 + 1))
    for b in range(n_mels):
        left, center, right = lo + b * delta, lo + (b + 1) * delta, lo + (b + 2) * delta
        up = (m - left) / (center - left)
        down = (right - m) / (right - center)
        out[b, : n_fft // 2] = np.where((m > left) & (m < right), np.where(m <= center, up, down), 0.0)
    return out


def kaldi_fbank_graph(fe: KaldiFbank, opset: int = 17) -> Any:
    """An ONNX model: `audio` [B, samples] float32 -> `features` [B, frames, n_mels * lfr_m] float32.

    Everything Kaldi does to a frame before the FFT (DC offset removal, pre-emphasis, its window, zero
    padding) is linear: it is folded, in float64, into the DFT kernels of one strided Conv."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    n = fe.frame_length
    n_fft = 1 << (n - 1).bit_length()
    n_freqs = n_fft // 2 + 1
    dc = np.eye(n) - np.full((n, n), 1.0 / n)
    pre = np.eye(n) - fe.preemph * np.eye(n, k=-1)
    pre[0, 0] = 1.0 - fe.preemph
    chain = np.diag(kaldi_window(fe.window, n)) @ pre @ dc * fe.input_scale  # [n, n]: frame -> windowed frame
    k = np.arange(n_freqs)[:, None] * np.arange(n)[None, :] * (2 * np.pi / n_fft)  # zero padding: columns < n
    dft = np.concatenate([np.cos(k), -np.sin(k)]) @ chain
    mel = kaldi_mel_banks(fe.n_mels, n_fft, fe.sample_rate, fe.low_freq, fe.high_freq).astype(np.float32)
    t, pad = fe.fbank_frames, (fe.lfr_m - 1) // 2
    # LFR as one gather over the frames: FunASR's stacking, with the first/last frames repeated at the edges
    lfr = np.clip(np.arange(fe.frames)[:, None] * fe.lfr_n + np.arange(fe.lfr_m)[None, :] - pad, 0, t - 1)
    if fe.lfr_context == "stream":  # no padding: the window's overlap with the previous one is the context
        lfr = np.arange(fe.frames)[:, None] + np.arange(fe.lfr_m)[None, :]
    inits = [
        numpy_helper.from_array(dft.astype(np.float32)[:, None, :], "fe_dft"),
        numpy_helper.from_array(mel.T.copy(), "fe_mel"),  # [F, n_mels]
        numpy_helper.from_array(np.array([1], np.int64), "fe_axis1"),
        numpy_helper.from_array(np.array([n_freqs], np.int64), "fe_nf"),
        numpy_helper.from_array(np.array([2 * n_freqs], np.int64), "fe_2nf"),
        numpy_helper.from_array(np.array([0], np.int64), "fe_zero"),
        numpy_helper.from_array(np.array(np.finfo(np.float32).eps, np.float32), "fe_floor"),
        numpy_helper.from_array(lfr.reshape(-1).astype(np.int64), "fe_lfr"),
        numpy_helper.from_array(np.array([0, fe.frames, fe.n_mels * fe.lfr_m], np.int64), "fe_lfr_shape"),
    ]
    nodes = [
        helper.make_node("Unsqueeze", ["audio", "fe_axis1"], ["fe_x3"]),  # [B, 1, samples]
        helper.make_node("Conv", ["fe_x3", "fe_dft"], ["fe_spec"], strides=[fe.frame_shift]),  # [B, 2F, T]
        helper.make_node("Mul", ["fe_spec", "fe_spec"], ["fe_sq"]),
        helper.make_node("Slice", ["fe_sq", "fe_zero", "fe_nf", "fe_axis1"], ["fe_re2"]),
        helper.make_node("Slice", ["fe_sq", "fe_nf", "fe_2nf", "fe_axis1"], ["fe_im2"]),
        helper.make_node("Add", ["fe_re2", "fe_im2"], ["fe_power"]),  # [B, F, T]
        helper.make_node("Transpose", ["fe_power"], ["fe_power_t"], perm=[0, 2, 1]),  # [B, T, F]
        helper.make_node("MatMul", ["fe_power_t", "fe_mel"], ["fe_melspec"]),  # [B, T, n_mels]
        helper.make_node("Max", ["fe_melspec", "fe_floor"], ["fe_floored"]),
        helper.make_node("Log", ["fe_floored"], ["fe_logmel" if fe.lfr_context == "window" else "fe_logmel_w"]),
        helper.make_node("Gather", ["fe_logmel", "fe_lfr"], ["fe_stacked"], axis=1),  # [B, frames * lfr_m, n_mels]
        helper.make_node("Reshape", ["fe_stacked", "fe_lfr_shape"],
                         ["fe_lfr_out" if (fe.cmvn_shift or fe.cmvn_scale) else "features"]),
    ]
    if fe.cmvn_shift or fe.cmvn_scale:
        dim = fe.n_mels * fe.lfr_m
        shift = np.asarray(fe.cmvn_shift or [0.0] * dim, np.float32)
        scale = np.asarray(fe.cmvn_scale or [1.0] * dim, np.float32)
        inits += [numpy_helper.from_array(shift, "fe_cmvn_shift"), numpy_helper.from_array(scale, "fe_cmvn_scale")]
        nodes += [helper.make_node("Add", ["fe_lfr_out", "fe_cmvn_shift"], ["fe_shifted"]),
                  helper.make_node("Mul", ["fe_shifted", "fe_cmvn_scale"], ["features"])]
    ins = [helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["batch", fe.samples])]
    outs = [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", *fe.out_dims])]
    if fe.lfr_context == "stream":
        _lfr_first_window(t, pad, nodes, inits, ins, outs)
    graph = helper.make_graph(nodes, "kaldi_fbank", ins, outs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = min(model.ir_version, 9)
    onnx.checker.check_model(model)
    return model


def _lfr_first_window(t: int, pad: int, nodes: list[Any], inits: list[Any], ins: list[Any], outs: list[Any]) -> None:
    """lfr_context stream: the front-end's state input and output, and on a stream's first window its first
    `pad` fbank frames (frame.padding, before the stream's first sample) made copies of the stream's first
    frame; later windows keep theirs (the previous window's audio)."""
    from onnx import TensorProto, helper, numpy_helper

    started, started_out = LFR_STARTED
    first = np.concatenate([np.full(pad, pad), np.arange(pad, t)]).astype(np.int64)
    inits += [numpy_helper.from_array(first, "fe_first_idx"),
              numpy_helper.from_array(np.array(0.5, np.float32), "fe_half"),
              numpy_helper.from_array(np.array(0.0, np.float32), "fe_f0"),
              numpy_helper.from_array(np.array(1.0, np.float32), "fe_f1"),
              numpy_helper.from_array(np.array([2], np.int64), "fe_axis2")]
    after_log = next(i for i, node in enumerate(nodes) if node.op_type == "Log") + 1
    nodes[after_log:after_log] = [
        helper.make_node("Gather", ["fe_logmel_w", "fe_first_idx"], ["fe_logmel_first"], axis=1),
        helper.make_node("Greater", [started, "fe_half"], ["fe_started_b"]),  # [B, 1]
        helper.make_node("Unsqueeze", ["fe_started_b", "fe_axis2"], ["fe_started_b3"]),  # [B, 1, 1]
        helper.make_node("Where", ["fe_started_b3", "fe_logmel_w", "fe_logmel_first"], ["fe_logmel"]),
    ]
    nodes += [helper.make_node("Mul", [started, "fe_f0"], ["fe_started_0"]),
              helper.make_node("Add", ["fe_started_0", "fe_f1"], [started_out])]
    ins.append(helper.make_tensor_value_info(started, TensorProto.FLOAT, ["batch", 1]))
    outs.append(helper.make_tensor_value_info(started_out, TensorProto.FLOAT, ["batch", 1]))


def frontend_from_dict(d: Mapping[str, Any], where: str) -> Frontend:
    kind = d.get("type")
    if kind not in FRONTEND_TYPES:
        raise BundleError(f"{where}: key frontend.type: {kind!r} is not a known front-end {list(FRONTEND_TYPES)}")
    cls = {"whisper_log_mel": WhisperLogMel, "stft_magnitude": StftMagnitude, "kaldi_fbank": KaldiFbank,
           "rfft": Rfft}[kind]
    try:
        return cls(**{k: v for k, v in d.items() if k != "type"})
    except TypeError as exc:
        raise BundleError(f"{where}: key frontend: {exc}") from exc


def _dft_kernels(n_fft: int, kind: str = "hann") -> np.ndarray:
    """The windowed (periodic Hann by default) onesided DFT as Conv weights [2F, 1, n_fft]: real parts, then
    imaginary."""
    n_freqs = n_fft // 2 + 1
    window = np.hanning(n_fft + 1)[:-1] if kind == "hann" else periodic_window(kind, n_fft)  # torch.hann_window
    k = np.arange(n_freqs)[:, None] * np.arange(n_fft)[None, :] * (2 * np.pi / n_fft)
    return np.concatenate([np.cos(k) * window, -np.sin(k) * window]).astype(np.float32)[:, None, :]


def stft_magnitude_graph(fe: StftMagnitude, opset: int = 17) -> Any:
    """An ONNX model: `audio` [B, samples] float32 -> `features` [B, n_fft // 2 + 1, frames] float32."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    n_freqs, pad = fe.n_fft // 2 + 1, fe.n_fft // 2
    inits = [
        numpy_helper.from_array(_dft_kernels(fe.n_fft, fe.window), "fe_dft"),
        numpy_helper.from_array(np.array([0, 0, pad, 0, 0, pad], np.int64), "fe_pads"),
        numpy_helper.from_array(np.array([1], np.int64), "fe_axis1"),
    ]
    nodes = [
        helper.make_node("Unsqueeze", ["audio", "fe_axis1"], ["fe_x3"]),  # [B, 1, samples]
        helper.make_node("Pad", ["fe_x3", "fe_pads"], ["fe_padded"], mode="reflect"),
        helper.make_node("Conv", ["fe_padded", "fe_dft"], ["fe_spec"], strides=[fe.hop]),  # [B, 2F, frames]
    ]
    if fe.complex:  # [B, 2F, T] -> [B, 2, F, T] -> [B, F, T, 2]
        inits.append(numpy_helper.from_array(np.array([0, 2, n_freqs, -1], np.int64), "fe_ri_shape"))
        nodes += [helper.make_node("Reshape", ["fe_spec", "fe_ri_shape"], ["fe_ri"]),
                  helper.make_node("Transpose", ["fe_ri"], ["features"], perm=[0, 2, 3, 1])]
    else:
        inits += [numpy_helper.from_array(np.array([n_freqs], np.int64), "fe_nf"),
                  numpy_helper.from_array(np.array([2 * n_freqs], np.int64), "fe_2nf"),
                  numpy_helper.from_array(np.array([0], np.int64), "fe_zero")]
        nodes += [
            helper.make_node("Mul", ["fe_spec", "fe_spec"], ["fe_sq"]),
            helper.make_node("Slice", ["fe_sq", "fe_zero", "fe_nf", "fe_axis1"], ["fe_re2"]),
            helper.make_node("Slice", ["fe_sq", "fe_nf", "fe_2nf", "fe_axis1"], ["fe_im2"]),
            helper.make_node("Add", ["fe_re2", "fe_im2"], ["features" if fe.power == 2 else "fe_power"]),
        ]
        if fe.power == 1:
            nodes.append(helper.make_node("Sqrt", ["fe_power"], ["features"]))
    graph = helper.make_graph(
        nodes, "stft_magnitude",
        [helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["batch", fe.samples])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", *fe.out_dims])],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = min(model.ir_version, 9)
    onnx.checker.check_model(model)
    return model


def _hz_to_mel_slaney(f: np.ndarray) -> np.ndarray:
    f = np.atleast_1d(np.asarray(f, np.float64))
    m = 3.0 * f / 200.0
    hi = f >= 1000.0
    m[hi] = 15.0 + np.log(f[hi] / 1000.0) * (27.0 / np.log(6.4))
    return m


def _mel_to_hz_slaney(m: np.ndarray) -> np.ndarray:
    m = np.atleast_1d(np.asarray(m, np.float64))
    f = 200.0 * m / 3.0
    hi = m >= 15.0
    f[hi] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (m[hi] - 15.0))
    return f


def slaney_mel_filters(n_freqs: int, n_mels: int, sample_rate: int) -> np.ndarray:
    """(n_freqs, n_mels) Slaney-normalised triangular filters from 0 Hz to Nyquist."""
    mels = np.linspace(_hz_to_mel_slaney(np.array([0.0]))[0], _hz_to_mel_slaney(np.array([sample_rate / 2]))[0],
                       n_mels + 2)
    hz = _mel_to_hz_slaney(mels)
    fft = np.linspace(0, sample_rate // 2, n_freqs)
    slopes = hz[None, :] - fft[:, None]
    diff = np.diff(hz)
    filt = np.maximum(0.0, np.minimum(-slopes[:, :-2] / diff[:-1], slopes[:, 2:] / diff[1:]))
    return filt * (2.0 / (hz[2:n_mels + 2] - hz[:n_mels]))[None, :]


def whisper_log_mel_graph(fe: WhisperLogMel, opset: int = 17) -> Any:
    """An ONNX model: `audio` [B, samples] float32 -> `features` [B, n_mels, frames] float32."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    n_freqs = fe.n_fft // 2 + 1
    kernels = _dft_kernels(fe.n_fft)  # the windowed DFT as one strided convolution
    mel = slaney_mel_filters(n_freqs, fe.n_mels, fe.sample_rate).T.astype(np.float32)  # (n_mels, n_freqs)
    pad = fe.n_fft // 2
    inits = [
        numpy_helper.from_array(kernels, "fe_dft"),
        numpy_helper.from_array(mel, "fe_mel"),
        numpy_helper.from_array(np.array([0, 0, pad, 0, 0, pad], np.int64), "fe_pads"),
        numpy_helper.from_array(np.array([1], np.int64), "fe_axis1"),
        numpy_helper.from_array(np.array([n_freqs], np.int64), "fe_nf"),
        numpy_helper.from_array(np.array([2 * n_freqs], np.int64), "fe_2nf"),
        numpy_helper.from_array(np.array([0], np.int64), "fe_zero"),
        numpy_helper.from_array(np.array([fe.frames], np.int64), "fe_frames"),
        numpy_helper.from_array(np.array([2], np.int64), "fe_axis2"),
        numpy_helper.from_array(np.array(1e-10, np.float32), "fe_floor"),
        numpy_helper.from_array(np.array(1.0 / np.log(10.0), np.float32), "fe_inv_ln10"),
        numpy_helper.from_array(np.array(8.0, np.float32), "fe_range"),
        numpy_helper.from_array(np.array(4.0, np.float32), "fe_four"),
        numpy_helper.from_array(np.array(1e-7, np.float32), "fe_eps"),
        numpy_helper.from_array(np.array([1, 2], np.int64), "fe_axes12"),
    ]

    def reduce(op: str, x: str, out: str, axes: list[int]) -> Any:
        if opset >= 18:  # axes became an input in opset 18
            name = "fe_axes12" if axes == [1, 2] else "fe_axis2"
            return helper.make_node(op, [x, name], [out], keepdims=1)
        return helper.make_node(op, [x], [out], axes=axes, keepdims=1)

    nodes = [helper.make_node("Unsqueeze", ["audio", "fe_axis1"], ["fe_x3"])]  # [B, 1, samples]
    x = "fe_x3"
    if fe.normalize:  # zero mean, unit variance over the whole window (before the spectrogram)
        nodes += [
            reduce("ReduceMean", x, "fe_mean", [2]),
            helper.make_node("Sub", [x, "fe_mean"], ["fe_c"]),
            helper.make_node("Mul", ["fe_c", "fe_c"], ["fe_c2"]),
            reduce("ReduceMean", "fe_c2", "fe_var", [2]),
            helper.make_node("Add", ["fe_var", "fe_eps"], ["fe_var_eps"]),
            helper.make_node("Sqrt", ["fe_var_eps"], ["fe_std"]),
            helper.make_node("Div", ["fe_c", "fe_std"], ["fe_norm"]),
        ]
        x = "fe_norm"
    nodes += [
        helper.make_node("Pad", [x, "fe_pads"], ["fe_padded"], mode="reflect"),
        helper.make_node("Conv", ["fe_padded", "fe_dft"], ["fe_spec"], strides=[fe.hop]),  # [B, 2F, frames+1]
        helper.make_node("Mul", ["fe_spec", "fe_spec"], ["fe_sq"]),
        helper.make_node("Slice", ["fe_sq", "fe_zero", "fe_nf", "fe_axis1"], ["fe_re2"]),
        helper.make_node("Slice", ["fe_sq", "fe_nf", "fe_2nf", "fe_axis1"], ["fe_im2"]),
        helper.make_node("Add", ["fe_re2", "fe_im2"], ["fe_power"]),  # [B, F, frames+1]
        helper.make_node("MatMul", ["fe_mel", "fe_power"], ["fe_melspec"]),  # [B, n_mels, frames+1]
        helper.make_node("Max", ["fe_melspec", "fe_floor"], ["fe_floored"]),
        helper.make_node("Log", ["fe_floored"], ["fe_ln"]),
        helper.make_node("Mul", ["fe_ln", "fe_inv_ln10"], ["fe_log10"]),
        helper.make_node("Slice", ["fe_log10", "fe_zero", "fe_frames", "fe_axis2"], ["fe_cut"]),  # the last frame dropped
        reduce("ReduceMax", "fe_cut", "fe_max", [1, 2]),
        helper.make_node("Sub", ["fe_max", "fe_range"], ["fe_low"]),
        helper.make_node("Max", ["fe_cut", "fe_low"], ["fe_clamped"]),
        helper.make_node("Add", ["fe_clamped", "fe_four"], ["fe_shift"]),
        helper.make_node("Div", ["fe_shift", "fe_four"], ["features"]),
    ]
    graph = helper.make_graph(
        nodes, "whisper_log_mel",
        [helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["batch", fe.samples])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", fe.n_mels, fe.frames])],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = min(model.ir_version, 9)
    onnx.checker.check_model(model)
    return model


def prepend_frontend(fe: Frontend, model: Any, where: str, extra: Iterable[Any] = ()) -> Any:
    """The model with the front-end before its frame input: it then takes `audio` [B, samples]. `extra` are
    the spec's other inputs (constants, states: a stateful model's h and c), which the front-end leaves alone."""
    import onnx
    from onnx import compose

    inits = {i.name for i in model.graph.initializer}
    others = {x if isinstance(x, str) else x.name for x in extra}  # names, or the spec's ExtraInputs
    inputs = [i for i in model.graph.input if i.name not in inits and i.name not in others]
    if len(inputs) != 1:
        raise BundleError(f"{where}: key frontend: the model takes {[i.name for i in inputs]} besides the spec's "
                          f"inputs {sorted(others)}; a front-end feeds one frame input (declare the others under "
                          "`inputs`)")
    dims = [d.dim_value or d.dim_param for d in inputs[0].type.tensor_type.shape.dim]
    # a symbolic dim of the model (FSMN-VAD's 'feats_length') takes the front-end's size
    if len(dims) != len(fe.out_dims) + 1 or any(isinstance(d, int) and d != o for d, o in zip(dims[1:], fe.out_dims)):
        raise BundleError(f"{where}: key frontend: it makes [batch, {', '.join(map(str, fe.out_dims))}], the model's "
                          f"input {inputs[0].name!r} is {dims}")
    fe_state = getattr(fe, "state", None)
    if fe_state is not None and fe_state[0] not in others:
        raise BundleError(f"{where}: key frontend: it carries a state across a stream's windows: declare it under "
                          f"`inputs`: {{name: {fe_state[0]}, kind: state, dtype: float32, shape: [1, 1], init: 0.0, "
                          f"from_output: {fe_state[1]}}}")
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    front = fe.graph(max(opset, 13))
    front.ir_version = model.ir_version
    # the model's other opset domains (com.microsoft, ...) come along
    for o in model.opset_import:
        if o.domain not in ("", "ai.onnx") and not any(p.domain == o.domain for p in front.opset_import):
            front.opset_import.append(onnx.helper.make_opsetid(o.domain, o.version))
    merged = compose.merge_models(front, model, io_map=[("features", inputs[0].name)])
    onnx.checker.check_model(merged)
    return merged
