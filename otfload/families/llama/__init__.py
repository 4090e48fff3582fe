"""The Llama family: Llama 3, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm).

``config`` parses ``config.json``, ``model`` is the NNX decoder, ``mapping`` the table from HF keys
to its leaves and the config's checks against the tensors; importing the package registers the
family (:func:`otfload.families.registry.register`).
"""

from otfload.families.llama.config import LlamaConfig
from otfload.families.llama.mapping import LLAMA_TABLE, llama_checks
from otfload.families.llama.model import LlamaForCausalLM
from otfload.families.registry import Family, register

LLAMA = register(
    Family(
        name="llama",
        model_types=("llama", "mistral", "qwen2", "qwen3"),
        parse_config=LlamaConfig.from_hf,
        build=LlamaForCausalLM,
        mapping=lambda cfg: LLAMA_TABLE,
        checks=llama_checks,
    )
)

__all__ = ["LLAMA", "LLAMA_TABLE", "LlamaConfig", "LlamaForCausalLM"]
