"""Built-in workloads: offline, deterministic prompts from a seed, with their recipes
(``recipes/NAME.toml``) and scorers — see :mod:`kvscope.workloads.builtin`."""

from .builtin import (  # noqa: F401
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
