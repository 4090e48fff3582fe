"""Model families, one package each (``llama/``, ``deepseek/``, ...). A family's package holds its
``config`` (``config.json`` → typed config, whose field names are the config's own), ``model`` (the
NNX decoder), ``mapping`` (HF keys → leaves, checks against the tensors, the LoRA layout of fused
experts) and an ``__init__`` that registers it.

The modules beside the packages are what families share: :mod:`~otfload.families.registry` (finds
every package here, no list to edit), :mod:`~otfload.families.lora` (the LoRA layout type) and
:mod:`~otfload.families.multimodal` (the text model of a multimodal checkpoint). Layers every model
uses live in :mod:`otfload.models`.
"""
