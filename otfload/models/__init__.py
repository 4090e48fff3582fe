"""What every bundled model shares: the causal-LM call interface and KV cache (``base``), attention,
parameter modules and layer math (``layers``), routed experts (``experts``), weights kept in
another form (``weights``) and where a built model came from (``origin``).

A family's own config, model and mapping table live in its package under :mod:`otfload.families`.
"""
