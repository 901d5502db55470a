"""torch.stft magnitude of float32 audio, as a reference for the stft_magnitude front-end (run in the
references venv, which holds torch; tests/test_sensor_frontend_stft.py calls it).

usage: stft_reference_run.py AUDIO.npy N_FFT HOP POWER OUT.npy   (AUDIO [B, samples] float32)
"""

from __future__ import annotations

import sys

import numpy as np
import torch


def main() -> None:
    audio, n_fft, hop, power, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    x = torch.from_numpy(np.load(audio))
    spec = torch.stft(x, n_fft, hop_length=hop, window=torch.hann_window(n_fft), center=True, pad_mode="reflect",
                      onesided=True, return_complex=True)
    np.save(out, (spec.abs() ** power).numpy().astype(np.float32))
    print(f"torch {torch.__version__}", flush=True)


if __name__ == "__main__":
    main()
