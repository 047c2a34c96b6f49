"""Built-in workloads: offline, deterministic prompts from a seed, with their recipes
(``recipes/NAME.toml``) and scorers — see ``kvscope.workloads.builtin``; RULER's synthetic tasks
in ``kvscope.workloads.ruler``, their metrics in ``kvscope.workloads.metrics``."""

from .builtin import (
    ANSWER_PREFIX,
    ANSWERS,
    CONTINUATION,
    QUESTION_AT,
    RECIPES,
    TOLERANCE,
    WORKLOADS,
    Workload,
    available,
    count_tokens,
    evaluate,
    get,
    load_recipe,
    prompts,
    prompts_for_model,
    score,
)

__all__ = [
    "ANSWERS",
    "ANSWER_PREFIX",
    "CONTINUATION",
    "QUESTION_AT",
    "RECIPES",
    "TOLERANCE",
    "WORKLOADS",
    "Workload",
    "available",
    "count_tokens",
    "evaluate",
    "get",
    "load_recipe",
    "prompts",
    "prompts_for_model",
    "score",
]
