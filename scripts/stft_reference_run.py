"""torch.stft magnitude of float32 audio, as a reference for the stft_magnitude front-end (run in the
references venv, which holds torch; tests/bundle/test_sensor_frontend_stft.py calls it).

usage: stft_reference_run.py AUDIO.npy N_FFT HOP POWER OUT.npy [AUDIO.npy N_FFT HOP POWER OUT.npy ...]
(AUDIO [B, samples] float32; several jobs in one run pay for one torch import)
"""

from __future__ import annotations

import sys

import numpy as np
import torch


def main() -> None:
    args = sys.argv[1:]
    if not args or len(args) % 5:
        sys.exit(__doc__)
    for i in range(0, len(args), 5):
        audio, n_fft, hop, power, out = args[i], int(args[i + 1]), int(args[i + 2]), int(args[i + 3]), args[i + 4]
        x = torch.from_numpy(np.load(audio))
        spec = torch.stft(x, n_fft, hop_length=hop, window=torch.hann_window(n_fft), center=True,
                          pad_mode="reflect", onesided=True, return_complex=True)
        np.save(out, (spec.abs() ** power).numpy().astype(np.float32))
    print(f"torch {torch.__version__}", flush=True)


if __name__ == "__main__":
    main()
