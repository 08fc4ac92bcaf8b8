"""A run's per-step metrics, written to ``<output_dir>/metrics.jsonl`` and TensorBoard (``<output_dir>/tensorboard``)
by :class:`MetricsLogger`, whatever the algorithm that computed them."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class MetricsLogger:
    """Appends one JSON object a step; on resume, drops lines the crashed run wrote past the checkpoint."""

    def __init__(
        self, output_dir: str | Path, report_to: list[str], *, enabled: bool = True, resume_step: int | None = None
    ) -> None:
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.writer = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.is_file():
            self._truncate_to(resume_step)
        self.jsonl = "jsonl" in report_to
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=str(Path(output_dir) / "tensorboard"))
            except ImportError:
                logger.warning("tensorboard is not installed: metrics go to metrics.jsonl only")

    def _truncate_to(self, resume_step: int) -> None:
        """Keep the lines up to the checkpoint's step. The file is replaced, never rewritten in
        place: a kill at any moment leaves the old file or the new one, never an empty one."""
        lines = self.path.read_text(encoding="utf-8").splitlines()
        steps = [_step(line) for line in lines]
        torn = sum(step is None and bool(line.strip()) for line, step in zip(lines, steps))
        if torn:  # a line cut short by the kill that made this a resume
            logger.warning("%s: dropped %d unreadable line(s)", self.path, torn)
        kept = "".join(f"{line}\n" for line, step in zip(lines, steps) if step is not None and step <= resume_step)
        _replace_text(self.path, kept)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        if self.jsonl:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value


def _step(line: str) -> int | None:
    """The line's step; None for a line that is not a JSON record (a write cut short)."""
    try:
        return int(json.loads(line).get("step", 0))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return None


def _replace_text(path: Path, text: str) -> None:
    """Write a sibling temporary file, flush it to disk, then rename it over ``path`` (atomic)."""
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def cpu_hours(steps: list[dict]) -> dict[int, float]:
    """CPU hours spent by the end of each step (``time/step_cpu_s``, the processes' CPU time; runs
    that predate it have none). Evaluations are not counted: they are the same for every recipe."""
    if not steps or "time/step_cpu_s" not in steps[0]:
        return {}
    total, hours = 0.0, {0: 0.0}
    for row in steps:
        total += row["time/step_cpu_s"]
        hours[row["step"]] = total / 3600
    return hours
