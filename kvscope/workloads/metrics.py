"""Task metrics of one output against its accepted answers, as RULER defines them
(NVIDIA/RULER ``scripts/eval/synthetic/constants.py``) and kvpress's evaluation applies them.

    string_match_all(output, answers)   share of the answers found in the output (case-insensitive)
    string_match_part(output, answers)  1 if any answer is found in the output, else 0
    metric_for(task)                    the metric a task is scored with

RULER averages these over samples and reports ×100; kvscope keeps one sample's score in [0, 1].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def string_match_all(output: str, answers: Sequence[str]) -> float:
    """``Σ_a [a.lower() ∈ output.lower()] / |answers|``: every answer counts (the needle tasks,
    variable tracking, common and frequent words)."""
    text = output.lower()
    return sum(answer.lower() in text for answer in answers) / len(answers)


def string_match_part(output: str, answers: Sequence[str]) -> float:
    """``max_a [a.lower() ∈ output.lower()]``: one accepted answer suffices (question answering)."""
    text = output.lower()
    return float(any(answer.lower() in text for answer in answers))


def metric_for(task: str | None) -> Callable[[str, Sequence[str]], float]:
    """RULER's metric of ``task``: ``string_match_part`` for question answering (a task named
    ``qa`` or ``qa_…``), ``string_match_all`` for every other task and for rows without one."""
    if task is not None and (task == "qa" or task.startswith("qa_")):
        return string_match_part
    return string_match_all
