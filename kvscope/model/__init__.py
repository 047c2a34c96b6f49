"""The model side of the data flow: which model and how it is loaded (``loading``), what it computes
(``spec``: layers, heads, the per-layer attention rule's parameters; ``attention``: the one attention
rule; ``rope``: rotary embeddings) and how prompts become its token ids (``prompts``)."""
