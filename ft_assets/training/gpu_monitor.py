"""Mean GPU utilization over a worker's whole wall time (idle periods included), from NVML.

The cost model divides by it to get effective training hours. Sampled every ``INTERVAL_S`` in a
daemon thread through ``torch.cuda.utilization`` (which needs the ``nvidia-ml-py`` package). Without
CUDA or NVML the mean is None and the cost model falls back to the step-time fraction.
"""

from __future__ import annotations

import threading

INTERVAL_S = 2.0  # NVML's own utilization window is ~1 s; 2 s keeps the thread's cost negligible


class GpuUtilization:
    def __init__(self):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuUtilization:
        import torch

        if torch.cuda.is_available():
            try:
                torch.cuda.utilization()
            except Exception:  # NVML missing or not permitted: no reading, the step-time fraction is used
                return self
            self._thread = threading.Thread(target=self._sample, name="gpu-utilization", daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        import torch

        while not self._stop.wait(INTERVAL_S):
            self.samples.append(torch.cuda.utilization() / 100.0)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=INTERVAL_S * 2)

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None
