"""What every bundled model shares, the blocks a family assembles: the causal-LM call interface and
KV cache (``base``), attention math (``attention``), parameter modules and layer math (``layers``),
GQA attention (``gqa``), gated MLPs (``mlp``), the pre-norm decoder layer (``decoder``), the routed
experts' block (``moe``) on the grouped expert dispatch (``experts``), weights kept in another form
(``weights``) and where a built model came from (``origin``).

A family's own config, model and mapping table live in its package under :mod:`otfload.families`.
"""
