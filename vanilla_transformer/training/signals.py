"""Stop signals: SIGINT or SIGTERM ends a run after the step under way, saved first (`StopRequests`), or stops its
final scoring at once (`StopScoring`); the run then exits with 128 + the signal (`TrainingInterrupted`).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from accelerate.logging import get_logger

from .run_folder import CHECKPOINTS

__all__ = ["ScoringInterrupted", "StopRequests", "StopScoring", "TrainingInterrupted"]

logger = get_logger(__name__)


class TrainingInterrupted(Exception):
    """SIGINT or SIGTERM stopped the run after its current step, saved as a checkpoint; `exit_code` is 128 + signal."""

    def __init__(self, signum: int, output_dir: str, step: int):
        self.exit_code = 128 + signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step}, saved in {Path(output_dir) / CHECKPOINTS}; "
            "run the same command with --resume to continue"
        )


class StopRequests:
    """While training: SIGINT and SIGTERM are recorded (the step under way finishes, then a checkpoint is
    written) instead of killing the run and losing every step since the last checkpoint. A second signal
    acts at once, as it would without this."""

    def __init__(self):
        self.signum, self._previous = 0, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def _record(self, signum, frame) -> None:
        self.signum = signum
        for number, handler in self._previous.items():  # the next one interrupts for real
            signal.signal(number, handler)
        logger.warning(f"{signal.Signals(signum).name}: stopping after this step and saving a checkpoint "
                       "(send it again to stop at once, unsaved)")

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class ScoringInterrupted(TrainingInterrupted):
    """SIGINT or SIGTERM during the final scoring, which stops at once: the model is saved by then, and `not_scored`
    names the splits left unscored."""

    def __init__(self, signum: int, output_dir: str = "", not_scored=()):
        self.exit_code = 128 + signum
        Exception.__init__(
            self, f"stopped by {signal.Signals(signum).name} during the final scoring; the trained model is saved in "
            f"{output_dir}, not scored: {', '.join(not_scored) or 'nothing'}; run the same command with --resume to "
            "score it"
        )


class StopScoring:
    """While the final scores are computed: SIGINT and SIGTERM stop them at once (`armed`), or, outside the
    scoring itself, once the card is written. `pending`: a stop asked for after the last step, which stops them
    before they start."""

    def __init__(self, pending: int = 0):
        self.signum, self.armed, self._previous = pending, False, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._stop)
        return self

    def _stop(self, signum, frame) -> None:
        self.signum = signum
        logger.warning(f"{signal.Signals(signum).name}: stopping the final scoring; the model is saved")
        if self.armed:
            raise ScoringInterrupted(signum)

    def check(self) -> None:
        """Raise ScoringInterrupted if a stop came; from now on, one stops at once."""
        self.armed = True
        if self.signum:
            raise ScoringInterrupted(self.signum)

    def disarm(self) -> None:
        """From now on a stop is recorded, not raised: what follows the scores is written whole."""
        self.armed = False

    def __exit__(self, *exc) -> None:
        self.armed = False
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
