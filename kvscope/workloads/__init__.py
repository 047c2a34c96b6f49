"""Built-in workloads: offline, deterministic prompts from a seed, with their recipes
(``recipes/NAME.toml``) and scorers — see ``kvscope.workloads.builtin``."""

from .builtin import (
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
